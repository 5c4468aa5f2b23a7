"""``lightning-3d plan``: rank 3D layouts for a model on a cluster, or evaluate one layout.

    lightning-3d plan model=bloom_176b cluster=jean_zay_bloom data.global_batch_size=2048
    lightning-3d plan recipe=bloom_176b --format json
    lightning-3d plan recipe=bloom_176b --layout tp=4,pp=12,dp=8,mb=2,zero=1

Arguments without ``--`` are Hydra overrides of ``lightning_3d/conf/config.yaml``, exactly as for
``recipes/train.py``, so a recipe and its plan read the same config.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from lightning_3d.core.layout_rules import LayoutRefused
from lightning_3d.planner import PlanResult, Planner, best_completion, plan, problem_from_config
from lightning_3d.planner.search import Estimate, Problem

LAYOUT_KEYS = {
    "dp": ("dp", int),
    "tp": ("tp", int),
    "pp": ("pp", int),
    "mb": ("micro_batch_size", int),
    "micro_batch_size": ("micro_batch_size", int),
    "v": ("virtual_stages", int),
    "virtual_stages": ("virtual_stages", int),
    "schedule": ("schedule", str),
    "zero": ("zero_stage", int),
    "zero_stage": ("zero_stage", int),
    "sp": ("sequence_parallel", "bool"),
    "sequence_parallel": ("sequence_parallel", "bool"),
    "recompute": ("recompute", str),
    "offload": ("offload", str),
    "cp": ("cp", int),
    "context_parallel": ("cp", int),
    "cp_mode": ("context_parallel_mode", str),
    "context_parallel_mode": ("context_parallel_mode", str),
    "ep": ("ep", int),
    "expert_parallel": ("ep", int),
}


def parse_layout(text: str) -> dict[str, Any]:
    """``"tp=4,pp=12,dp=8,mb=2"`` -> Layout fields."""
    out: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in LAYOUT_KEYS:
            raise ValueError(f"--layout item {item!r}: use key=value with keys {sorted(LAYOUT_KEYS)}.")
        field, kind = LAYOUT_KEYS[key]
        if kind == "bool":
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"--layout {key}={value!r}: use true or false.")
            out[field] = value.lower() in ("true", "1")
        elif kind is int:
            try:
                out[field] = int(value)
            except ValueError:
                raise ValueError(f"--layout {key}={value!r} must be an integer.") from None
        else:
            out[field] = {"interleaved": "interleaved_1f1b", "a2a": "all_to_all"}.get(value, value)
    return out


def _gib(x: float) -> str:
    return f"{x / 2**30:.1f}"


def format_table(problem: Problem, rows: list[Estimate], searched: int, seconds: float) -> str:
    m, c = problem.model, problem.cluster
    moe = bool(m.n_experts)
    active = f", {m.active_parameters / 1e9:.1f}B active" if moe else ""
    experts = f", {m.moe_layers} MoE blocks of {m.n_experts} experts (top {m.top_k})" if moe else ""
    head = (
        f"{m.num_parameters / 1e9:.1f}B parameters{active} ({m.n_layer} layers, hidden {m.hidden}, {m.n_head} heads{experts}), "
        f"seq {m.seq_len}, global batch {problem.global_batch}, {problem.precision}\n"
        f"{c.name}: {c.num_nodes} x {c.devices_per_node} {c.device.model} ({c.device.memory_gb:g} GB, "
        f"{c.device.peak_tflops:g} TFLOP/s peak, GEMM efficiency {c.device.gemm_efficiency:g}); "
        f"software profile {problem.software.name}; {searched} layouts estimated in {seconds:.2f} s\n"
    )
    ep_col = f"{'ep':>4} " if moe else ""
    cols = (
        f"{'#':>3} {'dp':>4} {'tp':>3} {'pp':>3} {'cp':>4} {ep_col}{'mb':>3} {'m':>5} {'schedule':>11} {'zero':>4} {'sp':>3} "
        f"{'recompute':>9} {'offload':>7} | {'params':>6} {'grads':>6} {'optim':>6} {'activ':>6} {'other':>6} {'total':>6} GiB"
        f" | {'step s':>8} {'TFLOP/s':>7} {'MFU':>5} {'tokens/s':>10}"
    )
    lines = [head, cols, "-" * len(cols)]
    for i, e in enumerate(rows, 1):
        lay, mem = e.layout, e.memory
        interleaved = lay.schedule == "interleaved_1f1b" and lay.virtual_stages > 1
        schedule = "-" if lay.pp == 1 else (f"interl.v{lay.virtual_stages}" if interleaved else lay.schedule)
        other = mem["buffers"] + mem["reserved"]
        cp = "-" if lay.cp == 1 else f"{lay.cp}" + ("a" if lay.context_parallel_mode == "all_to_all" else "r")
        ep = (f"{'-' if lay.ep == 1 else lay.ep:>4} " if moe else "")
        activations = mem["activations"] + mem["recompute"]
        flag = ("" if e.fits else f"  DOES NOT FIT: {e.why_not}") + ("  *" if e.caveats else "")
        lines.append(
            f"{i:>3} {lay.dp:>4} {lay.tp:>3} {lay.pp:>3} {cp:>4} {ep}{lay.micro_batch_size:>3} {lay.micro_batches(problem.global_batch):>5} "
            f"{schedule:>11} {lay.zero_stage:>4} {'y' if lay.sequence_parallel else 'n':>3} {lay.recompute:>9} {lay.offload:>7} | "
            f"{_gib(mem['params']):>6} {_gib(mem['grads']):>6} {_gib(mem['optimizer']):>6} {_gib(activations):>6} "
            f"{_gib(other):>6} {_gib(mem['total']):>6}     | {e.step_seconds:>8.3f} {e.tflops_per_device:>7.1f} "
            f"{e.mfu:>5.1%} {e.tokens_per_second:>10.0f}{flag}"
        )
    if not rows:
        lines.append("no layout fits: add nodes, allow offload/recompute (software profile), or lower the micro-batch.")
    for caveat in dict.fromkeys(c for e in rows for c in e.caveats):
        lines.append(f"* {caveat}")
    return "\n".join(lines)


def plan_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="lightning-3d plan",
        description="Rank 3D-parallel layouts by predicted throughput (see docs/planner.md).",
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides: model=..., cluster=..., recipe=..., data.global_batch_size=...")
    parser.add_argument("--format", choices=["table", "json"], default="table")
    parser.add_argument("--layout", default=None, help="evaluate one layout, e.g. tp=4,pp=12,dp=8,mb=2,zero=1 (cp=16,cp_mode=ring; ep=8)")
    parser.add_argument("--top", type=int, default=10, help="how many layouts to show (default 10)")
    parser.add_argument("--all", action="store_true", help="every fitting variant, not just the best per (dp, tp, pp, cp)")
    parser.add_argument("--software", default="lightning_3d", help="lightning_3d | megatron_2021 | megatron_deepspeed_2022")
    parser.add_argument("--global-batch", type=int, default=None, help="sequences per step (default: data.global_batch_size)")
    parser.add_argument("--seq-len", type=int, default=None, help="default: model.block_size")
    parser.add_argument("--nodes", type=int, default=None, help="override the cluster's node count")
    parser.add_argument("--precision", default=None, help="default: trainer.precision")
    parser.add_argument("--cross-node-tp", action="store_true", help="let tensor parallelism span nodes")
    parser.add_argument(
        "--expert-imbalance", type=float, default=1.0,
        help="MoE: routed rows on the busiest rank of an expert group / the mean (default 1: balanced)",
    )
    parser.add_argument("--config-dir", default=None, help="a Hydra config directory with config.yaml (default: the one shipped in lightning_3d/conf)")
    parser.add_argument(
        "--measure", type=int, default=0, metavar="K",
        help="run the top K fitting layouts here for a few steps (CPU processes over gloo) and print measured next to predicted",
    )
    parser.add_argument("--measure-steps", type=int, default=10, help="timed optimizer steps per measured layout (default 10)")
    args = parser.parse_args(argv)
    if args.measure < 0 or args.measure_steps < 2:
        parser.error(f"--measure={args.measure} must be >= 0 and --measure-steps={args.measure_steps} >= 2.")
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        parser.error(f"{bad}: positional arguments are Hydra overrides such as model=bloom_176b or cluster=jean_zay_bloom.")

    from lightning_3d.core.compose import compose_config

    cfg = compose_config(args.overrides, args.config_dir)
    problem = problem_from_config(
        cfg,
        software=args.software,
        global_batch=args.global_batch,
        seq_len=args.seq_len,
        nodes=args.nodes,
        precision=args.precision,
        cross_node_tp=args.cross_node_tp,
        expert_imbalance=args.expert_imbalance,
    )
    if args.layout:
        import time

        start = time.perf_counter()
        try:
            estimate = best_completion(Planner(problem), parse_layout(args.layout))
        except LayoutRefused as err:  # the strategy would refuse it too: say why, one line per reason
            head = err.prefix.rstrip(": ") or f"layout {args.layout} cannot run"
            print(f"lightning-3d plan: {head}:", *(f"  - {r.message}" for r in err.refusals), sep="\n", file=sys.stderr)
            return 2
        except ValueError as err:  # a malformed --layout
            print(f"lightning-3d plan: {err}", file=sys.stderr)
            return 2
        result = PlanResult(problem, [estimate], 1, time.perf_counter() - start)
    else:
        result = plan(problem, all_layouts=args.all)
    rows = result.ranked[: max(1, args.top)] if not args.layout else result.ranked
    measured = _measure(problem, [e for e in rows if e.fits][: args.measure], cfg, args.measure_steps) if args.measure else None
    if args.format == "json":
        out: Any = [dict(rank=i, **e.to_dict(problem.global_batch)) for i, e in enumerate(rows, 1)]
        print(json.dumps({"plan": out, "measured": measured} if measured is not None else out, indent=1))
    else:
        print(format_table(problem, rows, result.searched, result.seconds))
        if measured is not None:
            from lightning_3d.apps.measure import format_measured

            print(f"\nmeasured here ({args.measure_steps} steps each, after warm-up):")
            print(format_measured(measured))
    return 0 if rows else 1


def _measure(problem: Any, estimates: list[Estimate], cfg: Any, steps: int) -> list[dict[str, Any]]:
    """``--measure``: the layouts run here (lightning_3d.apps.measure); torch and Lightning load only now."""
    from omegaconf import OmegaConf

    from lightning_3d.apps.measure import check_measurable, measure

    recipe = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(recipe, dict)
    recipe.pop("hydra", None)
    check_measurable(problem, estimates, recipe)
    return measure(problem, estimates, recipe, steps)
