"""One set of layout rules (lightning_3d.core.layout_rules) for the strategy and the planner: the planner
never proposes a layout the strategy refuses, ``plan --layout`` says why it refuses one, and the
strategy refuses the same layouts at set-up, every reason at once."""

from __future__ import annotations

import functools
import itertools
from typing import Any

import pytest
import torch
from torch import nn

from lightning_3d import ParallelConfig, ThreeDParallelStrategy
from lightning_3d.apps.plan_cli import plan_main
from lightning_3d.core.compose import compose_config
from lightning_3d.core.layout_rules import raise_refusals
from lightning_3d.models import GPT, GPTConfig
from lightning_3d.models.adapters.gpt import GPT_ADAPTER, gpt_plan
from lightning_3d.models.adapters.registry import models_in
from lightning_3d.pipeline.partition import partition
from lightning_3d.planner import Planner, Problem, Software, best_completion, problem_from_config
from lightning_3d.testing.harness import run_on_ranks

from tests.helpers import quiet_trainer, tiny_data, tiny_gpt


def _plan(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = plan_main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    from lightning_3d.apps.cli import main

    try:
        code = main(list(argv))
    except SystemExit as exc:  # main may exit instead of returning
        code = exc.code if isinstance(exc.code, int) else 1
    return code, capsys.readouterr().err


def _problem(*overrides: str, **kwargs: Any) -> Problem:
    return problem_from_config(compose_config(list(overrides), None), **kwargs)


@functools.lru_cache(maxsize=None)
def _meta_gpt(shape: Any) -> tuple[GPT, Any]:
    """The reference GPT of the planner's shape (no memory: on the meta device) and its built-in plan."""
    with torch.device("meta"):
        model = GPT(GPTConfig(
            vocab_size=shape.vocab, block_size=shape.seq_len, n_layer=shape.n_layer, n_head=shape.n_head,
            n_kv_head=shape.n_kv_head, n_embd=shape.hidden, ffn_hidden=shape.ffn,
        ))
    return model, gpt_plan(model)


def _runnable_by_the_strategy(planner: Planner, layout: Any) -> list[str]:
    """What the strategy's own checks say about the keywords the planner would run ``layout`` with:
    construction (ParallelConfig), Trainer construction (check_world), set-up (the tensor-parallel
    plan's check on the real model class, the pipeline partition) and the first step (micro-batches
    split the batch; sequence parallelism splits the sequence)."""
    p, shape = planner.problem, planner.problem.model
    kwargs = layout.strategy_kwargs(p.global_batch)
    nvme = "/tmp" if layout.offload == "nvme" else None
    per_replica = p.global_batch // layout.dp
    try:
        config = ParallelConfig(**{**kwargs, "nvme_path": nvme})
        config.require_implemented()
        config.check_world(p.cluster.world_size, p.cluster.devices_per_node)
        raise_refusals(config.refusals(model=shape))  # with its sequence length: cp chunks, all-to-all heads
        model, plan = _meta_gpt(shape)
        plan.check(model, layout.tp)  # type: ignore[misc]
        if layout.pp > 1:
            partition(shape.n_layer, layout.pp * layout.virtual_stages)
    except (ValueError, NotImplementedError) as err:
        return [str(err)]
    m = kwargs["micro_batches"]
    if m is not None and per_replica % m:
        return [f"micro_batches={m} does not divide {per_replica}"]
    if layout.sequence_parallel and shape.seq_len % layout.tp:
        return [f"sequence {shape.seq_len} does not split {layout.tp} ways"]
    return []


# -- item 7: the planner approved layouts the strategy refuses -------------------------------------------------
def test_plan_layout_the_strategy_refuses_exits_2_with_every_reason(capsys):
    """tp=3 for the 4-head default model: before, `plan` ranked it (exit 0) and training failed
    after spawn; now it exits 2 naming each size tp=3 does not divide, one line each."""
    code, out, err = _plan(capsys, "cluster.devices_per_node=3", "--layout", "tp=3,pp=1,dp=1")
    assert code == 2, (out, err)
    assert out == ""
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert lines[0] == "lightning-3d plan: layout tp=3,pp=1,dp=1 cannot run:"
    assert any("model.n_head=4 is not divisible by tensor_parallel=3" in line for line in lines[1:])
    assert any("model.n_kv_head=4 is not divisible by tensor_parallel=3" in line for line in lines[1:])
    assert all(line.startswith("  - ") and "pick a tensor_parallel that divides" in line for line in lines[1:])
    # the same through the `lightning-3d` entry point
    code, err = _main(capsys, "plan", "cluster.devices_per_node=3", "--layout", "tp=3,pp=1,dp=1")
    assert code == 2 and "model.n_head=4 is not divisible by tensor_parallel=3" in err and "Traceback" not in err


def test_plan_layout_with_zero3_and_a_pipeline_says_why(capsys):
    """Before: "no layout matches {...}" and nothing else (raised as an exception)."""
    code, out, err = _plan(capsys, "cluster.devices_per_node=2", "--layout", "dp=1,tp=1,pp=2,zero=3")
    assert code == 2 and out == "" and "Traceback" not in err
    assert "zero_stage=3 with pipeline_parallel > 1 (pipeline_parallel=2)" in err
    assert "use zero_stage=1 or 2, or pipeline_parallel=1" in err
    assert len(err.strip().splitlines()) == 2  # the header and the one reason


def test_plan_layout_that_no_candidate_satisfies_counts_the_rules():
    """No reason shared by every candidate: each rule's count of excluded candidates, with an example."""
    from lightning_3d.core.layout_rules import LayoutRefused

    software = Software("zero0_or_3", zero_stages=(0, 3), offload=("none", "cpu"))
    problem = _problem("cluster.devices_per_node=2")
    planner = Planner(Problem(problem.model, problem.cluster, problem.global_batch, software, problem.precision))
    with pytest.raises(LayoutRefused) as info:
        best_completion(planner, dict(dp=1, tp=1, pp=2, schedule="1f1b", offload="cpu"))
    message = str(info.value)
    assert message.startswith("no layout matches dp=1,tp=1,pp=2,schedule=1f1b,offload=cpu: ")
    rules = {r.rule: r.message for r in info.value.refusals}
    assert set(rules) == {"offload_needs_zero", "zero3_with_pipeline"}
    candidates = len(list(planner.candidates(1, 1, 2, dict(schedule="1f1b", offload="cpu"))))
    half = candidates // 2
    assert rules["offload_needs_zero"].startswith(f"offload_needs_zero excluded {half} of the {candidates} candidates, e.g. ")
    assert rules["zero3_with_pipeline"].startswith(f"zero3_with_pipeline excluded {half} of the {candidates} candidates, e.g. ")


TWO = ("cluster.devices_per_node=2",)


@pytest.mark.parametrize(
    ("overrides", "kwargs", "layout", "excerpt"),
    [
        # the strategy's rules, as the planner reports them
        (("cluster.devices_per_node=2", "cluster.num_nodes=2", "cluster.inter_node_gb_per_s=10"), {}, "dp=1,tp=4,pp=1",
         "a tensor-parallel group would span nodes"),
        (TWO, {}, "dp=1,tp=1,pp=2,schedule=interleaved,v=4", "pieces need at least 8 layers, but the model has 4 (model.n_layer=4)"),
        (TWO, {}, "dp=1,tp=1,pp=2,schedule=1f1b,v=2", "virtual_stages=2 needs pipeline_schedule='interleaved_1f1b'"),
        (TWO, {}, "dp=1,tp=1,pp=2,schedule=interleaved,mb=16", "needs micro_batches to be a multiple of pipeline_parallel"),
        (TWO, {}, "dp=1,tp=2,pp=1,zero=3,sp=true", "zero_stage=3 with sequence_parallel=True"),
        (TWO, {}, "dp=2,tp=1,pp=1,zero=0,offload=cpu", "offloads the ZeRO optimizer's shard and needs zero_stage >= 1"),
        ((*TWO, "cluster.nvme_gb=100"), {}, "dp=2,tp=1,pp=1,zero=3,offload=nvme", "NVMe offload with zero_stage=3"),
        (TWO, dict(seq_len=127), "dp=1,tp=2,pp=1,sp=true", "the sequence length 127 (model.block_size or --seq-len) is not divisible by 2"),
        # the planner's own
        (("cluster.devices_per_node=3",), {}, "dp=3,tp=1,pp=1", "dp=3 does not divide the global batch 16"),
        (TWO, {}, "dp=2,tp=1,pp=1,mb=3", "mb=3 does not divide the per-replica batch 8"),
        (TWO, {}, "dp=2,tp=1,pp=1,sp=true", "sp=true needs tp > 1"),
        (TWO, {}, "dp=2,tp=1,pp=1,schedule=gpipe", "describe a pipeline, but pp=1"),
        (TWO, {}, "dp=2,tp=1,pp=1,offload=nvme,zero=1", "has no NVMe (nvme_gb=0)"),
        (TWO, dict(software="megatron_2021"), "dp=2,tp=1,pp=1,zero=1", "offers zero stages 0, not 1"),
        (TWO, dict(software="megatron_2021"), "dp=1,tp=1,pp=2,schedule=interleaved", "interleaves only with pp >= 3"),
        (("cluster.devices_per_node=3",), dict(software="megatron_2021"), "dp=1,tp=1,pp=3", "splits layers evenly, and pp=3 does not divide the 4 layers"),
    ],
)
def test_plan_layout_names_each_rule(overrides, kwargs, layout, excerpt):
    from lightning_3d.apps.plan_cli import parse_layout
    from lightning_3d.core.layout_rules import LayoutRefused

    with pytest.raises(LayoutRefused) as info:
        best_completion(Planner(_problem(*overrides, **kwargs)), parse_layout(layout))
    assert excerpt in str(info.value)
    assert str(info.value).startswith("layout dp=")  # a reason every completion shares, named as the layout's own


@pytest.mark.parametrize(
    "overrides",
    [
        # 12 ranks on 2 nodes of 6: tp=4 divides the world and the heads but would span nodes
        ("cluster.devices_per_node=6", "cluster.num_nodes=2", "cluster.inter_node_gb_per_s=10"),
        ("cluster.devices_per_node=3",),
        ("cluster.devices_per_node=8", "model.n_head=8", "+model.n_kv_head=2", "model.n_layer=6"),
        ("model=llama3_8b", "cluster=h100_80g_1node", "data.global_batch_size=64"),
    ],
)
def test_every_layout_the_planner_proposes_is_one_the_strategy_accepts(overrides):
    planner = Planner(_problem(*overrides))
    proposed = [layout for degrees in planner.degrees() for layout in planner.options(*degrees)]
    assert proposed
    refused = {layout.short(): why for layout in proposed if (why := _runnable_by_the_strategy(planner, layout))}
    assert not refused, list(refused.items())[:3]


def test_every_context_parallel_layout_the_planner_proposes_is_one_the_strategy_accepts():
    planner = Planner(_problem("model=llama3_8b", "cluster=h100_80g_1node", "data.global_batch_size=8", "model.block_size=32768"))
    proposed = [layout for d, t, pp, cp in planner.context_degrees() for layout in planner.options(d, t, pp, cp=cp)]
    assert proposed and {layout.cp for layout in proposed} >= {2, 4, 8}
    assert {layout.context_parallel_mode for layout in proposed} == {"ring", "all_to_all"}
    refused = {layout.short(): why for layout in proposed if (why := _runnable_by_the_strategy(planner, layout))}
    assert not refused, list(refused.items())[:3]


def test_the_planners_options_are_exactly_the_candidates_no_rule_refuses():
    """options() prunes nothing the rules allow and lets through nothing they refuse."""
    planner = Planner(_problem("cluster.devices_per_node=8", "model.n_head=8", "model.n_layer=8"))
    for degrees in planner.degrees():
        allowed = [layout for layout in planner.candidates(*degrees) if not planner.refusals(layout)]
        assert list(planner.options(*degrees)) == allowed


def test_planner_and_strategy_refuse_a_layout_for_the_same_reasons():
    """The planner's refusals of a candidate, less its own (batch splitting, software profile),
    are the strategy's refusals of the keywords that candidate runs with."""
    from lightning_3d.core.layout_rules import layout_refusals

    planner = Planner(_problem("cluster.devices_per_node=4", "model.n_head=6", "model.n_embd=96", "model.n_layer=3"))
    p = planner.problem
    seen_rules = set()
    for t, pp in itertools.product((1, 2, 3, 4), (1, 2, 4)):
        d = p.cluster.world_size // (t * pp)
        if d < 1:
            continue
        for layout in planner.candidates(d, t, pp, dict(offload="cpu") if t == 2 else None):
            ours = [r for r in planner.refusals(layout) if ":" not in r.rule and r.rule != "world_size"]
            kwargs = layout.strategy_kwargs(p.global_batch)
            theirs = layout_refusals(
                tp=t, pp=pp, dp=d, zero_stage=kwargs["zero_stage"], sequence_parallel=kwargs["sequence_parallel"],
                schedule=kwargs["pipeline_schedule"], virtual_stages=kwargs["virtual_stages"],
                micro_batches=kwargs["micro_batches"], offload_optimizer=kwargs["offload_optimizer"] or "none",
                offload_params=kwargs["offload_params"] or "none", model=p.model, world_size=p.cluster.world_size,
                processes_per_node=p.cluster.devices_per_node, per_replica_batch=p.global_batch // d,
            )
            assert sorted(r.message for r in ours) == sorted(r.message for r in theirs if r.rule != "world_size")
            seen_rules.update(r.rule for r in ours)
    assert {"tp_divides_model", "pipeline_needs_layers", "zero3_with_pipeline", "offload_needs_zero"} <= seen_rules


# -- the strategy's side ------------------------------------------------------------------------------------------
class _Holder(nn.Module):
    def __init__(self, **config: Any) -> None:
        super().__init__()
        self.model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, **config))


def test_strategy_check_of_the_model_names_every_reason_at_once():
    with pytest.raises(ValueError) as info:
        ParallelConfig(tensor_parallel=3, pipeline_parallel=3).check_models(models_in(_Holder()))
    message = str(info.value)
    for excerpt in (
        "model 'model': GPTConfig.n_head=4 is not divisible by tensor_parallel=3",
        "GPTConfig.n_kv_head=4 is not divisible by tensor_parallel=3",
        "GPTConfig.n_embd=32 is not divisible by tensor_parallel=3",
        "GPTConfig.ffn_dim=128 is not divisible by tensor_parallel=3",
        "pieces need at least 3 layers, but the model has 2 (GPTConfig.n_layer=2)",
    ):
        assert excerpt in message
    ParallelConfig(tensor_parallel=2, pipeline_parallel=2).check_models(models_in(_Holder()))  # fine
    # a user's own tensor-parallel plan decides what it splits: only the pipeline rule applies
    ParallelConfig(tensor_parallel=3).check_models(models_in(_Holder()), tensor_parallel_plan=False)


def test_models_in_finds_the_outermost_known_models():
    holder = _Holder(n_kv_head=2, ffn_hidden=96)
    ((name, dims),) = models_in(holder)
    assert name == "model"
    assert (dims.n_layer, dims.hidden, dims.n_head, dims.n_kv_head, dims.ffn) == (2, 32, 4, 2, 96)
    assert models_in(holder.model)[0][0] == ""
    assert models_in(nn.Linear(2, 2)) == []


@pytest.mark.parametrize("heads,kv,ffn", [(4, 4, 128), (4, 2, 96), (6, 3, 120), (8, 1, 64)])
def test_the_tensor_parallel_plan_checks_with_the_shared_rules(heads, kv, ffn):
    """The built-in plan refuses exactly what the rules refuse (it calls them), for tp 1..8."""
    from lightning_3d.core.layout_rules import ModelDims, check_tensor_parallel, tensor_parallel_refusals

    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=heads, n_kv_head=kv, n_embd=8 * heads, ffn_hidden=ffn))
    plan = gpt_plan(model)
    for tp in range(1, 9):
        expected = tensor_parallel_refusals(tp, ModelDims(1, 8 * heads, heads, kv, ffn))
        if expected:
            with pytest.raises(ValueError) as info:
                plan.check(model, tp)  # type: ignore[misc]
            assert [r.rule for r in info.value.refusals] == [r.rule for r in expected]  # type: ignore[attr-defined]
        else:
            plan.check(model, tp)  # type: ignore[misc]
            check_tensor_parallel(GPT_ADAPTER.dims(model), tp)


def refused_at_setup() -> str:
    """tp=2 on a one-head GPT: the strategy's own check at set-up, before the plan shards anything."""
    try:
        quiet_trainer(max_steps=1, strategy=ThreeDParallelStrategy(tensor_parallel=2)).fit(tiny_gpt(n_head=1), tiny_data())
    except ValueError as err:
        return str(err)
    return "no error"


def test_strategy_refuses_at_setup_with_the_shared_rules():
    message = run_on_ranks(refused_at_setup, 2, timeout=300)[0]
    assert "model 'model': GPTConfig.n_head=1 is not divisible by tensor_parallel=2" in message
    assert "GPTConfig.n_kv_head=1 is not divisible by tensor_parallel=2" in message


# -- context parallelism -----------------------------------------------------------------------------------------
def _shape(**kw):
    from lightning_3d.core.layout_rules import ModelDims

    return ModelDims(**{**dict(n_layer=4, hidden=64, n_head=8, n_kv_head=2, ffn=128, seq_len=1024), **kw})


@pytest.mark.parametrize(
    ("kwargs", "model", "rule"),
    [
        (dict(cp=4, context_parallel_mode="all_to_all", tp=4), {}, "all_to_all_divides_heads"),  # 8/4 = 2 heads per tp rank
        (dict(cp=3), dict(seq_len=1026), "context_parallel_divides_sequence"),  # 1026 % 6 == 0, but cp=3 makes world 3
        (dict(cp=4), dict(seq_len=1020), "context_parallel_divides_sequence"),
        (dict(cp=2, tp=4, sequence_parallel=True), dict(seq_len=1028), "context_parallel_divides_sequence"),
    ],
)
def test_context_parallel_rules(kwargs, model, rule):
    from lightning_3d.core.layout_rules import layout_refusals

    found = [r.rule for r in layout_refusals(model=_shape(**model), **kwargs)]
    if kwargs.get("cp") == 3:
        assert rule not in found  # 1026 splits into 6 chunks of 171
    else:
        assert rule in found, found


def test_context_parallel_accepts_what_it_can_run_and_counts_it_in_the_world():
    from lightning_3d.core.layout_rules import layout_refusals

    assert layout_refusals(model=_shape(), cp=4, tp=2, sequence_parallel=True, context_parallel_mode="all_to_all") == []
    assert layout_refusals(cp=4, tp=2, world_size=16) == []
    refused = layout_refusals(cp=4, tp=2, dp=4, world_size=16)
    assert [r.rule for r in refused] == ["world_size"] and "context_parallel=4" in refused[0].message


def test_context_parallel_mode_is_validated_with_aliases():
    from lightning_3d.core.config import ParallelConfig

    assert ParallelConfig(context_parallel=2, context_parallel_mode="ulysses").layout.context_parallel_mode == "all_to_all"
    with pytest.raises(ValueError, match=r"context_parallel_mode='bogus' is not supported; choose one of 'ring', 'all_to_all'"):
        ParallelConfig(context_parallel=2, context_parallel_mode="bogus")
    with pytest.raises(ValueError, match=r"context_parallel=0 is invalid"):
        ParallelConfig(context_parallel=0)
