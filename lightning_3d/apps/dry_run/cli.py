"""``lightning-3d dry-run``: the strategy's real set-up and one step for the ranks of a layout that
differ, on the meta device under a fake process group of the full world, next to the planner.

    lightning-3d dry-run recipe=llama3_405b
    lightning-3d dry-run recipe=bloom_176b --format json
    lightning-3d dry-run model=llama3_70b cluster=h100_80g_64nodes --layout tp=8,pp=4,dp=16,zero=1

Arguments without ``--`` are Hydra overrides, as for ``lightning-3d plan`` and ``recipes/train.py``.
Exit status: 0 when every rank fits its device, 1 when one does not (the rank and its bytes on
stderr), 2 for bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from lightning_3d.apps.dry_run import DryRunReport

GROUPS = ("tp", "cp", "pp", "dp", "embedding")


def _gib(x: float) -> str:
    return f"{x / 2**30:.2f}"


def _diff(measured: float, predicted: float) -> str:
    if not predicted:
        return "  -  " if not measured else " new "
    return f"{(measured - predicted) / predicted:+.1%}"


def format_report(report: DryRunReport) -> str:
    d = report.dims
    lines = [
        f"dry run of {report.layout} on {report.world_size} ranks (dp={d.dp} tp={d.tp} pp={d.pp} cp={d.cp}): "
        f"micro-batch {report.batch.micro_batch} x {report.batch.micro_batches} per step, "
        f"{len(report.roles)} representative ranks in {report.seconds:.1f} s",
        "GiB per rank, measured (from the set-up's meta tensors and one counted step) / planner / difference",
    ]
    head = f"{'role':<22} {'rank':>6} {'layers':>6} | {'params':^22} | {'grads':^22} | {'optimizer':^22} | {'activations':^22} | {'recompute':^9} | total"
    lines += [head, "-" * len(head)]
    for r in report.roles:
        m, p = r.measured, r.predicted
        opt = m.memory["master"] + m.memory["optimizer_state"]
        cols = [
            (m.memory["params"], p["params"]), (m.memory["grads"], p["grads"]), (opt, p["optimizer"]), (m.activations, p["activations"]),
        ]
        cells = " | ".join(f"{_gib(a):>7} {_gib(b):>7} {_diff(a, b):>6}" for a, b in cols)
        flag = "" if r.total <= report.capacity else "  DOES NOT FIT"
        lines.append(f"{r.role.name:<22} {r.role.rank:>6} {m.layers:>6} | {cells} | {_gib(m.recompute):>9} | {_gib(r.total)}{flag}")
    lines.append("")
    lines.append("GiB sent per rank per step, by process group: measured / planner / difference")
    groups = [g for g in GROUPS if any(g in r.measured.traffic or g in r.predicted["traffic"] for r in report.roles)]  # type: ignore[operator]
    extra = sorted({g for r in report.roles for g in r.measured.traffic} - set(groups))
    head = f"{'role':<22} | " + " | ".join(f"{g:^24}" for g in groups + extra)
    lines += [head, "-" * len(head)]
    for r in report.roles:
        t: dict[str, Any] = r.predicted["traffic"]  # type: ignore[assignment]
        cells = []
        for g in groups + extra:
            a, b = r.measured.traffic.get(g, 0.0), t.get(g, 0.0)
            cells.append(f"{_gib(a):>8} {_gib(b):>8} {_diff(a, b):>6}")
        lines.append(f"{r.role.name:<22} | " + " | ".join(cells))
    w = report.worst
    lines.append("")
    lines.append(
        f"worst rank {w.role.rank} ({w.role.name}): {w.total / 1e9:.1f} GB of {report.capacity / 1e9:.1f} GB usable "
        f"(incl. the planner's buffers and reserved memory): " + ("fits" if report.fits else "DOES NOT FIT")
    )
    return "\n".join(lines)


def dry_run_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="lightning-3d dry-run",
        description="Set up and step the representative ranks of a layout on the meta device (docs/dry_run.md).",
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides: recipe=..., model=..., cluster=..., parallel.*=...")
    parser.add_argument("--format", choices=["table", "json"], default="table")
    parser.add_argument("--layout", default=None, help="the layout to run instead of cfg.parallel's, as for lightning-3d plan --layout")
    parser.add_argument("--ranks", default=None, help="comma-separated global ranks instead of the representative ones")
    parser.add_argument("--config-dir", default=None, help="a Hydra config directory with config.yaml")
    args = parser.parse_args(argv)
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        parser.error(f"{bad}: positional arguments are Hydra overrides such as recipe=llama3_405b.")

    from lightning_3d.apps.dry_run import dry_run
    from lightning_3d.core.compose import compose_config

    cfg = compose_config(args.overrides, args.config_dir)
    if args.layout:
        from lightning_3d.apps.plan_cli import parse_layout
        from lightning_3d.core.layout_rules import LayoutRefused
        from lightning_3d.planner import Planner, best_completion, problem_from_config
        from lightning_3d.planner.recipe_layout import apply_layout

        problem = problem_from_config(cfg)
        try:
            estimate = best_completion(Planner(problem), parse_layout(args.layout))
        except LayoutRefused as err:
            head = err.prefix.rstrip(": ") or f"layout {args.layout} cannot run"
            print(f"lightning-3d dry-run: {head}:", *(f"  - {r.message}" for r in err.refusals), sep="\n", file=sys.stderr)
            return 2
        cfg = apply_layout(cfg, estimate, problem.global_batch)
    only = [int(r) for r in args.ranks.split(",")] if args.ranks else None
    report = dry_run(cfg, only=only)
    if args.format == "json":
        print(json.dumps(report.to_dict(), indent=1))
    else:
        print(format_report(report))
    if not report.fits:
        print(f"lightning-3d dry-run: layout {report.layout} does not fit: {report.why_not()}", file=sys.stderr)
        return 1
    return 0
