"""``lightning-3d profile``: measure this machine and write a cluster config that ``plan`` and
``dry-run`` take like any other (issue 37).

On CPU it runs ``--ranks`` processes over gloo, one thread each, as training runs them. All ranks
measure at once, so each figure includes its neighbours' contention, and the slowest rank's is kept:

* the compute rate: a transformer block at the tiny recipes' width, forward + backward, its FLOPs
  (the planner's count) over its time less its dispatch: ``device.peak_tflops``, with
  ``gemm_efficiency: 1.0`` because the figure is already what the arithmetic reaches (square fp32
  GEMMs, the rate of an older profile, are kept in the JSON);
* the copy bandwidth of a large tensor (read + write): ``device.memory_bandwidth_gb_per_s``
  (divided by the planner's HBM efficiency, which it applies again);
* the all-reduce bus bandwidth at the largest size (``2 (n - 1) / n x bytes / seconds``):
  ``intra_node_gb_per_s`` (divided by the planner's link efficiency);
* the all-reduce latency at the smallest size: ``collective_latency_us``, which replaces NCCL's
  latency tables for this cluster;
* the all-gather and reduce-scatter bus bandwidth at the largest size: ``all_gather_gb_per_s`` and
  ``reduce_scatter_gb_per_s`` (gloo runs them at a fraction of its all-reduce's rate);
* the rate block again on one process while the others wait: ``device.peak_tflops_alone``, the rate
  of a layout with one process on the host (processes computing at once slow each other);
* the rate block split by the tensor-parallel plan over all the processes (t = ``--ranks``), less
  its dispatch, element-wise bytes and 4 all-reduces as the planner charges them:
  ``device.peak_tflops_tp``, the rate of a layer's ``1 / t`` shard (narrower GEMMs reach less per
  FLOP), used for every t > 1;
* the forward + backward of a transformer block too small to compute: ``device.layer_overhead_us``,
  the per-layer dispatch time an eager CPU process pays in line;
* the median step of a Trainer under the strategy on a one-layer GPT too small to compute, less
  that layer and one all-reduce: ``step_overhead_ms``, the training loop's own time;
* a 4-layer minimal GPT's step under ZeRO-0 and ZeRO-3, at 1 and 2 micro-batches, the four in turn
  over 3 rounds, less what the planner charges each (ZeRO-3's gathers and scatters, the sharded
  optimizer): what FSDP2 adds per unit (a layer, the root) and micro-batch (the growth with a
  micro-batch), and per step (the rest), ``zero3_unit_overhead_us`` and ``zero3_step_overhead_ms``
  (each the median over the rounds).

The measured figures and their sizes are printed as JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import date
from pathlib import Path
from typing import Any, Optional

MB = 2**20


def measure_rank(
    gemm_sizes: list[int], copy_mb: int, reduce_sizes: list[int], repeats: int, loop_steps: int = 25, zero3_rounds: int = 3
) -> dict[str, Any]:
    """One rank's measurements (inside a process group: every rank runs this at once)."""
    import torch
    import torch.distributed as dist

    def timed(fn: Any, pick: Any, together: bool = True) -> float:
        fn()  # warm-up
        times = []
        for _ in range(repeats):
            if together:
                dist.barrier()
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return pick(times)

    def best(fn: Any) -> float:  # what the hardware can reach: rates and latencies
        return timed(fn, min)

    def typical(fn: Any) -> float:  # what a training step meets: the median, as steps are measured
        return timed(fn, statistics.median)

    cpu = torch.device("cpu")  # (this profile measures CPU processes over gloo; a GPU profile is not built)
    gemm = {}
    for n in gemm_sizes:
        a, b = torch.randn(n, n, device=cpu), torch.randn(n, n, device=cpu)
        gemm[n] = 2.0 * n**3 / best(lambda: a @ b) / 1e12
    x = torch.empty(copy_mb * MB // 4, device=cpu)
    y = torch.empty_like(x)
    copy = 2.0 * x.numel() * 4 / best(lambda: y.copy_(x)) / 1e9
    world = dist.get_world_size()
    # a small all-reduce between pieces of compute, as training issues them: its start-up plus the
    # wait for the other ranks' compute to line up, which an idle all-reduce does not show
    a = torch.randn(192, 192, device=cpu)
    small = torch.zeros(1024, device=cpu)
    chunks = 50

    def compute() -> None:
        for _ in range(chunks):
            a @ a

    def compute_and_reduce() -> None:
        for _ in range(chunks):
            a @ a
            dist.all_reduce(small)

    loaded_latency = max(0.0, (typical(compute_and_reduce) - typical(compute)) / chunks)
    reduce = {}
    for nbytes in reduce_sizes:
        t = torch.zeros(max(1, nbytes // 4), device=cpu)
        seconds = best(lambda: dist.all_reduce(t))
        reduce[nbytes] = {"seconds": seconds, "bus_gb_per_s": 2.0 * (world - 1) / world * t.numel() * 4 / seconds / 1e9}
    out = {
        "gemm_tflops": gemm, "copy_gb_per_s": copy, "all_reduce": reduce, "loaded_latency_s": loaded_latency,
        **gather_and_scatter(max(reduce_sizes), world, best, cpu),
        "layer_overhead_s": layer_overhead_seconds(typical), "block": block_seconds(typical), "block_tp": block_tp_seconds(typical),
        "block_alone": block_alone(lambda fn: timed(fn, statistics.median, together=False)),
    }
    warmup = max(2, loop_steps // 5)  # then the Trainer steps: the loop's own time, and ZeRO-3's, whose terms are
    out["step_s"] = minimal_step_seconds(loop_steps, warmup)  # differences: each round runs its four in turn
    out["zero3_steps"] = [[minimal_step_seconds(loop_steps, warmup, ZERO3_DEEP, z, a) for z, a in ZERO3_FITS] for _ in range(zero3_rounds)]
    return out


def gather_and_scatter(nbytes: int, world: int, best: Any, device: Any) -> dict[str, dict[str, float]]:
    """The all-gather and reduce-scatter of ``nbytes`` (the gathered output, the scattered input) as
    sequence parallelism and ZeRO issue them (flat tensors, ``core.distributed``), with the bus bandwidth
    nccl-tests reports: (n - 1) / n x bytes / seconds. Gloo runs them well below its all-reduce."""
    import torch

    from lightning_3d.core.distributed import all_gather_flat, reduce_scatter_flat

    full = torch.zeros(max(world, nbytes // 4 // world * world), device=device)
    part = torch.zeros(full.numel() // world, device=device)
    out: dict[str, dict[str, float]] = {}
    for kind, call in (("all_gather", lambda: all_gather_flat(full, part)), ("reduce_scatter", lambda: reduce_scatter_flat(part, full))):
        seconds = best(call)
        out[kind] = {"bytes": full.numel() * 4, "seconds": seconds, "bus_gb_per_s": (world - 1) / world * full.numel() * 4 / seconds / 1e9}
    return out


# The block whose forward + backward sets the device's rate: the tiny recipes' width (gpt_tiny), as
# they train here. A CPU's rate depends on the shapes (small GEMMs, SDPA, element-wise kernels), so
# plans for much wider models on this machine will be pessimistic.
RATE_BLOCK = dict(vocab_size=256, block_size=128, n_layer=1, n_head=4, n_embd=128)
RATE_BATCH = 8


def block_seconds(best: Any) -> dict[str, float]:
    """Forward + backward of one transformer block at the tiny recipes' size, and its training FLOPs
    as the planner counts them (3 x forward): what the planner's per-layer compute term must reach."""
    import torch

    from lightning_3d.core.model_shape import ModelShape
    from lightning_3d.models.gpt import Block, GPTConfig

    block = Block(GPTConfig(**RATE_BLOCK))
    x = torch.randn(RATE_BATCH, RATE_BLOCK["block_size"], RATE_BLOCK["n_embd"], requires_grad=True)
    shape = ModelShape.from_config(dict(RATE_BLOCK), seq_len=RATE_BLOCK["block_size"])
    flops = 3.0 * RATE_BATCH * RATE_BLOCK["block_size"] * shape.layer_forward_flops_per_token()
    return {"seconds": best(lambda: block(x).sum().backward()), "flops": flops}


def block_tp_seconds(median: Any) -> Optional[dict[str, float]]:
    """The rate block split by the GPT's tensor-parallel plan over every process of the profile (no
    sequence parallelism): each holds ``1 / t`` of its GEMMs and heads and issues its 4 all-reduces
    (2 in forward, 2 in backward), all computing at once. ``None`` where ``t`` does not divide the heads."""
    import torch
    import torch.distributed as dist

    from lightning_3d.models.adapters.gpt import gpt_plan
    from lightning_3d.models.gpt import GPT, GPTConfig
    from lightning_3d.tensor_parallel.plans import PlanContext, apply_plan
    from lightning_3d.tensor_parallel.random import RNGStatesTracker, seed_tracker

    world = dist.get_world_size()
    if RATE_BLOCK["n_head"] % world:
        return None
    tracker = RNGStatesTracker("cpu")
    seed_tracker(tracker, dist.get_rank(), base_seed=0)
    model = GPT(GPTConfig(**RATE_BLOCK))
    apply_plan(model, gpt_plan(model), PlanContext(dist.group.WORLD, False, tracker))
    block = model.blocks[0]
    x = torch.randn(RATE_BATCH, RATE_BLOCK["block_size"], RATE_BLOCK["n_embd"], requires_grad=True)
    return {"seconds": median(lambda: block(x).sum().backward()), "tp": world}


def block_alone(median_alone: Any) -> Any:
    """The rate block on rank 0 while the other ranks wait (``None`` elsewhere): a one-process layout's
    rate, which the ranks computing at once (:func:`block_seconds`) understate on a shared host.
    ``median_alone``: a timer with no collective inside (the others sit in the barrier)."""
    import torch.distributed as dist

    dist.barrier()
    out = block_seconds(median_alone) if dist.get_rank() == 0 else None
    dist.barrier()
    return out


def layer_overhead_seconds(best: Any, calls: int = 40) -> float:
    """Forward + backward of one transformer block too small to compute (16 wide, 8 tokens): what
    dispatching its operators and autograd cost this process, the per-layer time the arithmetic
    terms do not see."""
    import torch

    from lightning_3d.models.gpt import Block, GPTConfig

    block = Block(GPTConfig(vocab_size=256, block_size=8, n_layer=1, n_head=2, n_embd=16))
    x = torch.randn(1, 8, 16, requires_grad=True)

    def passes() -> None:
        for _ in range(calls):
            block(x).sum().backward()

    return best(passes) / calls


def minimal_step_seconds(steps: int = 25, warmup: int = 5, n_layer: int = 1, zero_stage: int = 0, accumulate: int = 1) -> float:
    """The median optimizer step of a Trainer with our strategy over every rank (data parallel) on a
    one-layer GPT too small to compute, with GPTModule's own callbacks: the training loop's own time
    per step, plus one layer and the gradient all-reduce, which :func:`cluster_from` subtracts. The
    loop's collectives (the loss logged with ``sync_dist``, the finite-gradient vote) are in it, so
    a one-rank layout is charged them too. ``n_layer`` / ``zero_stage`` / ``accumulate``: the same GPT
    deeper, fully sharded, with more micro-batches a step, whose differences give ZeRO-3's host terms
    (:func:`zero3_overheads`)."""
    import torch.distributed as dist

    from lightning_3d.apps.measure import timed_fit
    from lightning_3d.data import TextDataModule
    from lightning_3d.models import GPTConfig, GPTModule
    from lightning_3d.plugins.strategy import ThreeDParallelStrategy

    world = dist.get_world_size()
    model = GPTModule(GPTConfig(**MINIMAL_GPT, n_layer=n_layer), warmup_steps=2)
    data = TextDataModule(block_size=8, global_batch_size=world, max_bytes=2**16)
    return timed_fit(ThreeDParallelStrategy(data_parallel=world, zero_stage=zero_stage), model, data, steps, warmup, accumulate)


ZERO3_DEEP = 4  # layers of the minimal GPT whose ZeRO-3 steps are timed: 5 FSDP units (the layers, the root)
ZERO3_FITS = ((0, 1), (3, 1), (0, 2), (3, 2))  # (ZeRO stage, micro-batches a step)
MINIMAL_GPT = dict(vocab_size=256, block_size=8, n_head=2, n_embd=16)


def zero3_overheads(steps: list[float], charged: list[float]) -> dict[str, float]:
    """ZeRO-3's host terms from the minimal GPT's steps at :data:`ZERO3_FITS` (``steps``), less what the
    planner already charges for the same four (``charged``: its gathers and scatters, the sharded
    optimizer): how the rest grows with a second micro-batch, per FSDP unit, and what is left once per
    step. Negative parts (noise) count as 0."""
    rest = [measured - planned for measured, planned in zip(steps, charged)]
    one, two = rest[1] - rest[0], rest[3] - rest[2]  # ZeRO-3 over ZeRO-0 at 1 and 2 micro-batches
    unit = max(0.0, (two - one) / (ZERO3_DEEP + 1))
    return {"unit_s": unit, "step_s": max(0.0, one - unit * (ZERO3_DEEP + 1))}


def zero3_charged(cluster: Any, ranks: int) -> list[float]:
    """The planner's step for each of :data:`ZERO3_FITS` on ``cluster`` (without ZeRO-3's host terms)."""
    from lightning_3d.core.model_shape import ModelShape
    from lightning_3d.planner.search import Layout, Planner, Problem

    shape = ModelShape.from_config({**MINIMAL_GPT, "n_layer": ZERO3_DEEP}, seq_len=MINIMAL_GPT["block_size"])
    out = []
    for zero, accumulate in ZERO3_FITS:
        planner = Planner(Problem(shape, cluster, global_batch=ranks * accumulate, precision="32-true"))
        out.append(planner.evaluate(Layout(dp=ranks, tp=1, pp=1, micro_batch_size=1, zero_stage=zero)).step_seconds)
    return out


def slowest(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """The ranks' measurements as the slowest rank sees them (it sets a step's pace): the lowest GEMM
    and copy rates, the longest all-reduce of each size."""
    first = per_rank[0]
    reduce = {}
    for size in first["all_reduce"]:
        worst = max((r["all_reduce"][size] for r in per_rank), key=lambda entry: entry["seconds"])
        reduce[size] = dict(worst)
    return {
        "gemm_tflops": {n: min(r["gemm_tflops"][n] for r in per_rank) for n in first["gemm_tflops"]},
        "copy_gb_per_s": min(r["copy_gb_per_s"] for r in per_rank),
        "all_reduce": reduce,
        **{key: max(r[key] for r in per_rank) for key in ("layer_overhead_s", "step_s", "loaded_latency_s") if key in first},
        **({"zero3_steps": first["zero3_steps"]} if "zero3_steps" in first else {}),  # (steps: every rank waits for the slowest)
        **({"block": max((r["block"] for r in per_rank), key=lambda b: b["seconds"])} if "block" in first else {}),
        **({"block_alone": first["block_alone"]} if first.get("block_alone") else {}),
        **({"block_tp": max((r["block_tp"] for r in per_rank), key=lambda b: b["seconds"])} if first.get("block_tp") else {}),
        **{kind: max((r[kind] for r in per_rank), key=lambda entry: entry["seconds"]) for kind in ("all_gather", "reduce_scatter") if kind in first},
    }


def cluster_from(measured: dict[str, Any], name: str, devices_per_node: int, ranks: int) -> tuple[dict[str, Any], list[str]]:
    """The cluster config (a dict in ``conf/cluster``'s schema) for recorded measurements of ``ranks``
    CPU processes, and the comment lines that say where each figure comes from. The planner derates
    link and memory bandwidths by its efficiency constants, so the measured ones (already achieved)
    are written divided by them: the model then charges what was measured. Raises ``ValueError``
    when a figure cannot make a valid cluster (the schema's own check)."""
    from lightning_3d.planner.collective_cost import LINK_EFFICIENCY
    from lightning_3d.planner.hardware import load_cluster
    from lightning_3d.core.model_shape import ModelShape
    from lightning_3d.planner.search import SOFTWARE
    from lightning_3d.planner.timing import BACKWARD_FACTOR, HBM_EFFICIENCY, elementwise_forward_bytes

    if devices_per_node < 1:
        raise ValueError(f"--devices-per-node={devices_per_node} must be at least 1.")
    gemm = max(measured["gemm_tflops"].values())
    rate_from = f"the best square fp32 GEMM of sizes {sorted(int(n) for n in measured['gemm_tflops'])} per process"
    block = measured.get("block")

    def block_rate(block: dict[str, float]) -> float:
        # what a transformer block's arithmetic reaches once what the planner charges it apart is taken
        # out: its dispatch (per layer) and its element-wise bytes at the measured copy rate (flash attention)
        shape = ModelShape.from_config(dict(RATE_BLOCK), seq_len=RATE_BLOCK["block_size"])
        flash = SOFTWARE["lightning_3d"].flash_attention
        forward_bytes, _ = elementwise_forward_bytes(shape, RATE_BATCH, tp=1, sequence_parallel=False, flash_attention=flash)
        elementwise = (1 + BACKWARD_FACTOR) * forward_bytes / (measured["copy_gb_per_s"] * 1e9)
        arithmetic = block["seconds"] - measured.get("layer_overhead_s", 0.0) - elementwise
        if arithmetic <= 0:
            raise ValueError(f"the rate block took {block['seconds']:.4g} s, no more than its dispatch and element-wise time: re-run the profile.")
        return block["flops"] / arithmetic / 1e12

    alone = 0.0  # not measured, or nothing left once the shared figures are taken out: the shared rate applies
    if block and measured.get("block_alone"):
        try:
            alone = block_rate(measured["block_alone"])
        except ValueError:
            pass
    if block:
        gemm = block_rate(block)
        rate_from = (f"a {RATE_BLOCK['n_embd']}-wide block's forward + backward ({RATE_BATCH} x {RATE_BLOCK['block_size']} tokens, "
                     f"the planner's FLOP count) less its dispatch and element-wise bytes; square GEMMs reach {max(measured['gemm_tflops'].values()):.4g}")
    reduce = measured["all_reduce"]
    largest, smallest = max(reduce, key=int), min(reduce, key=int)
    ram_gb = measured.get("ram_gb", 0.0)
    latency_s = max(reduce[smallest]["seconds"], measured.get("loaded_latency_s", 0.0))
    layer_s = measured.get("layer_overhead_s", 0.0)
    # the minimal step less what the model charges it anyway: its one layer's dispatch and its gradient all-reduce
    loop_s = max(0.0, measured.get("step_s", 0.0) - layer_s - latency_s) if "step_s" in measured else 0.0
    link_gb_per_s = float(f"{reduce[largest]['bus_gb_per_s'] / LINK_EFFICIENCY:.4g}")
    latency_us = float(f"{latency_s * 1e6:.4g}")
    tp_rate = 0.0  # not measured: the full-width rate applies to tp shards too
    if block and measured.get("block_tp"):
        tp_rate = tensor_parallel_rate(measured, RATE_BLOCK, RATE_BATCH, block["flops"], link_gb_per_s, latency_us)
    config = {
        "name": name,
        "accelerator": "cpu",
        "devices_per_node": devices_per_node,
        "num_nodes": 1,
        "launcher": "local",
        "intra_node_gb_per_s": link_gb_per_s,
        "inter_node_gb_per_s": 0,
        "cpu_ram_gb": round(ram_gb, 1),
        "nvme_gb": 0,
        "collective_latency_us": latency_us,
        **{f"{kind}_gb_per_s": float(f"{measured[kind]['bus_gb_per_s'] / LINK_EFFICIENCY:.4g}") for kind in ("all_gather", "reduce_scatter") if kind in measured},
        "step_overhead_ms": float(f"{loop_s * 1e3:.4g}"),
        "device": {
            "model": "cpu-process (measured)",
            "memory_gb": float(f"{ram_gb / devices_per_node:.4g}"),
            "peak_tflops": float(f"{gemm:.4g}"),
            "memory_bandwidth_gb_per_s": float(f"{measured['copy_gb_per_s'] / HBM_EFFICIENCY:.4g}"),
            "gemm_efficiency": 1.0,
            "reserved_gb": 0.0,
            "layer_overhead_us": float(f"{layer_s * 1e6:.4g}"),
            "peak_tflops_alone": float(f"{alone:.4g}"),
            "peak_tflops_tp": float(f"{tp_rate:.4g}"),
        },
    }
    cluster = load_cluster(config)  # a figure that makes no valid cluster fails here, before any file is written
    if measured.get("zero3_steps"):  # ZeRO-3's host terms: what its steps take beyond what this cluster is charged
        charged = zero3_charged(cluster, ranks)
        each = [zero3_overheads(r, charged) for r in measured["zero3_steps"]]
        config["zero3_step_overhead_ms"] = float(f"{statistics.median(e['step_s'] for e in each) * 1e3:.4g}")
        config["zero3_unit_overhead_us"] = float(f"{statistics.median(e['unit_s'] for e in each) * 1e6:.4g}")
    comments = [
        f"Written by `lightning-3d profile` on {measured.get('date', '?')} ({measured.get('host', '?')}): {ranks} CPU processes over",
        "gloo, one thread each, measuring at once (docs/planner.md, \"Profiling a machine\").",
        f"device.peak_tflops: {rate_from};",
        "gemm_efficiency 1.0, since the figure is what the arithmetic reaches.",
        f"device.memory_bandwidth_gb_per_s: a {measured.get('copy_mb', '?')} MB copy (read + write) per process, / {HBM_EFFICIENCY}.",
        f"intra_node_gb_per_s: all-reduce bus bandwidth of {int(largest) // MB} MB over {ranks} processes, / {LINK_EFFICIENCY}.",
        "(the planner derates bandwidths by those factors: it then charges the measured ones); the slowest rank's figures.",
        f"collective_latency_us: a small all-reduce over {ranks} processes between pieces of compute (its start-up and the",
        f"ranks lining up), or idle ({int(smallest)} bytes) if larger; in place of NCCL's latency tables.",
        "all_gather_gb_per_s, reduce_scatter_gb_per_s: their bus bandwidth at the largest size (the tensor calls sequence",
        "parallelism and ZeRO make), / the link efficiency; gloo runs them well below its all-reduce.",
        "device.layer_overhead_us: forward + backward of a 16-wide, 8-token transformer block (operator dispatch, autograd).",
        "device.peak_tflops_alone: the same rate block on one process while the others wait (a one-process layout; 0: not measured).",
        "step_overhead_ms: a Trainer step of a 1-layer, 16-wide GPT under the strategy (data parallel over the processes),",
        "less that layer and one all-reduce: the training loop's own time (its callbacks; no logger, bar or checkpoints).",
        f"device.peak_tflops_tp: the rate block split by the tp plan over the {ranks} processes (t = {ranks}), less its dispatch,",
        "element-wise bytes and 4 all-reduces as the planner charges them (narrow GEMMs reach less per FLOP; 0: not measured).",
        f"zero3_*: a {ZERO3_DEEP}-layer minimal GPT's step under ZeRO-3 less under ZeRO-0, at 1 and 2 micro-batches, less what",
        "the planner charges those steps (gathers, scatters, the sharded optimizer): per FSDP unit and micro-batch (the growth",
        "with a micro-batch) and per step (the rest): FSDP2's hooks, copies and DTensor dispatch on this host.",
    ]
    return config, comments


def tensor_parallel_rate(
    measured: dict[str, Any], block_config: dict[str, Any], batch: int, flops: float, link_gb_per_s: float, latency_us: float
) -> float:
    """TFLOP/s of a tensor-parallel shard of the rate block: its share of the FLOPs over its time less what
    the planner charges a tp layer apart (its dispatch, its element-wise bytes at the copy rate, 4
    all-reduces of its activation over the cluster's link and latency, as ``collective_cost`` prices them)."""
    from lightning_3d.core.model_shape import ModelShape
    from lightning_3d.planner.collective_cost import Group, collective_cost
    from lightning_3d.planner.search import SOFTWARE
    from lightning_3d.planner.timing import BACKWARD_FACTOR, elementwise_forward_bytes

    tp_block, t = measured["block_tp"], measured["block_tp"]["tp"]
    shape = ModelShape.from_config(dict(block_config), seq_len=block_config["block_size"])
    forward_bytes, _ = elementwise_forward_bytes(shape, batch, tp=t, sequence_parallel=False, flash_attention=SOFTWARE["lightning_3d"].flash_attention)
    elementwise = (1 + BACKWARD_FACTOR) * forward_bytes / (measured["copy_gb_per_s"] * 1e9)
    activation = batch * block_config["block_size"] * block_config["n_embd"] * 4.0
    comm = 4 * collective_cost("all_reduce", activation, Group(t, 1, link_gb_per_s, latency_us=latency_us)).seconds
    arithmetic = tp_block["seconds"] - measured.get("layer_overhead_s", 0.0) - elementwise - comm
    if arithmetic <= 0:
        raise ValueError(f"the tensor-parallel rate block took {tp_block['seconds']:.4g} s, no more than its dispatch, element-wise and "
                         "all-reduce time: re-run the profile.")
    return flops / t / arithmetic / 1e12


def write_cluster(config: dict[str, Any], comments: list[str], directory: Path) -> Path:
    """``directory/cluster/<name>.yaml``: plan and dry-run read it with ``hydra.searchpath=[file://<directory>]``."""
    from omegaconf import OmegaConf

    path = directory / "cluster" / f"{config['name']}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    body = OmegaConf.to_yaml(OmegaConf.create(config))
    path.write_text("".join(f"# {line}\n" for line in comments) + body)
    return path


def _ram_gb() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024 / 1e9  # (kB there means KiB)
    except OSError:
        pass
    return 0.0


def profile_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="lightning-3d profile",
        description="Measure this machine's CPU processes and write a cluster config for plan and dry-run (docs/planner.md).",
    )
    parser.add_argument("--name", default="profiled", help="the cluster's name (cluster=NAME)")
    parser.add_argument("--out", default="l3d_profile", help="a config directory: writes OUT/cluster/NAME.yaml (default ./l3d_profile)")
    parser.add_argument("--ranks", type=int, default=2, help="processes measured at once (default 2)")
    parser.add_argument("--devices-per-node", type=int, default=None, help="the cluster's processes per node (default --ranks)")
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke test (seconds, rough figures)")
    args = parser.parse_args(argv)
    if args.ranks < 2:
        parser.error(f"--ranks={args.ranks}: the collectives need at least 2 processes.")
    from lightning_3d.core.compose import CONF_DIR

    if (CONF_DIR / "cluster" / f"{args.name}.yaml").is_file():  # Hydra would pick the shipped one over it
        parser.error(f"--name={args.name}: a shipped cluster has that name (conf/cluster/{args.name}.yaml); choose another.")
    from lightning_3d.testing.harness import run_on_ranks

    quick = args.quick
    sizes = ([64, 128], 8, [4096, MB], 2, 6, 1) if quick else ([256, 512, 1024], 256, [4096, 64 * 1024, MB, 16 * MB], 5, 25, 3)
    start = time.perf_counter()
    measured = slowest(run_on_ranks(measure_rank, args.ranks, *sizes, timeout=600, strict=False))
    measured.update(
        date=str(date.today()), host=platform.node() or "?", copy_mb=sizes[1], ram_gb=_ram_gb(), ranks=args.ranks,
        seconds=round(time.perf_counter() - start, 1),
    )
    devices = args.ranks if args.devices_per_node is None else args.devices_per_node
    config, comments = cluster_from(measured, args.name, devices, args.ranks)
    path = write_cluster(config, comments, Path(args.out).resolve())
    print(json.dumps({"cluster": str(path), "measured": measured}, default=str))
    print(f"plan with it: lightning-3d plan hydra.searchpath=[file://{path.parent.parent}] cluster={args.name} model=...",
          file=sys.stderr)
    return 0
