"""Tensor parallelism through the Trainer: layout invariance for GPT and HF models, collectives per
layer, randomness, checkpoints across tp degrees, errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import lightning as L
import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_3d import ThreeDParallelStrategy
from lightning_3d.checkpoint.dense_state import full_state_dict
from lightning_3d.models import GPT, GPTConfig
from lightning_3d.models.adapters.gpt import gpt_plan
from lightning_3d.tensor_parallel import PlanContext, RNGStatesTracker, TensorParallelPlan, apply_plan
from lightning_3d.tensor_parallel.random import seed_tracker
from lightning_3d.testing.harness import run_on_ranks
from tests.helpers import STEPS, TINY_GPT, LossRecorder, gpt_losses, quiet_trainer, result_of, run_checks, tiny_data, tiny_gpt
from tests.test_data_parallel import CountingModule

HF_KINDS = ("llama", "gpt2")


class HFCausalLM(L.LightningModule):
    """The plain way to train a Hugging Face model: the step is just ``model(..., labels=...).loss``."""

    def __init__(self, kind: str, layers: int = 2) -> None:
        super().__init__()
        self.kind, self.layers = kind, layers
        self.model: Optional[nn.Module] = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        import transformers

        if self.kind == "llama":
            config = transformers.LlamaConfig(
                vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=self.layers,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
            )
            self.model = transformers.LlamaForCausalLM(config)
        else:
            config = transformers.GPT2Config(
                vocab_size=256, n_embd=32, n_layer=self.layers, n_head=4, n_positions=64,
                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            )
            self.model = transformers.GPT2LMHeadModel(config)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        input_ids, _ = batch
        return self.model(input_ids=input_ids, labels=input_ids).loss

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch[0]).logits.argmax(-1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def hf_losses(kind: str, tp: int) -> list[float]:
    L.seed_everything(0)
    recorder = LossRecorder()
    trainer = quiet_trainer(
        max_steps=STEPS, limit_val_batches=0, callbacks=[recorder], gradient_clip_val=0.5,
        strategy=ThreeDParallelStrategy(tensor_parallel=tp),
    )
    trainer.fit(HFCausalLM(kind), tiny_data(global_batch_size=8))
    return recorder.losses


def gpt_tp_losses(tp: int, sequence_parallel: bool = False) -> dict[str, Any]:
    L.seed_everything(0)
    recorder = LossRecorder()
    trainer = quiet_trainer(
        max_steps=STEPS, limit_val_batches=0, callbacks=[recorder], gradient_clip_val=0.5,
        strategy=ThreeDParallelStrategy(tensor_parallel=tp, sequence_parallel=sequence_parallel),
    )
    model = tiny_gpt()
    trainer.fit(model, tiny_data(global_batch_size=8))
    return {"losses": recorder.losses, "wte_shape": list(model.model.wte.weight.shape)}


def predictions(tp: int) -> list[list[int]]:
    L.seed_everything(0)
    trainer = quiet_trainer(strategy=ThreeDParallelStrategy(tensor_parallel=tp), limit_predict_batches=2)
    out = trainer.predict(tiny_gpt(), tiny_data(global_batch_size=4))
    return [p.flatten().tolist() for p in out]


def _tp_context(sequence_parallel: bool) -> PlanContext:
    tracker = RNGStatesTracker("cpu")
    seed_tracker(tracker, dist.get_rank(), base_seed=0)
    return PlanContext(dist.group.WORLD, sequence_parallel, tracker)


def sharded_init_equals_dense() -> float:
    torch.manual_seed(5)
    dense = GPT(GPTConfig(**TINY_GPT))
    reference = {k: v.clone() for k, v in dense.state_dict().items()}
    apply_plan(dense, gpt_plan(dense), _tp_context(False))
    gathered = full_state_dict(dense)
    assert gathered.keys() == reference.keys()
    return max(float((gathered[k] - reference[k]).abs().max()) for k in reference)


class CollectiveCounter:
    """Counts tp collectives by kind, by patching torch.distributed while active."""

    NAMES = ("all_reduce", "all_gather_into_tensor", "all_gather_single", "reduce_scatter_single", "reduce_scatter_tensor")

    def __init__(self) -> None:
        self.counts = {n: 0 for n in self.NAMES}  # (a name this torch lacks stays 0)
        self._originals = {n: getattr(dist, n) for n in self.NAMES if hasattr(dist, n)}

    def __enter__(self) -> "CollectiveCounter":
        for name, original in self._originals.items():
            def counting(*args: Any, _name: str = name, _orig: Any = original, **kwargs: Any) -> Any:
                self.counts[_name] += 1
                return _orig(*args, **kwargs)
            setattr(dist, name, counting)
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)

    def snapshot(self) -> dict[str, int]:
        out = dict(self.counts)
        out["reduce_scatter"] = out.pop("reduce_scatter_single") + out.pop("reduce_scatter_tensor")
        out["all_gather"] = out.pop("all_gather_into_tensor") + out.pop("all_gather_single")
        return out


def collectives_per_layer(sequence_parallel: bool) -> dict[str, dict[str, int]]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY_GPT))
    apply_plan(model, gpt_plan(model), _tp_context(sequence_parallel))
    block = model.blocks[0]
    t = TINY_GPT["block_size"] // (2 if sequence_parallel else 1)
    x = torch.randn(2, t, TINY_GPT["n_embd"], requires_grad=True)
    with CollectiveCounter() as counter:
        y = block(x)
        forward = counter.snapshot()
        y.sum().backward()
        total = counter.snapshot()
    backward = {k: total[k] - forward[k] for k in total}
    return {"forward": forward, "backward": backward}


def dropout_randomness() -> dict[str, Any]:
    """Dropout in the attention core (tp region) differs per tp rank; in replicated regions it is shared;
    recompute under activation checkpointing replays the same masks."""
    torch.manual_seed(0)
    config = GPTConfig(**{**TINY_GPT, "dropout": 0.5})
    model = GPT(config)
    ctx = _tp_context(False)
    apply_plan(model, gpt_plan(model), ctx)
    model.train()
    core = model.blocks[0].attn.core
    q = torch.randn(1, 1, 8, 8)  # one local head, identical input on both ranks
    core_out = core(q, q, q)
    replicated = model.drop(torch.ones(64))
    gathered_core = [torch.empty_like(core_out) for _ in range(2)]
    dist.all_gather(gathered_core, core_out)
    gathered_rep = [torch.empty_like(replicated) for _ in range(2)]
    dist.all_gather(gathered_rep, replicated)

    block = model.blocks[0]
    x = torch.randn(2, 8, TINY_GPT["n_embd"], requires_grad=True)
    torch.manual_seed(1)
    state = ctx.tracker.get_states()
    block(x).sum().backward()
    plain = x.grad.clone()
    x.grad = None
    torch.manual_seed(1)
    ctx.tracker.set_states(state)
    ctx.tracker.checkpoint(block, x).sum().backward()
    return {
        "core_differs": not torch.equal(gathered_core[0], gathered_core[1]),
        "replicated_same": torch.equal(gathered_rep[0], gathered_rep[1]),
        "recompute_error": float((x.grad - plain).abs().max()),
    }


def tp_checkpoint(tmp: str) -> dict[str, Any]:
    """8 uninterrupted steps (checkpoint after 4) vs. resuming from that checkpoint."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    kwargs: dict[str, Any] = dict(max_steps=8, limit_val_batches=0, enable_checkpointing=True)
    L.seed_everything(0)
    full = LossRecorder()
    checkpoint = ModelCheckpoint(dirpath=tmp, every_n_train_steps=4, save_top_k=-1, filename="tp2-{step}")
    trainer = quiet_trainer(callbacks=[full, checkpoint], strategy=ThreeDParallelStrategy(tensor_parallel=2), **kwargs)
    trainer.fit(tiny_gpt(), tiny_data())
    path = str(Path(tmp) / "tp2-step=4.ckpt")
    L.seed_everything(0)
    resumed = LossRecorder()
    trainer = quiet_trainer(callbacks=[resumed], strategy=ThreeDParallelStrategy(tensor_parallel=2), **kwargs)
    trainer.fit(tiny_gpt(), tiny_data(), ckpt_path=path)
    return {"full": full.losses, "resumed": resumed.losses, "path": path}


def load_tp2_checkpoint_in_one_process(path: str) -> dict[str, Any]:
    """A tp=2 checkpoint, consolidated, loads into a plain module with no strategy; optimizer state too."""
    from lightning_3d.checkpoint.consolidate import consolidate
    from lightning_3d.models import GPTModule

    path = consolidate(path, path + ".consolidated.ckpt")["out"]
    module = GPTModule.load_from_checkpoint(path, weights_only=True)
    checkpoint = torch.load(path, weights_only=True)
    exp_avg_shapes = sorted(tuple(s["exp_avg"].shape) for s in checkpoint["optimizer_states"][0]["state"].values())
    dense = sorted(tuple(p.shape) for p in {id(p): p for p in module.parameters()}.values())
    return {"wte": list(module.model.wte.weight.shape), "exp_avg_shapes_match": exp_avg_shapes == dense}


def metrics_count_once() -> dict[str, float]:
    L.seed_everything(0)
    trainer = quiet_trainer(strategy=ThreeDParallelStrategy(tensor_parallel=2, tensor_parallel_plan={"layer": "column"}))
    return {k: float(v) for k, v in trainer.validate(CountingModule(), verbose=False)[0].items()}


def gpt_padded_vocab(tp: int) -> list[float]:
    """vocab 255 (valid UTF-8 never contains byte 0xFF) is padded to 256 at tp=2."""
    L.seed_everything(0)
    recorder = LossRecorder()
    trainer = quiet_trainer(max_steps=6, limit_val_batches=0, callbacks=[recorder], strategy=ThreeDParallelStrategy(tensor_parallel=tp))
    trainer.fit(tiny_gpt(vocab_size=255), tiny_data(global_batch_size=8))
    return recorder.losses


def bf16_mixed(tp: int) -> list[float]:
    L.seed_everything(0)
    recorder = LossRecorder()
    trainer = quiet_trainer(
        max_steps=STEPS, limit_val_batches=0, callbacks=[recorder], precision="bf16-mixed",
        strategy=ThreeDParallelStrategy(tensor_parallel=tp),
    )
    trainer.fit(tiny_gpt(), tiny_data(global_batch_size=8))
    return recorder.losses


def _error_of(fn: Any) -> str:
    try:
        fn()
    except (ValueError, NotImplementedError) as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def bad_inputs() -> dict[str, str]:
    from lightning_3d.models.adapters import adapter_for

    def plan_on(model: nn.Module, sequence_parallel: bool = False) -> None:
        adapter = adapter_for(model)
        assert adapter is not None
        apply_plan(model, adapter.tp_plan(model), _tp_context(sequence_parallel))

    def llama(**overrides: Any) -> nn.Module:
        import transformers

        kw = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**kw, **overrides}))

    def gpt2() -> nn.Module:  # its family plan has no sequence-parallel wiring (transformers' plans have)
        import transformers

        return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=256, n_embd=32, n_layer=1, n_head=4))

    return {
        "heads": _error_of(lambda: plan_on(GPT(GPTConfig(**{**TINY_GPT, "n_head": 1})))),
        "ffn": _error_of(lambda: plan_on(GPT(GPTConfig(**{**TINY_GPT, "ffn_hidden": 33})))),
        "kv_heads": _error_of(lambda: plan_on(llama(num_key_value_heads=1))),
        "intermediate": _error_of(lambda: plan_on(llama(intermediate_size=63))),
        "hf_sequence_parallel": _error_of(lambda: plan_on(gpt2(), sequence_parallel=True)),
        "unknown_style": _error_of(lambda: apply_plan(nn.Sequential(nn.Linear(4, 4)), TensorParallelPlan({"0": "diagonal"}), _tp_context(False))),
        "unmatched": _error_of(lambda: apply_plan(nn.Sequential(nn.Linear(4, 4)), TensorParallelPlan({"1": "column"}), _tp_context(False))),
        "no_plan": _error_of(lambda: quiet_trainer(strategy=ThreeDParallelStrategy(tensor_parallel=2), max_steps=1).fit(CountingModule())),
    }


def tp2_world(tmp: str) -> dict[str, Any]:
    checks = {
        "gpt": lambda: gpt_tp_losses(2),
        "gpt_sp": lambda: gpt_tp_losses(2, sequence_parallel=True),
        "init": sharded_init_equals_dense,
        "collectives": lambda: collectives_per_layer(False),
        "collectives_sp": lambda: collectives_per_layer(True),
        "dropout": dropout_randomness,
        "predict": lambda: predictions(2),
        "checkpoint": lambda: tp_checkpoint(tmp),
        "padded_vocab": lambda: gpt_padded_vocab(2),
        "bf16": lambda: bf16_mixed(2),
        "errors": bad_inputs,
    }
    checks.update({f"hf_{kind}": (lambda kind=kind: hf_losses(kind, 2)) for kind in HF_KINDS})
    return run_checks(checks)


def dp2_tp2_world() -> dict[str, Any]:
    return run_checks({"gpt": lambda: gpt_tp_losses(2), "metrics": metrics_count_once, "hf_llama": lambda: hf_losses("llama", 2)})


def tp4_world() -> dict[str, Any]:
    return run_checks({"gpt": lambda: gpt_tp_losses(4, sequence_parallel=True)})


def reference_world() -> dict[str, Any]:
    checks = {
        "gpt": gpt_losses,
        "gpt_clip": lambda: gpt_tp_losses(1),
        "predict": lambda: predictions(1),
        "padded_vocab": lambda: gpt_padded_vocab(1),
        "bf16": lambda: bf16_mixed(1),
    }
    checks.update({f"hf_{kind}": (lambda kind=kind: hf_losses(kind, 1)) for kind in HF_KINDS})
    return run_checks(checks)


@pytest.fixture(scope="module")
def tp2(tmp_path_factory) -> list[dict[str, Any]]:
    return run_on_ranks(tp2_world, 2, str(tmp_path_factory.mktemp("tp2")), timeout=600)


@pytest.fixture(scope="module")
def dp2tp2() -> list[dict[str, Any]]:
    return run_on_ranks(dp2_tp2_world, 4, timeout=600)


@pytest.fixture(scope="module")
def tp4() -> list[dict[str, Any]]:
    return run_on_ranks(tp4_world, 4, timeout=600)


@pytest.fixture(scope="module")
def single() -> dict[str, Any]:
    return run_on_ranks(reference_world, 1, timeout=600)[0]


def _close(ours: Any, reference: Any) -> None:
    assert len(ours) == len(reference) == STEPS
    np.testing.assert_allclose(ours, reference, rtol=1e-5)


@pytest.mark.parametrize("name", ["gpt", "gpt_sp"])
def test_gpt_tp2_matches_one_process(tp2, single, name):
    reference = result_of(single, "gpt_clip")["losses"]
    for r in tp2:  # tp peers compute the same (global) loss
        _close(result_of(r, name)["losses"], reference)
        assert result_of(r, name)["wte_shape"] == [128, 32]  # each rank holds half the vocabulary


def test_gpt_dp2_tp2_matches_one_process(dp2tp2, single):
    per_rank = [result_of(r, "gpt")["losses"] for r in dp2tp2]
    # ranks (0,1) form dp replica 0 and (2,3) replica 1; each replica's loss is half the global batch
    _close(np.mean([per_rank[0], per_rank[2]], axis=0), result_of(single, "gpt_clip")["losses"])
    assert per_rank[0] == per_rank[1] and per_rank[2] == per_rank[3]


def test_gpt_tp4_with_sequence_parallel_matches_one_process(tp4, single):
    for r in tp4:
        _close(result_of(r, "gpt")["losses"], result_of(single, "gpt_clip")["losses"])


@pytest.mark.parametrize("kind", HF_KINDS)
def test_hf_models_tp2_match_one_process(tp2, single, kind):
    for r in tp2:
        _close(result_of(r, f"hf_{kind}"), result_of(single, f"hf_{kind}"))


def test_hf_llama_dp2_tp2_matches_one_process(dp2tp2, single):
    per_rank = [result_of(r, "hf_llama") for r in dp2tp2]
    _close(np.mean([per_rank[0], per_rank[2]], axis=0), result_of(single, "hf_llama"))


def test_sharded_initialization_equals_the_dense_model(tp2):
    for r in tp2:
        assert result_of(r, "init") == 0.0


@pytest.mark.parametrize("name", ["collectives", "collectives_sp"])
def test_collectives_per_transformer_layer(tp2, name):
    counts = result_of(tp2[0], name)
    if name == "collectives":
        assert counts["forward"] == {"all_reduce": 2, "all_gather": 0, "reduce_scatter": 0}
        assert counts["backward"] == {"all_reduce": 2, "all_gather": 0, "reduce_scatter": 0}
    else:  # layer norms' partial gradients are summed too: 4 small all-reduces in backward (2 norms x w, b)
        assert counts["forward"] == {"all_reduce": 0, "all_gather": 2, "reduce_scatter": 2}
        # 2 all-gathers adjoint to the forward reduce-scatters, and 2 re-gathers of the sequence shards the
        # attention and MLP column layers keep for their weight gradients (instead of the gathered inputs)
        assert counts["backward"]["all_gather"] == 4 and counts["backward"]["reduce_scatter"] == 2
        assert counts["backward"]["all_reduce"] == 6  # ln_1, ln_2 (weight, bias) + 2 row biases


def test_dropout_randomness_per_region(tp2):
    for r in tp2:
        d = result_of(r, "dropout")
        assert d["core_differs"] and d["replicated_same"]
        assert d["recompute_error"] == 0.0


def test_predictions_gather_the_full_vocabulary(tp2, single):
    assert result_of(tp2[0], "predict") == result_of(single, "predict")


def test_tp2_checkpoint_resumes_and_loads_without_the_strategy(tp2):
    run = result_of(tp2[0], "checkpoint")
    assert len(run["full"]) == 8
    np.testing.assert_allclose(run["resumed"], run["full"][4:], rtol=1e-6)
    plain = run_on_ranks(load_tp2_checkpoint_in_one_process, 1, run["path"], timeout=120)[0]
    assert plain["wte"] == [256, 32] and plain["exp_avg_shapes_match"]


def test_torchmetrics_and_sync_dist_count_each_sample_once_with_tp(dp2tp2):
    for r in dp2tp2:
        logged = result_of(r, "metrics")
        assert logged["logged_count"] == 24 and logged["metric_count"] == 24


def test_padded_vocabulary_never_affects_the_loss(tp2, single):
    reference = result_of(single, "padded_vocab")
    for r in tp2:
        np.testing.assert_allclose(result_of(r, "padded_vocab"), reference, rtol=1e-5)


def test_bf16_mixed_tracks_fp32_within_bf16_tolerance(tp2, single):
    ours, reference = np.array(result_of(tp2[0], "bf16")), np.array(result_of(single, "bf16"))
    np.testing.assert_allclose(ours, reference, rtol=2e-2)
    np.testing.assert_allclose(ours, result_of(single, "gpt_clip")["losses"], rtol=5e-2)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("heads", "GPTConfig.n_head=1 is not divisible by tensor_parallel=2"),
        ("ffn", "GPTConfig.ffn_dim=33 is not divisible by tensor_parallel=2"),
        ("kv_heads", "num_key_value_heads=1 is not divisible by tensor_parallel=2"),
        ("intermediate", "intermediate_size=63 is not divisible by tensor_parallel=2"),
        ("hf_sequence_parallel", "NotImplementedError: the GPT2LMHeadModel plan does not support sequence_parallel=True"),
        ("unknown_style", "unknown tensor-parallel style 'diagonal'"),
        ("unmatched", "patterns ['1'] matched no module"),
        ("no_plan", "CountingModule contains no model with a built-in plan"),
    ],
)
def test_bad_input_is_refused_clearly(tp2, case, message):
    assert message in result_of(tp2[0], "errors")[case]
