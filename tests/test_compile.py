"""Regional ``torch.compile`` (``ThreeDParallelStrategy(compile=...)``): the keyword's forms and
refusals, one compiled graph for all blocks, and under tensor + sequence parallelism the same
collectives as eager (they stay outside the graphs) and one process's losses. Every layout meets
compilation in the composition matrix (tests/matrix.py, factor ``compile``)."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_3d import ThreeDParallelStrategy
from lightning_3d.core.config import ParallelConfig, compile_refusals
from lightning_3d.core.layout_rules import LayoutRefused
from lightning_3d.models import GPT, GPTConfig
from lightning_3d.parallel.parallelize import apply_compile
from lightning_3d.testing.harness import run_on_ranks
from tests.helpers import TINY_GPT, LossRecorder, quiet_trainer, tiny_data, tiny_gpt

COUNTED = ("all_reduce", "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all_single", "broadcast")


def test_compile_keyword_forms_and_refusals():
    assert ParallelConfig(compile=True).compile.blocks == {"backend": "inductor"}
    assert ParallelConfig(compile="aot_eager").compile.blocks == {"backend": "aot_eager"}
    assert ParallelConfig(compile={"mode": "max-autotune-no-cudagraphs"}).compile.blocks == {
        "backend": "inductor", "mode": "max-autotune-no-cudagraphs"}
    for off in (False, None, "none"):
        assert not ParallelConfig(compile=off).compile.enabled
    with pytest.raises(ValueError, match=r"\['cache'\] are not torch.compile keywords"):
        ParallelConfig(compile={"cache": True})
    with pytest.raises(ValueError, match="records CUDA graphs.*max-autotune-no-cudagraphs"):
        ParallelConfig(compile={"mode": "reduce-overhead"})
    with pytest.raises(ValueError, match="compile=3 is invalid"):
        ParallelConfig(compile=3)
    with pytest.raises(LayoutRefused, match="fullgraph=True with tensor_parallel=2.*use fullgraph=False"):
        ParallelConfig(compile={"fullgraph": True}, tensor_parallel=2)
    ParallelConfig(compile={"fullgraph": True})  # data parallel only: a block is one graph
    with pytest.raises(NotImplementedError, match="pipeline_schedule='zb_v' is not supported.*'1f1b'"):
        ThreeDParallelStrategy(compile=True, pipeline_parallel=2, pipeline_schedule="zb_v")
    # the same rules are what parallel=auto skips (lightning_3d/planner/recipe_layout.py)
    degrees = dict(tp=1, cp=1, ep=1)
    assert [r.rule for r in compile_refusals({"backend": "inductor"}, pp=2, schedule="zb_h1", **degrees)] == ["compile_zero_bubble"]
    assert not compile_refusals(None, pp=2, schedule="zb_h1", **degrees)
    assert not compile_refusals({"backend": "inductor", "fullgraph": True}, pp=1, schedule="1f1b", **degrees)
    with pytest.raises(ValueError, match="found no model with a layer sequence.*compile=False"):
        apply_compile(nn.Sequential(nn.Linear(4, 4)), {"backend": "aot_eager"})


def test_the_blocks_share_one_compiled_graph():
    """Dynamo caches by code and guards: four blocks are one compilation, not four (compile time is
    one block's, whatever the depth), and the compiled model computes the eager one's loss."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch.manual_seed(0)
    eager = GPT(GPTConfig(**{**TINY_GPT, "n_layer": 4}))
    compiled = GPT(GPTConfig(**{**TINY_GPT, "n_layer": 4}))
    compiled.load_state_dict(eager.state_dict())
    counter = CompileCounterWithBackend("aot_eager")
    assert apply_compile(compiled, {"backend": counter}) == 4
    assert apply_compile(compiled, {"backend": counter}) == 0  # a second set-up does not wrap twice
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    for model in (eager, compiled):
        model(ids, ids).backward()
    torch.testing.assert_close(compiled(ids, ids), eager(ids, ids), rtol=1e-6, atol=0)
    for a, b in zip(compiled.parameters(), eager.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7)
    assert counter.frame_count == 1, f"{counter.frame_count} compilations for 4 identical blocks"


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_selective_recompute_inside_a_compiled_block_replays_dropout(backend):
    """Selective recompute puts a checkpoint inside the compiled block: it must run as written (Dynamo's
    own checkpoint refuses our context and would not replay the RNG), so the recomputed attention
    draws the forward's dropout masks and the gradients are the eager model's."""
    from lightning_3d.parallel.parallelize import apply_activation_checkpointing

    config = GPTConfig(**{**TINY_GPT, "dropout": 0.2})
    grads = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = GPT(config)
        if compiled:
            apply_compile(model, {"backend": backend})
        apply_activation_checkpointing(model, "selective")
        ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
        torch.manual_seed(5)
        model(ids, ids).backward()
        grads.append([p.grad for p in model.parameters()])
    for eager, compiled in zip(*grads):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-7)


def _fit_counting(compile: Any) -> dict[str, Any]:
    """Train the tiny GPT at tp2 + SP, ZeRO-1, selective recompute; count the collectives training calls
    (from the first batch on: set-up's once-per-process checks are not the blocks')."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counts = dict.fromkeys((n for n in COUNTED if hasattr(dist, n)), 0)
    originals = {name: getattr(dist, name) for name in counts}
    training = []

    class Training(L.Callback):
        def on_train_start(self, *_: Any) -> None:
            training.append(True)

    def counting(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name] += bool(training)
            return originals[name](*args, **kwargs)

        return call

    counter = CompileCounterWithBackend("aot_eager") if compile else None
    torch._dynamo.reset()
    torch.manual_seed(0)
    recorder = LossRecorder()
    strategy = ThreeDParallelStrategy(
        tensor_parallel=2, sequence_parallel=True, zero_stage=1, activation_checkpointing="selective",
        replica_check_every=None, compile={"backend": counter} if compile else False,
    )
    trainer = quiet_trainer(strategy=strategy, max_steps=4, callbacks=[recorder, Training()])
    for name in counts:
        setattr(dist, name, counting(name))
    try:
        trainer.fit(tiny_gpt(n_layer=2), tiny_data())
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return {"losses": recorder.losses, "counts": counts, "frames": counter.frame_count if counter else 0}


def _eager_and_compiled() -> tuple[dict[str, Any], dict[str, Any]]:
    return _fit_counting(False), _fit_counting(True)


def test_collectives_stay_eager_and_losses_match_under_tensor_and_sequence_parallel():
    results = run_on_ranks(_eager_and_compiled, 2, timeout=300)
    for eager, compiled in results:
        assert compiled["frames"] >= 2, "the blocks did not compile"
        # each collective runs as written, between the graphs: the same calls as eager
        assert compiled["counts"] == eager["counts"], (compiled["counts"], eager["counts"])
        counts = eager["counts"]
        reduce_scatters = counts.get("reduce_scatter_single", 0) + counts["reduce_scatter_tensor"]
        all_gathers = counts.get("all_gather_single", 0) + counts["all_gather_into_tensor"]
        assert counts["all_reduce"] > 0 and all_gathers > 0 and reduce_scatters > 0
        torch.testing.assert_close(torch.tensor(compiled["losses"]), torch.tensor(eager["losses"]), rtol=1e-5, atol=0)
