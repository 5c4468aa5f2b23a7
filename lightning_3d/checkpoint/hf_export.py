"""Export a sharded checkpoint to a Hugging Face model directory, one tensor at a time.

Nothing here holds the model: the model family's adapter says which Hugging Face tensor is made
from which checkpoint tensors (``ExportTensor(key, sources, combine)``), the checkpoint's manifest
gives every source's dense shape and dtype without reading data, ``combine`` run on meta tensors
gives each output's shape and dtype, and the safetensors headers are written from those. Then each
output tensor is assembled from only its sources' pieces, written, and dropped (and the rank files'
mapped pages released), so peak memory follows the largest tensor, not the model.

Before anything is written, the planned keys and shapes are checked against the Hugging Face model
built on the meta device from the exported config: an export that ``from_pretrained`` would reject
or load wrongly is refused with the differences named.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import Tensor

from lightning_3d.checkpoint.safetensors_write import (
    DEFAULT_MAX_SHARD_SIZE,
    TensorInfo,
    parse_size,
    staged_directory,
    write_sharded,
)
from lightning_3d.checkpoint.sharded import LazyDense, ShardedCheckpoint, latest_complete
from lightning_3d.models.adapters.base import ExportTensor
from lightning_3d.models.adapters.registry import adapter_for_hf_config, adapter_named

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# what `--tokenizer DIR` copies when present: tokenizers of every common kind, and generation defaults
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model",
    "chat_template.jinja", "chat_template.json", "generation_config.json",
)


# -- where the Hugging Face config and the mapping come from --------------------------------------------
def _load_hf_config(source: Union[str, Path], overrides: Optional[dict[str, Any]] = None) -> Any:
    """A transformers config from a config.json file or a model directory (``overrides`` as
    ``from_pretrained``'s config keyword arguments, e.g. the ones a fine-tuning run changed)."""
    import transformers

    path = Path(source)
    if path.is_file():
        config_dict = json.loads(path.read_text())
        if "model_type" not in config_dict:
            raise ValueError(f"{path} has no model_type: give the config.json of a Hugging Face model.")
        return transformers.AutoConfig.for_model(**{**config_dict, **(overrides or {})})
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"hf_config={str(source)!r}: neither a config.json file nor a directory holding one.")
    return transformers.AutoConfig.from_pretrained(str(path), **(overrides or {}))


def _unflatten(flat: dict[str, Any]) -> dict[str, Any]:
    nested: dict[str, Any] = {}
    for dotted, value in flat.items():
        node = nested
        *parents, last = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                break
        else:
            node[last] = value
    return nested


def _manifest_hf_config(checkpoint: ShardedCheckpoint, prefix: str) -> Any:
    """The Hugging Face config a sharded save recorded for the submodule at ``prefix`` (the manifest
    keeps every HF submodule's config as dotted scalars), or None."""
    flat = ((checkpoint.manifest.get("model") or {}).get("config")) or {}
    head = f"{prefix}config."
    mine = {k[len(head) :]: v for k, v in flat.items() if k.startswith(head)}
    if "model_type" not in mine:
        return None
    import transformers

    return transformers.AutoConfig.for_model(**_unflatten(mine))


def _gpt_export(config: Any) -> tuple[Any, list[ExportTensor]]:
    """Our GPT (a GPTModule checkpoint records its GPTConfig as a dict): the ``gpt`` adapter's export."""
    return adapter_named("gpt").hf_export(config)


def _hf_export(config: Any) -> list[ExportTensor]:
    """A Hugging Face model trained here: the family adapter's tensors (its own keys, each from the same
    name in the checkpoint, a tied output embedding once)."""
    _, tensors = adapter_for_hf_config(config).hf_export(config)
    return list(tensors)


def export_plan(
    checkpoint: ShardedCheckpoint, prefix: str = "model.", hf_config: Optional[Union[str, Path]] = None
) -> tuple[Any, list[ExportTensor], str]:
    """(transformers config, tensors to write, where the config came from)."""
    if hf_config is not None:
        config = _load_hf_config(hf_config)
        return config, _hf_export(config), f"hf_config={hf_config}"
    hparams = checkpoint.meta().get("hyper_parameters", {}) or {}
    init_from = hparams.get("init_from")
    if init_from and (Path(init_from) / "config.json").is_file():
        config = _load_hf_config(init_from, hparams.get("config_overrides") or {})
        return config, _hf_export(config), f"init_from={init_from}"
    recorded = _manifest_hf_config(checkpoint, prefix)
    if recorded is not None:
        return recorded, _hf_export(recorded), "the checkpoint's recorded config"
    if "config" in hparams:
        config, tensors = _gpt_export(hparams["config"])
        return config, list(tensors), "GPTModule hyper-parameters"
    raise ValueError(
        f"{checkpoint.path}: cannot tell which Hugging Face model this checkpoint holds (no GPTModule config, no "
        f"init_from and no recorded Hugging Face config under prefix {prefix!r}); pass hf_config=<config.json or "
        f"model directory> (--hf-config)."
    )


# -- checks before writing ------------------------------------------------------------------------------
def _reference_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """Keys and shapes of ``config``'s causal-LM model as transformers holds it (built on the meta
    device: no memory); a weight tied to an earlier one is left out, as save_pretrained does. These
    are save_pretrained's keys except where transformers 5 merges tensors on load (an MoE family's
    experts, stacked): the export writes the stack, which transformers 5 loads as is."""
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    shapes: dict[str, tuple[int, ...]] = {}
    seen: set[int] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        shapes[name] = tuple(p.shape)
    for name, buf in model.named_buffers():
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name) if module_name else model
        if attr not in module._non_persistent_buffers_set:
            shapes[name] = tuple(buf.shape)
    return shapes


def _check_against_reference(config: Any, infos: Sequence[TensorInfo]) -> None:
    reference = _reference_shapes(config)
    planned = {i.name: i.shape for i in infos}
    missing = [k for k in reference if k not in planned]
    unexpected = [k for k in planned if k not in reference]
    wrong = [f"{k}: {list(planned[k])} (expected {list(reference[k])})" for k in planned if k in reference and planned[k] != reference[k]]
    if missing or unexpected or wrong:
        details = "; ".join(
            part for part in (
                f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}" if missing else "",
                f"unexpected {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}" if unexpected else "",
                f"wrong shapes {wrong[:3]}" if wrong else "",
            ) if part
        )
        raise ValueError(
            f"the export does not match {config.model_type}'s Hugging Face model ({details}); check hf_config and prefix."
        )


def _plan_infos(
    checkpoint: ShardedCheckpoint, tensors: Sequence[ExportTensor], prefix: str, dtype: Optional[torch.dtype]
) -> list[TensorInfo]:
    """Each output's name, dtype and shape: ``combine`` on meta tensors shaped like its sources."""
    infos = []
    for t in tensors:
        metas = []
        for source in t.sources:
            try:
                shape, src_dtype = checkpoint.dense_info("model", prefix + source)
            except KeyError:
                raise ValueError(
                    f"{checkpoint.path}: {prefix + source!r} (needed for {t.key!r}) is not in the checkpoint; check prefix="
                    f"{prefix!r} (the LightningModule attribute that holds the model, with a trailing dot)."
                ) from None
            metas.append(torch.empty(shape, dtype=src_dtype, device="meta"))
        out = t.combine(metas)
        out_dtype = dtype if dtype is not None and out.is_floating_point() else out.dtype
        infos.append(TensorInfo(t.key, out_dtype, tuple(out.shape)))
    return infos


# -- tokenizer ----------------------------------------------------------------------------------------------
def copy_tokenizer(source: Any, directory: Path) -> list[str]:
    """Copy a tokenizer's files (a directory; or an object with ``save_pretrained``) into ``directory``."""
    if hasattr(source, "save_pretrained"):
        source.save_pretrained(str(directory))
        return sorted(p.name for p in directory.iterdir() if p.name in TOKENIZER_FILES)
    root = Path(source)
    if not root.is_dir():
        raise FileNotFoundError(f"tokenizer={str(source)!r} is not a directory.")
    copied = []
    for name in TOKENIZER_FILES:
        if (root / name).is_file():
            shutil.copy2(root / name, directory / name)
            copied.append(name)
    if not any(name != "generation_config.json" for name in copied):
        raise FileNotFoundError(
            f"{root} holds no tokenizer files ({', '.join(TOKENIZER_FILES[:-1])}); give the directory where "
            f"tokenizer.save_pretrained() wrote them."
        )
    return copied


def _tokenizer_of_init_from(checkpoint: ShardedCheckpoint) -> Optional[Path]:
    """A model fine-tuned from a Hugging Face directory (``init_from``) exports with that directory's
    tokenizer unless another is given: the pair a user would upload."""
    init_from = (checkpoint.meta().get("hyper_parameters", {}) or {}).get("init_from")
    if not init_from:
        return None
    root = Path(init_from)
    found = [name for name in TOKENIZER_FILES if name != "generation_config.json" and (root / name).is_file()]
    return root if found else None


# -- export ---------------------------------------------------------------------------------------------------
def _as_dtype(dtype: Union[str, torch.dtype, None]) -> Optional[torch.dtype]:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: choose one of {sorted(set(DTYPES))}.")
    return DTYPES[dtype]


def export_hf(
    path: Union[str, Path],
    out_dir: Union[str, Path],
    *,
    prefix: str = "model.",
    hf_config: Optional[Union[str, Path]] = None,
    dtype: Union[str, torch.dtype, None] = None,
    tokenizer: Any = None,
    max_shard_size: Union[int, str] = DEFAULT_MAX_SHARD_SIZE,
) -> dict[str, Any]:
    """Write a ``from_pretrained``-loadable directory from a sharded checkpoint, streaming.

    Args:
        path: a sharded checkpoint directory (any layout wrote it).
        out_dir: the Hugging Face directory to write (replaced only once the export is complete).
        prefix: the LightningModule attribute holding the model, with a trailing dot.
        hf_config: config.json (or a directory with one) of a Hugging Face model trained here; without
            it the config comes from the checkpoint (``init_from``, the recorded HF config, or
            GPTModule's hyper-parameters: our GPT exports as GPT-2 or Llama).
        dtype: cast floating tensors (``"bf16"``...); default: as stored (fp32 masters).
        tokenizer: a directory whose tokenizer files are copied (or a tokenizer object); default: the
            ``init_from`` directory's, when the model was fine-tuned from one that has them.
        max_shard_size: split weights into files of at most this size (``"5GB"``, ``"500MB"``, bytes).
    """
    checkpoint = ShardedCheckpoint(latest_complete(Path(path), fallback=False))
    out_dtype = _as_dtype(dtype)
    parse_size(max_shard_size)  # refuse a bad size before any work
    config, tensors, origin = export_plan(checkpoint, prefix, hf_config)
    infos = _plan_infos(checkpoint, tensors, prefix, out_dtype)
    _check_against_reference(config, infos)
    by_key = {t.key: t for t in tensors}
    dense = LazyDense(checkpoint, "model")

    def produce(info: TensorInfo) -> Tensor:
        spec = by_key[info.name]
        out = spec.combine([dense[prefix + s] for s in spec.sources]).to(info.dtype)
        checkpoint.release()  # unmap the rank files: their read pages would stay resident otherwise
        return out

    if out_dtype is not None:
        config.dtype = out_dtype
    else:
        floating = [i.dtype for i in infos if i.dtype.is_floating_point]
        config.dtype = max(set(floating), key=floating.count) if floating else torch.float32
    copied: list[str] = []
    with staged_directory(out_dir, also_written=TOKENIZER_FILES) as tmp:
        config.save_pretrained(str(tmp))
        written = write_sharded(tmp, infos, produce, max_shard_size)
        if tokenizer is None:
            tokenizer = _tokenizer_of_init_from(checkpoint)
        if tokenizer is not None:
            copied = copy_tokenizer(tokenizer, tmp)
    return {
        "out": str(out_dir),
        "from": str(checkpoint.path),
        "model_type": config.model_type,
        "config_from": origin,
        "tensors": len(infos),
        "parameters": sum(_numel(i.shape) for i in infos),
        "bytes": written["total_size"],
        "files": written["files"],
        "tokenizer_files": copied,
    }


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
