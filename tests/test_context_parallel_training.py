"""Context parallelism in training: every layout gives one process's losses.

Two model shapes (Llama-style: GQA + RoPE + SwiGLU + RMSNorm; GPT-2-style: learned positions),
both attention modes, and cp composed with tensor + sequence parallel, the pipeline and ZeRO 1/3,
10 steps in fp32 against one process within 1e-5 relative, with masked targets (counts differ
between the cp ranks' chunks, so the loss normalization over dp x cp is exercised). Also: the
validation loss and the logits (gathered back to the full sequence) equal one process's; saved
activations per rank at cp=4 are a quarter of one process's; and what context parallelism cannot
run is refused before step 1, naming the fix.
"""

from __future__ import annotations

import os
import re
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch

from lightning_3d import ThreeDParallelStrategy
from lightning_3d.models import GPTConfig, GPTModule
from lightning_3d.models.gpt import IGNORE_INDEX
from lightning_3d.monitoring.callbacks import MemoryProbe
from lightning_3d.testing.harness import run_on_ranks
from tests.helpers import STEPS, LossRecorder, quiet_trainer, refusal_message, result_of, run_checks, tiny_data

GPT2 = dict(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=32)
LLAMA = dict(GPT2, n_kv_head=2, ffn_hidden=64, mlp="swiglu", norm="rmsnorm", position="rope", bias=False, tie_embeddings=False)
MODELS = {"llama": LLAMA, "gpt2": GPT2}
PROBE = torch.arange(64).view(2, 32) * 7 % 256
RTOL = 1e-5

LAYOUTS: dict[str, dict[str, Any]] = {
    "cp2": dict(context_parallel=2),
    "cp4": dict(context_parallel=4),
    "cp2-tp2-sp": dict(context_parallel=2, tensor_parallel=2, sequence_parallel=True),
    "cp2-pp2": dict(context_parallel=2, pipeline_parallel=2, micro_batches=4),
    "dp2-cp2-zero1": dict(data_parallel=2, context_parallel=2, zero_stage=1),
    "dp2-cp2-zero3": dict(data_parallel=2, context_parallel=2, zero_stage=3),
}
FOUR = [k for k in LAYOUTS if k != "cp2"]
MODES = ("ring", "all_to_all")
# make test (its 15-minute budget): every layout in at least one mode, cp4 (the memory check) in both,
# all-to-all at cp2 in the matrix (dp2-cp2, cp2-pp2),
# the GPT-2-style model on cp4 and dp2 x cp2 ZeRO-3 (it runs cp2 / dp2-cp2 / cp2-tp2 / cp2-pp2 in the
# composition matrix, with masked targets, recompute, precisions, resume ...). `make test-slow` runs
# the rest of the cross.
EVERY = [(model, layout, mode) for model in MODELS for layout in LAYOUTS for mode in MODES]
CASES = [
    ("llama", "cp2", "ring"),
    ("llama", "cp4", "ring"), ("llama", "cp4", "all_to_all"),
    ("llama", "cp2-tp2-sp", "all_to_all"), ("llama", "cp2-pp2", "ring"),
    ("llama", "dp2-cp2-zero1", "all_to_all"), ("llama", "dp2-cp2-zero3", "ring"),
    ("gpt2", "cp4", "ring"), ("gpt2", "dp2-cp2-zero3", "all_to_all"),
]
SLOW = [c for c in EVERY if c not in CASES]


class MaskedGPT(GPTModule):
    """Targets whose input token is a multiple of 5 are masked, in training and validation."""

    def _masked(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        input_ids, targets = batch
        return input_ids, targets.masked_fill(input_ids % 5 == 0, IGNORE_INDEX)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(self._masked(batch), batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().validation_step(self._masked(batch), batch_idx)

    def configure_callbacks(self) -> list:
        return []


def train(model_name: str, probe_memory: bool = False, validate_first: bool = False, **strategy: Any) -> dict[str, Any]:
    """10 masked-target steps at a global batch of 8, then the validation loss and the logits of PROBE.
    ``validate_first``: a ``trainer.validate`` before ``fit`` (set-up runs twice on the same model)."""
    L.seed_everything(0)
    recorder, probe = LossRecorder(), MemoryProbe(step=1)
    model = MaskedGPT(GPTConfig(**MODELS[model_name]), lr=1e-2, warmup_steps=2)
    trainer = quiet_trainer(
        max_steps=STEPS, limit_val_batches=2, val_check_interval=STEPS, gradient_clip_val=0.5,
        callbacks=[recorder] + ([probe] if probe_memory else []), strategy=ThreeDParallelStrategy(timeout=120, **strategy),
    )
    data = tiny_data(global_batch_size=8)
    if validate_first:
        trainer.validate(model, data, verbose=False)
        L.seed_everything(0)
    trainer.fit(model, data)
    model.eval()
    with torch.no_grad():
        logits = model(PROBE)
    out = {"losses": recorder.losses, "val_loss": float(trainer.callback_metrics["val_loss"]), "logits": logits.tolist()}
    if probe_memory:
        out["activations"] = probe.measured["activations"]
    return out


def case_id(model_name: str, layout: str, mode: str) -> str:
    return f"{model_name}|{layout}|{mode}"


VALIDATE_FIRST = ("llama", "cp2", "ring")  # this case also runs trainer.validate before fit (set-up twice)


def run_cases(cases: list[tuple[str, str, str]]) -> dict[str, Any]:
    checks = {
        case_id(*c): (
            lambda c=c: train(
                c[0], probe_memory=c[1] == "cp4", validate_first=c == VALIDATE_FIRST, context_parallel_mode=c[2], **LAYOUTS[c[1]]
            )
        )
        for c in cases
    }
    return run_checks(checks)


class HFLlama(L.LightningModule):
    """A Hugging Face Llama with attention dropout, which context-parallel attention has not."""

    def configure_model(self) -> None:
        import transformers

        config = transformers.LlamaConfig(
            vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, attention_dropout=0.1,
        )
        self.model = transformers.LlamaForCausalLM(config)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def refusals() -> dict[str, Any]:
    """What a 2-rank cp world refuses, each before the first step."""

    def fit(model: L.LightningModule, block_size: int = 32, **strategy: Any) -> None:
        trainer = quiet_trainer(max_steps=1, limit_val_batches=0, strategy=ThreeDParallelStrategy(**strategy))
        trainer.fit(model, tiny_data(global_batch_size=8, block_size=block_size))

    return {
        "dropout": refusal_message(lambda: fit(MaskedGPT(GPTConfig(**GPT2, dropout=0.1)), context_parallel=2)),
        "length": refusal_message(lambda: fit(MaskedGPT(GPTConfig(**GPT2)), block_size=30, context_parallel=2)),
        "heads": refusal_message(lambda: fit(MaskedGPT(GPTConfig(**dict(GPT2, n_head=1, n_embd=32))), context_parallel=2, context_parallel_mode="all_to_all")),
        "hf": refusal_message(lambda: fit(HFLlama(), context_parallel=2)),
    }


class SeededPerRank(L.Callback):
    """Records the default generator's state at the first step, and what the strategy's reductions give."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.state = torch.get_rng_state().tolist()
        strategy = trainer.strategy
        self.summed = float(strategy.reduce(torch.tensor(1.0), reduce_op="sum"))  # one replica's samples: 1
        self.mean = float(strategy.reduce(torch.tensor(float(trainer.global_rank)), reduce_op="mean"))
        self.gathered = strategy.all_gather(torch.tensor([7.0])).shape[0]


def groups_and_random_state() -> dict[str, Any]:
    """cp peers agree on the default generator (they must load the same samples) even when seeded
    apart; per-sample sums and gathers count a sample once, means span dp x cp."""
    os.environ.pop("PL_GLOBAL_SEED", None)  # else the strategy's set-up re-seeds every rank alike (seed_everything)
    torch.manual_seed(100 + torch.distributed.get_rank())  # seeded apart, before the strategy's set-up
    seeded = SeededPerRank()
    trainer = quiet_trainer(max_steps=1, limit_val_batches=0, callbacks=[seeded], strategy=ThreeDParallelStrategy(context_parallel=2))
    trainer.fit(MaskedGPT(GPTConfig(**GPT2)), tiny_data(global_batch_size=8))
    return {"state": seeded.state, "summed": seeded.summed, "mean": seeded.mean, "gathered": seeded.gathered}


def two_rank_world() -> dict[str, Any]:
    return {
        **run_cases([c for c in CASES if c[1] == "cp2"]),
        "refusals": run_checks({"refusals": refusals})["refusals"],
        "groups": run_checks({"groups": groups_and_random_state})["groups"],
    }


def references() -> dict[str, Any]:
    return run_checks({name: (lambda name=name: train(name, probe_memory=True)) for name in MODELS})


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    return run_on_ranks(references, 1, timeout=300)[0]


@pytest.fixture(scope="module")
def four() -> list[dict[str, Any]]:
    return run_on_ranks(run_cases, 4, [c for c in CASES if c[1] != "cp2"], timeout=900)


@pytest.fixture(scope="module")
def two() -> list[dict[str, Any]]:
    return run_on_ranks(two_rank_world, 2, timeout=300)


def _outcomes(per_rank: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    return [result_of(r, key) for r in per_rank]


def check_case(case: tuple[str, str, str], per_rank: list[dict[str, Any]], reference: dict[str, Any]) -> None:
    model_name, layout, _ = case
    ref = result_of(reference, model_name)
    outcomes = _outcomes(per_rank, case_id(*case))
    # each rank's loss is its tokens' share; their mean is the batch's target mean (as for dp replicas)
    ours = np.mean(np.array([o["losses"] for o in outcomes]), axis=0)
    assert len(ours) == STEPS
    np.testing.assert_allclose(ours, ref["losses"], rtol=RTOL, err_msg=case_id(*case))
    for o in outcomes:  # logits gathered to the full sequence, in natural order, on every rank
        np.testing.assert_allclose(np.array(o["logits"]), np.array(ref["logits"]), rtol=1e-4, atol=1e-5)
    if "dp2" not in layout:  # (data-parallel replicas keep per-replica validation means, as documented)
        for o in outcomes:
            np.testing.assert_allclose(o["val_loss"], ref["val_loss"], rtol=RTOL)


@pytest.mark.parametrize("case", [c for c in CASES if c[1] != "cp2"], ids=lambda c: case_id(*c))
def test_four_rank_layouts_match_one_process(case, four, reference):
    check_case(case, four, reference)


@pytest.mark.parametrize("case", [c for c in CASES if c[1] == "cp2"], ids=lambda c: case_id(*c))
def test_cp2_matches_one_process(case, two, reference):
    check_case(case, two, reference)


def test_validate_before_fit_trains_like_one_process(two, reference):
    """A second set-up rebuilds the wrappers in order (the loss normalization inside the input split)."""
    assert VALIDATE_FIRST in CASES
    check_case(VALIDATE_FIRST, two, reference)


def test_cp_peers_share_the_random_state_and_count_each_sample_once(two):
    outcomes = [result_of(r, "groups") for r in two]
    assert outcomes[0]["state"] == outcomes[1]["state"]
    for o in outcomes:
        assert o["summed"] == 1.0 and o["gathered"] == 1  # dp=1: one copy of each sample
        assert o["mean"] == 0.5  # ranks 0 and 1: the mean spans dp x cp


@pytest.mark.slow
def test_every_model_mode_and_layout_matches_one_process(reference):
    """The rest of the cross (models x modes x layouts), under make test-slow."""
    by_world = {2: [c for c in SLOW if c[1] == "cp2"], 4: [c for c in SLOW if c[1] != "cp2"]}
    for world, cases in by_world.items():
        per_rank = run_on_ranks(run_cases, world, cases, timeout=900)
        for case in cases:
            check_case(case, per_rank, reference)


@pytest.mark.parametrize("mode", MODES)
def test_saved_activations_per_rank_at_cp4_are_a_quarter(mode, four, reference):
    one = result_of(reference, "llama")["activations"]
    per_rank = [o["activations"] for o in _outcomes(four, case_id("llama", "cp4", mode))]
    for measured in per_rank:
        assert abs(measured / one - 0.25) <= 0.025, (mode, measured, one, measured / one)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("dropout", r"GPTConfig.dropout=0.1 applies dropout to attention.*set dropout=0.0"),
        ("length", r"sequence length 30 is not divisible by 2 \* cp = 4"),
        ("heads", r"context_parallel_mode='all_to_all' shards attention heads over context_parallel=2.*'ring'"),
        ("hf", r"context_parallel=2 cannot run LlamaForCausalLM: its attention_dropout=0.1 applies dropout to attention probabilities.*context_parallel=1"),
    ],
)
def test_what_context_parallel_cannot_run_is_refused(name, message, two):
    for r in two:
        assert re.search(message, result_of(r, "refusals")[name]), result_of(r, "refusals")[name]
