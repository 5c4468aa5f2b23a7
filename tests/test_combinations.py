"""Silent errors found where features meet (issue 13), each pinned by a test that failed before its fix.

1. resume with optimizer offload in 32-true / bf16-true kept the stale offloaded master;
2. ZeRO-3 x tensor parallel x meta device left the parallel layers uninitialized;
3. pipelined GPT weighted micro-batches by ``targets.numel()``, not by unmasked targets;
4. clipping by value did nothing where ``p.grad`` is ``None`` (ZeRO 1/2, mixed precision);
5. interleaved 1F1B raised on a ragged last batch;
6. ZeRO 1/2 stepped parameters that had no gradient (weight decay, momentum, step count);
7. non-element-wise optimizers ran on pieces of parameters;
8. two pipelined forwards in one step shared one gradient stash;
9. replicated parameters were synchronized over dp only (not tp, not the tied pipeline embedding);
10. dropout was correlated across pipeline stages and across tp ranks inside HF GPT-2 attention;
11. partial optimizer state dropped a whole bucket's state and shared one ``step``;
12. ``ZeroOptimizer.state_dict()`` was a collective (a rank-0-only caller hung).

Found while building the matrix: fp16 with manual optimization clipped still-scaled gradients;
ZeRO-3 checkpoints saved after ``fit`` lost the tensor-parallel shard metadata; a fully masked
micro-batch or replica turned the loss into NaN; meta-device init gave tp peers the same values.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Optional

import lightning as L
import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_3d import ThreeDParallelStrategy
from lightning_3d.models import GPT, GPTConfig, GPTModule
from lightning_3d.plugins.precision import ThreeDPrecision
from lightning_3d.testing.harness import run_on_ranks
from lightning_3d.zero.sharded_optimizer import ZeroOptimizer
from tests.helpers import TINY_GPT, LossRecorder, host_reads_logged, quiet_trainer, result_of, run_checks, tiny_data, tiny_gpt
from tests.matrix import Cell, MatrixGPT, check_cell, reference_of, run_cell, run_references
from tests.test_zero import MetaGPT

# -- 1. resume with offloaded masters -----------------------------------------------------------------
def offload_resume(tmp: str, stage: int, offload: str, precision: str) -> dict[str, Any]:
    ckpt_dir = Path(tmp) / f"offload-{stage}-{offload}-{precision}"
    nvme = Path(tmp) / "nvme"
    nvme.mkdir(exist_ok=True)

    def strategy() -> ThreeDParallelStrategy:
        return ThreeDParallelStrategy(zero_stage=stage, offload_optimizer=offload, nvme_path=str(nvme), bucket_size_mb=0.05)

    kwargs: dict[str, Any] = dict(max_steps=8, limit_val_batches=0, enable_checkpointing=True, precision=precision)
    L.seed_everything(0)
    full = LossRecorder()
    checkpoint = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=4, save_top_k=-1, filename="{step}")
    quiet_trainer(callbacks=[full, checkpoint], strategy=strategy(), **kwargs).fit(tiny_gpt(), tiny_data())
    L.seed_everything(0)
    resumed = LossRecorder()
    quiet_trainer(callbacks=[resumed], strategy=strategy(), **kwargs).fit(tiny_gpt(), tiny_data(), ckpt_path=str(ckpt_dir / "step=4.ckpt"))
    return {"full": full.losses, "resumed": resumed.losses}


# -- 2. meta device x ZeRO-3 x tensor parallel ----------------------------------------------------------
def meta_zero3_tp() -> dict[str, Any]:
    L.seed_everything(0)
    recorder = LossRecorder()
    model = MetaGPT(GPTConfig(**TINY_GPT), lr=3e-3)
    strategy = ThreeDParallelStrategy(zero_stage=3, tensor_parallel=2)
    quiet_trainer(max_steps=6, limit_val_batches=0, callbacks=[recorder], strategy=strategy).fit(model, tiny_data())
    q = model.model.blocks[0].attn.q_proj.weight.to_local()
    finite = all(bool(torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all()) for p in model.parameters())
    rows = [torch.empty_like(q[0]) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, q[0].contiguous())  # the tp ranks' slices must not repeat each other
    return {"losses": recorder.losses, "std": float(q.std()), "finite": finite, "tp_slices_differ": not torch.equal(rows[0], rows[1])}


def refit_zero3_tp() -> dict[str, Any]:
    """fit, validate, fit again under ZeRO-3 x tp=2: every set-up moves the module (FSDP2 re-creates its
    parameters); the tp slices must stay distinct, not be broadcast as if replicated."""
    L.seed_everything(0)
    trainer = quiet_trainer(max_steps=2, limit_val_batches=2, strategy=ThreeDParallelStrategy(zero_stage=3, tensor_parallel=2))
    model, data = tiny_gpt(), tiny_data()
    trainer.fit(model, data)
    validated = float(trainer.validate(model, data, verbose=False)[0]["val_loss"])
    trainer.fit_loop.epoch_loop.max_steps = 4
    trainer.fit(model, data)
    q = model.model.blocks[0].attn.q_proj.weight.to_local()[0].contiguous()
    rows = [torch.empty_like(q) for _ in range(2)]
    dist.all_gather(rows, q)
    return {"val_loss": validated, "steps": trainer.global_step, "tp_slices_differ": not torch.equal(rows[0], rows[1])}


class Uncovered(nn.Module):
    """A parameter no reset_parameters() writes: materializing it must be refused, naming it."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.empty(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class MetaWithUncovered(MetaGPT):
    def configure_model(self) -> None:
        if self.model is None:
            super().configure_model()
            with torch.device("meta"):
                self.extra = Uncovered()


def meta_uncovered() -> str:
    L.seed_everything(0)
    try:
        quiet_trainer(max_steps=1, strategy=ThreeDParallelStrategy(zero_stage=3, tensor_parallel=2)).fit(
            MetaWithUncovered(GPTConfig(**TINY_GPT)), tiny_data()
        )
    except ValueError as err:
        return str(err)
    return "no error"


# -- 4. clipping by value on ZeRO slices -----------------------------------------------------------------
def clip_value_on_slices(stage: int, precision: str) -> dict[str, float]:
    """Gradients live in the ZeRO optimizer's reduced slices (p.grad is None): clip there."""
    torch.manual_seed(0)
    plugin = ThreeDPrecision(precision)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4)).to(plugin.compute_dtype)
    opt = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), dist.group.WORLD, stage, plugin.compute_dtype, plugin.master_dtype)
    model(torch.randn(8, 16, dtype=plugin.compute_dtype) * 10).pow(2).sum().backward()
    opt.grads.after_backward()
    before = max(float(g.abs().max()) for _, g in opt._grad_slices())
    plugin.clip_gradients(opt, 1e-3, "value")
    after = max(float(g.abs().max()) for _, g in opt._grad_slices())
    none_grads = all(p.grad is None for p in model.parameters())
    opt.remove()
    return {"before": before, "after": after, "none_grads": float(none_grads)}


# -- 7. optimizers that need whole parameters ------------------------------------------------------------
class WithOptimizer(GPTModule):
    def __init__(self, name: str) -> None:
        super().__init__(GPTConfig(**TINY_GPT))
        self.name = name

    def configure_optimizers(self) -> Any:
        matrices = [p for p in self.parameters() if p.dim() == 2]
        if self.name == "muon":
            return torch.optim.Muon(matrices, lr=0.01)
        return torch.optim.Adafactor(self.parameters(), lr=0.01)


def refused_optimizer(name: str, precision: str = "32-true", **strategy: Any) -> str:
    L.seed_everything(0)
    try:
        trainer = quiet_trainer(max_steps=1, precision=precision, strategy=ThreeDParallelStrategy(**strategy))
        trainer.fit(WithOptimizer(name), tiny_data())
    except ValueError as err:
        return str(err)
    return "trained"


def whole_parameter_masters() -> dict[str, Any]:
    """Stage 0 with separate masters (mixed precision) gives Adafactor whole, parameter-shaped
    masters: three steps equal plain Adafactor on the same parameters."""
    torch.manual_seed(0)
    ours, plain = nn.Linear(6, 5), nn.Linear(6, 5)
    plain.load_state_dict(ours.state_dict())
    opt = ZeroOptimizer(torch.optim.Adafactor(ours.parameters(), lr=0.05), dist.group.WORLD, 0, torch.float32, torch.float64)
    reference = torch.optim.Adafactor(plain.parameters(), lr=0.05)
    for step in range(3):
        torch.manual_seed(step)
        x = torch.randn(4, 6)
        ours(x).pow(2).sum().backward()
        opt.grads.after_backward()
        opt.step()
        plain(x).pow(2).sum().backward()  # stage 0 averages over dp: both ranks saw the same x
        reference.step()
        reference.zero_grad()
    shapes = [list(t.shape) for g in opt.inner.param_groups for t in g["params"]]
    error = max(float((a - b).abs().max()) for a, b in zip(ours.parameters(), plain.parameters()))
    opt.remove()
    return {"shapes": shapes, "max_error": error}


# -- 11. partial optimizer state, per-parameter step counts -----------------------------------------------
def partial_state(b_has_state: bool) -> dict[str, float]:
    """A dense AdamW state where B stepped fewer times than A (or never): loading it into ZeRO-1
    keeps each parameter's own state and step; the next step equals the plain optimizer's."""
    torch.manual_seed(0)
    plain = nn.ParameterDict({"a": nn.Parameter(torch.randn(6)), "b": nn.Parameter(torch.randn(5))})
    reference = torch.optim.AdamW(plain.values(), lr=0.1, weight_decay=0.1)
    for step in range(3):
        plain["a"].grad = torch.full((6,), 0.5 + step)
        plain["b"].grad = torch.full((5,), -1.0) if (step == 0 and b_has_state) else None
        reference.step()
    saved = reference.state_dict()
    ours = nn.ParameterDict({k: nn.Parameter(v.detach().clone()) for k, v in plain.items()})
    opt = ZeroOptimizer(torch.optim.AdamW(ours.values(), lr=0.1, weight_decay=0.1), dist.group.WORLD, 1)
    ((ours["a"] * 9.0).sum() + (ours["b"] * 9.0).sum()).backward()  # state that the load must replace
    opt.grads.after_backward()
    opt.step()
    with torch.no_grad():
        for k in ours:
            ours[k].copy_(plain[k])
    opt.load_state_dict(saved)
    opt.load_dense_master({id(ours[k]): plain[k].detach() for k in ours})
    for p in (*plain.values(), *ours.values()):
        p.grad = None
    plain["a"].grad, plain["b"].grad = torch.full((6,), 2.0), torch.full((5,), 3.0)
    reference.step()
    ((ours["a"] * 2.0).sum() + (ours["b"] * 3.0).sum()).backward()
    opt.grads.after_backward()
    opt.step()
    error = max(float((ours[k] - plain[k]).abs().max()) for k in ("a", "b"))
    opt.remove()
    return {"max_error": error}


# -- micro-batches and replicas whose targets are all masked ----------------------------------------------
def masked_replica() -> dict[str, float]:
    """dp=2 where rank 0's targets are all masked: its share of the batch mean is zero (not 0/0 = NaN),
    and the averaged gradient is one process's on the whole batch."""
    from lightning_3d.models.adapters.gpt import gpt_sequence
    from lightning_3d.transforms.loss_normalization import normalize_over_data_parallel

    config = GPTConfig(**TINY_GPT)
    g = torch.Generator().manual_seed(3)
    ids, targets = torch.randint(0, 256, (4, 16), generator=g), torch.randint(0, 256, (4, 16), generator=g)
    targets[:2] = -100
    torch.manual_seed(0)
    reference = GPT(config)
    reference(ids, targets).backward()
    torch.manual_seed(0)
    model = GPT(config).train()
    normalize_over_data_parallel(model, gpt_sequence(model), dist.group.WORLD)
    mine = slice(0, 2) if dist.get_rank() == 0 else slice(2, 4)
    reads: list[str] = []
    with host_reads_logged(reads):  # counting targets and rescaling waits for nothing on the device
        loss = model(ids[mine], targets[mine])
    loss.backward()
    error = 0.0
    for p, r in zip(model.parameters(), reference.parameters()):
        dist.all_reduce(p.grad)
        error = max(error, float((p.grad / 2 - r.grad).abs().max()))
    return {"loss_finite": float(torch.isfinite(loss)), "grad_error": error, "host_reads": reads}


class PromptMasked(GPTModule):
    """Samples whose first token is 0 have every target masked (prompts): with 4 micro-batches of 2,
    the first two micro-batches carry no target at all."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        input_ids, targets = batch
        return self(input_ids, targets.masked_fill((input_ids[:, :1] == 0), -100))


def masked_micro_batches(pipeline_parallel: int) -> list[float]:
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, 256, (16, 17), generator=g)
    ids[0:4, 0] = ids[8:12, 0] = 0
    loader = DataLoader(TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=8)
    L.seed_everything(0)
    recorder = LossRecorder()
    strategy = ThreeDParallelStrategy(pipeline_parallel=pipeline_parallel, micro_batches=4) if pipeline_parallel > 1 else "3d"
    quiet_trainer(max_steps=2, callbacks=[recorder], strategy=strategy, use_distributed_sampler=False).fit(
        PromptMasked(GPTConfig(**TINY_GPT), lr=3e-3), loader
    )
    return recorder.losses


def nvme_stores_never_share_a_file(tmp: str) -> bool:
    from lightning_3d.zero.offload import NVMeStateStore

    first, second = NVMeStateStore(tmp, 0, [8]), NVMeStateStore(tmp, 0, [8])
    distinct = first.path != second.path
    first.close()
    alive = second.path.exists()
    second.close()
    return distinct and alive


def sampler_repeat_warning() -> list[str]:
    """21 samples on 2 replicas: the sampler repeats one; the strategy says so before step 1."""
    import warnings

    from tests.matrix import matrix_loader

    L.seed_everything(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_trainer(max_steps=1).fit(tiny_gpt(n_layer=1, block_size=16), matrix_loader("odd", 2))
    return [str(w.message) for w in caught if "repeats" in str(w.message)]


# -- 12. state_dict on one rank only ------------------------------------------------------------------------
def local_state_dict() -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    opt = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=0.1), dist.group.WORLD, 1)
    model(torch.randn(4, 8)).sum().backward()
    opt.grads.after_backward()
    opt.step()
    out: dict[str, Any] = {}
    mine = opt.state_dict() if dist.get_rank() == 0 else None  # a third-party callback on rank 0 only
    dist.barrier()
    gathered: list[Any] = [None, None]
    dist.all_gather_object(gathered, opt.state_dict())
    if dist.get_rank() == 0:
        before = {k: {n: v.clone() for n, v in e.items()} for k, e in mine["state"].items()}
        opt.load_state_dict(mine)
        after = opt.state_dict()["state"]
        out["round_trip"] = all(torch.equal(before[k][n], after[k][n]) for k in before for n in before[k])
        try:
            opt.load_state_dict(gathered[1])
            out["other_rank"] = "loaded"
        except ValueError as err:
            out["other_rank"] = str(err)
    opt.remove()
    return out


# -- 9. replicas synchronized over tp and the tied pipeline embedding ---------------------------------------
class SeededPerRank(GPTModule):
    """A user who seeds every rank differently before building the model."""

    def configure_model(self) -> None:
        if self.model is None:
            torch.manual_seed(1000 + dist.get_rank())
            self.model = GPT(self.config)

    def on_train_start(self) -> None:
        self.snapshot = _replicas(self)

    def on_train_end(self) -> None:
        self.final = _replicas(self)


def _replicas(module: SeededPerRank) -> dict[str, Any]:
    topo = module.trainer.strategy.topology
    wpe = getattr(module.model.wpe, "weight", None)
    tied = module.model.wte.weight if topo.pp_rank == 0 else getattr(module.model.lm_head, "weight", None)
    return {
        "coords": (topo.pp_rank, topo.dp_rank, topo.tp_rank),
        "wpe": None if wpe is None else wpe.detach().float().clone(),
        "tied": None if tied is None else tied.detach().float().clone(),
    }


def replicas_agree() -> dict[str, Any]:
    L.seed_everything(0)
    model = SeededPerRank(GPTConfig(**{**TINY_GPT, "n_layer": 2}), lr=3e-3, warmup_steps=1)
    quiet_trainer(max_steps=2, limit_val_batches=0, strategy=ThreeDParallelStrategy(tensor_parallel=2, pipeline_parallel=2)).fit(
        model, tiny_data()
    )
    out = {}
    for when, snap in (("start", model.snapshot), ("end", model.final)):
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, snap)
        by = {g["coords"]: g for g in gathered}
        out[f"wpe_{when}"] = torch.equal(by[(0, 0, 0)]["wpe"], by[(0, 0, 1)]["wpe"])
        out[f"tied_{when}"] = all(torch.equal(by[(0, 0, t)]["tied"], by[(1, 0, t)]["tied"]) for t in (0, 1))
    return out


class GeneratorStates(L.Callback):
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.state = hashlib.sha1(torch.get_rng_state().numpy().tobytes()).hexdigest()


def generators_agree_within_a_replica() -> list[Any]:
    """Ranks seeded differently (and no Lightning seed): tp and pp peers still share one generator state,
    so a sampler or dropout drawing from it gives them the same batch and masks."""
    import os

    os.environ.pop("PL_GLOBAL_SEED", None)
    torch.manual_seed(100 + dist.get_rank())
    record = GeneratorStates()
    strategy = ThreeDParallelStrategy(tensor_parallel=2, pipeline_parallel=2)
    quiet_trainer(max_steps=1, limit_val_batches=0, callbacks=[record], strategy=strategy).fit(tiny_gpt(), tiny_data())
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, record.state)
    return gathered


# -- 10. dropout randomness ---------------------------------------------------------------------------------
class FirstDropoutState(L.Callback):
    """The random state each rank's first dropout of the first training forward draws from."""

    def __init__(self) -> None:
        self.state: Optional[str] = None
        self.hooks: list[Any] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for m in pl_module.modules():
            if isinstance(m, nn.Dropout):
                self.hooks.append(m.register_forward_pre_hook(self._record))

    def _record(self, module: nn.Module, args: Any) -> None:
        if self.state is None:
            self.state = hashlib.sha1(torch.get_rng_state().numpy().tobytes()).hexdigest()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for h in self.hooks:
            h.remove()


def pipeline_dropout_streams() -> dict[str, Any]:
    L.seed_everything(0)
    record = FirstDropoutState()
    model = GPTModule(GPTConfig(**{**TINY_GPT, "dropout": 0.1}), lr=3e-3)
    strategy = ThreeDParallelStrategy(tensor_parallel=2, pipeline_parallel=2)
    quiet_trainer(max_steps=1, limit_val_batches=0, callbacks=[record], strategy=strategy).fit(model, tiny_data())
    topo = strategy.topology
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, ((topo.pp_rank, topo.tp_rank), record.state))
    return dict(gathered)


def gpt2_attention_dropout() -> dict[str, Any]:
    """HF GPT-2 at tp=2: attention-probability dropout differs per tp rank (different heads), the
    residual dropout after the all-reduce is the same on both."""
    import transformers

    from lightning_3d.models.adapters.gpt2 import GPT2
    from lightning_3d.tensor_parallel.plans import PlanContext, apply_plan
    from lightning_3d.tensor_parallel.random import RNGStatesTracker, seed_tracker

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=16, attn_pdrop=0.5, resid_pdrop=0.3, embd_pdrop=0.0,
        attn_implementation="eager",
    )
    model = transformers.GPT2LMHeadModel(config)
    tracker = RNGStatesTracker()
    seed_tracker(tracker, dist.get_rank(), base_seed=0)
    apply_plan(model, GPT2.tp_plan(model), PlanContext(dist.group.WORLD, False, tracker))
    model.train()
    masks: dict[float, list[torch.Tensor]] = {}
    original = F.dropout

    def recording(x: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
        out = original(x, p, training, inplace)
        if training and p > 0:
            masks.setdefault(p, []).append((out == 0).flatten().float())
        return out

    F.dropout = recording
    try:
        model(input_ids=torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1)))
    finally:
        F.dropout = original
    out = {}
    for p, name in ((0.5, "attention"), (0.3, "residual")):
        mine = torch.cat(masks[p])
        gathered = [torch.empty_like(mine) for _ in range(2)]
        dist.all_gather(gathered, mine)
        out[name] = bool(torch.equal(gathered[0], gathered[1]))
    return out


# -- worlds --------------------------------------------------------------------------------------------------
ITEM_CELLS = {
    "masked_pp2": Cell(layout="pp2", targets="masked"),
    "masked_dp2_pp2": Cell(layout="dp2-pp2", zero=1, targets="masked"),
    "ragged_interleaved": Cell(layout="pp2-v2", last_batch="odd"),
    "two_forwards_pp2": Cell(layout="pp2", forwards=2),
    "unused_zero1": Cell(zero=1, params="unused-frozen"),
    "unused_zero2_acc2": Cell(zero=2, params="unused-frozen", accumulate=2),
    "unused_zero1_nvme": Cell(zero=1, params="unused-frozen", offload="nvme"),
    "clip_value_zero1": Cell(zero=1, clip="value"),
    "clip_value_bf16": Cell(zero=0, precision="bf16-mixed", clip="value"),
    "masked_dp2_zero2": Cell(zero=2, targets="masked"),
    # found by the matrix: manual optimization clips before opt.step(), i.e. before fp16 unscaling
    "fp16_manual_clip": Cell(zero=1, precision="16-mixed", clip="norm", optimizers="two"),
    # pipeline x expert parallelism (no matrix layout has both): ZeRO-0's expert scale ran at every
    # micro-batch's backward and again at the pipeline's hand-over; under manual optimization with
    # accumulation, a second hand-over in the step on top
    "pp_ep_manual_acc2": Cell(layout="dp2-pp2-ep2", experts="moe", accumulate=2, optimizers="two", targets="masked"),
    "pp_ep_zero1_bf16": Cell(layout="dp2-pp2-ep2", experts="moe", zero=1, precision="bf16-mixed", accumulate=2, clip="norm"),
}


def dp2_world(tmp: str) -> dict[str, Any]:
    checks: dict[str, Any] = {
        "offload_cpu_fp32": lambda: offload_resume(tmp, 1, "cpu", "32-true"),
        "offload_nvme_bf16_true": lambda: offload_resume(tmp, 2, "nvme", "bf16-true"),
        "clip_slices_1": lambda: clip_value_on_slices(1, "32-true"),
        "clip_slices_2_bf16": lambda: clip_value_on_slices(2, "bf16-mixed"),
        "adafactor_zero1": lambda: refused_optimizer("adafactor", zero_stage=1),
        "muon_zero2": lambda: refused_optimizer("muon", zero_stage=2),
        "adafactor_zero3": lambda: refused_optimizer("adafactor", zero_stage=3),
        "adafactor_zero0_bf16": lambda: refused_optimizer("adafactor", "bf16-mixed", zero_stage=0),
        "whole_masters": whole_parameter_masters,
        "partial_state_stepped": lambda: partial_state(True),
        "partial_state_missing": lambda: partial_state(False),
        "masked_replica": masked_replica,
        "sampler_warning": sampler_repeat_warning,
    }
    checks.update({name: (lambda c=c: run_cell(c, tmp)) for name, c in ITEM_CELLS.items() if c.world == 2 and c.layout == "dp2"})
    return run_checks(checks)


def pp2_world(tmp: str) -> dict[str, Any]:
    checks: dict[str, Any] = {name: (lambda c=c: run_cell(c, tmp)) for name, c in ITEM_CELLS.items() if c.layout in ("pp2", "pp2-v2")}
    checks["masked_micro_batches"] = lambda: masked_micro_batches(2)
    return run_checks(checks)


def tp2_world() -> dict[str, Any]:
    return run_checks(
        {
            "meta": meta_zero3_tp,
            "meta_uncovered": meta_uncovered,
            "refit": refit_zero3_tp,
            "adafactor_tp2": lambda: refused_optimizer("adafactor", tensor_parallel=2),
            "gpt2_dropout": gpt2_attention_dropout,
        }
    )


class ClipNorms(L.Callback):
    """The global norm each optimizer step was clipped by (the precision plugin's record of it)."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        norm = trainer.precision_plugin._clip_norm.get(id(getattr(optimizer, "_optimizer", optimizer)))
        self.norms.append(float(norm) if norm is not None else float("nan"))


def manual_clip_norms(layout: str, tmp: str) -> list[float]:
    """Manual optimization clips before ``opt.step()``. Under ZeRO-3 x tp with MoE, the router's
    gradient is partial on each tp rank until summed (FSDP2 dropped its hook): the sum must come
    before the norm, not at the step (it came after: a norm over partial gradients, 4.1e-5 off in
    the final weights, hidden by AdamW)."""
    from tests.matrix import LAYOUTS, _trainer, MatrixGPT, matrix_loader

    cell = Cell(layout=layout, zero=3 if layout != "one" else 0, clip="norm", optimizers="two", experts="moe")
    L.seed_everything(0)
    model, norms = MatrixGPT(cell), ClipNorms()
    _trainer(cell, layout, Path(tmp) / f"clip-{layout}", norms, 1).fit(model, matrix_loader("even", LAYOUTS[layout]["data_parallel"]))
    return norms.norms


class OutsideAdamW(torch.optim.AdamW):
    """AdamW under a class from outside ``torch.optim`` (as bitsandbytes', apex's or a user's are): the
    precision plugin leaves its step to Lightning's ``optimizer.step(closure)``."""

    elementwise = True  # (shards and slices step as the whole would: see optimizer_kinds)


class OutsideGPT(MatrixGPT):
    """The matrix GPT stepped by :class:`OutsideAdamW`: under ZeRO-3 x tp with MoE the router's partial
    gradients must be summed over tp before the clip and the step on that path too (they never were)."""

    def configure_optimizers(self) -> Any:
        config = super().configure_optimizers()
        config["optimizer"].__class__ = OutsideAdamW  # the same optimizer and state, another class
        return config


OUTSIDE_CELL = Cell(layout="dp2-tp2-ep2", zero=3, clip="norm", experts="moe")


def four_world(tmp: str) -> dict[str, Any]:
    checks: dict[str, Any] = {
        "replicas": replicas_agree,
        "dropout_streams": pipeline_dropout_streams,
        "generators": generators_agree_within_a_replica,
        "manual_clip_norms": lambda: manual_clip_norms("dp2-tp2-ep2", tmp),
        "outside_optimizer": lambda: run_cell(OUTSIDE_CELL, tmp, OutsideGPT),
    }
    checks.update({name: (lambda c=c: run_cell(c, tmp)) for name, c in ITEM_CELLS.items() if c.world == 4})
    return run_checks(checks)


@pytest.fixture(scope="module")
def dp2(tmp_path_factory) -> list[dict[str, Any]]:
    return run_on_ranks(dp2_world, 2, str(tmp_path_factory.mktemp("combo-dp2")), timeout=900)


@pytest.fixture(scope="module")
def pp2(tmp_path_factory) -> list[dict[str, Any]]:
    return run_on_ranks(pp2_world, 2, str(tmp_path_factory.mktemp("combo-pp2")), timeout=600)


@pytest.fixture(scope="module")
def tp2() -> list[dict[str, Any]]:
    return run_on_ranks(tp2_world, 2, timeout=600)


@pytest.fixture(scope="module")
def four(tmp_path_factory) -> list[dict[str, Any]]:
    return run_on_ranks(four_world, 4, str(tmp_path_factory.mktemp("combo-4")), timeout=900)


def reference_world() -> dict[str, Any]:
    out = run_references(list(ITEM_CELLS.values()))
    out["masked_micro_batches"] = masked_micro_batches(1)
    out["outside_optimizer"] = {repr(OUTSIDE_CELL.reference_key()): reference_of(OUTSIDE_CELL, OutsideGPT)}
    import tempfile

    with tempfile.TemporaryDirectory(prefix="l3d-ref-") as tmp:
        out["manual_clip_norms"] = manual_clip_norms("one", tmp)
    return out


@pytest.fixture(scope="module")
def references() -> dict[str, Any]:
    return run_on_ranks(reference_world, 1, timeout=600)[0]


def _world_of(request: Any, cell: Cell) -> list[Any]:
    name = {"pp2": "pp2", "pp2-v2": "pp2"}.get(cell.layout, "dp2" if cell.world == 2 else "four")
    return request.getfixturevalue(name)


# 1 ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["offload_cpu_fp32", "offload_nvme_bf16_true"])
def test_resume_with_offloaded_masters_continues_the_run(dp2, name):
    for r in dp2:
        run = result_of(r, name)
        assert len(run["full"]) == 8
        np.testing.assert_allclose(run["resumed"], run["full"][4:], rtol=1e-6)


# 2 ---------------------------------------------------------------------------------------------------------
def test_meta_device_model_under_zero3_and_tensor_parallel_is_initialized(tp2):
    for r in tp2:
        run = result_of(r, "meta")
        assert run["finite"]
        assert run["std"] == pytest.approx(0.02, abs=0.004)  # GPT's init on the column-parallel shard
        assert abs(run["losses"][0] - np.log(256)) < 0.1
        assert run["losses"][-1] < run["losses"][0] - 0.1
        assert run["tp_slices_differ"]  # not the same random draws on both tp ranks (duplicated heads)


def test_zero3_tensor_parallel_shards_survive_fit_validate_fit(tp2):
    for r in tp2:
        run = result_of(r, "refit")
        assert np.isfinite(run["val_loss"]) and run["steps"] == 4 and run["tp_slices_differ"]


def test_meta_device_parameter_without_reset_is_named(tp2):
    for r in tp2:
        message = result_of(r, "meta_uncovered")
        assert "no reset_parameters() initialized" in message and "extra.scale" in message


# 3, 5, 8 and the ZeRO cells ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(ITEM_CELLS))
def test_combination_matches_one_process(request, references, name):
    cell = ITEM_CELLS[name]
    world = _world_of(request, cell)
    renamed = [{cell.id: r[name]} for r in world]
    assert check_cell(cell, renamed, references) == "trained"


# 4 ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["clip_slices_1", "clip_slices_2_bf16"])
def test_clipping_by_value_reaches_the_zero_slices(dp2, name):
    for r in dp2:
        run = result_of(r, name)
        assert run["before"] > 1e-2
        assert run["after"] <= 1e-3 * (1 + 1e-2)
        assert run["none_grads"] == 1.0


# 7 ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("world", "name", "where"),
    [
        ("dp2", "adafactor_zero1", "zero_stage=1"),
        ("dp2", "muon_zero2", "zero_stage=2"),
        ("dp2", "adafactor_zero3", "zero_stage=3"),
        ("tp2", "adafactor_tp2", "tensor_parallel=2"),
    ],
)
def test_non_elementwise_optimizers_are_refused_where_they_see_pieces(request, world, name, where):
    for r in request.getfixturevalue(world):
        message = result_of(r, name)
        assert "not an element-wise optimizer" in message and where in message
        assert "zero_stage=0 with tensor_parallel=1" in message


def test_non_elementwise_optimizer_trains_at_stage_0_with_whole_masters(dp2):
    for r in dp2:
        assert result_of(r, "adafactor_zero0_bf16") == "trained"
        run = result_of(r, "whole_masters")
        assert sorted(run["shapes"]) == [[5], [5, 6]]  # whole, parameter-shaped (not flat slices)
        assert run["max_error"] < 1e-5  # fp64 masters vs plain fp32 Adafactor


# 9 ---------------------------------------------------------------------------------------------------------
def test_replicated_parameters_agree_across_tensor_and_pipeline_ranks(four):
    for r in four:
        run = result_of(r, "replicas")
        assert run == {"wpe_start": True, "tied_start": True, "wpe_end": True, "tied_end": True}


def test_tensor_and_pipeline_peers_share_one_generator_state(four):
    states = result_of(four[0], "generators")
    assert len(set(states)) == 1, states


# 10 --------------------------------------------------------------------------------------------------------
def test_pipeline_stages_draw_dropout_from_their_own_streams(four):
    states = result_of(four[0], "dropout_streams")
    assert states[(0, 0)] != states[(1, 0)] and states[(0, 1)] != states[(1, 1)]  # stages differ
    assert states[(0, 0)] == states[(0, 1)] and states[(1, 0)] == states[(1, 1)]  # replicated region: tp peers agree


def test_hf_gpt2_attention_dropout_differs_per_tensor_parallel_rank(tp2):
    for r in tp2:
        assert result_of(r, "gpt2_dropout") == {"attention": False, "residual": True}


# 11 --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["partial_state_stepped", "partial_state_missing"])
def test_partial_optimizer_state_loads_per_parameter(dp2, name):
    for r in dp2:
        assert result_of(r, name)["max_error"] < 1e-6


# zero-count micro-batches and replicas -----------------------------------------------------------------------
def test_a_micro_batch_without_targets_contributes_nothing_not_nan(pp2, references):
    reference = result_of(references, "masked_micro_batches")
    assert np.isfinite(reference).all()
    for r in pp2:
        np.testing.assert_allclose(result_of(r, "masked_micro_batches"), reference, rtol=1e-5)


def test_a_replica_without_targets_contributes_nothing_not_nan(dp2):
    for r in dp2:
        run = result_of(r, "masked_replica")
        assert run["loss_finite"] == 1.0 and run["grad_error"] < 1e-6
        # the target count and its all-reduce stay on the device: on a GPU a host read here would
        # make every training forward wait for itself before the backward can be queued
        assert run["host_reads"] == [], run["host_reads"][0]


def test_a_sampler_that_repeats_samples_is_reported(dp2):
    messages = result_of(dp2[0], "sampler_warning")  # rank 0 warns
    assert any("21 samples" in m and "repeats 1 of them" in m for m in messages), messages


def test_nvme_stores_never_share_a_file(tmp_path):
    assert nvme_stores_never_share_a_file(str(tmp_path))


# 12 --------------------------------------------------------------------------------------------------------
def test_zero_optimizer_state_dict_is_local():
    results = run_on_ranks(local_state_dict, 2, timeout=120)
    assert results[0]["round_trip"]
    assert "saved by a rank of another layout" in results[0]["other_rank"]


def test_manual_clipping_under_zero3_tensor_parallel_sums_partial_gradients_first(four, references):
    want = result_of(references, "manual_clip_norms")
    assert len(want) == 6 and all(np.isfinite(want))  # 3 batches, two optimizers: both clip
    for r in four:
        np.testing.assert_allclose(result_of(r, "manual_clip_norms"), want, rtol=1e-5)


def test_an_optimizer_from_outside_torch_optim_gets_the_tensor_parallel_sums_under_zero3(four, references):
    renamed = [{OUTSIDE_CELL.id: result_of(r, "outside_optimizer")} for r in four]
    assert check_cell(OUTSIDE_CELL, renamed, result_of(references, "outside_optimizer")) == "trained"
