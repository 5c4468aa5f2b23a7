"""The stack on one real GPU (CUDA + NCCL, world size 1) in one run: a bf16 GPT of 1.28 B parameters
trains 3 optimizer steps under each ZeRO stage, CPU and NVMe optimizer offload, ZeRO-3 CPU offload
and full / selective recompute, from the same seed on the same data; then the peers (DeepSpeed ZeRO
1-3 and ZeRO-Offload, a plain torch FSDP2 loop: ``gpu_peers.py``) on the same model, data and AdamW,
compared in the verdict's ``peers`` section. See docs/gpu.md.

    python benchmarks/gpu_check.py                      # one GPU (install a CUDA torch first: README)
    python benchmarks/gpu_check.py --cases zero0,zero3  # a subset (zero0, the reference, always runs)
    python benchmarks/gpu_check.py --cpu-dry-run        # the same code path, tiny model, CPU + gloo

Each case runs in its own process (an out-of-memory error or a crash stays in its case, and peak
memory is per case) and prints one JSON line: losses, step time, tokens/s, MFU, peak GPU memory
(``torch.cuda.max_memory_allocated``) and what the planner (``lightning_3d.planner``, the model behind
``lightning-3d plan --layout``) predicts for that layout on this device. Then a table of measured vs
predicted, and a last JSON line with the verdict. Exit code 0: every case ran and its losses agree
with ``zero0``'s within ``--rtol`` (see ``RTOL``), and zero0's loss fell clearly; 1: not so; 2: no
CUDA device (without ``--cpu-dry-run``), a missing dependency or a bad argument.

On the CPU (``--cpu-dry-run``) there is no GPU memory to measure: ``peak_gpu_gib`` is null and
``peak_host_rss_gib`` (the process's peak resident set size, the Python runtime included; with
``--in-process`` the maximum over the cases run so far) is all there is; MFU is against the rough
``cpu_process`` device profile and says nothing about a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
RESULT = "RESULT "
GIB = 2**30


@dataclass(frozen=True)
class Case:
    """One layout on one device, as the planner's ``Layout`` fields (dp = tp = pp = 1)."""

    name: str
    zero_stage: int
    recompute: str = "none"
    offload: str = "none"  # optimizer offload for stages 1-2, parameter offload (FSDP2) for stage 3
    proves: str = ""
    compile: bool = False  # torch.compile of each block (inductor), as ThreeDParallelStrategy(compile=True)
    peer: str = ""  # another stack's run of the layout (benchmarks/gpu_peers.py): "deepspeed" or "fsdp2"
    step_rounds: Optional[int] = None  # ZeRO 1-2's inner step calls per step (None: ZeroOptimizer.step_rounds decides)
    variant_of: str = ""  # the case this one runs otherwise (the verdict's "variants": speed and losses side by side)

    @property
    def ours(self) -> str:
        """The lightning_3d case a peer's speed and memory are compared with (its own name for ours)."""
        if not self.peer:
            return self.name
        offload = {"cpu": "_offload_cpu"}.get(self.offload, "")
        return f"zero{self.zero_stage}{offload}"


CASES = [
    Case("zero0", 0, proves="the reference: bf16 parameters, fp32 masters and Adam on the GPU, NCCL all-reduce path"),
    Case("zero1", 1, proves="ZeRO-1 flat buffers and fp32 master shard on CUDA (reduce-scatter / all-gather on NCCL)"),
    Case("zero2", 2, proves="ZeRO-2: gradients kept only as the reduced shard"),
    Case("zero3", 3, proves="ZeRO-3: FSDP2 fully_shard with bf16 compute on CUDA"),
    Case("zero2_offload_cpu", 2, offload="cpu", proves="ZeRO-Offload: pinned host masters, fused CPU AdamW, copies back"),
    Case(
        "zero2_offload_cpu_one_call", 2, offload="cpu", step_rounds=1, variant_of="zero2_offload_cpu",
        proves="ZeRO-Offload with the host step in one call, every upload after it: against zero2_offload_cpu's rounds",
    ),
    Case("zero3_offload_cpu", 3, offload="cpu", proves="FSDP2 CPUOffloadPolicy: parameters, gradients and the step on the host"),
    Case("zero1_offload_nvme", 1, offload="nvme", proves="ZeRO-Infinity-style: masters and moments streamed from a file"),
    Case("zero1_recompute_full", 1, recompute="full", proves="full activation recompute (non-reentrant checkpoint) on CUDA"),
    Case("zero1_recompute_selective", 1, recompute="selective", proves="selective recompute of the attention core"),
    Case("zero1_compile", 1, compile=True, proves="regional torch.compile (inductor) of each block, against zero1"),
    Case("zero3_compile", 3, compile=True, proves="regional torch.compile under FSDP2 (torchtitan's recipe), against zero3 and fsdp2_zero3"),
    # the peers: the same model, data, seed and AdamW on the stacks users would pick instead
    Case("deepspeed_zero1", 1, peer="deepspeed", proves="DeepSpeed ZeRO-1 (bf16 mode, torch AdamW) vs ours"),
    Case("deepspeed_zero2", 2, peer="deepspeed", proves="DeepSpeed ZeRO-2 vs ours"),
    Case("deepspeed_zero3", 3, peer="deepspeed", proves="DeepSpeed ZeRO-3 (every parameter sharded) vs ours"),
    Case("deepspeed_zero2_offload_cpu", 2, offload="cpu", peer="deepspeed", proves="DeepSpeed ZeRO-Offload (DeepSpeedCPUAdam) vs ours"),
    Case("fsdp2_zero3", 3, peer="fsdp2", proves="a plain torch FSDP2 loop (torchtitan's data-parallel recipe) vs our ZeRO-3"),
]
REFERENCE = "zero0"
CASE_BY_NAME = {c.name: c for c in CASES}
# A peer's losses can differ from ours for a reason of its design, not a bug; said next to its numbers.
PEER_LOSS_NOTES = {
    "deepspeed": (
        "DeepSpeed makes its fp32 masters from the bf16-cast weights, where ours and FSDP2 keep the fp32 init: "
        "at a small lr the first updates are below bf16 resolution and its loss falls less. On the CPU, "
        "rounding the init to bf16 first makes FSDP2's losses equal DeepSpeed's to 5 digits (docs/gpu.md). "
        "Its bf16 mode also runs the forward and the loss in bf16 (its engine turns autocast off; its losses are "
        "bf16 values), so its peak memory lacks the fp32 log-softmax buffers ours and FSDP2 hold"
    ),
}

# bf16 keeps 8 significant bits: each rounding is off by up to 2**-9 = 0.2% relative. The cases
# round in different places (FSDP2 casts sharded fp32 parameters, our ZeRO casts flat masters; the
# host and NVMe paths run torch's CPU AdamW kernel instead of the CUDA one; recompute re-runs the
# kernels; CUDA's bf16 GEMM and attention backward kernels are not bitwise deterministic). That
# should move the weights by about one bf16 step and the loss by a few 1e-3 after 3 steps (expected,
# not yet measured on a GPU; on the CPU the cases agree exactly). 2e-2 (~10 bf16 steps) leaves room
# for it and is of the order of the composition matrix's bf16 tolerance (tests/matrix.py: 3e-2). A
# real bug -- a skipped or doubled update, a stale shard, a wrong gradient scale -- moves the loss by
# about a whole update's drop, and the check requires zero0's loss to fall by more than MIN_DROP x
# RTOL over its 2 recorded updates (the loss of step k is computed before step k's update).
RTOL = 2e-2
TOLERANCE_WHY = (
    "relative, every step: bf16 rounds to 2**-9 relative and the cases round in different places "
    "(FSDP2 vs flat-master casts, CPU vs CUDA AdamW, recompute, non-deterministic CUDA kernels)"
)
MIN_DROP = 3.0  # the reference's loss must fall by more than this many tolerances over the run

# The model, batch and learning rate of a GPU run and of a CPU dry run. Adam's first steps move every
# weight by about lr whatever its gradient, so at width 2048 a usual rate overshoots: on the CPU at
# 12 x 2048 (seq 64, batch 2) lr 1e-4 sent the loss from 10.8 to 17.6 after one step, 1e-5 gave
# 10.8, 7.6, 7.8 (up again) and 3e-6 a smooth 10.8, 9.2, 6.8. 24 layers move about twice as much per
# step, hence 2e-6: a large, smooth drop, the regime where bf16 rounding differences stay small.
GPU_RUN = dict(layers=24, width=2048, heads=16, vocab=32768, seq=1024, batch=16, lr=2e-6)
DRY_RUN = dict(layers=2, width=64, heads=4, vocab=512, seq=32, batch=4, lr=1e-2)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-dry-run", action="store_true", help="tiny model on the CPU over gloo: checks the script")
    parser.add_argument("--in-process", action="store_true", help="run the cases one after another in this process (CPU tests)")
    parser.add_argument("--cases", default=None, help="comma-separated case names (default: all); zero0 is always added")
    for key, value in GPU_RUN.items():
        kind = float if key == "lr" else int
        what = "AdamW learning rate (constant)" if key == "lr" else "model/batch size"
        parser.add_argument(f"--{key}", type=kind, default=None, help=f"{what}: {value:g} ({DRY_RUN[key]:g} with --cpu-dry-run)")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per case")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--rtol", type=float, default=RTOL, help="loss agreement with zero0, relative (see docs/gpu.md)")
    parser.add_argument("--nvme-dir", default=None, help="where the NVMe case's temporary directory goes (default: $TMPDIR)")
    parser.add_argument("--case-timeout", type=float, default=300.0, help="seconds one case's process may take (default 300)")
    parser.add_argument(
        "--profile-dir", default=None, help="profile one extra step per case (kept out of its timings) into this directory (gpu_profile.py)"
    )
    parser.add_argument("--case", default=None, help=argparse.SUPPRESS)  # a child process runs this one case
    args = parser.parse_args(argv)
    defaults = DRY_RUN if args.cpu_dry_run else GPU_RUN
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    known = {c.name for c in CASES}
    names = [n for n in (args.cases or ",".join(c.name for c in CASES)).split(",") if n]
    unknown = sorted(set(names) - known)
    if unknown:
        parser.error(f"unknown case(s) {unknown}; choose from {[c.name for c in CASES]}.")
    args.case_list = [CASE_BY_NAME[n] for n in dict.fromkeys([REFERENCE, *names])]  # the reference first, then as given
    if args.case is not None and args.case not in known:
        parser.error(f"--case {args.case!r} is unknown.")
    if args.nvme_dir is not None and not os.path.isdir(args.nvme_dir):
        parser.error(f"--nvme-dir {args.nvme_dir!r} is not a directory; create it first (mkdir -p {args.nvme_dir}).")
    return args


# -- the planner's prediction ------------------------------------------------------------------------
def cluster_profile(device_name: Optional[str]) -> tuple[str, str]:
    """The ``conf/cluster`` whose device matches this one, and a note when none does."""
    if device_name is None:
        return "local_cpu", "CPU process profile (rough fp32 figures): speed and MFU are indicative only"
    upper = device_name.upper()
    for key, cluster in (("H200", "h200_141g_1node"), ("H100", "h100_80g_1node"), ("A100", "a100_80g_1node")):
        if key in upper:
            return cluster, ""
    return "h100_80g_1node", f"no device profile for {device_name!r}: predicted with the H100 one"


@functools.lru_cache(maxsize=None)
def load_profile(name: str) -> Any:
    """``conf/cluster/<name>`` as the planner's ``ClusterSpec`` (composed by Hydra, as ``plan`` does)."""
    from lightning_3d.core.compose import compose_config
    from lightning_3d.planner import load_cluster

    return load_cluster(compose_config([f"cluster={name}"]).cluster)


def machine_cluster(name: str, nvme_dir: str) -> Any:
    """One device of ``conf/cluster/<name>``, with this machine's RAM and the free space under ``nvme_dir``
    (the planner's fit checks for host and NVMe offload); the other figures are the profile's."""
    from dataclasses import replace

    cluster = load_profile(name)
    ram_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    return replace(cluster, devices_per_node=1, num_nodes=1, cpu_ram_gb=ram_gb, nvme_gb=shutil.disk_usage(nvme_dir).free / 1e9)


def predict(case: Case, config: Any, batch: int, device_name: Optional[str], nvme_dir: str) -> dict[str, Any]:
    """What ``lightning-3d plan --layout dp=1,tp=1,pp=1,mb=<batch>,zero=..,recompute=..,offload=..`` says."""
    from lightning_3d.planner import ModelShape, Planner, Problem, best_completion

    name, note = cluster_profile(device_name)
    cluster = machine_cluster(name, nvme_dir)
    problem = Problem(model=ModelShape.from_config(asdict(config)), cluster=cluster, global_batch=batch, precision="bf16-mixed")
    estimate = best_completion(Planner(problem), asdict(case_layout(case, batch)))  # every field fixed
    memory = {k: round(v / GIB, 3) for k, v in estimate.memory.items()}
    return {
        "profile": name,
        "device": cluster.device.model,
        "peak_tflops": cluster.device.peak_tflops,
        "note": note or None,
        "fits": estimate.fits,
        "step_s": round(estimate.step_seconds, 4),
        "tokens_per_s": round(estimate.tokens_per_second, 1),
        "mfu": round(estimate.mfu, 4),
        "memory_gib": memory,
        # what torch.cuda.max_memory_allocated can see: the prediction without the runtime's reserve
        "allocated_gib": round((estimate.memory["total"] - estimate.memory["reserved"]) / GIB, 3),
        "host_gib": round(estimate.host_bytes_per_node / GIB, 3),  # offloaded state in host memory
        "nvme_gib": round(estimate.nvme_bytes_per_node / GIB, 3),
    }


# -- one case -------------------------------------------------------------------------------------------
def case_layout(case: Case, batch: int) -> Any:
    """The case as the planner's ``Layout``: one device, one micro-batch of ``batch``."""
    from lightning_3d.planner import Layout

    return Layout(dp=1, tp=1, pp=1, micro_batch_size=batch, zero_stage=case.zero_stage, recompute=case.recompute, offload=case.offload)


def strategy_keywords(case: Case, batch: int, nvme_path: Optional[str], gpu: bool = True) -> dict[str, Any]:
    """The strategy's keywords for the case: the planner's own mapping of a layout to them. The CPU dry
    run compiles with ``aot_eager`` (the same capture and graphs; inductor's C++ build per graph would
    take longer than the rest of the dry run)."""
    kwargs = case_layout(case, batch).strategy_kwargs(global_batch=batch)
    if case.compile:
        kwargs["compile"] = True if gpu else "aot_eager"
    if case.offload == "nvme":
        kwargs["nvme_path"] = nvme_path
    return kwargs


@functools.lru_cache(maxsize=None)
def corpus_file(n_bytes: int) -> Path:
    """The first ``n_bytes`` of the standard-library byte corpus as a token file, written once per
    process (listing the standard library costs ~1 s, which the in-process dry run would pay per case)."""
    import atexit

    from lightning_3d.data import stdlib_bytes, write_token_file

    directory = tempfile.mkdtemp(prefix="gpu_check_data_")
    atexit.register(shutil.rmtree, directory, True)
    path = Path(directory) / "corpus.bin"
    write_token_file(stdlib_bytes(n_bytes), path, vocab_size=256, tokenizer="bytes")
    return path


def model_flops(config: Any, batch: int) -> float:
    """FLOPs of one step as the planner counts them (``ModelShape.step_flops``: Narayanan et al.,
    no recompute), so measured and predicted MFU are the same ratio."""
    from lightning_3d.core.model_shape import ModelShape

    return ModelShape.from_config(asdict(config)).step_flops(batch, 0.0)


def peak_memory(gpu: bool) -> dict[str, Any]:
    """Peak GPU memory (``torch.cuda.max_memory_allocated``: tensors only, no CUDA context or cache;
    null on the CPU) and the process's peak resident set size (host; with ``--in-process`` the
    maximum over every case run so far in the process)."""
    import torch

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return {
        "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / GIB, 3) if gpu else None,
        "peak_gpu_reserved_gib": round(torch.cuda.max_memory_reserved() / GIB, 3) if gpu else None,
        "peak_host_rss_gib": round(rss / GIB, 3),
    }


def run_case(case: Case, args: argparse.Namespace) -> dict[str, Any]:
    """Train ``args.steps`` steps of the case's layout in this process; never raises."""
    import torch

    from lightning_3d.models import GPTConfig

    gpu = not args.cpu_dry_run
    tokens = args.batch * args.seq
    result: dict[str, Any] = {"case": case.name, "ok": False, "tokens_per_step": tokens}
    if case.peer:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from gpu_peers import missing_package

        why = missing_package(case.peer)
        if why:
            return {**result, "not_run": why}
    nvme_root = args.nvme_dir or tempfile.gettempdir()
    nvme_path = None
    start = time.perf_counter()
    try:
        config = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads, n_embd=args.width)
        result["parameters"] = config.num_parameters()
        flops = model_flops(config, args.batch)
        if case.offload == "nvme":
            nvme_path = tempfile.mkdtemp(prefix="gpu_check_nvme_", dir=nvme_root)
        if gpu:
            torch.cuda.reset_peak_memory_stats()
        device_name = torch.cuda.get_device_name(0) if gpu else None
        result["device"] = device_name or "cpu"
        kwargs = strategy_keywords(case, args.batch, nvme_path, gpu=gpu)
        shown = ("zero_stage", "activation_checkpointing", "offload_optimizer", "offload_params", "compile")
        result["strategy"] = {k: v for k, v in kwargs.items() if k in shown and v is not None}
        try:  # a prediction that fails (a planner bug, omegaconf missing) must not cost the measurement
            result["predicted"] = predict(case, config, args.batch, device_name, nvme_root)
        except Exception as err:
            traceback.print_exc(file=sys.stderr)
            result["predicted"] = {"error": f"{type(err).__name__}: {err}"[:300]}
        corpus = corpus_file(2 * (args.steps + 1) * (tokens + args.batch) + 4096)  # enough for the run and a 5% validation tail
        profile = step_profile(case, args)
        if case.peer:
            losses, seconds, backend = run_peer_case(case, config, args, str(corpus), profile)
        else:
            losses, seconds, backend = run_our_case(kwargs, config, args, str(corpus), profile, case.step_rounds, result)
        if profile is not None:
            result["profile"] = profile.summary
        if len(losses) != args.steps:
            raise RuntimeError(f"trained {len(losses)} steps, expected {args.steps}")
        timed = seconds[1:] or seconds  # the first step warms up kernels and the allocator
        step_s = sum(timed) / len(timed)
        peak = result["predicted"].get("peak_tflops")
        result.update(
            ok=True,
            backend=backend,
            losses=[round(x, 5) for x in losses],
            step_seconds=[round(x, 4) for x in seconds],
            step_s=round(step_s, 4),
            tokens_per_s=round(tokens / step_s, 1),
            model_tflops_per_s=round(flops / step_s / 1e12, 2),
            mfu=round(flops / step_s / (peak * 1e12), 4) if peak else None,
        )
    except BaseException as err:  # an OOM or a crash is this case's result, not the run's end
        if isinstance(err, KeyboardInterrupt):
            raise
        traceback.print_exc(file=sys.stderr)
        message = str(err).strip().splitlines()
        result["error"] = f"{type(err).__name__}: {message[0][:300] if message else ''}"
    finally:
        if nvme_path is not None:
            shutil.rmtree(nvme_path, ignore_errors=True)
    try:
        result.update(peak_memory(gpu))
    except Exception as err:  # e.g. a CUDA error that left the device unusable
        result["peak_memory_error"] = f"{type(err).__name__}: {err}"[:300]
    result["seconds"] = round(time.perf_counter() - start, 1)
    return result


def step_profile(case: Case, args: argparse.Namespace) -> Any:
    """With ``--profile-dir``, the profiler of the case's extra step (``gpu_profile.StepProfile``)."""
    if not args.profile_dir:
        return None
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_profile import StepProfile

    return StepProfile(args.profile_dir, case.name, gpu=not args.cpu_dry_run)


def run_our_case(
    kwargs: dict[str, Any], config: Any, args: argparse.Namespace, corpus: str, profile: Any = None,
    step_rounds: Optional[int] = None, record: Optional[dict[str, Any]] = None,
) -> tuple[list[float], list[float], Optional[str]]:
    """``args.steps`` steps of lightning_3d's Trainer with the strategy ``kwargs`` (and one more under
    ``profile``, not recorded): losses, step seconds and the process group's backend. ``step_rounds``
    sets ZeRO 1-2's rounds; ``record`` receives the rounds the step ran in."""
    import lightning as L
    import torch

    from lightning_3d import ThreeDParallelStrategy
    from lightning_3d.data import TextDataModule
    from lightning_3d.models import GPTModule

    gpu = not args.cpu_dry_run
    L.seed_everything(args.seed, verbose=False)
    probe = step_probe(gpu, args.steps, profile, step_rounds)
    steps = args.steps + (profile is not None)
    trainer = one_device_trainer(gpu, ThreeDParallelStrategy(**kwargs), steps, probe)
    module = GPTModule(config, lr=args.lr, warmup_steps=1, decay_steps=10**9)  # a constant rate
    data = TextDataModule(source=corpus, block_size=args.seq, batch_size=args.batch)
    trainer.fit(module, data)
    backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else None
    if record is not None and probe.step_rounds is not None:
        record["step_rounds"] = probe.step_rounds
    return probe.losses, probe.seconds, backend


def one_device_trainer(gpu: bool, strategy: Any, steps: int, callback: Any) -> Any:
    """The Trainer of a one-device check: bf16-mixed, ``steps`` steps, no validation, logging or
    checkpoints (``gpu_offload_check.py`` uses it too)."""
    import lightning as L

    return L.Trainer(
        accelerator="gpu" if gpu else "cpu",
        devices=1,
        strategy=strategy,
        precision="bf16-mixed",
        max_steps=steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )


def run_peer_case(
    case: Case, config: Any, args: argparse.Namespace, corpus: str, profile: Any = None
) -> tuple[list[float], list[float], Optional[str]]:
    """The same steps on another stack (``benchmarks/gpu_peers.py``), and one more under ``profile``."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import gpu_peers

    losses: list[float] = []
    seconds: list[float] = []

    def record(loss: float, elapsed: float) -> None:
        if profile is not None and profile.active:
            profile.end()
            return
        losses.append(loss)
        seconds.append(elapsed)
        if profile is not None and len(losses) == args.steps:
            profile.begin()  # the loop's next step is the profiled one

    run_args = argparse.Namespace(**{**vars(args), "steps": args.steps + (profile is not None)})
    backend = gpu_peers.run_peer(case.peer, case.zero_stage, case.offload, config, run_args, corpus, record)
    return losses, seconds, backend


def step_probe(gpu: bool, steps: int, profile: Any = None, step_rounds: Optional[int] = None) -> Any:
    """A Lightning callback that records each step's loss and its wall time, from batch start to the
    end of the optimizer step (device synchronized), for ``steps`` steps; a step after those runs
    under ``profile``. At the start it sets ZeRO 1-2's ``step_rounds`` where given and records the
    rounds the step runs in. Built here so the parent process never imports Lightning."""
    import lightning as L
    import torch

    class StepProbe(L.Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []
            self.seconds: list[float] = []
            self._start = 0.0
            self.step_rounds: Optional[int] = None

        def on_train_start(self, trainer: Any, module: Any) -> None:
            for optimizer in trainer.strategy.optimizers:
                if hasattr(optimizer, "step_rounds"):  # our ZeroOptimizer
                    if step_rounds is not None:
                        optimizer.rounds = step_rounds
                    self.step_rounds = optimizer.step_rounds

        def _sync(self) -> None:
            if gpu:
                torch.cuda.synchronize()

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            if profile is not None and len(self.seconds) == steps:
                profile.begin()
                return
            self._sync()
            self._start = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if profile is not None and profile.active:
                profile.end()
                return
            self._sync()
            self.seconds.append(time.perf_counter() - self._start)
            self.losses.append(float(outputs["loss"]))

    return StepProbe()


def run_in_child(case: Case, args: argparse.Namespace) -> dict[str, Any]:
    """The case in a fresh process; whatever happens there comes back as a result."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--case", case.name]
    for key in (*GPU_RUN, "steps", "seed"):
        cmd += [f"--{key}", str(getattr(args, key))]
    if args.cpu_dry_run:
        cmd.append("--cpu-dry-run")
    if args.nvme_dir:
        cmd += ["--nvme-dir", args.nvme_dir]
    if args.profile_dir:
        cmd += ["--profile-dir", args.profile_dir]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.case_timeout)
    except subprocess.TimeoutExpired as err:
        tail = (err.stderr or b"")[-1500:]
        tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        return {"case": case.name, "ok": False, "error": f"timed out after {args.case_timeout:g} s", "stderr_tail": tail}
    line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith(RESULT)), None)
    if line is None:
        error = f"the case's process exited with {proc.returncode} and no result"
        return {"case": case.name, "ok": False, "error": error, "stderr_tail": proc.stderr[-1500:]}
    result = json.loads(line[len(RESULT):])
    if not result.get("ok"):
        result["stderr_tail"] = proc.stderr[-1500:]
    return result


# -- the verdict ------------------------------------------------------------------------------------------
def loss_differences(results: list[dict[str, Any]]) -> dict[str, Optional[float]]:
    """Per case, the largest relative difference of its losses from the reference's over the steps
    (None where either did not run; infinity if they ran different step counts)."""
    ref = next((r for r in results if r["case"] == REFERENCE and r.get("ok")), None)
    return {r["case"]: None if ref is None or not r.get("ok") else relative_gap(r["losses"], ref["losses"]) for r in results}


def relative_gap(losses: list[float], reference: list[float]) -> float:
    """The largest ``|loss - reference| / |reference|`` over the steps; infinity if the step counts differ."""
    if len(losses) != len(reference):
        return float("inf")
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference))


def compare(results: list[dict[str, Any]], rtol: float) -> dict[str, Any]:
    """The verdict: every case ran, its losses agree with the reference's within ``rtol``, and the
    reference's loss fell by more than ``MIN_DROP`` tolerances (else agreement would prove nothing)."""
    diffs = loss_differences(results)
    ref = next((r for r in results if r["case"] == REFERENCE and r.get("ok")), None)
    peers = {r["case"] for r in results if CASE_BY_NAME[r["case"]].peer}
    failed = [r["case"] for r in results if not r.get("ok") and r["case"] not in peers]
    disagree = [name for name, d in diffs.items() if d is not None and not d <= rtol and name not in peers]
    drop = (ref["losses"][0] - ref["losses"][-1]) / abs(ref["losses"][0]) if ref else None
    signal = drop is not None and drop > MIN_DROP * rtol
    return {
        "case": "gpu_check",
        "passed": bool(ref) and not failed and not disagree and signal,
        "cases": len(results),
        "failed": failed,
        "disagree": disagree,
        # null: the case (or the reference) did not run, or they ran different step counts
        "max_rel_diff": {name: (round(d, 6) if d is not None and d != float("inf") else None) for name, d in diffs.items()},
        "rtol": rtol,
        "tolerance": TOLERANCE_WHY,
        "reference": REFERENCE,
        "reference_relative_drop": round(drop, 4) if drop is not None else None,
        "reference_drop_ok": signal,
        "reference_drop_needed": round(MIN_DROP * rtol, 4),
        # reported, not failed: the prediction is a comparison, not part of what must work
        "predictions_missing": [r["case"] for r in results if "step_s" not in (r.get("predicted") or {}) and not r.get("not_run")],
        # reported, not failed: the other stacks' runs of the same layouts (a peer's crash is not ours)
        "peers": peer_comparison(results, diffs, rtol),
        # reported: a case against its variant (the same layout run another way), e.g. the step in rounds vs one call
        "variants": variant_comparison(results),
    }


def variant_comparison(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per variant case that ran beside its base: base / variant tokens per second (above 1: the base's
    way is faster), the largest relative difference between their losses (the same arithmetic gives 0
    up to the GPU kernels' own nondeterminism), and the ZeRO step rounds each ran."""
    by_name = {r["case"]: r for r in results if r.get("ok")}
    out: dict[str, Any] = {}
    for r in results:
        base_name = CASE_BY_NAME[r["case"]].variant_of
        base = by_name.get(base_name)
        if not base_name or base is None or not r.get("ok"):
            continue
        entry: dict[str, Any] = {"of": base_name, "step_rounds": [base.get("step_rounds"), r.get("step_rounds")]}
        entry["speed_ratio"] = round(base["tokens_per_s"] / r["tokens_per_s"], 3) if base.get("tokens_per_s") and r.get("tokens_per_s") else None
        gap = relative_gap(r["losses"], base["losses"])
        if gap != float("inf"):
            entry["max_rel_diff"] = gap
        out[r["case"]] = entry
    return out


def peer_comparison(results: list[dict[str, Any]], diffs: dict[str, Optional[float]], rtol: float) -> dict[str, Any]:
    """Per peer case: ours / the peer's tokens per second and peak GPU memory (the lightning_3d case of
    the same layout), whether its losses agree with the reference's within ``rtol``, or why it did
    not run."""
    by_name = {r["case"]: r for r in results}
    out: dict[str, Any] = {}
    for r in results:
        case = CASE_BY_NAME[r["case"]]
        if not case.peer:
            continue
        entry: dict[str, Any] = {"ours": case.ours}
        if not r.get("ok"):
            entry["not_run" if r.get("not_run") else "error"] = r.get("not_run") or r.get("error")
        else:
            ours = by_name.get(case.ours) or {}
            for key, name in (("tokens_per_s", "speed_ratio"), ("peak_gpu_gib", "memory_ratio")):
                a, b = ours.get(key), r.get(key)
                entry[name] = round(a / b, 3) if ours.get("ok") and a and b else None
            entry["max_rel_diff"] = None if diffs[r["case"]] is None else round(diffs[r["case"]], 6)
            entry["losses_agree"] = diffs[r["case"]] is not None and diffs[r["case"]] <= rtol
            if case.peer in PEER_LOSS_NOTES:
                entry["why_losses_differ"] = PEER_LOSS_NOTES[case.peer]
        out[r["case"]] = entry
    return out


def table(results: list[dict[str, Any]]) -> str:
    """Measured next to predicted (the planner's), one row per case."""

    def num(value: Any, fmt: str) -> str:
        return format(value, fmt) if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"

    head = (
        f"{'case':<26} {'ok':>3} {'last loss':>9} {'rel diff':>8} | {'step s':>7} {'pred':>7} | {'MFU':>6} {'pred':>6} | "
        f"{'GPU GiB':>7} {'pred':>6} {'ratio':>5} | {'host RSS':>8} {'offl.':>6}"
    )
    lines = [head, "-" * len(head)]
    diffs = loss_differences(results)
    for r in results:
        pred = r.get("predicted") or {}
        measured, predicted = r.get("peak_gpu_gib"), pred.get("allocated_gib")
        ratio = measured / predicted if measured and predicted else None
        lines.append(
            f"{r['case']:<26} {'yes' if r.get('ok') else 'NO':>3} {num((r.get('losses') or [None])[-1], '.4f'):>9} "
            f"{num(diffs[r['case']], '.1e'):>8} | {num(r.get('step_s'), '.3f'):>7} {num(pred.get('step_s'), '.3f'):>7} | "
            f"{num(r.get('mfu'), '.1%'):>6} {num(pred.get('mfu'), '.1%'):>6} | {num(measured, '.2f'):>7} "
            f"{num(predicted, '.2f'):>6} {num(ratio, '.2f'):>5} | {num(r.get('peak_host_rss_gib'), '.2f'):>8} "
            f"{num(pred.get('host_gib', 0) + pred.get('nvme_gib', 0) if pred else None, '.2f'):>6}"
        )
    lines.append(
        "rel diff: max over steps of |loss - zero0's| / zero0's. GPU GiB: torch.cuda.max_memory_allocated vs the "
        "planner's per-device total without its runtime reserve. host RSS: the process's peak (the Python runtime "
        "included); offl.: the planner's offloaded state (host or NVMe)."
    )
    if results and all(r.get("peak_gpu_gib") is None for r in results):
        lines.append("CPU run: no GPU memory to measure; speed and MFU are against a rough CPU profile.")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every selected case (in child processes, or here with ``--in-process``), each printed as it ends."""
    results = []
    for case in args.case_list:
        if args.in_process:
            with contextlib.redirect_stdout(sys.stderr):  # Lightning's chatter; stdout is for results
                result = run_case(case, args)
        else:
            result = run_in_child(case, args)
        result.setdefault("proves", case.proves)
        results.append(result)
        print(json.dumps(result), flush=True)
    verdict = compare(results, args.rtol)
    return results, verdict


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.case is not None:  # a child: one case, one RESULT line
        case = next(c for c in CASES if c.name == args.case)
        with contextlib.redirect_stdout(sys.stderr):
            result = run_case(case, args)
        print(RESULT + json.dumps(result), flush=True)
        return 0
    missing = [name for name in ("torch", "lightning", "omegaconf", "hydra") if importlib.util.find_spec(name) is None]
    if missing:
        print(f"gpu_check: missing {', '.join(missing)}: install the project first (pip install -e .; README).", file=sys.stderr)
        return 2
    if not args.cpu_dry_run:
        import torch

        if not torch.cuda.is_available():
            print(
                "gpu_check: no CUDA device is visible to torch "
                f"{torch.__version__}; install a CUDA build of torch (README, GPU set-up) or use --cpu-dry-run.",
                file=sys.stderr,
            )
            return 2
    results, verdict = run(args)
    print(table(results), flush=True)
    print(json.dumps(verdict), flush=True)
    return 0 if verdict["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
