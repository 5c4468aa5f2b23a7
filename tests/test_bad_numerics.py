"""Bad numbers in, clear errors out (issue 14, items 3 and 4).

3. Token ids at or past the model's vocabulary: refused at set-up (the file's ``vocab_size`` against
   the model's) and per window as it is read, naming both numbers; the vocab-parallel embedding raises
   instead of looking up zeros (padding rows included).
4. Non-finite losses: steps are skipped and counted (``skipped_steps`` on the progress bar and in
   the logger), a warning when the fp16 loss scale reaches its floor, and after
   ``max_consecutive_nonfinite`` such steps in a row every rank raises the same error.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Optional

import lightning as L
import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_3d import ThreeDParallelStrategy
from lightning_3d.data import TextDataModule, TokenWindows, stdlib_bytes, write_token_file
from lightning_3d.models import GPTConfig, GPTModule
from lightning_3d.plugins.precision import DynamicLossScaler, ThreeDPrecision
from lightning_3d.testing.harness import run_on_ranks
from tests.helpers import TINY_GPT, quiet_trainer, result_of, run_checks, tiny_data


# -- item 4: non-finite losses ---------------------------------------------------------------------------
class NanGPT(GPTModule):
    """The tiny GPT whose loss is multiplied by NaN (NaN gradients) on the given global steps and ranks."""

    def __init__(self, nan_steps: Callable[[int], bool], nan_rank: Optional[int] = None) -> None:
        super().__init__(GPTConfig(**TINY_GPT), lr=1e-2, warmup_steps=2)
        self.nan_steps, self.nan_rank = nan_steps, nan_rank

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.nan_steps(self.trainer.global_step) and self.nan_rank in (None, dist.get_rank()):
            loss = loss * float("nan")
        return loss


def _finite(module: nn.Module) -> bool:
    return all(bool(torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all()) for p in module.parameters())


def _fit_until_error(model: GPTModule, precision: ThreeDPrecision, stage: int, steps: int, **trainer_kwargs: Any) -> dict[str, Any]:
    """Fit; report the error (if any), where training stopped, the metrics and warnings."""
    L.seed_everything(0)
    strategy = ThreeDParallelStrategy(zero_stage=stage, bucket_size_mb=0.05, health_check=False)  # (no 13 s peer diagnosis)
    trainer = quiet_trainer(max_steps=steps, limit_val_batches=0, strategy=strategy, plugins=[precision], **trainer_kwargs)
    error = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(model, tiny_data(global_batch_size=8))
        except Exception as e:  # noqa: BLE001 - the test asserts what it was
            error = f"{type(e).__name__}: {e}"
    return {
        "raised": error,
        "global_step": trainer.global_step,
        "skipped": precision.skipped_steps if hasattr(precision, "skipped_steps") else None,
        "callback_metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "progress_bar": {k: float(v) for k, v in trainer.progress_bar_metrics.items()},
        "warnings": [str(w.message) for w in caught],
        "finite": _finite(model),
    }


def fp16_stuck_at_floor() -> dict[str, Any]:
    """NaN on every step under fp16: 4 -> 2 -> 1 (floor), then the default 10 overflows at the floor: stop."""
    precision = ThreeDPrecision("16-mixed", initial_scale=4.0, hysteresis=1)
    return _fit_until_error(NanGPT(lambda step: True), precision, stage=1, steps=40)


def bf16_nan_on_one_rank() -> dict[str, Any]:
    """bf16 with clipping (the norm is reused): only rank 1's loss is NaN, from step 2 on (default limit 10)."""
    precision = ThreeDPrecision("bf16-mixed")
    return _fit_until_error(NanGPT(lambda step: step >= 2, nan_rank=1), precision, stage=0, steps=40, gradient_clip_val=1.0)


def fp32_nan_without_clipping() -> dict[str, Any]:
    """32-true ZeRO-1 without clipping (the gradient slices are checked): NaN from the first step."""
    precision = ThreeDPrecision("32-true", max_consecutive_nonfinite=2)
    return _fit_until_error(NanGPT(lambda step: True), precision, stage=1, steps=40)


def fp32_transient_nan() -> dict[str, Any]:
    """Two NaN steps, then clean ones: skipped and counted, the weights stay finite, training goes on."""
    precision = ThreeDPrecision("32-true")
    result = _fit_until_error(NanGPT(lambda step: step in (2, 3)), precision, stage=0, steps=6)
    return result


class NanGradientGPT(GPTModule):
    """The tiny GPT whose first block's attention weight gets a NaN gradient (the loss stays finite) on
    the given global steps, on rank 1 only: only the gradients can tell."""

    def __init__(self, nan_steps: Callable[[int], bool]) -> None:
        super().__init__(GPTConfig(**TINY_GPT), lr=1e-2, warmup_steps=2)
        self.nan_steps = nan_steps

    def on_fit_start(self) -> None:
        weight = next(p for n, p in self.named_parameters() if p.requires_grad and p.dim() == 2 and ".0." in n)
        weight.register_hook(lambda g: g * float("nan") if self.nan_steps(self.trainer.global_step) and dist.get_rank() == 1 else g)


def offload_nan_gradient(precision_name: str = "32-true", **trainer_kwargs: Any) -> dict[str, Any]:
    """ZeRO-2 CPU offload: rank 1's gradient is NaN on steps 2 and 3. Unless something changed the host
    slices after they left the device (clipping by value, unscaling), the check is the flag the
    optimizer raised on the device as they went -- the precision plugin never looks at the host
    slices (counted) -- and the two steps are skipped on both ranks (under fp16, as overflows)."""
    import lightning_3d.plugins.precision as precision_module

    looked = []
    plain = precision_module.any_nonfinite
    precision_module.any_nonfinite = lambda tensors, device: looked.append(1) or plain(tensors, device)
    try:
        L.seed_everything(0)
        fp16 = {"initial_scale": 4.0, "hysteresis": 1} if precision_name == "16-mixed" else {}
        precision = ThreeDPrecision(precision_name, **fp16)
        strategy = ThreeDParallelStrategy(zero_stage=2, offload_optimizer="cpu", bucket_size_mb=0.05, health_check=False)
        model = NanGradientGPT(lambda step: step in (2, 3))
        trainer = quiet_trainer(max_steps=6, limit_val_batches=0, strategy=strategy, plugins=[precision], **trainer_kwargs)
        trainer.fit(model, tiny_data(global_batch_size=8))
    finally:
        precision_module.any_nonfinite = plain
    return {"skipped": precision.skipped_steps, "global_step": trainer.global_step, "finite": _finite(model), "host_looks": len(looked)}


# -- item 3: token ids outside the vocabulary ------------------------------------------------------------
def _lying_token_file(directory: str) -> str:
    """A token file whose .bin.json says vocab_size=256 but which holds id 300 every 97 tokens."""
    path = Path(directory) / "lying.bin"
    tokens = stdlib_bytes(60_000).astype(np.uint16)
    tokens[::97] = 300
    tokens.tofile(path)
    meta = {"dtype": "uint16", "vocab_size": 256, "num_tokens": int(len(tokens)), "tokenizer": "bytes"}
    path.with_name(path.name + ".json").write_text(json.dumps(meta))
    return str(path)


def _fit_data(source: str, tp: int = 1) -> dict[str, Any]:
    L.seed_everything(0)
    model = GPTModule(GPTConfig(**TINY_GPT), lr=1e-2, warmup_steps=2)
    trainer = quiet_trainer(max_steps=3, limit_val_batches=0, strategy=ThreeDParallelStrategy(tensor_parallel=tp, health_check=False))
    data = TextDataModule(source=source, block_size=TINY_GPT["block_size"], global_batch_size=8 // tp)
    try:
        trainer.fit(model, data)
    except Exception as e:  # noqa: BLE001
        return {"raised": f"{type(e).__name__}: {e}", "global_step": trainer.global_step}
    return {"raised": None, "global_step": trainer.global_step}


def _wide_token_file(directory: str) -> str:
    """A valid token file of a 512-token vocabulary (its ids happen to be bytes)."""
    path = Path(directory) / "wide.bin"
    write_token_file(stdlib_bytes(20_000), path, vocab_size=512, tokenizer="bytes")
    return str(path)


def embedding_backstop() -> dict[str, Any]:
    """tp=2, vocabulary 63 padded to 64 rows: id 63 is a padding row, -1 is nothing; both must raise."""
    from lightning_3d.tensor_parallel.layers import VocabParallelEmbedding

    torch.manual_seed(0)
    layer = VocabParallelEmbedding(63, 8, tp_group=dist.group.WORLD)
    out: dict[str, Any] = {"in_range_ok": tuple(layer(torch.tensor([[0, 31, 32, 62]])).shape) == (1, 4, 8)}
    for name, bad in (("padding_row", 63), ("past_padding", 70), ("negative", -1)):
        try:
            layer(torch.tensor([[1, bad, 2]]))
            out[name] = None
        except Exception as e:  # noqa: BLE001
            out[name] = f"{type(e).__name__}: {e}"
    return out


class EpochEndStepGPT(GPTModule):
    """Manual optimization that accumulates over the epoch and steps in on_train_epoch_end (a hook
    where per-step logging is not allowed)."""

    def __init__(self) -> None:
        super().__init__(GPTConfig(**TINY_GPT), lr=1e-2, warmup_steps=2)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        self.manual_backward(super().training_step(batch, batch_idx))

    def on_train_epoch_end(self) -> None:
        opt = self.optimizers()
        opt.step()
        opt.zero_grad()


class TwoPassSGD(torch.optim.Optimizer):
    """A SAM-like optimizer outside torch.optim that must evaluate its closure itself."""

    def __init__(self, params: Any, lr: float = 1e-2) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        assert closure is not None, "TwoPassSGD needs a closure"
        with torch.enable_grad():
            loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])
        return loss


class ClosureGPT(GPTModule):
    def configure_optimizers(self) -> Any:
        return TwoPassSGD(self.parameters())


class HugeGradientGPT(GPTModule):
    """Finite gradients around 1e20: their sum of squares overflows fp32, the gradients do not."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) * 1e20


def _fit_quietly(model: GPTModule, steps: int, **trainer_kwargs: Any) -> dict[str, Any]:
    return _fit_until_error(model, ThreeDPrecision("32-true"), stage=0, steps=steps, **trainer_kwargs)


def world(directory: str) -> dict[str, Any]:
    box = [_lying_token_file(directory), _wide_token_file(directory)] if dist.get_rank() == 0 else [None, None]
    dist.broadcast_object_list(box, 0)
    lying, wide = box
    return run_checks(
        {
            "fp16_stuck_at_floor": fp16_stuck_at_floor,
            "bf16_nan_on_one_rank": bf16_nan_on_one_rank,
            "fp32_nan_without_clipping": fp32_nan_without_clipping,
            "fp32_transient_nan": fp32_transient_nan,
            "offload_nan_gradient": offload_nan_gradient,
            "offload_nan_gradient_fp16": lambda: offload_nan_gradient("16-mixed"),
            "offload_nan_gradient_clip_value": lambda: offload_nan_gradient(gradient_clip_val=1e-3, gradient_clip_algorithm="value"),
            "file_vocab_larger_than_model": lambda: _fit_data(wide),
            "ids_past_vocab_tp1": lambda: _fit_data(lying),
            "ids_past_vocab_tp2": lambda: _fit_data(lying, tp=2),
            "embedding_backstop": embedding_backstop,
            "epoch_end_step": lambda: _fit_quietly(EpochEndStepGPT(), 1, max_epochs=1, limit_train_batches=2),
            "closure_optimizer": lambda: _fit_quietly(ClosureGPT(GPTConfig(**TINY_GPT)), 2),
            "huge_finite_gradients": lambda: _fit_quietly(HugeGradientGPT(GPTConfig(**TINY_GPT)), 2, gradient_clip_val=1.0),
        }
    )


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict[str, Any]]:
    return run_on_ranks(world, 2, str(tmp_path_factory.mktemp("bad-numerics")), timeout=300)


def _errors(ranks: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [result_of(r, name) for r in ranks]


def test_fp16_overflowing_forever_stops_with_an_error_on_every_rank(ranks):
    results = _errors(ranks, "fp16_stuck_at_floor")
    for rank, r in enumerate(results):
        assert r["raised"] is not None, f"rank {rank} trained {r['global_step']} steps of overflows without an error"
        assert r["raised"].startswith("NonFiniteStepsError")
        assert "10 consecutive optimizer steps overflowed" in r["raised"] and "floor min_scale=1" in r["raised"]
        assert "max_consecutive_nonfinite" in r["raised"]
        # 4 -> 2 -> 1: two steps back the scale off, then ten at the floor (the 12th raises)
        assert r["skipped"] == 12 and r["global_step"] == 11
        assert r["callback_metrics"]["skipped_steps"] == 11.0 and r["progress_bar"]["skipped_steps"] == 11.0
        assert r["callback_metrics"]["loss_scale"] == 1.0
    floor = [w for w in results[0]["warnings"] if "loss scale reached its floor min_scale=1" in w]
    assert len(floor) == 1, results[0]["warnings"]  # once, on rank 0


def test_bf16_nan_on_one_rank_stops_every_rank_at_the_same_step_with_finite_weights(ranks):
    results = _errors(ranks, "bf16_nan_on_one_rank")
    for rank, r in enumerate(results):
        assert r["raised"] is not None, f"rank {rank} finished without an error (weights finite: {r['finite']})"
        assert "10 consecutive optimizer steps had a non-finite loss or gradients" in r["raised"]
        assert "precision='bf16-mixed'" in r["raised"]
        assert r["skipped"] == 10 and r["global_step"] == 11
        assert r["finite"], "skipped steps must leave the weights as they were"
    assert results[0]["global_step"] == results[1]["global_step"]


def test_fp32_zero1_nan_without_clipping_stops(ranks):
    for r in _errors(ranks, "fp32_nan_without_clipping"):
        assert r["raised"] is not None and "2 consecutive optimizer steps had a non-finite loss" in r["raised"]
        assert r["skipped"] == 2 and r["finite"]


def test_transient_nan_steps_are_skipped_counted_and_training_continues(ranks):
    for r in _errors(ranks, "fp32_transient_nan"):
        assert r["raised"] is None and r["global_step"] == 6
        assert r["finite"], "a skipped step must not write NaN into the weights"
        assert r["skipped"] == 2
        assert r["callback_metrics"]["skipped_steps"] == 2.0 and r["progress_bar"]["skipped_steps"] == 2.0
        assert math.isfinite(r["callback_metrics"]["train_loss"])
    # issue 32: with the logger and progress bar off (quiet_trainer) the run still says so, on rank zero
    said = _errors(ranks, "fp32_transient_nan")[0]["warnings"]
    first = [w for w in said if "was skipped: its loss or gradients were not finite" in w]
    summary = [w for w in said if "2 of 6 optimizer steps were skipped" in w]
    assert len(first) == 1 and "global step 2" in first[0] and len(summary) == 1, said


def test_offloaded_nan_gradients_are_caught_on_the_device_and_skipped(ranks):
    for r in _errors(ranks, "offload_nan_gradient") + _errors(ranks, "offload_nan_gradient_fp16"):
        assert r["skipped"] == 2 and r["finite"], r
        assert r["host_looks"] == 0, "the step looked at the host gradient slices instead of the device flag"
    assert all(r["global_step"] == 6 for r in _errors(ranks, "offload_nan_gradient"))
    # clipping by value changed the host slices (a clamped inf would be finite): they are looked at; NaN stays NaN
    for r in _errors(ranks, "offload_nan_gradient_clip_value"):
        assert r["skipped"] == 2 and r["global_step"] == 6 and r["finite"] and r["host_looks"] > 0, r


def test_token_file_with_a_larger_vocabulary_is_refused_at_setup(ranks):
    for r in _errors(ranks, "file_vocab_larger_than_model"):
        assert r["raised"] is not None and r["global_step"] == 0
        assert "wide.bin has vocab_size=512 (from its .bin.json), but the model's vocabulary has 256 entries" in r["raised"]
        assert "GPTModule.config.vocab_size" in r["raised"] and "vocab_size >= 512" in r["raised"]


@pytest.mark.parametrize("tp", [1, 2])
def test_token_ids_past_the_vocabulary_are_refused_per_window(ranks, tp):
    for rank, r in enumerate(_errors(ranks, f"ids_past_vocab_tp{tp}")):
        assert r["raised"] is not None, f"rank {rank} trained {r['global_step']} steps on ids >= the vocabulary"
        assert r["raised"].startswith("ValueError") and r["global_step"] == 0
        assert "token id 300 at position" in r["raised"] and "is outside the model's vocabulary [0, 256)" in r["raised"]


def test_vocab_parallel_embedding_refuses_ids_outside_the_vocabulary(ranks):
    for r in _errors(ranks, "embedding_backstop"):
        assert r["in_range_ok"]
        for name, bad in (("padding_row", 63), ("past_padding", 70), ("negative", -1)):
            assert r[name] is not None, f"id {bad} was looked up silently"
            assert f"token id {bad} is outside the vocabulary [0, 63)" in r[name]
            assert "padded to 64 rows for tensor_parallel=2" in r[name]


# -- in-process pieces -------------------------------------------------------------------------------------
def test_max_consecutive_nonfinite_is_validated():
    for bad in (0, -1, 2.5, True, "10"):
        with pytest.raises(ValueError, match="max_consecutive_nonfinite=.* must be a positive integer"):
            ThreeDPrecision("bf16-mixed", max_consecutive_nonfinite=bad)
    assert ThreeDPrecision("bf16-mixed", max_consecutive_nonfinite=None).max_consecutive_nonfinite is None
    assert ThreeDPrecision("16-mixed").max_consecutive_nonfinite == 10


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_host_gradients_are_checked_for_every_nonfinite_value(dtype):
    """Offloaded (host) gradients take the min/max path: NaN, +inf and -inf anywhere in a tensor --
    the first element, a vector lane in the middle, the scalar tail, a strided view -- are found,
    and huge finite values (whose squares would overflow) are not."""
    from lightning_3d.core.finite import any_nonfinite as _nonfinite

    cpu = torch.device("cpu")
    big = torch.finfo(dtype).max
    finite = [torch.full((1037,), big, dtype=dtype), -torch.full((64, 3), big, dtype=dtype)[:, 1], torch.zeros(0, dtype=dtype)]
    assert _nonfinite(finite, cpu).item() == 0.0
    for bad in (float("nan"), float("inf"), -float("inf")):
        for where in (0, 517, 1036):
            t = torch.randn(1037).to(dtype)
            t[where] = bad
            assert _nonfinite([*finite, t], cpu).item() == 1.0, (bad, where)
        strided = torch.randn(64, 3).to(dtype)
        strided[63, 1] = bad
        assert _nonfinite([strided[:, 1]], cpu).item() == 1.0, bad


def test_loss_scaler_warns_once_when_it_reaches_its_floor():
    scaler = DynamicLossScaler(initial_scale=8.0, hysteresis=1, min_scale=2.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(6):
            scaler.update(True)
    floor = [str(w.message) for w in caught if "floor" in str(w.message)]
    assert scaler.scale == 2.0 and len(floor) == 1
    assert "min_scale=2 after 2 skipped step(s)" in floor[0]


def test_model_vocab_size_is_found_duck_typed():
    from lightning_3d.data.vocab import model_vocab_size

    assert model_vocab_size(GPTModule(GPTConfig(**{**TINY_GPT, "vocab_size": 300}))) == (300, "GPTModule.config.vocab_size")

    class HFLike(nn.Module):  # a Hugging Face model inside a LightningModule: the embedding wins over config
        def __init__(self) -> None:
            super().__init__()
            self.config = SimpleNamespace(vocab_size=1000)
            self.embed = nn.Embedding(1024, 4)

        def get_input_embeddings(self) -> nn.Module:
            return self.embed

    class Wrapper(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = HFLike()

    assert model_vocab_size(Wrapper()) == (1024, "HFLike.get_input_embeddings().num_embeddings")

    class ConfigOnly(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = SimpleNamespace(vocab_size=77)

    assert model_vocab_size(nn.Sequential(ConfigOnly())) == (77, "ConfigOnly.config.vocab_size")

    class Attr(nn.Module):
        vocab_size = 33

    assert model_vocab_size(Attr()) == (33, "Attr.vocab_size")
    assert model_vocab_size(nn.Linear(2, 2)) is None


def test_token_windows_refuse_negative_and_too_large_ids():
    windows = TokenWindows(np.array([1, 2, -1, 3, 4, 5, 6, 7, 8], dtype=np.int32), 4, vocab_size=10)
    with pytest.raises(ValueError, match=r"token id -1 at position 2 of the token stream is outside the model's vocabulary \[0, 10\)"):
        windows[0]
    windows = TokenWindows(np.array([1, 2, 3, 4, 5, 6, 12, 7, 8], dtype=np.uint16), 4, vocab_size=10)
    assert windows[0][0].tolist() == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="token id 12 at position 6"):
        windows[1]


def test_write_token_file_refuses_ids_outside_its_vocab_size(tmp_path):
    with pytest.raises(ValueError, match=r"token ids range over \[0, 300\], outside vocab_size=256"):
        write_token_file(np.array([0, 5, 300]), tmp_path / "t.bin", vocab_size=256, tokenizer="bytes")


def test_byte_corpus_is_checked_exactly_against_the_model_vocabulary():
    """The in-memory byte corpus needs only the bytes it holds (valid UTF-8 never has 0xFF): a
    255-token model is fine, a 100-token one is refused at set-up."""

    def setup_with(vocab_size: int) -> TextDataModule:
        data = TextDataModule(block_size=8, max_bytes=20_000)
        data.trainer = SimpleNamespace(lightning_module=GPTModule(GPTConfig(**{**TINY_GPT, "vocab_size": vocab_size})))
        data.setup("fit")
        return data

    assert setup_with(255)._train.vocab_size == 255  # windows now check against the model's vocabulary
    with pytest.raises(ValueError, match=r"standard-library byte corpus holds bytes up to \d+ \(needs vocab_size >= \d+\), but the model's vocabulary has 100 entries"):
        setup_with(100)


def test_a_manual_step_in_an_epoch_hook_is_not_broken_by_the_step_counters(ranks):
    for result in _errors(ranks, "epoch_end_step"):
        assert result["raised"] is None and result["finite"], result["raised"]


def test_an_optimizer_that_evaluates_its_own_closure_still_gets_it(ranks):
    for result in _errors(ranks, "closure_optimizer"):
        assert result["raised"] is None and result["global_step"] == 2, result["raised"]


def test_finite_gradients_whose_squared_norm_overflows_are_not_skipped(ranks):
    for result in _errors(ranks, "huge_finite_gradients"):
        assert result["raised"] is None and result["skipped"] == 0, result
