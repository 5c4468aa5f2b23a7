"""Llama-style options of the reference GPT (grouped-query attention, SwiGLU, RMSNorm, rotary
positions): the model in one process, then layout invariance under tp, tp + sequence parallel, pp
(1F1B, interleaved), dp with ZeRO 1/3, activation checkpointing and dp x tp, sharded
initialization, checkpoints, and the Hugging Face export (LlamaForCausalLM; mixed options refused)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

import lightning as L
import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_3d import ThreeDParallelStrategy
from lightning_3d.checkpoint.consolidate import consolidate, export_hf
from lightning_3d.models import GPT, GPTConfig, GPTModule
from lightning_3d.models.adapters.gpt import GPT_ADAPTER, gpt_plan, gpt_sequence
from lightning_3d.models.gpt import apply_rotary, rotary_cos_sin
from lightning_3d.parallel.parallelize import apply_activation_checkpointing
from lightning_3d.tensor_parallel import PlanContext, RNGStatesTracker, apply_plan
from lightning_3d.tensor_parallel.layers import ColumnParallelLinear
from lightning_3d.tensor_parallel.random import seed_tracker
from lightning_3d.testing.harness import run_on_ranks
from tests.helpers import STEPS, TINY_GPT, LossRecorder, quiet_trainer, result_of, run_checks, tiny_data

LLAMA = dict(
    TINY_GPT, n_layer=4, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden=64,
    mlp="swiglu", norm="rmsnorm", position="rope", bias=False, tie_embeddings=False,
)
PROBE = torch.arange(32).view(2, 16) * 7 % 256  # fixed input for logits comparisons


def llama(**overrides: Any) -> GPTConfig:
    return GPTConfig(**{**LLAMA, **overrides})


# -- one process -----------------------------------------------------------------------------------------
def test_shapes_and_modules():
    model = GPT(llama())
    attn, mlp = model.blocks[0].attn, model.blocks[0].mlp
    assert not hasattr(model, "wpe")
    assert attn.q_proj.weight.shape == (32, 32) and attn.k_proj.weight.shape == (16, 32)  # 2 kv heads of 8
    assert {n for n, _ in mlp.named_children()} == {"gate_proj", "up_proj", "down_proj", "dropout"}
    assert isinstance(model.blocks[0].ln_1, nn.RMSNorm) and isinstance(model.ln_f, nn.RMSNorm)
    assert model.lm_head.weight is not model.wte.weight
    assert model(PROBE).shape == (2, 16, 256)
    assert model(PROBE, PROBE).dim() == 0


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        dict(bias=True),
        dict(n_kv_head=1, tie_embeddings=True),
        dict(n_kv_head=None, ffn_hidden=None),
        dict(mlp="gelu", position="learned"),
        dict(norm="layernorm", bias=True, mlp="gelu"),
        dict(position="learned", n_kv_head=4, bias=True),
    ],
    ids=["llama", "bias", "mqa-tied", "mha", "gelu-learned", "layernorm", "learned-bias"],
)
def test_parameter_count_formula(overrides):
    config = llama(**overrides)
    assert sum(p.numel() for p in GPT(config).parameters()) == config.num_parameters()


def test_defaults_are_gpt2():
    config = GPTConfig()
    assert (config.n_kv_head, config.mlp, config.norm, config.position, config.rope_theta) == (None, "gelu", "layernorm", "learned", 10000.0)
    assert config.kv_heads == config.n_head
    assert hasattr(GPT(config), "wpe")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(n_kv_head=3), "n_head=4 is not divisible by n_kv_head=3"),
        (dict(n_kv_head=0), "n_kv_head=0 is invalid"),
        (dict(mlp="relu"), r"mlp='relu' is unknown: choose one of \('gelu', 'swiglu'\)"),
        (dict(norm="batchnorm"), "norm='batchnorm' is unknown"),
        (dict(position="alibi"), "position='alibi' is unknown"),
        (dict(n_embd=12, n_head=4, n_kv_head=None), "head_dim=n_embd/n_head=3 must be even"),
        (dict(rope_theta=0.0), "rope_theta=0.0 must be a positive number"),
    ],
)
def test_bad_options_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        llama(**overrides)


def test_rope_changes_outputs_after_the_first_position():
    """Rotation at position 0 is the identity, so (causal) position 0 is unchanged; later ones are not."""
    torch.manual_seed(0)
    model = GPT(llama()).eval()
    with torch.no_grad():
        rope = model(PROBE)
        for block in model.blocks:
            block.attn.rope_theta = None  # the same weights with no positions at all
        plain = model(PROBE)
    torch.testing.assert_close(rope[:, 0], plain[:, 0])
    # small at init (near-uniform attention from N(0, 0.02) weights), but far above float noise
    assert (rope[:, 1:] - plain[:, 1:]).abs().max() > 1e-5
    torch.manual_seed(0)
    learned = GPT(llama(position="learned"))
    assert set(learned.state_dict()) - set(model.state_dict()) == {"wpe.weight"}


def test_rope_scores_depend_on_relative_position_only():
    cos, sin = rotary_cos_sin(torch.arange(12), 8, 10000.0)
    q, k = torch.randn(8), torch.randn(8)
    rotated_q = apply_rotary(q.expand(1, 1, 12, 8), cos, sin)[0, 0]
    rotated_k = apply_rotary(k.expand(1, 1, 12, 8), cos, sin)[0, 0]
    torch.testing.assert_close(rotated_q.norm(dim=-1), q.norm().expand(12))
    torch.testing.assert_close(rotated_q[5] @ rotated_k[2], rotated_q[9] @ rotated_k[6])


@pytest.mark.parametrize("kv", [1, 2, 4])
def test_grouped_query_attention_equals_repeated_key_value_heads(kv):
    """GQA with ``kv`` heads = multi-head attention whose k/v projections repeat each kv head for its
    consecutive query heads (the grouping a tp split along heads preserves)."""
    torch.manual_seed(0)
    gqa = GPT(llama(n_kv_head=kv)).eval()
    mha = GPT(llama(n_kv_head=None)).eval()
    group, head_dim = 4 // kv, 8
    state = {}
    for name, value in gqa.state_dict().items():
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            value = value.view(kv, head_dim, -1).repeat_interleave(group, dim=0).reshape(4 * head_dim, -1)
        state[name] = value
    mha.load_state_dict(state)
    with torch.no_grad():
        torch.testing.assert_close(gqa(PROBE), mha(PROBE), atol=1e-5, rtol=1e-5)
    if kv == 4:
        assert GPT(llama(n_kv_head=4)).blocks[0].attn.k_proj.weight.shape == (32, 32)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_gives_the_same_gradients(mode):
    torch.manual_seed(0)
    plain = GPT(llama())
    recomputed = GPT(llama())
    recomputed.load_state_dict(plain.state_dict())
    assert apply_activation_checkpointing(recomputed, mode) == 4
    for model in (plain, recomputed):
        model(PROBE, PROBE).backward()
    for (name, a), b in zip(plain.named_parameters(), recomputed.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


def test_pipeline_sequence_has_no_position_table_with_rope():
    model = GPT(llama())
    sequence = gpt_sequence(model)
    assert sequence.embed_modules == ("wte", "drop")
    assert all(model.get_submodule(path) is not None for path in (*sequence.embed_modules, *sequence.head_modules))
    assert gpt_sequence(GPT(GPTConfig(**TINY_GPT))).embed_modules == ("wte", "wpe", "drop")
    x = sequence.embed({"input_ids": PROBE})
    for block in sequence.blocks:
        x = sequence.block(block, x, {})
    torch.testing.assert_close(sequence.head(x, {"targets": None}).logits, model(PROBE))


def test_plan_refuses_kv_heads_not_divisible_by_tp_before_sharding():
    model = GPT(llama(n_kv_head=1))
    with pytest.raises(ValueError, match=r"n_kv_head=1 is not divisible by tensor_parallel=2"):
        gpt_plan(model).check(model, 2)
    gpt_plan(model).check(model, 1)
    styles = gpt_plan(GPT(llama())).styles
    assert "wpe" not in styles and styles["blocks.*.mlp.gate_proj"] == "column_prepared"
    assert styles["blocks.*.mlp.down_proj"] == "row" and styles["blocks.*.ln_1"] == "sequence_norm"


def test_llama_style_exports_as_llama():
    pytest.importorskip("transformers")
    hf, tensors = GPT_ADAPTER.hf_export(asdict(llama()))
    keys = {t.key for t in tensors}
    assert hf.model_type == "llama" and hf.num_key_value_heads == 2 and not hf.tie_word_embeddings
    assert {"model.layers.3.self_attn.k_proj.weight", "model.layers.0.mlp.gate_proj.weight", "lm_head.weight"} <= keys


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (dict(mlp="gelu"), "position='rope'"),
        (dict(position="learned", mlp="gelu", norm="layernorm"), "n_kv_head=2 (GPT-2: 4)"),
        (dict(position="learned", n_kv_head=None, norm="layernorm"), "mlp='swiglu'"),
        (dict(position="learned", n_kv_head=None, mlp="gelu"), "norm='rmsnorm'"),
    ],
)
def test_export_refuses_mixed_architectures(overrides, named):
    with pytest.raises(ValueError, match="not GPT-2 architecture .* and not Llama architecture") as err:
        GPT_ADAPTER.hf_export(asdict(llama(**overrides)))
    assert named in str(err.value) and "use `consolidate`" in str(err.value)


def test_gpt2_export_still_takes_gpt2_without_biases_or_ties():
    pytest.importorskip("transformers")
    config = llama(position="learned", n_kv_head=None, mlp="gelu", norm="layernorm")  # bias=False, untied
    hf, tensors = GPT_ADAPTER.hf_export(asdict(config))
    keys = {t.key for t in tensors}
    assert not hf.tie_word_embeddings and {"transformer.wpe.weight", "lm_head.weight"} <= keys


# -- layout invariance -----------------------------------------------------------------------------------
def llama_losses(tmp: Optional[str] = None, **strategy: Any) -> dict[str, Any]:
    """10 steps of the tiny Llama-style GPT; with ``tmp``, a checkpoint and the logits of PROBE after."""
    L.seed_everything(0)
    recorder = LossRecorder()
    trainer = quiet_trainer(
        max_steps=STEPS, limit_val_batches=0, callbacks=[recorder], gradient_clip_val=0.5,
        strategy=ThreeDParallelStrategy(**strategy),
    )
    module = GPTModule(llama(), lr=3e-3, warmup_steps=2)
    trainer.fit(module, tiny_data(global_batch_size=8))
    out: dict[str, Any] = {"losses": recorder.losses}
    if tmp is not None:
        path = str(Path(tmp) / "llama.ckpt")
        trainer.save_checkpoint(path)
        module.eval()
        with torch.no_grad():
            out.update(path=path, logits=module(PROBE).tolist())
    return out


def sharded_init_equals_dense() -> float:
    from lightning_3d.checkpoint.dense_state import full_state_dict

    torch.manual_seed(5)
    dense = GPT(llama())
    reference = {k: v.clone() for k, v in dense.state_dict().items()}
    tracker = RNGStatesTracker("cpu")
    seed_tracker(tracker, dist.get_rank(), base_seed=0)
    apply_plan(dense, gpt_plan(dense), PlanContext(dist.group.WORLD, True, tracker))
    assert dense.blocks[0].attn.k_proj.weight.shape == (8, 32)  # one of the two kv heads per rank
    gathered = full_state_dict(dense)
    assert gathered.keys() == reference.keys()
    return max(float((gathered[k] - reference[k]).abs().max()) for k in reference)


def kv_heads_refused_before_sharding() -> dict[str, Any]:
    model = GPT(llama(n_kv_head=1))
    try:
        apply_plan(model, gpt_plan(model), PlanContext(dist.group.WORLD, False, None))
    except ValueError as err:
        message = str(err)
    else:
        message = "no error"
    return {"message": message, "untouched": not any(isinstance(m, ColumnParallelLinear) for m in model.modules())}


def two_rank_world(tmp: str) -> dict[str, Any]:
    return run_checks(
        {
            "tp2": lambda: llama_losses(tmp, tensor_parallel=2),
            "tp2_sp": lambda: llama_losses(tensor_parallel=2, sequence_parallel=True),
            "pp2": lambda: llama_losses(pipeline_parallel=2),
            "pp2_interleaved": lambda: llama_losses(pipeline_parallel=2, pipeline_schedule="interleaved_1f1b", virtual_stages=2),
            "tp2_sp_recompute": lambda: llama_losses(tensor_parallel=2, sequence_parallel=True, activation_checkpointing="selective"),
            "dp2_zero1_recompute": lambda: llama_losses(data_parallel=2, zero_stage=1, activation_checkpointing="full"),
            "dp2_zero3": lambda: llama_losses(data_parallel=2, zero_stage=3),
            "init": sharded_init_equals_dense,
            "kv_heads": kv_heads_refused_before_sharding,
        }
    )


def four_rank_world() -> dict[str, Any]:
    return run_checks({"dp2tp2": lambda: llama_losses(tensor_parallel=2)})


def reference_world() -> dict[str, Any]:
    return run_checks({"losses": llama_losses})


@pytest.fixture(scope="module")
def single() -> dict[str, Any]:
    return run_on_ranks(reference_world, 1, timeout=300)[0]


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> list[dict[str, Any]]:
    return run_on_ranks(two_rank_world, 2, str(tmp_path_factory.mktemp("llama")), timeout=600)


@pytest.fixture(scope="module")
def four() -> list[dict[str, Any]]:
    return run_on_ranks(four_rank_world, 4, timeout=600)


def _close(ours: Any, reference: Any) -> None:
    assert len(ours) == len(reference) == STEPS
    np.testing.assert_allclose(ours, reference, rtol=1e-5)


@pytest.mark.parametrize("name", ["tp2", "tp2_sp", "pp2", "pp2_interleaved", "tp2_sp_recompute"])
def test_two_rank_layouts_match_one_process(two, single, name):
    reference = result_of(single, "losses")["losses"]
    for r in two:  # tp peers compute the same loss; the last stage's loss is visible on every pp rank
        _close(result_of(r, name)["losses"], reference)


@pytest.mark.parametrize("name", ["dp2_zero1_recompute", "dp2_zero3"])
def test_data_parallel_and_zero_match_one_process(two, single, name):
    _close(np.mean([result_of(r, name)["losses"] for r in two], axis=0), result_of(single, "losses")["losses"])


def test_dp2_tp2_matches_one_process(four, single):
    per_rank = [result_of(r, "dp2tp2")["losses"] for r in four]
    # ranks (0, 1) are dp replica 0 and (2, 3) replica 1; each replica's loss is over half the batch
    _close(np.mean([per_rank[0], per_rank[2]], axis=0), result_of(single, "losses")["losses"])
    assert per_rank[0] == per_rank[1] and per_rank[2] == per_rank[3]


def test_sharded_initialization_equals_the_dense_model(two):
    for r in two:
        assert result_of(r, "init") == 0.0


def test_kv_heads_not_divisible_by_tp_is_refused_before_sharding(two):
    out = result_of(two[0], "kv_heads")
    assert "n_kv_head=1 is not divisible by tensor_parallel=2" in out["message"] and out["untouched"]


def test_tp2_checkpoint_consolidates_and_exports_as_llama(two, tmp_path):
    import transformers

    run = result_of(two[0], "tp2")
    export_hf(run["path"], str(tmp_path / "hf"))
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    with torch.no_grad():
        np.testing.assert_allclose(hf(input_ids=PROBE).logits.numpy(), np.array(run["logits"]), rtol=1e-4, atol=1e-5)
    dense = consolidate(run["path"], str(tmp_path / "llama.ckpt"))["out"]
    module = GPTModule.load_from_checkpoint(dense, weights_only=True)
    assert module.config == llama() and module.model.wte.weight.shape == (256, 32)
    with torch.no_grad():
        np.testing.assert_allclose(module.eval()(PROBE).numpy(), np.array(run["logits"]), rtol=1e-4, atol=1e-5)
