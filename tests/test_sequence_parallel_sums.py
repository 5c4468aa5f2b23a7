"""Sequence parallelism's gradient sums over tp, taken over by the data-parallel reducers (issue 36).

A replicated parameter applied to a sequence shard (layer norms, row-parallel biases, the MoE router)
gets a partial gradient on each tp rank. Its hook used to sum every contribution in a blocking
all-reduce of its own: 26 calls per backward on ``gpt_tiny``. ZeRO 0-2's reducers now bucket those
parameters apart and sum each bucket over tp once per reduction; ZeRO-3 sums them, flattened, once per
step. Under SGD a wrong scale shows in the weights, and manual optimization's two backwards a step
meet an already reduced gradient (a sum that is not idempotent would count it twice).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from lightning_3d.testing.harness import run_on_ranks
from tests.test_expert_parallel import MANUAL, _ep_fit, assert_same_weights

DENSE = {"n_experts": 0}  # the SGD GPT of test_expert_parallel, without its MoE blocks
STEPS = 4
LAYOUTS = {  # name: (model overrides, strategy), on 4 ranks
    "zero0": (DENSE, dict(tensor_parallel=2, sequence_parallel=True)),
    "zero1_manual": ({**DENSE, **MANUAL}, dict(tensor_parallel=2, sequence_parallel=True, zero_stage=1)),
    "zero2": (DENSE, dict(tensor_parallel=2, sequence_parallel=True, zero_stage=2)),
    "zero0_manual": ({**DENSE, **MANUAL}, dict(tensor_parallel=2, sequence_parallel=True)),
    "zero0_bf16": (DENSE, dict(tensor_parallel=2, sequence_parallel=True)),  # (ZeroOptimizer's stage 0)
    "zero0_bf16_true": (DENSE, dict(tensor_parallel=2, sequence_parallel=True)),  # (ZeRO-0's reducer in bf16)
    "zero3_router_manual": (MANUAL, dict(tensor_parallel=2, expert_parallel=2, zero_stage=3)),  # (SP itself is refused at ZeRO-3)
    "pp2_tp2": ({**DENSE, "n_layer": 4}, dict(tensor_parallel=2, sequence_parallel=True, pipeline_parallel=2)),  # dp = 1
    "moe_router": ({}, dict(tensor_parallel=2, sequence_parallel=True, expert_parallel=2, zero_stage=1)),
}
PRECISION = {"zero0_bf16": "bf16-mixed", "zero0_bf16_true": "bf16-true"}


class CountTensorParallelAllReduces:
    """A Lightning callback counting the all-reduces this rank issues over its tp group, per batch."""

    def __init__(self) -> None:
        import lightning as L

        self.per_batch: list[int] = []
        outer = self

        class _Callback(L.Callback):
            def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
                import torch.distributed as dist

                ranks = dist.get_process_group_ranks(trainer.strategy.topology.tp_group)
                original, outer.per_batch = dist.all_reduce, [*outer.per_batch, 0]

                def counting(tensor: Any, *a: Any, group: Any = None, **k: Any) -> Any:
                    if group is not None and dist.get_process_group_ranks(group) == ranks:
                        outer.per_batch[-1] += 1
                    return original(tensor, *a, group=group, **k)

                self._original, dist.all_reduce = original, counting

            def on_train_batch_end(self, *args: Any) -> None:
                import torch.distributed as dist

                dist.all_reduce = self._original

        self.callback = _Callback()


def _fit(name: str) -> dict[str, Any]:
    model, strategy = LAYOUTS[name]
    counter = CountTensorParallelAllReduces()
    out = _ep_fit(None, STEPS, callbacks=(counter.callback,), model=dict(model), precision=PRECISION.get(name, "32-true"), **strategy)
    return {**out, "tp_all_reduces": counter.per_batch, "hooks_given_back": _hooks_given_back()}


def _hooks_given_back() -> bool:
    """After teardown (the reducers removed): every SP hook sums again, and no arrival scale is left."""
    import gc

    from lightning_3d.core.param_meta import meta_of
    from lightning_3d.tensor_parallel.spec import SumOverGroup

    hooks = [o for o in gc.get_objects() if isinstance(o, SumOverGroup)]
    params = [o for o in gc.get_objects() if isinstance(o, torch.nn.Parameter) and meta_of(o).sequence_parallel_hook is not None]
    return bool(params) and not any(h.taken for h in hooks) and all(meta_of(p).arrival_scale_hook is None for p in params)


def _world() -> dict[str, Any]:
    from tests.helpers import run_checks

    return run_checks({name: (lambda name=name: _fit(name)) for name in LAYOUTS})


def _references() -> dict[str, Any]:
    """One process's run for each (model, precision) the layouts use, by layout name."""
    want: dict[tuple[Any, ...], Any] = {}
    for name, (model, _) in LAYOUTS.items():
        key = (tuple(sorted(model.items())), PRECISION.get(name, "32-true"))
        if key not in want:
            want[key] = _ep_fit(None, STEPS, model=dict(model), precision=key[1])
        want[name] = want[key]
    return {name: want[name] for name in LAYOUTS}


@pytest.fixture(scope="module")
def runs() -> tuple[dict[str, Any], list[dict[str, Any]]]:
    single = run_on_ranks(_references, 1, timeout=300)[0]
    return single, run_on_ranks(_world, 4, timeout=600)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_sequence_parallel_gradients_equal_one_process_under_sgd(runs, name):
    from tests.helpers import result_of

    single, ranks = runs
    want = single[name]
    got = [result_of(rank, name) for rank in ranks]
    rtol = 2e-2 if name in PRECISION else 1e-5
    losses = [sum(step) / 4 for step in zip(*(r["losses"] for r in got))]
    np.testing.assert_allclose(losses, want["losses"], rtol=rtol, err_msg=name)
    weights = got[0]["weights"] if not name.startswith("pp2") else {**got[0]["weights"], **got[2]["weights"]}
    if name not in PRECISION:
        assert_same_weights(weights, want["weights"], name)


def test_sequence_parallel_sums_are_one_call_per_reduction_not_one_per_parameter(runs):
    """Per batch, the tp all-reduces that ZeRO 0-2 issue: the layers' (none with SP, whose exchanges
    are reduce-scatters and all-gathers), the vocab-parallel loss's, and one per sequence-parallel
    bucket: 4. With one blocking call per SP parameter from its hook, the count was 14. After
    teardown the hooks sum again."""
    from tests.helpers import result_of

    _, ranks = runs
    counts = {name: result_of(ranks[0], name)["tp_all_reduces"] for name in ("zero0", "zero2", "zero1_manual", "zero0_bf16")}
    for name, per_batch in counts.items():
        assert max(per_batch) <= 4, (name, per_batch)
    assert all(result_of(rank, name)["hooks_given_back"] for rank in ranks for name in LAYOUTS if name != "zero3_router_manual")
