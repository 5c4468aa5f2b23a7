"""The ``lightning-3d`` command.

``fit``/``validate``/``test``/``predict`` are LightningCLI over :class:`GPTModule` (or, with
``--model.init_from=HF_DIR``, :class:`HFCausalLMModule`: fine-tune that Hugging Face checkpoint) and
:class:`TextDataModule`, so every Trainer, model and data argument is a flag or a YAML key.
``--model path.to.MyModule`` / ``--data path.to.MyData`` train the user's own classes instead
(LightningCLI subclass mode):

    lightning-3d fit --trainer.strategy=3d --trainer.devices=2 --trainer.max_steps=50
    lightning-3d fit --trainer.strategy=lightning_3d.ThreeDParallelStrategy --trainer.strategy.data_parallel=2
    lightning-3d fit --config run.yaml
    lightning-3d fit --model my_project.MyModule --model.hidden=256 --data my_project.MyData --trainer.strategy=3d

``prepare`` writes a memory-mapped token file from text files for ``--data.source``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Callable, Optional

LIGHTNING_SUBCOMMANDS = ("fit", "validate", "test", "predict")

USAGE = """usage: lightning-3d [--version] {fit,validate,test,predict,plan,dry-run,profile,prepare,consolidate,export} ...

  fit, validate, test, predict   LightningCLI over GPTModule + TextDataModule, or your own
                                 --model path.to.MyModule / --data path.to.MyData
                                 (lightning-3d fit --help lists every flag)
  plan [OVERRIDES] [--layout ...]  rank 3D layouts for a model on a cluster (docs/planner.md)
  dry-run [OVERRIDES] [--layout ...]  set up and step a layout's representative ranks on the meta
                                 device, next to the plan; exit 1 if a rank does not fit (docs/dry_run.md)
  profile [--name N] [--out DIR]  measure this machine's CPU processes (GEMM, copy, all-reduce) and
                                 write DIR/cluster/N.yaml for plan and dry-run (docs/planner.md)
  prepare OUT INPUT [INPUT ...]  tokenize text files as bytes into OUT (.bin + .bin.json)
  consolidate CKPT_DIR OUT       a sharded checkpoint as one dense .pt/.ckpt/.safetensors file
  export CKPT_DIR OUT_DIR        a Hugging Face model directory (from_pretrained-loadable;
                                 --tokenizer DIR, --max-shard-size 5GB, --dtype bf16)

examples:
  lightning-3d fit --trainer.strategy=3d --trainer.accelerator=cpu --trainer.devices=2 --trainer.max_steps=50
  lightning-3d fit --trainer.strategy=lightning_3d.ThreeDParallelStrategy --trainer.strategy.data_parallel=2
  lightning-3d fit --model my_project.MyModule --data my_project.MyData --trainer.strategy=3d --trainer.devices=2
  lightning-3d fit --model.init_from=HF_DIR --data.block_size=128 --trainer.strategy=lightning_3d.ThreeDParallelStrategy --trainer.strategy.tensor_parallel=2
  lightning-3d plan model=bloom_176b cluster=jean_zay_bloom data.global_batch_size=2048
  lightning-3d dry-run recipe=llama3_405b
  lightning-3d prepare data/corpus.bin ~/texts && lightning-3d fit --data.source=data/corpus.bin
"""


def prepare_main(argv: list[str]) -> int:
    from lightning_3d.data import prepare_byte_tokens

    parser = argparse.ArgumentParser(prog="lightning-3d prepare", description="Write a byte-level token file.")
    parser.add_argument("out", help="output token file, e.g. data/corpus.bin")
    parser.add_argument("inputs", nargs="+", help="text files, or directories searched for --suffixes")
    parser.add_argument("--suffixes", default=".txt,.md,.py,.rst", help="comma-separated file suffixes")
    args = parser.parse_args(argv)
    meta = prepare_byte_tokens(args.inputs, args.out, suffixes=tuple(args.suffixes.split(",")))
    print(json.dumps({"out": args.out, **meta}))
    return 0


def consolidate_main(argv: list[str]) -> int:
    from lightning_3d.checkpoint.consolidate import consolidate

    parser = argparse.ArgumentParser(prog="lightning-3d consolidate", description="Write a sharded checkpoint as one file.")
    parser.add_argument("checkpoint", help="a sharded checkpoint directory (e.g. checkpoints/step=100.ckpt)")
    parser.add_argument("out", help="output file: .pt / .ckpt (a Lightning checkpoint) or .safetensors (weights)")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None, help="cast floating tensors")
    parser.add_argument("--weights-only", action="store_true", help="only the model's state dict")
    args = parser.parse_args(argv)
    print(json.dumps(consolidate(args.checkpoint, args.out, dtype=args.dtype, weights_only=args.weights_only)))
    return 0


def export_main(argv: list[str]) -> int:
    from lightning_3d.checkpoint.hf_export import export_hf

    parser = argparse.ArgumentParser(
        prog="lightning-3d export",
        description="Export a sharded checkpoint to a Hugging Face model directory, streaming tensor by tensor.",
    )
    parser.add_argument("checkpoint", help="a sharded checkpoint directory")
    parser.add_argument("out", help="output directory (save_pretrained layout); replaced only when the export is complete")
    parser.add_argument("--hf-config", default=None, help="config.json (or model dir) of the HF model that was trained")
    parser.add_argument("--prefix", default="model.", help="the model's attribute path in the LightningModule")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None, help="cast floating tensors")
    parser.add_argument("--tokenizer", default=None, metavar="DIR", help="copy the tokenizer files found in DIR")
    parser.add_argument("--max-shard-size", default="5GB", help="largest weight file, e.g. 5GB, 500MB (default 5GB)")
    args = parser.parse_args(argv)
    size = int(args.max_shard_size) if args.max_shard_size.isdigit() else args.max_shard_size
    out = export_hf(
        args.checkpoint, args.out, prefix=args.prefix, hf_config=args.hf_config, dtype=args.dtype,
        tokenizer=args.tokenizer, max_shard_size=size,
    )
    print(json.dumps(out))
    return 0


def plan_main(argv: list[str]) -> int:
    from lightning_3d.apps.plan_cli import plan_main as run

    return run(argv)


def profile_main(argv: list[str]) -> int:
    from lightning_3d.apps.profile_cli import profile_main as run

    return run(argv)


def dry_run_main(argv: list[str]) -> int:
    from lightning_3d.apps.dry_run.cli import dry_run_main as run

    return run(argv)


def _config_docs(argv: list[str]) -> list[dict]:
    """The ``--config`` YAML files named on the command line, parsed (unreadable ones skipped:
    LightningCLI reports those itself)."""
    import yaml

    paths = [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]
    paths += [b for a, b in zip(argv, argv[1:]) if a == "--config"]
    docs = []
    for path in paths:
        try:
            with open(path) as f:
                doc = yaml.safe_load(f) or {}
        except (OSError, yaml.YAMLError):
            continue
        if isinstance(doc, dict):
            docs.append(doc)
    return docs


def _init_from_given(argv: list[str]) -> bool:
    """Whether ``--model.init_from`` is set, on the command line or in a ``--config`` YAML file."""
    if any(a == "--model.init_from" or a.startswith("--model.init_from=") for a in argv):
        return True
    for doc in _config_docs(argv):
        model = doc.get("model")
        if isinstance(model, dict) and model.get("init_from"):
            return True
    return False


def _names_a_class(argv: list[str], key: str) -> bool:
    """Whether ``--model``/``--data`` (``key``) names the user's own class: ``--model path.to.MyModule``,
    ``--model=MyModule``, ``--model '{"class_path": ...}'``, ``--model.help ...``, or a ``--config`` /
    ``--model FILE`` whose ``model:`` has a ``class_path``. Then LightningCLI runs in subclass mode for
    that group; a ``--model FILE`` of plain init arguments keeps the built-in class."""
    import yaml

    values = [a.split("=", 1)[1] for a in argv if a.startswith(f"--{key}=")]
    values += [b for a, b in zip(argv, argv[1:]) if a == f"--{key}"]
    if any(a == f"--{key}.help" or a.startswith(f"--{key}.help=") for a in argv):
        return True
    for value in values:
        if os.path.isfile(value):  # a config file for the group: a class only if it says class_path
            try:
                with open(value) as f:
                    doc = yaml.safe_load(f)
            except (OSError, yaml.YAMLError):
                return True  # let LightningCLI parse (and report) it in subclass mode
            if isinstance(doc, dict) and "class_path" in doc:
                return True
            continue
        return True
    for doc in _config_docs(argv):
        group = doc.get(key)
        if isinstance(group, str) or (isinstance(group, dict) and "class_path" in group):
            return True
    return False


def lightning_main(argv: list[str]) -> None:
    """LightningCLI over GPTModule, or over HFCausalLMModule when ``--model.init_from`` names a Hugging
    Face checkpoint to fine-tune (its other flags are the same optimizer keys), with TextDataModule.
    ``--model path.to.MyModule`` / ``--data path.to.MyData`` name the user's own LightningModule /
    LightningDataModule instead (LightningCLI subclass mode, ``--model.init_args.*`` or ``--model.*``
    for their arguments)."""
    from lightning.pytorch.cli import LightningCLI

    from lightning_3d.data import TextDataModule
    from lightning_3d.models import GPTModule
    from lightning_3d.models.hf_module import HFCausalLMModule

    user_model, user_data = _names_a_class(argv, "model"), _names_a_class(argv, "data")
    if user_model:
        model_class = None  # any LightningModule, named by --model
    else:
        model_class = HFCausalLMModule if _init_from_given(argv) else GPTModule
    # a module of the user's own without any --data: its own loaders, as LightningCLI does (TextDataModule
    # would need its block_size and fail after the ranks started)
    data_given = any(a == "--data" or a.startswith("--data.") or a.startswith("--data=") for a in argv) or any(
        "data" in doc for doc in _config_docs(argv)
    )
    data_class = None if user_data or (user_model and not data_given) else TextDataModule
    LightningCLI(
        model_class,
        data_class,
        subclass_mode_model=user_model,
        subclass_mode_data=user_data,
        # The command line itself: Lightning reads sys.argv (given both, it warns on every run).
        args=None if argv == sys.argv[1:] else argv,
        seed_everything_default=1234,
        save_config_kwargs={"overwrite": True},
    )


def user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean "the input is wrong": their message is the whole story (Lightning's and
    the checkpoint's own only where those are loaded: a ``plan`` never imports them)."""
    errors: list[type[BaseException]] = [ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, PermissionError]
    for module, name in (("lightning.fabric.utilities.exceptions", "MisconfigurationException"), ("lightning_3d.checkpoint.sharded", "CheckpointError")):
        if module in sys.modules:
            errors.append(getattr(sys.modules[module], name))
    return tuple(errors)


def _run(command: str, call: Callable[[], Optional[int]]) -> int:
    """Run a subcommand; a user error prints one line and exits 2, anything else keeps its traceback
    (``LIGHTNING_3D_TRACEBACK=1`` shows it for user errors too). What the handling needs is imported
    only when something is raised: ``plan`` and ``--version`` never load Lightning."""
    try:
        return call() or 0
    except Exception as err:
        preemption = sys.modules.get("lightning_3d.resilience.preemption")  # loaded by any command that trains
        if preemption is not None and isinstance(err, preemption.TrainingInterrupted):
            # SIGTERM: the checkpoint is written; exit as a scheduler expects
            print(f"lightning-3d {command}: {err}", file=sys.stderr, flush=True)
            return preemption.EXIT_CODE
        if not isinstance(err, user_errors()) or os.environ.get("LIGHTNING_3D_TRACEBACK") == "1":
            raise
        message = _plain_message(" ".join(str(err).split()) or type(err).__name__)
        print(f"lightning-3d {command}: error: {message}", file=sys.stderr, flush=True)
        return 2


def _plain_message(message: str) -> str:
    """jsonargparse wraps a class's own refusal in its Union bookkeeping ("Does not validate against any
    of the Union subtypes ... - zero_stage=9 is invalid: ... Given value type: ..."): keep the refusal."""
    import re

    wrapped = re.search(r"Does not validate against any of the Union subtypes.*?Errors: (.*?) Given value type:", message)
    if not wrapped:
        return message
    reasons = [r.strip() for r in re.split(r"(?:^|\s)- ", wrapped.group(1)) if r.strip() and not r.strip().startswith("Expected a <class")]
    return " ".join(reasons) or message


def version() -> str:
    """The installed distribution's version (the package's own when run from a source tree)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("lightning-3d")
    except PackageNotFoundError:
        from lightning_3d.core import __version__

        return __version__


def main(argv: Optional[list[str]] = None) -> int:
    """``lightning-3d``; output cut short by its reader (``lightning-3d --help | head -1``) ends quietly."""
    try:
        code = _main(argv)
        sys.stdout.flush()  # inside the try: a closed pipe surfaces here, not at interpreter exit
        return code
    except BrokenPipeError:
        # Python's recipe: point stdout at devnull so the exit-time flush cannot raise again. Only
        # this error, not SIGPIPE's default action: a training run must not die silently on a socket.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 128 + 13  # as if killed by SIGPIPE, which is what `set -o pipefail` expects


def _main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if argv[0] in ("-V", "--version"):
        print(f"lightning-3d {version()}")
        return 0
    commands = {"plan": plan_main, "dry-run": dry_run_main, "profile": profile_main, "prepare": prepare_main, "consolidate": consolidate_main, "export": export_main}
    if argv[0] in commands:
        return _run(argv[0], lambda: commands[argv[0]](argv[1:]))
    if argv[0] in LIGHTNING_SUBCOMMANDS:
        return _run(argv[0], lambda: lightning_main(argv))
    print(f"lightning-3d: unknown command {argv[0]!r}.\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
