"""Mixture of experts (issue 34): the router, grouped experts and the MoE layer against per-token
references, in one process (expert parallelism's multi-rank tests build on these)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.nn import functional as F

from lightning_3d.moe import MoE, TopKRouter, grouped_mm
from lightning_3d.moe.experts import capacity

DIM, HIDDEN, EXPERTS, TOP_K = 16, 24, 6, 2


def _moe(**kwargs) -> MoE:
    torch.manual_seed(0)
    moe = MoE(DIM, HIDDEN, EXPERTS, TOP_K, **kwargs)
    torch.nn.init.normal_(moe.router.gate.weight, std=0.5)  # decided routes, not near-ties
    return moe


def _expert(moe: MoE, e: int, x: torch.Tensor) -> torch.Tensor:
    ex = moe.experts
    return (F.silu(x @ ex.gate_proj[e]) * (x @ ex.up_proj[e])) @ ex.down_proj[e]


def per_token_reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Each token through its k experts one at a time, weighted; plus the shared experts."""
    tokens = x.reshape(-1, x.shape[-1])
    routing = moe.router(tokens)
    out = []
    for t in range(tokens.shape[0]):
        y = sum(routing.weights[t, j] * _expert(moe, int(routing.experts[t, j]), tokens[t]) for j in range(TOP_K))
        if moe.shared_experts is not None:
            y = y + moe.shared_experts(tokens[t])
        out.append(y)
    return torch.stack(out).view(x.shape)


@pytest.mark.parametrize("kwargs", [{}, {"n_shared_experts": 1}, {"score": "sigmoid"}, {"normalize": False}], ids=["softmax", "shared", "sigmoid", "raw"])
def test_moe_matches_the_per_token_reference_forward_and_backward(kwargs):
    moe = _moe(**kwargs)
    x = torch.randn(3, 5, DIM, requires_grad=True)
    ours = moe(x)
    ref_x = x.detach().clone().requires_grad_()
    ref = per_token_reference(moe, ref_x)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    ours_grads = torch.autograd.grad(ours.sum(), [x, *moe.parameters()], allow_unused=True)  # .sum(): a stride-0 gradient
    ref_grads = torch.autograd.grad(ref.sum(), [ref_x, *moe.parameters()], allow_unused=True)
    for name, a, b in zip(["x", *(n for n, _ in moe.named_parameters())], ours_grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)


def test_router_weights():
    torch.manual_seed(0)
    x = torch.randn(7, DIM)
    soft = TopKRouter(DIM, EXPERTS, 3)(x)
    assert soft.experts.shape == (7, 3) and soft.experts.dtype == torch.int64
    torch.testing.assert_close(soft.weights.sum(-1), torch.ones(7))
    assert torch.equal(torch.sort(soft.experts, -1).values, torch.sort(torch.topk(soft.scores, 3).indices, -1).values)
    sig = TopKRouter(DIM, EXPERTS, 3, score="sigmoid", normalize=False)  # sigmoid scores are always renormalised
    torch.testing.assert_close(sig(x).weights.sum(-1), torch.ones(7))
    for bad, match in (({"top_k": 0}, "top_k=0"), ({"top_k": 7}, "top_k=7"), ({"score": "relu"}, "score='relu'")):
        args = {"top_k": 2, **bad}
        with pytest.raises(ValueError, match=match):
            TopKRouter(DIM, EXPERTS, args.pop("top_k"), **args)


def test_grouped_mm_matches_a_loop_including_empty_experts():
    torch.manual_seed(0)
    counts = [3, 0, 6, 0]
    offsets = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    for width in (8, 3):  # 3 fp32 columns are not a 16-byte row: the loop stands in
        x, w = torch.randn(9, 4), torch.randn(4, 4, width)
        loop = torch.cat([rows @ we for rows, we in zip(torch.split(x, counts), w)])
        torch.testing.assert_close(grouped_mm(x, w, offsets), loop)
        torch.testing.assert_close(grouped_mm(x.double(), w.double(), offsets).float(), loop)  # float64: the loop itself


def test_capacity_factor_keeps_each_experts_highest_weights_per_sequence():
    moe = _moe(capacity_factor=1.0)
    x = torch.randn(4, 6, DIM)
    keep = capacity(6, TOP_K, EXPERTS, 1.0)
    assert keep == 2  # ceil(1.0 * 6 tokens * 2 / 6 experts) rows per expert and sequence
    expected = torch.zeros_like(x)
    dropped = 0
    for s, sequence in enumerate(x):
        with torch.no_grad():
            routing = moe.router(sequence)
        for e in range(EXPERTS):
            rows = [(float(routing.weights[t, j]), t) for t in range(6) for j in range(TOP_K) if routing.experts[t, j] == e]
            dropped += max(0, len(rows) - keep)
            for weight, t in sorted(rows, key=lambda r: -r[0])[:keep]:
                expected[s, t] += weight * _expert(moe, e, sequence[t])
    assert dropped > 0  # the case is one that drops
    out = moe(x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.cat([moe(part) for part in x.split(1)]), out)  # any split: the same drops
    with pytest.raises(ValueError, match="capacity_factor=0"):
        MoE(DIM, HIDDEN, EXPERTS, TOP_K, capacity_factor=0)


@pytest.mark.parametrize("dim", [16, 12], ids=["grouped-gemm", "loop"])  # 12 bf16 features: not 16-byte rows
def test_under_autocast_the_experts_run_in_bf16_and_stay_close_to_fp32(dim):
    torch.manual_seed(0)
    moe = MoE(dim, 24, EXPERTS, TOP_K, n_shared_experts=1)
    x = torch.randn(2, 5, dim)
    full = moe(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        half = moe(x)
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), full, rtol=5e-2, atol=5e-3)
    half.float().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in moe.experts.parameters())


def test_top_1_weights_are_one_when_normalised_and_the_probability_when_not():
    torch.manual_seed(0)
    x = torch.randn(5, DIM)
    assert torch.equal(TopKRouter(DIM, EXPERTS, 1)(x).weights, torch.ones(5, 1))
    raw = TopKRouter(DIM, EXPERTS, 1, normalize=False)(x)
    torch.testing.assert_close(raw.weights[:, 0], raw.scores.max(dim=-1).values)


def test_aux_losses_are_per_sequence_so_any_split_of_the_batch_gives_the_same():
    moe = _moe(balance_coefficient=0.1, z_loss_coefficient=1e-3)
    moe.train()
    x = torch.randn(4, 5, DIM)
    moe(x)
    whole = moe.aux_loss
    halves = []
    for part in x.split(2):
        moe(part)
        halves.append(moe.aux_loss)
    torch.testing.assert_close(whole, sum(halves) / 2)  # the mean of the micro-batches' means, as the main loss
    with torch.no_grad():
        moe(x)
    assert moe.aux_loss is None  # only a training forward with gradients leaves one
    balanced = _moe(balance_coefficient=1.0)
    torch.nn.init.zeros_(balanced.router.gate.weight)  # every score 1/E: sum_i f_i P_i = sum_i f_i / E = 1
    balanced.train()
    balanced(torch.randn(1, EXPERTS // TOP_K * 4, DIM))
    assert balanced.aux_loss is not None and balanced.aux_loss.item() == pytest.approx(1.0)


# -- the reference GPT with experts, through Lightning's Trainer ------------------------------------------------
MOE_GPT = dict(n_experts=4, top_k=2, n_shared_experts=1, moe_every=2, expert_hidden=32, moe_z_loss=1e-3, mlp="swiglu")
MOE_STEPS = 4
PIPELINED_MOE = {"n_layer": 4, "moe_every": 1}  # an MoE layer in every piece, zb_v's four included
MASKED_AUX = {"moe_balance_loss": 1.0}  # a large auxiliary part: weighed by targets, it would show at rel 1e-5


def moe_losses(model: dict[str, object] | None = None, masked: bool = False, **strategy: object) -> list[float]:
    """``masked``: targets whose input token is a multiple of 5 are ignored, so replicas and
    micro-batches hold different numbers of targets but the same number of sequences."""
    import lightning as L

    from lightning_3d import ThreeDParallelStrategy
    from lightning_3d.models import GPTConfig, GPTModule
    from lightning_3d.models.gpt import IGNORE_INDEX
    from tests.helpers import TINY_GPT, LossRecorder, quiet_trainer, tiny_data

    class MaskedGPT(GPTModule):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            return super().training_step((x, y.masked_fill(x % 5 == 0, IGNORE_INDEX) if masked else y), batch_idx)

    L.seed_everything(0)
    recorder = LossRecorder()
    kwargs = {"strategy": ThreeDParallelStrategy(**strategy)} if strategy else {}
    trainer = quiet_trainer(max_steps=MOE_STEPS, limit_val_batches=0, callbacks=[recorder], **kwargs)
    module = MaskedGPT(GPTConfig(**{**TINY_GPT, **MOE_GPT, **(model or {})}), lr=1e-2, warmup_steps=2)
    trainer.fit(module, tiny_data(global_batch_size=8))
    return recorder.losses


def moe_world() -> dict[str, object]:
    from tests.helpers import refusal_message, run_checks

    checks = {f"zero{stage}": (lambda stage=stage: moe_losses(zero_stage=stage)) for stage in (0, 1, 2, 3)}
    checks["recompute"] = lambda: moe_losses(activation_checkpointing="full")
    checks["cp2"] = lambda: moe_losses(data_parallel=1, context_parallel=2)  # the balance loss's counts summed over cp
    checks["cp2_capacity"] = lambda: refusal_message(lambda: moe_losses(data_parallel=1, context_parallel=2, model={"capacity_factor": 1.0}))
    for schedule in ("1f1b", "zb_v"):  # every stage's auxiliary losses join the gradient and the reported loss
        checks[f"pp2_{schedule}"] = lambda schedule=schedule: moe_losses(
            PIPELINED_MOE, data_parallel=1, pipeline_parallel=2, pipeline_schedule=schedule
        )
    checks["tp2"] = lambda: moe_losses(data_parallel=1, tensor_parallel=2)  # experts, shared experts split over tp
    # targets masked unevenly: the auxiliary losses are weighed by sequences, the main loss by targets
    checks["masked"] = lambda: moe_losses(MASKED_AUX, masked=True)
    checks["masked_pp2"] = lambda: moe_losses({**PIPELINED_MOE, **MASKED_AUX}, masked=True, data_parallel=1, pipeline_parallel=2)
    checks["tp2_sp"] = lambda: moe_losses(data_parallel=1, tensor_parallel=2, sequence_parallel=True)  # gathered, reduce-scattered
    return run_checks(checks)


def test_moe_gpt_parameters_and_blocks():
    from lightning_3d.models.gpt import GPT, GPTConfig

    config = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=16, **MOE_GPT)
    model = GPT(config)
    assert [isinstance(b.mlp, MoE) for b in model.blocks] == [False, True, False, True]
    assert config.num_parameters() == sum(p.numel() for p in model.parameters())
    for bad, match in (({"top_k": 5}, "top_k=5"), ({"moe_every": 0}, "moe_every=0"), ({"n_experts": -1}, "n_experts=-1")):
        with pytest.raises(ValueError, match=match):
            GPTConfig(**{**MOE_GPT, **bad})


def test_dp2_moe_matches_one_process_at_every_zero_stage_and_other_degrees_are_refused():
    """Data parallelism replicates the experts (ZeRO shards them like any parameter); the auxiliary
    losses are per sequence, so the replicas' mean loss is one process's; at cp2 each rank holds half
    of every sequence, and the balance loss sums the experts' counts over cp."""
    from lightning_3d.testing.harness import run_on_ranks
    from tests.helpers import result_of

    single = run_on_ranks(moe_losses, 1, timeout=300)[0]
    pipelined = run_on_ranks(moe_losses, 1, PIPELINED_MOE, timeout=300)[0]
    masked = run_on_ranks(moe_losses, 1, MASKED_AUX, True, timeout=300)[0]
    masked_pp = run_on_ranks(moe_losses, 1, {**PIPELINED_MOE, **MASKED_AUX}, True, timeout=300)[0]
    assert len(single) == MOE_STEPS and single[-1] < single[0]
    ranks = run_on_ranks(moe_world, 2, timeout=600)
    for name in ("zero0", "zero1", "zero2", "zero3", "recompute", "cp2", "pp2_1f1b", "pp2_zb_v", "tp2", "tp2_sp", "masked", "masked_pp2"):
        # (a pipeline's ranks report the batch loss each: their mean is it too)
        want = {"masked": masked, "masked_pp2": masked_pp}.get(name, pipelined if name.startswith("pp2") else single)
        mean = [sum(r) / 2 for r in zip(*(result_of(rank, name) for rank in ranks))]
        np_close = [abs(a - b) <= 1e-5 * abs(b) for a, b in zip(mean, want)]
        assert all(np_close), (name, mean, want)
    capacity = result_of(ranks[0], "cp2_capacity")
    assert "context_parallel=2: an MoE layer has capacity_factor=1.0" in capacity, capacity


def test_flops_per_token_count_what_a_token_computes_in_its_experts():
    """The loop path (10 fp32 features: not 16-byte rows) is plain matmuls, which torch's counter sees."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from lightning_3d.models.adapters.registry import adapter_for
    from lightning_3d.models.gpt import GPT, GPTConfig

    config = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=10, bias=False, **{**MOE_GPT, "expert_hidden": 6})
    model = GPT(config)
    x = torch.randint(0, 64, (2, 8))
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        model(x, x).backward()
    assert counter.get_total_flops() / x.numel() == pytest.approx(adapter_for(model).flops_per_token(model, 8), rel=0.01)
    with pytest.raises(ValueError, match="a mixture-of-experts GPT has no Hugging Face export yet"):
        adapter_for(model).hf_export(config)


@pytest.mark.parametrize("family", ["MixtralConfig", "Qwen3MoeConfig", "OlmoeConfig", "DeepseekV3Config"])
def test_hugging_face_moe_families_are_split_where_their_experts_are_known(family):
    """transformers' stacked experts are split by lightning_3d.moe's dispatch (models/adapters/hf_moe.py):
    every degree passes the set-up's check; experts of another convention, a block part tensor
    parallelism would not know how to split, and the router loss under a pipeline or context parallelism
    are refused, by name."""
    import transformers

    from lightning_3d.core.config import ParallelConfig
    from lightning_3d.core.layout_rules import model_refusals
    from lightning_3d.models.adapters.hf_common import config_dims
    from lightning_3d.parallel.parallelize import refuse_foreign_experts

    config = getattr(transformers, family)()
    dims = config_dims(config)
    assert dims.n_experts == (getattr(config, "n_routed_experts", None) or config.num_local_experts) > 0
    assert any(r.rule == "expert_parallel_divides_experts" for r in model_refusals(tp=1, pp=1, ep=dims.n_experts + 1, model=dims))
    assert config_dims(transformers.LlamaConfig()).n_experts == 0
    tiny = _tiny_hf_moe(family)
    every = ({"data_parallel": 2, "zero_stage": 3}, {"tensor_parallel": 2}, {"context_parallel": 2}, {"expert_parallel": 2}, {"pipeline_parallel": 2})
    for degrees in every:
        refuse_foreign_experts(tiny, ParallelConfig(**degrees))
    tiny.config.output_router_logits = True  # transformers' router loss: from every layer of whole sequences
    for degrees, why in (({"pipeline_parallel": 2}, "which no pipeline stage runs"), ({"context_parallel": 2}, "which context_parallel=2 splits")):
        if not hasattr(tiny, "router_aux_loss_coef"):  # (DeepSeek-V3 computes no router loss: nothing to refuse)
            refuse_foreign_experts(tiny, ParallelConfig(**degrees))
            continue
        with pytest.raises(NotImplementedError, match=why):
            refuse_foreign_experts(tiny, ParallelConfig(**degrees))
    refuse_foreign_experts(tiny, ParallelConfig(tensor_parallel=2))
    tiny.config.output_router_logits = False
    block = next(m for m in tiny.modules() if hasattr(m, "experts"))
    if hasattr(block, "jitter_noise"):  # Mixtral's in-place jitter: tp ranks would route apart
        block.jitter_noise = 0.01
        with pytest.raises(NotImplementedError, match=r"router_jitter_noise=0.01.*set router_jitter_noise=0"):
            refuse_foreign_experts(tiny, ParallelConfig(tensor_parallel=2))
        refuse_foreign_experts(tiny, ParallelConfig(expert_parallel=2))
        block.jitter_noise = 0.0
    block.extra_gate = torch.nn.Linear(16, 1)  # (Qwen2-MoE's shared_expert_gate: tp would sum it unsplit)
    with pytest.raises(NotImplementedError, match=r"extra_gate \(Linear\) is neither the router"):
        refuse_foreign_experts(tiny, ParallelConfig(tensor_parallel=2))
    refuse_foreign_experts(tiny, ParallelConfig(expert_parallel=2))  # (expert parallelism leaves it whole)
    block.experts.register_parameter("gate_up_proj_bias", torch.nn.Parameter(torch.zeros(4, 32)))  # (GPT-OSS's biases)
    with pytest.raises(NotImplementedError, match=r"its experts hold .*gate_up_proj_bias.*at expert_parallel=2; set those degrees to 1"):
        refuse_foreign_experts(tiny, ParallelConfig(expert_parallel=2))


def _tiny_hf_moe(family: str) -> torch.nn.Module:
    import transformers

    sizes = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
    experts = {
        "MixtralConfig": dict(num_local_experts=4, num_experts_per_tok=2),
        "Qwen3MoeConfig": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, head_dim=8),
        "OlmoeConfig": dict(num_experts=4, num_experts_per_tok=2),
        "DeepseekV3Config": dict(
            n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_group=1, topk_group=1,
            q_lora_rank=8, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, first_k_dense_replace=0,
        ),
    }[family]
    config = getattr(transformers, family)(**sizes, **experts)
    return transformers.AutoModelForCausalLM.from_config(config)


def load_balancing_loss_func(gate_logits, num_experts=None, top_k=2, attention_mask=None):  # noqa: ANN001
    """A family whose router loss is not transformers' Switch-style one (it weighs the logits' squares)."""
    return sum(layer.square().mean() for layer in gate_logits)


def test_the_router_loss_over_replicas_is_transformers_own():
    """At dp > 1 the router loss is rebuilt from the whole batch's statistics: its sums give exactly
    transformers' load_balancing_loss_func on the same logits (with and without padding), and a family
    whose own function differs is found (so refused at dp > 1, not computed differently)."""
    import transformers

    from lightning_3d.models.adapters import hf_moe

    model = _tiny_hf_moe("MixtralConfig")
    assert hf_moe._family_loss_agrees(model, 4, 2)
    logits = [torch.randn(6, 4) for _ in range(3)]
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    for m in (None, mask):
        theirs = transformers.models.mixtral.modeling_mixtral.load_balancing_loss_func(tuple(logits), 4, 2, m)
        ours = hf_moe._balance_loss(*hf_moe.switch_balance_terms(logits, 4, 2, m), 4)
        torch.testing.assert_close(ours, theirs)

    class OtherLoss(transformers.MixtralForCausalLM):
        pass

    assert not hf_moe._family_loss_agrees(OtherLoss(model.config), 4, 2)  # (this module's function above)


def test_tensor_parallel_must_divide_the_experts_and_the_shared_experts_width():
    """Refused by the layout rules, before set-up, on every rank alike (review: the shared experts'
    width was checked while splitting them, on the stages that hold them only)."""
    from lightning_3d.core.layout_rules import ModelDims, model_refusals

    dims = ModelDims(n_layer=2, hidden=32, n_head=4, n_kv_head=4, ffn=128, n_experts=6, shared_expert_width=33)
    rules = {r.rule: r.message for r in model_refusals(tp=2, pp=1, ep=2, model=dims)}
    assert "expert_parallel=2 x tensor_parallel=2 = 4 ranks split the model's 6 routed experts" in rules["expert_tensor_parallel_divides_experts"]
    assert "shared experts, of width 33" in rules["tensor_parallel_divides_shared_experts"]
    assert not model_refusals(tp=2, pp=1, ep=1, model=ModelDims(2, 32, 4, 4, 128, n_experts=4, shared_expert_width=32))


def test_a_model_whose_every_block_has_experts_is_not_held_to_its_dense_mlp_width():
    """(review) The dense MLP width was checked against tp even when no block has a dense MLP."""
    from lightning_3d.core.layout_rules import model_refusals
    from lightning_3d.models.adapters.registry import adapter_for
    from lightning_3d.models.gpt import GPT, GPTConfig

    def refusals(moe_every: int) -> list[str]:
        config = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16, ffn_hidden=33, **{**MOE_GPT, "moe_every": moe_every})
        with torch.device("meta"):
            model = GPT(config)
        return [r.message for r in model_refusals(tp=2, pp=1, model=adapter_for(model).dims(model))]

    assert not refusals(1)
    assert any("ffn_dim=33 is not divisible by tensor_parallel=2" in m for m in refusals(2))


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "olmoe", "deepseek_v3"])
def test_hugging_face_moe_families_are_counted_with_their_experts(family):
    """The planner's shape of a transformers MoE model (its FLOPs, so the MFU it logs, and its memory) has
    the model's own experts: the blocks that have them (DeepSeek-V3's first block is dense), their width and
    top-k. Before, such a model was counted as dense, its experts as one MLP (Mixtral: half its FLOPs)."""
    import transformers

    from lightning_3d.models.adapters.registry import adapter_for
    from tests.hf_families import hf_family_config

    config = hf_family_config(family)
    model = transformers.AutoModelForCausalLM.from_config(config)
    shape = adapter_for(model).model_shape(model, 16)
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    assert shape.moe_layers * shape.moe_layer_expert_params == experts > 0
    assert shape.moe_layers == config.num_hidden_layers - getattr(config, "first_k_dense_replace", 0)
    assert shape.top_k == config.num_experts_per_tok
    routed_per_token = shape.moe_layers * shape.top_k * 3 * shape.hidden * shape.expert_ffn
    assert shape.active_parameters == shape.num_parameters - experts + routed_per_token


@pytest.mark.parametrize("family", ["MixtralConfig", "Qwen3MoeConfig", "OlmoeConfig", "DeepseekV3Config"])
def test_the_experts_dispatch_computes_what_transformers_does(family):
    """One process, one MoE block: the block with its experts' call replaced by lightning_3d.moe's
    dispatch (models/adapters/hf_moe.py) gives transformers' output and gradients (fp32), and under
    bf16 autocast stays within bf16 rounding of transformers' own autocast result (the rows are weighted
    and summed in the router weights' promoted dtype, as transformers does)."""
    from lightning_3d.core.forward_wrappers import unwrap_forward, wrap_forward
    from lightning_3d.models.adapters import hf_moe

    torch.manual_seed(0)
    model = _tiny_hf_moe(family)
    _, block = hf_moe.moe_blocks(model)[0]
    experts = block.experts
    x = torch.randn(2, 5, 16)

    def run(autocast: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad()
        inputs = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = block(inputs)
        out.float().square().sum().backward()
        return out.detach().float(), [inputs.grad.clone(), *(p.grad.clone() for p in (experts.gate_up_proj, experts.down_proj, block.gate.weight))]

    theirs, theirs_bf16 = run(False), run(True)
    wrap_forward(experts, hf_moe.EXPERTS_KIND, hf_moe._experts_forward(experts, experts.gate_up_proj.shape[0], None, None))
    try:
        ours, ours_bf16 = run(False), run(True)
    finally:
        unwrap_forward(experts, hf_moe.EXPERTS_KIND)
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-5, atol=1e-6)
    for a, b in zip(ours[1], theirs[1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours_bf16[0], theirs_bf16[0], rtol=2e-2, atol=2e-2)
    assert not torch.equal(ours_bf16[0], ours[0])  # (autocast did compute in bf16)
