"""Model adapters (issue 16): generic code knows no model; the registry finds every family; each
family's FLOPs are the planner's; a new family (Qwen2) trains at tp2 and pp2 like one process."""

from __future__ import annotations

import ast
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

import lightning as L
import numpy as np
import pytest
import torch
from torch import nn

from lightning_3d import ThreeDParallelStrategy
from lightning_3d.core.model_shape import ModelShape
from lightning_3d.models import GPT, GPTConfig
from lightning_3d.models.adapters import adapter_for, adapter_for_hf_config, find_models, find_sequences, models_in
from lightning_3d.testing.harness import run_on_ranks
from tests.helpers import LossRecorder, quiet_trainer, result_of, run_checks, tiny_data

transformers = pytest.importorskip("transformers")

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_3d"
GENERIC = ("core", "testing", "tensor_parallel", "pipeline", "context_parallel", "zero", "transforms", "checkpoint", "planner", "monitoring", "parallel", "resilience", "plugins")
# the registry and the interface are the one way into model families; no model module is imported
ALLOWED = ("lightning_3d.models.adapters.registry", "lightning_3d.models.adapters.base")
HF_CLASS_NAMES = ("LlamaForCausalLM", "GPT2LMHeadModel", "Qwen2ForCausalLM")
SEQ = 16


# -- (a) generic code imports no model ---------------------------------------------------------------------------
def _generic_files() -> list[Path]:
    files: list[Path] = []
    for entry in GENERIC:
        path = PACKAGE / entry
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return files


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                out.add(id(first.value))
    return out


def model_knowledge(path: Path) -> list[str]:
    """Imports of model modules, and HF class names in code (not docstrings), in one source file."""
    tree = ast.parse(path.read_text(), str(path))
    docs = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] if node.level == 0 else []
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            found += [f"line {node.lineno}: {name!r} in a string" for name in HF_CLASS_NAMES if name in node.value]
            continue
        else:
            continue
        for name in names:
            if (name == "lightning_3d.models" or name.startswith("lightning_3d.models.")) and name not in ALLOWED:
                found.append(f"line {node.lineno}: imports {name}")
    return found


def test_generic_code_imports_no_model():
    files = _generic_files()
    assert len(files) > 20 and PACKAGE / "core" / "layout_rules.py" in files
    offenders = {str(p.relative_to(PACKAGE)): f for p in files if (f := model_knowledge(p))}
    assert not offenders, offenders


def test_the_check_sees_what_it_must(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        '"""Mentions LlamaForCausalLM in a docstring: fine."""\n'
        "from lightning_3d.models.gpt import GPT\n"
        "import lightning_3d.models.adapters.llama\n"
        "from lightning_3d.models.adapters.registry import adapter_for\n"
        "KIND = {'GPT2LMHeadModel': 1}\n"
    )
    assert [f.split(":")[0] for f in model_knowledge(bad)] == ["line 2", "line 3", "line 5"]


# -- (b) the registry ---------------------------------------------------------------------------------------------
def _hf_configs() -> dict[str, Any]:
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    return {
        "llama": transformers.LlamaConfig(**common),
        "gpt2": transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=SEQ),
        "qwen2": transformers.Qwen2Config(**common, use_sliding_window=True, sliding_window=4, max_window_layers=1),
    }


def _models() -> dict[str, nn.Module]:
    torch.manual_seed(0)
    out: dict[str, nn.Module] = {"gpt": GPT(GPTConfig(vocab_size=64, block_size=SEQ, n_layer=2, n_head=4, n_embd=32))}
    for name, config in _hf_configs().items():
        # eager attention: matmuls that FlopCounterMode counts on CPU
        out[name] = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    out["gpt_llama_style"] = GPT(GPTConfig(
        vocab_size=64, block_size=SEQ, n_layer=2, n_head=4, n_embd=32, n_kv_head=2, mlp="swiglu", norm="rmsnorm",
        position="rope", bias=False, tie_embeddings=False,
    ))
    return out


class _Holder(nn.Module):
    def __init__(self, **models: nn.Module) -> None:
        super().__init__()
        for name, model in models.items():
            self.add_module(name, model)


def test_registry_finds_every_family():
    models = _models()
    family = {"gpt": "gpt", "gpt_llama_style": "gpt", "gpt2": "gpt2", "llama": "hf", "qwen2": "hf"}  # hf: transformers' plans
    for name, model in models.items():
        adapter = adapter_for(model)
        assert adapter is not None and adapter.name == family[name], name
        assert adapter_for(next(iter(model.children()))) is None  # a layer of the model is not the model
    holder = _Holder(**models)
    found = [(name, adapter.name) for name, _, adapter in find_models(holder)]
    assert found == [(name, family[name]) for name in models]  # outermost only: no nested match
    assert [name for name, *_ in find_sequences(holder)] == list(models)
    dims = dict(models_in(holder))
    assert (dims["qwen2"].n_head, dims["qwen2"].n_kv_head, dims["qwen2"].labels["n_kv_head"]) == (4, 2, "num_key_value_heads")
    for model_type, config in _hf_configs().items():
        assert adapter_for_hf_config(config).name == family[model_type]
        assert adapter_for_hf_config(config.to_dict()).name == family[model_type]


def test_registry_refuses_a_model_type_that_is_no_causal_lm_naming_the_way_out():
    with pytest.raises(ValueError) as info:
        adapter_for_hf_config(transformers.ViTConfig())
    message = str(info.value)
    assert "model_type='vit'" in message and "not a causal language model" in message and "register_adapter" in message


def test_hf_export_lists_the_model_keys_and_leaves_a_tied_head_out():
    for model_type, config in _hf_configs().items():
        for tied in (False, True):
            config.tie_word_embeddings = tied
            hf, tensors = adapter_for_hf_config(config).hf_export(config.to_dict())
            keys = [t.key for t in tensors]
            assert hf.model_type == model_type and all(t.sources == (t.key,) for t in tensors)
            assert ("lm_head.weight" in keys) != tied, (model_type, tied)
    qwen_keys = {t.key for t in adapter_for_hf_config(_hf_configs()["qwen2"]).hf_export(_hf_configs()["qwen2"])[1]}
    assert "model.layers.1.self_attn.k_proj.bias" in qwen_keys


def test_gpt_exports_as_gpt2_with_the_same_logits():
    """Our GPT-2-architecture GPT (no biases, untied head: both representable) through its export
    mapping loads into transformers' GPT2LMHeadModel with the same logits."""
    config = GPTConfig(vocab_size=64, block_size=SEQ, n_layer=2, n_head=4, n_embd=32, bias=False, tie_embeddings=False)
    torch.manual_seed(0)
    ours = GPT(config).eval()
    state = ours.state_dict()
    hf_config, tensors = adapter_for(ours).hf_export(asdict(config))  # type: ignore[union-attr]
    hf = transformers.GPT2LMHeadModel(hf_config).eval()
    missing, unexpected = hf.load_state_dict({t.key: t.combine([state[s] for s in t.sources]) for t in tensors}, strict=False)
    assert not missing and not unexpected
    x = torch.randint(0, 64, (2, SEQ))
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=x).logits, ours(x), atol=1e-5, rtol=1e-5)


# -- (c) FLOPs: the planner's count, and what the model really computes ----------------------------------------------
def _planner_shape(name: str, model: nn.Module) -> ModelShape:
    """ModelShape written out from each config, independently of the adapters."""
    if isinstance(model, GPT):
        return ModelShape.from_config(asdict(model.config), SEQ)
    c = model.config
    if name == "gpt2":
        return ModelShape(c.n_layer, c.n_embd, c.n_head, c.n_head, 4 * c.n_embd, c.vocab_size, SEQ, tied_embeddings=c.tie_word_embeddings)
    return ModelShape(
        c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.intermediate_size, c.vocab_size, SEQ,
        gated_mlp=True, tied_embeddings=c.tie_word_embeddings, learned_positions=False, bias=False, rms_norm=True,
    )


def test_flops_per_token_is_the_planners_and_what_runs():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    for name, model in _models().items():
        adapter = adapter_for(model)
        assert adapter is not None
        ours = adapter.flops_per_token(model, SEQ)
        assert ours == pytest.approx(_planner_shape(name, model).step_flops(1) / SEQ, rel=0.01), name
        x = torch.randint(0, 64, (2, SEQ))
        with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):  # (math: attention as matmuls)
            loss = model(x, x) if isinstance(model, GPT) else model(input_ids=x, labels=x).loss
            loss.backward()
        assert counter.get_total_flops() / x.numel() == pytest.approx(ours, rel=0.01), name


# -- (d) Qwen2 at tp2 and pp2 -----------------------------------------------------------------------------------------
class Qwen2LM(L.LightningModule):
    """A tiny Qwen2 (GQA, q/k/v biases, a sliding-window second layer, tied head) trained as HF models
    are; ``padded``: supervised fine-tuning batches (right/left padding, masked prompt)."""

    def __init__(self, padded: bool = False) -> None:
        super().__init__()
        self.padded = padded
        self.model: Optional[nn.Module] = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
                vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, use_sliding_window=True, sliding_window=4,
                max_window_layers=1, tie_word_embeddings=True,
            ))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        input_ids, _ = batch
        if not self.padded:
            return self.model(input_ids=input_ids, labels=input_ids).loss
        b, t = input_ids.shape
        lengths = torch.tensor([t - (3 * i + batch_idx) % (t // 2) for i in range(b)])
        cols = torch.arange(t).unsqueeze(0)
        left = (torch.arange(b) % 2 == 1).unsqueeze(1)
        mask = torch.where(left, cols >= t - lengths.unsqueeze(1), cols < lengths.unsqueeze(1)).long()
        labels = input_ids.masked_fill(mask == 0, -100)
        labels[:, : t // 4] = -100
        position_ids = (mask.cumsum(1) - 1).clamp(min=0)
        return self.model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, labels=labels).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def qwen2_losses(padded: bool = False, **strategy: Any) -> list[float]:
    L.seed_everything(0)
    recorder = LossRecorder()
    trainer = quiet_trainer(max_steps=3, limit_val_batches=0, callbacks=[recorder], strategy=ThreeDParallelStrategy(**strategy))
    trainer.fit(Qwen2LM(padded), tiny_data(global_batch_size=4, block_size=SEQ))
    return recorder.losses


def reference_world() -> dict[str, Any]:
    return run_checks({"plain": qwen2_losses, "padded": lambda: qwen2_losses(padded=True)})


def two_rank_world() -> dict[str, Any]:
    return run_checks({
        "tp2": lambda: qwen2_losses(tensor_parallel=2),
        "pp2": lambda: qwen2_losses(pipeline_parallel=2),
        "pp2_padded": lambda: qwen2_losses(padded=True, pipeline_parallel=2),
    })


@pytest.fixture(scope="module")
def single() -> dict[str, Any]:
    return run_on_ranks(reference_world, 1, timeout=300)[0]


@pytest.fixture(scope="module")
def two() -> list[dict[str, Any]]:
    return run_on_ranks(two_rank_world, 2, timeout=300)


@pytest.mark.parametrize(("name", "reference"), [("tp2", "plain"), ("pp2", "plain"), ("pp2_padded", "padded")])
def test_qwen2_trains_like_one_process(single, two, name, reference):
    expected = result_of(single, reference)
    assert len(expected) == 3 and all(np.isfinite(expected))
    for rank in two:
        np.testing.assert_allclose(result_of(rank, name), expected, rtol=1e-5)


# -- (e) any Hugging Face causal LM from transformers' plans (issue 31) -----------------------------------------------
@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "olmo2", "granite", "gpt_neox", "starcoder2"])
def test_the_pipeline_pieces_run_the_models_own_forward(kind):
    """Embed -> blocks -> head, built from base_model_pp_plan, gives the model's own loss bit for bit, on a
    padded SFT batch (left padding, position ids, masked prompt), also on a stage without the embedding
    (the layers' arguments recorded from its received hidden states)."""
    from tests.hf_families import hf_family_config

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_family_config(kind)).train()
    ids = torch.randint(0, 128, (2, SEQ))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :2] = -100
    kwargs = dict(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0), labels=labels)
    expected = model(**kwargs).loss
    adapter = adapter_for(model)
    assert adapter is not None and adapter.pipeline_refusal(model) is None
    sequence = adapter.layer_sequence(model)
    for own_embedding in (True, False):
        batch = sequence.inputs((), kwargs)
        x = sequence.embed(batch)
        if not own_embedding:
            batch = sequence.inputs((), kwargs)  # a later stage: nothing recorded yet
        for layer in sequence.blocks:
            x = sequence.block(layer, x, batch)
        assert torch.equal(sequence.head(x, batch).loss, expected), (kind, own_embedding)


def test_a_family_without_plans_trains_data_parallel_and_says_how_to_give_a_plan():
    from lightning_3d.models.adapters.hf_plans import PlanRefused
    from tests.hf_families import hf_family_config

    model = transformers.AutoModelForCausalLM.from_config(hf_family_config("opt"))
    adapter = adapter_for(model)
    assert adapter is not None and adapter.name == "hf"
    assert "no base_model_pp_plan" in adapter.pipeline_refusal(model)
    assert len(adapter.layer_sequence(model).blocks) == 4  # recompute still finds the decoder layers
    with pytest.raises(PlanRefused, match=r"base_model_tp_plan = .*tensor_parallel_plan=.*register_adapter.*tensor_parallel=1"):
        adapter.tp_plan(model)


def test_a_users_adapter_wins_over_the_generic_one():
    from lightning_3d.models.adapters import register_adapter, unregister_adapter
    from lightning_3d.models.adapters.hf_generic import GenericHFAdapter

    class Mine(GenericHFAdapter):
        name, fallback = "mine", False

    model = transformers.AutoModelForCausalLM.from_config(_hf_configs()["llama"])
    register_adapter(Mine())
    try:
        assert adapter_for(model).name == "mine"
    finally:
        unregister_adapter("mine")
    assert adapter_for(model).name == "hf"


def test_the_no_plan_hint_lists_the_layers_of_a_model_built_in_init():
    """litgpt-style: the model is built in __init__, no family knows it; the hint names its layers as patterns."""
    from lightning_3d.parallel.parallelize import _plan_hint

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv, self.proj = nn.Linear(8, 24), nn.Linear(8, 8)

    class LitGPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.transformer = nn.ModuleDict({"h": nn.ModuleList([Block(), Block()])})
            self.lm_head = nn.Linear(8, 16)

    hint = _plan_hint(LitGPT())
    assert "'transformer.h.*.qkv': ..., 'transformer.h.*.proj': ..., 'lm_head': ..." in hint and "register_adapter" in hint
    assert "build the model in __init__ or configure_model()" in _plan_hint(nn.Module())


def test_flops_of_a_family_whose_heads_are_not_hidden_over_heads():
    """Gemma 3 with head_dim 16 (4 heads x 16 = 64 for hidden 32): the planner's count follows the
    query width, and equals what torch counts in a real forward and backward."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    config = transformers.Gemma3TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=SEQ, query_pre_attn_scalar=16,
    )
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    adapter = adapter_for(model)
    assert adapter is not None and adapter.model_shape(model, SEQ).q_width == 64
    x = torch.randint(0, 64, (2, SEQ))
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        model(input_ids=x, labels=x).loss.backward()
    assert counter.get_total_flops() / x.numel() == pytest.approx(adapter.flops_per_token(model, SEQ), rel=0.01)
