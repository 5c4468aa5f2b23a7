"""Benchmark cases. Each case is a function of ``(steps, repeats)`` returning one JSON-able dict.

Cases compare our strategy with the built-in alternative on the same model, ranks and batch in
the same run, alternating the two to spread machine noise evenly, and quote ratios.
"""

from __future__ import annotations

import statistics
from typing import Any, Callable, Optional

import lightning as L
import torch

from lightning_3d.data import TextDataModule
from lightning_3d.models import GPTConfig, GPTModule
from lightning_3d.monitoring.callbacks import TokenThroughput
from lightning_3d.testing.harness import run_on_ranks

BENCH_GPT = dict(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=128)
CASES: dict[str, Callable[[int, int], dict[str, Any]]] = {}


def case(fn: Callable[[int, int], dict[str, Any]]) -> Callable[[int, int], dict[str, Any]]:
    CASES[fn.__name__] = fn
    return fn


def model_state_mb(module: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> float:
    """Bytes this rank holds for parameters, gradients and optimizer state (DTensors: local shards)."""

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    tensors = {}
    for p in module.parameters():
        tensors[id(p)] = local(p)
        if p.grad is not None:
            tensors[id(p.grad)] = local(p.grad)
    for opt in optimizers:
        for state in opt.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    tensors[id(v)] = local(v)
    return sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20


def _strategy(spec: Any) -> tuple[Any, type[GPTModule]]:
    """A strategy and the module class to train with it, from a short spec such as ``3d:dp=2,tp=2``."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_3d import ThreeDParallelStrategy

    if isinstance(spec, dict):  # ThreeDParallelStrategy keywords (a planned layout's strategy_kwargs)
        return ThreeDParallelStrategy(**spec), GPTModule
    name, _, args = spec.partition(":")
    kwargs: dict[str, Any] = {k: (int(v) if v.isdigit() else v) for k, v in (item.split("=") for item in args.split(",") if item)}
    if name == "3d":
        names = {
            "dp": "data_parallel",
            "tp": "tensor_parallel",
            "pp": "pipeline_parallel",
            "zero": "zero_stage",
            "offload": "offload_optimizer",
            "nvme": "nvme_path",
            "ac": "activation_checkpointing",
            "guard": "replica_check_every",
            "sp": "sequence_parallel",
            "compile": "compile",  # a backend name: regional torch.compile of the blocks
            "schedule": "pipeline_schedule",
            "mb": "micro_batches",
            "vs": "virtual_stages",
        }
        kwargs = {k: {"off": None, "true": True}.get(v, v) if isinstance(v, str) else v for k, v in kwargs.items()}
        return ThreeDParallelStrategy(**{names[k]: v for k, v in kwargs.items()}), GPTModule
    if name == "model_parallel":
        from baselines import DTensorGPTModule

        return ModelParallelStrategy(data_parallel_size=kwargs["dp"], tensor_parallel_size=kwargs["tp"]), DTensorGPTModule
    if name == "fully_shard":
        from baselines import FullyShardGPTModule

        return ModelParallelStrategy(data_parallel_size=kwargs["dp"], tensor_parallel_size=1), FullyShardGPTModule
    return name, GPTModule


class StateMemory(L.Callback):
    """Model-state bytes at the end of training, before teardown releases anything."""

    def __init__(self) -> None:
        self.mb = float("nan")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        report = getattr(trainer.strategy, "memory_report", None)
        if report is not None:
            self.mb = report()["total"] / 2**20
        else:
            self.mb = model_state_mb(pl_module, trainer.optimizers)


def bench_trainer(strategy: Any, max_steps: int, callbacks: list[L.Callback]) -> L.Trainer:
    """A quiet CPU Trainer over every rank of this world: no validation, logger, checkpoints or bars."""
    return L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=torch.distributed.get_world_size(),
        max_steps=max_steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )


class StepLosses(L.Callback):
    """This rank's training loss of every step (its own micro-batches' mean), for agreement checks."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))


def fit_throughput(
    strategy_spec: Any, steps: int, global_batch: int, warmup: int = 5, model_dims: Optional[dict[str, Any]] = None
) -> dict[str, Any]:
    """Runs on every rank: tokens/s (all replicas), step time, peak memory and losses of ``steps`` GPT
    steps (``model_dims``: GPTConfig fields, default ``BENCH_GPT``)."""
    import lightning_3d  # noqa: F401  (registers "3d")

    dims = model_dims or BENCH_GPT
    L.seed_everything(0)
    throughput, state, losses = TokenThroughput(warmup=warmup), StateMemory(), StepLosses()
    strategy, module_class = _strategy(strategy_spec)
    trainer = bench_trainer(strategy, steps + warmup, [throughput, state, losses])
    model = module_class(GPTConfig(**dims), warmup_steps=2)
    model.configure_callbacks = lambda: []  # keep our instance
    trainer.fit(model, TextDataModule(block_size=dims["block_size"], global_batch_size=global_batch, max_bytes=2**21))
    tokens_per_step = global_batch * dims["block_size"]
    return {
        "tokens_per_s": throughput.mean_tokens_per_s,
        "step_time_s": tokens_per_step / throughput.mean_tokens_per_s,
        "peak_memory_mb": throughput.peak_memory_mb,
        "model_state_mb": state.mb,
        "losses": losses.losses,
    }


def _alternate(runs_spec: dict[str, tuple[int, str]], steps: int, repeats: int, global_batch: int) -> dict[str, Any]:
    """label -> (world size, strategy spec); runs alternate so machine noise spreads evenly."""
    runs: dict[str, list[dict[str, float]]] = {label: [] for label in runs_spec}
    for _ in range(repeats):
        for label, (world, spec) in runs_spec.items():
            runs[label].append(run_on_ranks(fit_throughput, world, spec, steps, global_batch, timeout=900)[0])
    return {
        label: {
            "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in rs), 1),
            "step_time_s": round(statistics.median(r["step_time_s"] for r in rs), 4),
            "peak_memory_mb": round(max(r["peak_memory_mb"] for r in rs), 1),
            "model_state_mb": round(max(r["model_state_mb"] for r in rs), 2),
        }
        for label, rs in runs.items()
    }


def _ratio(a: float, b: float) -> float:
    return round(a / b, 3)


@case
def dp2_vs_ddp(steps: int, repeats: int) -> dict[str, Any]:
    """ThreeDParallelStrategy at dp=2 vs Lightning's DDP: same GPT, 2 CPU ranks, global batch 16 x 128 tokens."""
    result = _alternate({"3d": (2, "3d:dp=2"), "ddp": (2, "ddp")}, steps, repeats, global_batch=16)
    ours, theirs = result["3d"], result["ddp"]
    return {
        "case": "dp2_vs_ddp",
        "model": BENCH_GPT,
        "global_batch": 16,
        "steps": steps,
        "repeats": repeats,
        "3d": ours,
        "ddp": theirs,
        "tokens_per_s_ratio": _ratio(ours["tokens_per_s"], theirs["tokens_per_s"]),
        "peak_memory_ratio": _ratio(ours["peak_memory_mb"], theirs["peak_memory_mb"]),
    }


@case
def tp2_dp2_vs_model_parallel(steps: int, repeats: int) -> dict[str, Any]:
    """dp=2 x tp=2 on 4 CPU ranks: ours vs Lightning ModelParallelStrategy (DTensor TP + FSDP2), same GPT and batch."""
    result = _alternate(
        {"3d": (4, "3d:dp=2,tp=2"), "model_parallel": (4, "model_parallel:dp=2,tp=2")}, steps, repeats, global_batch=16
    )
    ours, theirs = result["3d"], result["model_parallel"]
    return {
        "case": "tp2_dp2_vs_model_parallel",
        "model": BENCH_GPT,
        "global_batch": 16,
        "steps": steps,
        "repeats": repeats,
        "3d": ours,
        "model_parallel": theirs,
        "tokens_per_s_ratio": _ratio(ours["tokens_per_s"], theirs["tokens_per_s"]),
        "peak_memory_ratio": _ratio(ours["peak_memory_mb"], theirs["peak_memory_mb"]),
        "model_state_ratio": _ratio(ours["model_state_mb"], theirs["model_state_mb"]),
    }


@case
def replica_guard_cost(steps: int, repeats: int) -> dict[str, Any]:
    """The replica guard's cost at dp2 x tp2 x pp2 (8 CPU ranks): off, checking every step, and "auto"
    (the default: spaced to cost under 1% of a step)."""
    layout = "3d:dp=2,tp=2,pp=2,zero=1"
    result = _alternate(
        {"off": (8, f"{layout},guard=off"), "every_step": (8, f"{layout},guard=1"), "auto": (8, layout)},
        steps, repeats, global_batch=16,
    )
    off = result["off"]["step_time_s"]
    return {
        "case": "replica_guard_cost",
        "model": BENCH_GPT,
        "global_batch": 16,
        "steps": steps,
        "repeats": repeats,
        **result,
        "every_step_over_off": _ratio(result["every_step"]["step_time_s"], off),
        "auto_over_off": _ratio(result["auto"]["step_time_s"], off),
    }


@case
def tp2_vs_tp1(steps: int, repeats: int) -> dict[str, Any]:
    """Step time of one model replica split over 2 ranks (tp=2, without and with sequence parallelism)
    vs on 1 rank, same GPT and batch."""
    result = _alternate({"tp2": (2, "3d:tp=2"), "tp2_sp": (2, "3d:tp=2,sp=true"), "tp1": (1, "3d")}, steps, repeats, global_batch=8)
    return {
        "case": "tp2_vs_tp1",
        "model": BENCH_GPT,
        "global_batch": 8,
        "steps": steps,
        "repeats": repeats,
        "tp2": result["tp2"],
        "tp2_sp": result["tp2_sp"],
        "tp1": result["tp1"],
        "step_time_ratio": _ratio(result["tp2"]["step_time_s"], result["tp1"]["step_time_s"]),
        "sp_over_tp2_step_time_ratio": _ratio(result["tp2_sp"]["step_time_s"], result["tp2"]["step_time_s"]),
        "peak_memory_ratio": _ratio(result["tp2"]["peak_memory_mb"], result["tp1"]["peak_memory_mb"]),
        "model_state_ratio": _ratio(result["tp2"]["model_state_mb"], result["tp1"]["model_state_mb"]),
    }


@case
def zero_stages_vs_ddp(steps: int, repeats: int) -> dict[str, Any]:
    """ZeRO 1/2/3 at dp=2 vs Lightning's DDP (fp32 AdamW): tokens/s and per-rank model-state memory."""
    runs = {"ddp": (2, "ddp"), "zero1": (2, "3d:dp=2,zero=1"), "zero2": (2, "3d:dp=2,zero=2"), "zero3": (2, "3d:dp=2,zero=3")}
    result = _alternate(runs, steps, repeats, global_batch=16)
    ddp = result["ddp"]
    out: dict[str, Any] = {"case": "zero_stages_vs_ddp", "model": BENCH_GPT, "global_batch": 16, "steps": steps, "repeats": repeats}
    out.update(result)
    for stage in ("zero1", "zero2", "zero3"):
        out[f"{stage}_tokens_per_s_ratio"] = _ratio(result[stage]["tokens_per_s"], ddp["tokens_per_s"])
        out[f"{stage}_model_state_ratio"] = _ratio(result[stage]["model_state_mb"], ddp["model_state_mb"])
        out[f"{stage}_peak_memory_ratio"] = _ratio(result[stage]["peak_memory_mb"], ddp["peak_memory_mb"])
    return out


@case
def zero3_vs_fully_shard(steps: int, repeats: int) -> dict[str, Any]:
    """Our ZeRO-3 vs plain torch FSDP2 (fully_shard via ModelParallelStrategy), dp=2, same GPT and batch."""
    result = _alternate({"zero3": (2, "3d:dp=2,zero=3"), "fully_shard": (2, "fully_shard:dp=2")}, steps, repeats, global_batch=16)
    ours, theirs = result["zero3"], result["fully_shard"]
    return {
        "case": "zero3_vs_fully_shard",
        "model": BENCH_GPT,
        "global_batch": 16,
        "steps": steps,
        "repeats": repeats,
        "zero3": ours,
        "fully_shard": theirs,
        "tokens_per_s_ratio": _ratio(ours["tokens_per_s"], theirs["tokens_per_s"]),
        "model_state_ratio": _ratio(ours["model_state_mb"], theirs["model_state_mb"]),
    }


@case
def pp2_1f1b_vs_torch_pipelining(steps: int, repeats: int) -> dict[str, Any]:
    from pipeline_cases import compare_with_torch

    return compare_with_torch(steps, repeats)


@case
def pp2_zbv_vs_torch_pipelining(steps: int, repeats: int) -> dict[str, Any]:
    from pipeline_cases import compare_zbv_with_torch

    return compare_zbv_with_torch(steps, repeats)


@case
def pp2_zbv_vs_torch_pipelining_8x(steps: int, repeats: int) -> dict[str, Any]:
    """The zb_v comparison on a GPT with 8x the compute per chunk (messages small against compute)."""
    from pipeline_cases import ZBV_GPT_8X, compare_zbv_with_torch

    return {**compare_zbv_with_torch(steps, repeats, ZBV_GPT_8X), "case": "pp2_zbv_vs_torch_pipelining_8x"}


@case
def pipeline_bubbles(steps: int, repeats: int) -> dict[str, Any]:
    from pipeline_cases import bubbles

    return bubbles(steps, repeats)


@case
def pipeline_bubbles_pp2_m8(steps: int, repeats: int) -> dict[str, Any]:
    """The acceptance cell of the bubble table (pp=2, m=8) on a model with 8x the compute per micro-batch."""
    from pipeline_cases import BAR_GPT, bubbles

    return {**bubbles(steps, repeats, pps=(2,), ms=(8,), gpt=BAR_GPT), "case": "pipeline_bubbles_pp2_m8"}


@case
def offload_step_time(steps: int, repeats: int) -> dict[str, Any]:
    """ZeRO-2 at dp=2: optimizer state on the device vs offloaded to CPU vs streamed from NVMe (a temp dir)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="nvme_bench_") as nvme:
        runs = {
            "none": (2, "3d:dp=2,zero=2"),
            "cpu": (2, "3d:dp=2,zero=2,offload=cpu"),
            "nvme": (2, f"3d:dp=2,zero=2,offload=nvme,nvme={nvme}"),
        }
        result = _alternate(runs, steps, repeats, global_batch=16)
    out: dict[str, Any] = {"case": "offload_step_time", "model": BENCH_GPT, "global_batch": 16, "steps": steps, "repeats": repeats}
    out.update(result)
    out["cpu_vs_none_step_time_ratio"] = _ratio(result["cpu"]["step_time_s"], result["none"]["step_time_s"])
    out["nvme_vs_cpu_step_time_ratio"] = _ratio(result["nvme"]["step_time_s"], result["cpu"]["step_time_s"])
    return out


def _offload_host_step(stage: int, steps: int, width: int, layers: int) -> dict[str, float]:
    """One gloo rank: a bf16 stack of ``layers`` ``width x width`` linear maps (fp32 masters), a tiny
    forward and backward, then the step of ZeRO-``stage`` with offload_optimizer="cpu" vs torch's fused
    AdamW stepping fp32 parameters in place (the native floor: the same kernel without ZeRO's copies)."""
    import time

    import torch.distributed as dist

    from lightning_3d.zero.sharded_optimizer import ZeroOptimizer

    def stack(dtype: torch.dtype) -> torch.nn.Sequential:
        torch.manual_seed(0)
        return torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(layers))).to(dtype)

    x = torch.randn(1, width)

    def timed(model: torch.nn.Module, optimizer: Any) -> float:
        times = []
        for i in range(steps + 2):
            start = time.perf_counter()
            model(x.to(next(model.parameters()).dtype)).float().square().mean().backward()
            optimizer.step()
            if hasattr(optimizer, "zero_grad"):
                optimizer.zero_grad()
            if i >= 2:  # two warm-up steps: state allocation and the first host buffers
                times.append(time.perf_counter() - start)
        return statistics.median(times)

    ours_model = stack(torch.bfloat16)
    ours = ZeroOptimizer(
        torch.optim.AdamW(ours_model.parameters(), lr=1e-4), dist.group.WORLD, stage,
        compute_dtype=torch.bfloat16, master_dtype=torch.float32, offload="cpu",
    )
    try:
        ours_s = timed(ours_model, ours)
    finally:
        ours.grads.remove()
    native_model = stack(torch.float32)
    native_s = timed(native_model, torch.optim.AdamW(native_model.parameters(), lr=1e-4, fused=True))
    return {"ours_s": ours_s, "torch_fused_s": native_s}


@case
def offload_host_step(steps: int, repeats: int) -> dict[str, Any]:
    """The host side of a ZeRO-Offload step (gradient slice to the host, fused CPU AdamW, masters back to
    the parameters) at ZeRO-1 and ZeRO-2, on 67 M parameters, against torch's fused AdamW on fp32
    parameters: the native floor. The forward and backward are negligible (one token)."""
    width, layers = 4096, 4
    out: dict[str, Any] = {"case": "offload_host_step", "parameters": width * width * layers, "steps": steps, "repeats": repeats}
    for stage in (1, 2):
        runs = [run_on_ranks(_offload_host_step, 1, stage, max(3, steps // 4), width, layers, timeout=900)[0] for _ in range(repeats)]
        ours = statistics.median(r["ours_s"] for r in runs)
        native = statistics.median(r["torch_fused_s"] for r in runs)
        out[f"zero{stage}"] = {"ours_step_s": round(ours, 4), "torch_fused_step_s": round(native, 4)}
        out[f"zero{stage}_vs_torch_fused_step_time_ratio"] = _ratio(ours, native)
    return out


def _zero_step_rounds(steps: int, repeats: int, width: int, layers: int, bucket_mb: float) -> dict[str, Any]:
    """On each of 2 gloo ranks: ZeRO-1 AdamW over a stack of ``layers`` ``width x width`` fp32 linear
    maps in ``bucket_mb`` buckets; the median time of ``ZeroOptimizer.step`` (the used vote, the inner
    step, the all-gathers and their wait) with the step in rounds against one call, alternating."""
    import time

    import torch.distributed as dist

    from lightning_3d.zero.sharded_optimizer import STEP_ROUNDS, ZeroOptimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(layers)))
    opt = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4), dist.group.WORLD, 1, bucket_bytes=int(bucket_mb * 2**20))
    x = torch.randn(4, width)
    medians: dict[str, list[float]] = {"rounds": [], "one_call": []}
    try:
        for _ in range(repeats):
            for label, rounds in (("rounds", STEP_ROUNDS), ("one_call", 1)):
                opt.rounds = rounds
                times = []
                for i in range(steps + 2):
                    model(x).square().mean().backward()
                    opt.grads.after_backward()
                    dist.barrier()  # both ranks enter the step together: the time is the step's own
                    start = time.perf_counter()
                    opt.step()
                    if i >= 2:
                        times.append(time.perf_counter() - start)
                medians[label].append(statistics.median(times))
    finally:
        opt.remove()
    return {"buckets": len(opt.buckets), **{k: statistics.median(v) for k, v in medians.items()}}


@case
def zero_step_rounds(steps: int, repeats: int) -> dict[str, Any]:
    """ZeRO-1's step in rounds (each round's all-gathers in flight while the next round steps) against
    one inner call followed by every all-gather: dp=2, 16.8 M fp32 parameters in 4 MiB buckets."""
    width, layers, bucket_mb = 1024, 16, 4.0
    ranks = run_on_ranks(_zero_step_rounds, 2, max(5, steps // 2), repeats, width, layers, bucket_mb, timeout=900)
    rounds = max(r["rounds"] for r in ranks)  # the slower rank's median
    one_call = max(r["one_call"] for r in ranks)
    return {
        "case": "zero_step_rounds", "parameters": width * width * layers, "bucket_mb": bucket_mb, "buckets": ranks[0]["buckets"],
        "steps": max(5, steps // 2), "repeats": repeats, "rounds_step_s": round(rounds, 4), "one_call_step_s": round(one_call, 4),
        "rounds_vs_one_call_step_time_ratio": _ratio(rounds, one_call),
    }


@case
def cpu_adam_throughput(steps: int, repeats: int) -> dict[str, Any]:
    """Elements/s of one AdamW step on the CPU: torch per-parameter (foreach, fused) vs the offload path
    (torch's fused kernel on the flat master slices ZeRO keeps)."""
    import time

    from lightning_3d.models import GPT
    from lightning_3d.zero.offload import fused_adam_like

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=8, n_embd=512))
    params = [p for p in model.parameters()]
    n = sum(p.numel() for p in params)

    def rate(optimizer: torch.optim.Optimizer, tensors: list[torch.Tensor]) -> float:
        for t in tensors:
            t.grad = torch.randn_like(t) * 1e-3
        optimizer.step()
        times = []
        for _ in range(max(5, steps // 3)):
            start = time.perf_counter()
            optimizer.step()
            times.append(time.perf_counter() - start)
        return n / statistics.median(times)

    flat = torch.nn.Parameter(torch.cat([p.detach().reshape(-1) for p in params]))
    hyper = dict(lr=1e-3, weight_decay=0.1)
    results = {
        "torch_foreach": rate(torch.optim.AdamW(params, foreach=True, **hyper), params),
        "torch_fused": rate(torch.optim.AdamW(params, fused=True, **hyper), params),
        "ours_flat_fused": rate(fused_adam_like(torch.optim.AdamW(params, **hyper), [{"params": [flat], **hyper}]), [flat]),
    }
    return {
        "case": "cpu_adam_throughput",
        "parameters": n,
        "tensors": len(params),
        **{k: round(v / 1e6, 1) for k, v in results.items()},
        "unit": "M elements/s",
        "ours_vs_torch_fused_ratio": _ratio(results["ours_flat_fused"], results["torch_fused"]),
        "ours_vs_torch_foreach_ratio": _ratio(results["ours_flat_fused"], results["torch_foreach"]),
    }


@case
def recompute_overhead(steps: int, repeats: int) -> dict[str, Any]:
    """Step time with full and selective activation checkpointing vs none (one rank, same GPT and batch)."""
    runs = {"none": (1, "3d"), "selective": (1, "3d:ac=selective"), "full": (1, "3d:ac=full")}
    result = _alternate(runs, steps, repeats, global_batch=8)
    out: dict[str, Any] = {"case": "recompute_overhead", "model": BENCH_GPT, "global_batch": 8, "steps": steps, "repeats": repeats}
    out.update(result)
    out["selective_step_time_ratio"] = _ratio(result["selective"]["step_time_s"], result["none"]["step_time_s"])
    out["full_step_time_ratio"] = _ratio(result["full"]["step_time_s"], result["none"]["step_time_s"])
    return out


@case
def compile_blocks(steps: int, repeats: int) -> dict[str, Any]:
    """Regional ``torch.compile`` (inductor) against eager, at dp=2 ZeRO-1 and at tp=2 with sequence
    parallelism (the collectives stay eager between the compiled graphs). The warm-up steps take the
    compilation; the timed steps run compiled code."""
    runs = {
        "dp2_eager": (2, "3d:dp=2,zero=1"), "dp2_compiled": (2, "3d:dp=2,zero=1,compile=inductor"),
        "tp2_sp_eager": (2, "3d:tp=2,sp=true"), "tp2_sp_compiled": (2, "3d:tp=2,sp=true,compile=inductor"),
    }
    result = _alternate(runs, steps, repeats, global_batch=16)
    out: dict[str, Any] = {"case": "compile_blocks", "model": BENCH_GPT, "global_batch": 16, "steps": steps, "repeats": repeats}
    out.update(result)
    for layout in ("dp2", "tp2_sp"):
        out[f"{layout}_compiled_tokens_per_s_ratio"] = _ratio(result[f"{layout}_compiled"]["tokens_per_s"], result[f"{layout}_eager"]["tokens_per_s"])
    return out


@case
def checkpoint_8rank(steps: int, repeats: int) -> dict[str, Any]:
    from checkpoint_cases import checkpoint_cost

    return checkpoint_cost(steps, repeats)


@case
def planner_search_speed(steps: int, repeats: int) -> dict[str, Any]:
    from planner_cases import search_speed

    return search_speed(repeats)


@case
def planner_validation(steps: int, repeats: int) -> dict[str, Any]:
    from planner_cases import validation

    return validation()


@case
def cp2_vs_cp1(steps: int, repeats: int) -> dict[str, Any]:
    from context_parallel_cases import cp_vs_cp1

    return cp_vs_cp1(steps, repeats)


@case
def cp_attention_kernels(steps: int, repeats: int) -> dict[str, Any]:
    from context_parallel_cases import cp_attention_kernels as kernels

    return kernels(steps, repeats)


@case
def ep2_vs_ep1(steps: int, repeats: int) -> dict[str, Any]:
    from moe_cases import ep2_vs_ep1 as compare

    return compare(steps, repeats)


@case
def resume_seek_time(steps: int, repeats: int) -> dict[str, Any]:
    """Issue 35: the time from a training loader's restored state to its first batch, at steps 10 and
    10,000 of a token file (10.3 M tokens, windows of 128, 8 per batch), for the data cursor (the
    strategy's loader) and for the skip that reads every batch already done (the loader before it,
    and what it falls back to under other strategies); median of ``repeats + 2``."""
    import tempfile
    import time
    from pathlib import Path

    import numpy as np
    from torch.utils.data import DistributedSampler

    from lightning_3d.data.corpus import TokenWindows, read_token_file, write_token_file
    from lightning_3d.data.sampler import GlobalCursorSampler, ResumableDataLoader

    path = Path(tempfile.mkdtemp(prefix="l3d-seek-")) / "tokens.bin"
    write_token_file(np.random.default_rng(0).integers(0, 50_000, 80_016 * 128 + 1), path, 50_000, "random")
    windows = TokenWindows(read_token_file(path)[0], 128)

    def first_batch(step: int, cursor: bool) -> float:
        sampler = GlobalCursorSampler(len(windows)) if cursor else DistributedSampler(windows, 1, 0, seed=0)
        loader = ResumableDataLoader(windows, batch_size=8, sampler=sampler, drop_last=True)
        start = time.perf_counter()
        loader.load_state_dict({"batches_done": step, "epoch": 0, "samples_per_batch": 8, "samples_consumed": 8 * step})
        next(iter(loader))
        return time.perf_counter() - start

    out: dict[str, Any] = {"case": "resume_seek_time", "windows": len(windows)}
    for name, cursor in (("cursor", True), ("skip", False)):
        for step in (10, 10_000):
            out[f"{name}_step{step}_s"] = round(statistics.median(first_batch(step, cursor) for _ in range(repeats + 2)), 4)
    return out


@case
def plan_wall_time(steps: int, repeats: int) -> dict[str, Any]:
    """``lightning-3d plan recipe=llama3_70b`` end to end in a fresh process (issue 37: under 2 s on
    a quiet 2-core machine), the median of ``repeats + 2`` runs, with a fixed Python loop's time as
    the machine's speed at that moment (0.4 s when quiet here)."""
    import subprocess
    import sys
    import time

    def calibration() -> float:
        start = time.perf_counter()
        sum(i * i for i in range(10**7))
        return time.perf_counter() - start

    command = [sys.executable, "-c", "from lightning_3d.apps.cli import main; raise SystemExit(main(['plan', 'recipe=llama3_70b']))"]
    walls, loops = [], []
    for _ in range(repeats + 2):
        loops.append(calibration())
        start = time.perf_counter()
        subprocess.run(command, check=True, capture_output=True)
        walls.append(time.perf_counter() - start)
    return {
        "case": "plan_wall_time",
        "command": "lightning-3d plan recipe=llama3_70b",
        "median_s": round(statistics.median(walls), 3),
        "runs_s": [round(w, 3) for w in walls],
        "calibration_loop_s": round(statistics.median(loops), 3),
    }


@case
def deepspeed_zero_stages(steps: int, repeats: int) -> dict[str, Any]:
    """Ours vs DeepSpeed 0.19.8 (its CPU accelerator, gloo) at ZeRO 1, 2, 3 and ZeRO-2 + CPU offload, dp=2:
    same GPT, data, batch, fp32 AdamW and schedule (issue 36; needs `make bench-peers`). ``lightning_loop``
    measures the floor under both: Lightning's ``ddp`` over torch DDP in a plain loop."""
    from peer_cases import compare

    pairs = {
        "zero1": ("3d:dp=2,zero=1", 2, "deepspeed_run.py", ["--stage", "1"]),
        "zero2": ("3d:dp=2,zero=2", 2, "deepspeed_run.py", ["--stage", "2"]),
        "zero3": ("3d:dp=2,zero=3", 2, "deepspeed_run.py", ["--stage", "3"]),
        "zero2_offload": ("3d:dp=2,zero=2,offload=cpu", 2, "deepspeed_run.py", ["--stage", "2", "--offload"]),
        # What Lightning's loop costs: its DDP strategy against torch DDP in a plain loop, like DeepSpeed's.
        "lightning_loop": ("ddp", 2, "torch_ddp_run.py", []),
    }
    return compare("deepspeed_zero_stages", pairs, steps, repeats, global_batch=16, dims=BENCH_GPT)


# The bench GPT in Llama's form (torchtitan trains only Llama-family decoders): SwiGLU, RMSNorm, RoPE,
# no biases, untied embeddings.
LLAMA_BENCH_GPT = dict(BENCH_GPT, mlp="swiglu", norm="rmsnorm", position="rope", bias=False, tie_embeddings=False)


@case
def torchtitan_llama(steps: int, repeats: int) -> dict[str, Any]:
    """Ours vs torchtitan 0.3.0 (its Llama 3 model and ``parallelize_llama``, on CPU over gloo) on the
    same Llama-style GPT weights, data, batch and fp32 AdamW: FSDP at dp=2 against our ZeRO-3, and
    FSDP + TP at dp=2 x tp=2 against ours (issue 36; needs `make bench-peers`)."""
    from peer_cases import compare

    pairs = {
        "fsdp": ("3d:dp=2,zero=3", 2, "torchtitan_run.py", ["--tp", "1"]),
        # Ours refuses ZeRO-3 with sequence parallelism (not implemented), so both run TP without SP.
        "fsdp_tp": ("3d:dp=2,tp=2,zero=3", 4, "torchtitan_run.py", ["--tp", "2"]),
    }
    return compare("torchtitan_llama", pairs, steps, repeats, global_batch=16, dims=LLAMA_BENCH_GPT)


@case
def torchtitan_pipeline(steps: int, repeats: int) -> dict[str, Any]:
    """Ours vs torchtitan 0.3.0's pipeline (its ``pipeline_llm`` split and torch's schedules) on the same
    Llama-style GPT weights, data, batch and fp32 AdamW: pp=2, 8 micro-batches of 2, at 1F1B, interleaved
    1F1B (2 chunks per rank) and ZB-V, the same blocks on each stage (issue 36; needs `make bench-peers`)."""
    from peer_cases import compare

    pairs = {
        "1f1b": ("3d:pp=2,schedule=1f1b,mb=8", 2, "torchtitan_run.py", ["--schedule", "1F1B"]),
        "interleaved_1f1b": ("3d:pp=2,schedule=interleaved_1f1b,vs=2,mb=8", 2, "torchtitan_run.py", ["--schedule", "Interleaved1F1B"]),
        "zb_v": ("3d:pp=2,schedule=zb_v,mb=8", 2, "torchtitan_run.py", ["--schedule", "ZBVZeroBubble"]),
    }
    for *_, args in pairs.values():
        args += ["--microbatches", "8"]
    return compare("torchtitan_pipeline", pairs, steps, repeats, global_batch=16, dims=LLAMA_BENCH_GPT)


@case
def planner_predicted_vs_measured(steps: int, repeats: int) -> dict[str, Any]:
    """Issue 37's table: `lightning-3d profile` here, then the planner's step time and model state for 15
    layouts of gpt_tiny on 1-2 CPU processes against our Trainer's, alternating; errors and Spearman."""
    from planner_cases import predicted_vs_measured

    return predicted_vs_measured(steps, repeats)
