"""The composition matrix: every feature against every other, each cell compared with one process.

A *cell* picks one value of every factor below. It either trains (two epochs of a tiny GPT on a
fixed token set) and must give the losses of one process trained from the same seed with the
same math (accumulation, clipping, masking, data, parameters, optimizers), and end on its final
weights (:func:`check_weights`: losses alone miss errors in weights that move the loss little), or it
is refused by the strategy before step 1 with the message :func:`refusal` predicts. See docs/testing.md.

* :func:`covering_array` picks the cells of ``make test``: every pair (``strength=2``) of factor
  values appears in a cell that trains -- or, for a pair the strategy refuses whatever else is
  chosen, in a cell that is refused. Deterministic (fixed seed), so a run is reproducible.
* :func:`full_matrix` is what ``make test-matrix`` runs (see its docstring for what "all" means).
* :func:`run_cell` runs a cell on every rank of a world of the layout's size; :func:`reference_of`
  runs its one-process reference.
"""

from __future__ import annotations

import itertools
import os
import random
import re
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_3d import ThreeDParallelStrategy
from lightning_3d.core.layout_rules import ZERO_BUBBLE
from lightning_3d.data import stdlib_bytes
from lightning_3d.models import GPT, GPTConfig, GPTModule
from lightning_3d.models.gpt import IGNORE_INDEX
from lightning_3d.plugins.precision import ThreeDPrecision
from tests.helpers import LossRecorder, quiet_trainer

# -- the factors -----------------------------------------------------------------------------------
FACTORS: dict[str, tuple[Any, ...]] = {
    "layout": (
        "dp2", "tp2", "pp2", "dp2-tp2", "dp2-pp2", "tp2-pp2-v2", "dp2-tp2-pp2", "cp2", "dp2-cp2", "cp2-tp2", "cp2-pp2", "pp2-zb",
        "pp2-zbv", "pp2-dpv", "dp2-ep2", "dp2-tp2-ep2",
    ),
    "zero": (0, 1, 2, 3),
    "precision": ("32-true", "bf16-mixed", "16-mixed"),
    "accumulate": (1, 2),
    "recompute": ("none", "full", "selective"),
    "offload": ("none", "cpu", "nvme"),
    "sequence_parallel": (False, True),
    "clip": ("none", "norm", "value"),
    "targets": ("plain", "masked"),
    "last_batch": ("even", "ragged"),
    "params": ("all", "unused-frozen"),
    "optimizers": ("one", "two"),
    "resume": ("no", "other-layout"),
    "experts": ("none", "moe"),  # a dense GPT, or MoE blocks (lightning_3d.moe) in every other block
    "compile": ("off", "blocks"),  # torch.compile of each block, with the cell's compile_backend
}
# aot_eager: Dynamo's capture and AOTAutograd's graphs, around our eager collectives, without inductor's C++
# build per graph (seconds per cell); MATRIX_COMPILE_BACKEND=inductor runs the matrix on the code users get.
COMPILE_BACKEND = os.environ.get("MATRIX_COMPILE_BACKEND", "aot_eager")
CORE = ("layout", "zero", "precision", "accumulate")  # crossed in full by make test-matrix

# (dp, tp, pp, cp) and pipeline / context-parallel settings; each layout's world size is dp * tp * pp * cp.
# The cp layouts alternate the two context-parallel modes.
LAYOUTS: dict[str, dict[str, Any]] = {
    "one": dict(data_parallel=1),
    "dp2": dict(data_parallel=2),
    "tp2": dict(data_parallel=1, tensor_parallel=2),
    "pp2": dict(data_parallel=1, pipeline_parallel=2, pipeline_schedule="1f1b", micro_batches=4),
    "dp2-tp2": dict(data_parallel=2, tensor_parallel=2),
    "dp2-pp2": dict(data_parallel=2, pipeline_parallel=2, pipeline_schedule="gpipe", micro_batches=2),
    "tp2-pp2-v2": dict(data_parallel=1, tensor_parallel=2, pipeline_parallel=2, pipeline_schedule="interleaved_1f1b", virtual_stages=2, micro_batches=4),
    "dp2-tp2-pp2": dict(data_parallel=2, tensor_parallel=2, pipeline_parallel=2, pipeline_schedule="1f1b", micro_batches=2),
    "pp2-v2": dict(data_parallel=1, pipeline_parallel=2, pipeline_schedule="interleaved_1f1b", virtual_stages=2, micro_batches=8),
    "tp4": dict(data_parallel=1, tensor_parallel=4),
    "dp2-tp4": dict(data_parallel=2, tensor_parallel=4),
    "pp2-zb": dict(data_parallel=1, pipeline_parallel=2, pipeline_schedule="zb_h1", micro_batches=4),
    "pp2-zbv": dict(data_parallel=1, pipeline_parallel=2, pipeline_schedule="zb_v", micro_batches=4),
    "pp2-dpv": dict(data_parallel=1, pipeline_parallel=2, pipeline_schedule="dualpipe_v", micro_batches=4),
    "cp2": dict(data_parallel=1, context_parallel=2),
    "dp2-cp2": dict(data_parallel=2, context_parallel=2, context_parallel_mode="all_to_all"),
    "cp2-tp2": dict(data_parallel=1, context_parallel=2, tensor_parallel=2),
    "cp2-pp2": dict(data_parallel=1, context_parallel=2, context_parallel_mode="all_to_all", pipeline_parallel=2, pipeline_schedule="1f1b", micro_batches=4),
    "dp2-ep2": dict(data_parallel=2, expert_parallel=2),
    "dp2-tp2-ep2": dict(data_parallel=2, tensor_parallel=2, expert_parallel=2),
    # not a matrix factor (adding one re-deals every chunk of the full matrix's ledger): cells in
    # tests/test_combinations.py; each pipeline stage holds one MoE block
    "dp2-pp2-ep2": dict(data_parallel=2, pipeline_parallel=2, pipeline_schedule="1f1b", micro_batches=2, expert_parallel=2),
}
# A resumed cell continues under another layout of the same world size (the first that its ZeRO
# stage allows): the checkpoint must reshard. Every data-parallel size here divides the sample
# counts: otherwise the distributed sampler repeats samples to even out replicas (one process would not).
PARTNERS: dict[str, tuple[str, ...]] = {
    "dp2": ("tp2", "pp2"), "tp2": ("pp2-dpv", "dp2"), "pp2": ("dp2", "tp2"), "pp2-zbv": ("dp2", "tp2"), "pp2-dpv": ("pp2-zbv", "dp2"),
    "dp2-tp2": ("tp2-pp2-v2", "tp4"), "dp2-pp2": ("dp2-tp2",), "tp2-pp2-v2": ("dp2-tp2",), "dp2-tp2-pp2": ("dp2-tp4",),
    "pp2-zb": ("dp2", "tp2"), "cp2": ("dp2", "tp2"), "dp2-cp2": ("cp2-tp2", "dp2-tp2"), "cp2-tp2": ("dp2-cp2", "tp4"), "cp2-pp2": ("dp2-cp2", "dp2-tp2"),
    "dp2-ep2": ("tp2", "pp2"), "dp2-tp2-ep2": ("dp2-cp2", "dp2-tp2"),
}

MODEL = dict(vocab_size=256, block_size=16, n_layer=4, n_head=4, n_embd=32)
EXPERTS = dict(n_experts=4, top_k=2, moe_every=2, expert_hidden=32, n_shared_experts=1, moe_z_loss=1e-3)  # experts="moe"
GLOBAL_BATCH = 8
# 3 batches an epoch: 8, 8, 8 or 8, 8, 6 (even per replica at dp 2); "odd" (8, 8, 5) is for one replica.
SAMPLES = {"even": 24, "ragged": 22, "odd": 21}
EPOCHS = 2
LR = 3e-3
CLIP = {"norm": ("norm", 0.5), "value": ("value", 2e-3)}
# Losses over 6 batches vs one process in fp32: fp32 cells are exact up to summation order; the
# mixed-precision cells are held to what bf16/fp16 rounding of weights and activations allows.
RTOL = {"32-true": 1e-5, "bf16-mixed": 3e-2, "16-mixed": 1e-2}
# Final weights vs one process's, relative to how far one process moved them (weight_errors): the whole
# model, and each tensor. About 10x the largest of the pairwise sample (fp32: 4.7e-5 and 3.2e-4, clipping
# by value the worst) and 3x under mixed precision, whose trajectories differ by design; an expert
# gradient reduced 1/ep too small on one micro-batch of two read 0.26 and 0.43 while its losses stayed
# within 1.6e-6 (docs/testing.md).
WEIGHT_RTOL = {"32-true": (5e-4, 3e-3), "bf16-mixed": (0.25, 0.6), "16-mixed": (0.12, 0.4)}
# Gradients that are zero in exact arithmetic: a key's bias adds one constant to each query's scores, which
# the softmax ignores. Adam turns their rounding noise into full steps on both sides, so they are only
# held in the whole-model figure.
NOISE_ONLY = ("attn.k_proj.bias",)


@dataclass(frozen=True)
class Cell:
    layout: str = "dp2"
    zero: int = 0
    precision: str = "32-true"
    accumulate: int = 1
    recompute: str = "none"
    offload: str = "none"
    sequence_parallel: bool = False
    clip: str = "none"
    targets: str = "plain"
    last_batch: str = "even"
    params: str = "all"
    optimizers: str = "one"
    resume: str = "no"
    experts: str = "none"
    compile: str = "off"
    compile_backend: str = COMPILE_BACKEND  # not a matrix factor: make test's sample compiles with "eager" (tests/test_matrix.py)
    forwards: int = 1  # not a matrix factor: model calls per training step (tests of the pipeline)

    @property
    def id(self) -> str:
        defaults = Cell()
        extra = [f"{k}={v}" for k, v in asdict(self).items() if k not in CORE and v != getattr(defaults, k)]
        return "|".join([self.layout, f"zero{self.zero}", self.precision, f"acc{self.accumulate}", *extra])

    @property
    def world(self) -> int:
        return world_of(self.layout)

    def reference_key(self) -> tuple:
        """What the one-process reference depends on: the math, not the layout."""
        return (self.accumulate, self.clip, self.targets, self.last_batch, self.params, self.optimizers, self.forwards, self.experts)


def world_of(layout: str) -> int:
    spec = LAYOUTS[layout]
    return spec["data_parallel"] * spec.get("tensor_parallel", 1) * spec.get("pipeline_parallel", 1) * spec.get("context_parallel", 1)


# -- what the strategy refuses (the order is the order its checks run in) ----------------------------
RULES: list[tuple[tuple[str, ...], Callable[[dict[str, Any]], bool], str]] = [
    (("offload", "zero"), lambda c: c["offload"] != "none" and c["zero"] == 0, r"offload_optimizer='(cpu|nvme)' offloads the ZeRO optimizer's shard and needs zero_stage >= 1"),
    (("zero", "layout"), lambda c: c["zero"] == 3 and LAYOUTS[c["layout"]].get("pipeline_parallel", 1) > 1, r"zero_stage=3 with pipeline_parallel > 1"),
    (("zero", "sequence_parallel", "layout"), lambda c: c["zero"] == 3 and c["sequence_parallel"] and LAYOUTS[c["layout"]].get("tensor_parallel", 1) > 1, r"zero_stage=3 with sequence_parallel=True"),
    (("offload", "zero"), lambda c: c["offload"] == "nvme" and c["zero"] == 3, r"NVMe offload with zero_stage=3"),
    # at set-up, when the optimizers exist: the matrix's second optimizer is SGD
    (("offload", "optimizers"), lambda c: c["offload"] == "nvme" and c["optimizers"] == "two", r"offload_optimizer='nvme' streams Adam/AdamW state; SGD is not supported there"),
    (("layout", "experts"), lambda c: LAYOUTS[c["layout"]].get("expert_parallel", 1) > 1 and c["experts"] == "none", r"splits the experts of mixture-of-experts layers, but the model has none"),
    (("layout", "compile"), lambda c: c["compile"] != "off" and LAYOUTS[c["layout"]].get("pipeline_schedule") in ZERO_BUBBLE, r"compile with pipeline_schedule='(zb_h1|zb_v|dualpipe_v)' is not supported"),
]


def refusal(values: dict[str, Any]) -> Optional[str]:
    """The message pattern the strategy refuses these (possibly partial) values with, if a rule applies."""
    for factors, applies, message in RULES:
        if all(f in values for f in factors) and applies(values):
            return message
    return None


# -- which cells -----------------------------------------------------------------------------------------
def _ordered(items: Iterable[tuple[str, Any]]) -> tuple:
    order = list(FACTORS)
    return tuple(sorted(items, key=lambda kv: order.index(kv[0])))


def _new_tuples(chosen: dict[str, Any], name: str, value: Any, strength: int) -> Iterable[tuple]:
    """The tuples that assigning ``name=value`` completes together with values already chosen."""
    for others in itertools.combinations(chosen.items(), strength - 1):
        yield _ordered([*others, (name, value)])


def _minimal_refused(t: tuple) -> tuple:
    """The smallest part of a refused tuple that is refused by itself (what its refused cell shows)."""
    for size in range(1, len(t) + 1):
        for sub in itertools.combinations(t, size):
            if refusal(dict(sub)) is not None:
                return _ordered(sub)
    return t


def covering_array(strength: int = 2, seed: int = 0, candidates: int = 24) -> list[Cell]:
    """Cells in which every ``strength``-tuple of factor values appears: in a cell that trains when
    some cell containing it can, otherwise in a refused cell (greedy, AETG-style, seeded)."""
    rng = random.Random(seed)
    names = list(FACTORS)
    every = {
        _ordered(t)
        for combo in itertools.combinations(names, strength)
        for t in itertools.product(*[[(n, v) for v in FACTORS[n]] for n in combo])
    }
    refused = {_minimal_refused(t) for t in every if refusal(dict(t)) is not None}
    uncovered = {t for t in every if refusal(dict(t)) is None}
    cells: list[Cell] = []
    while uncovered:
        pool = sorted(uncovered, key=repr)
        target = pool[rng.randrange(len(pool))]
        best: Optional[tuple[int, dict[str, Any]]] = None
        for _ in range(candidates):
            chosen = dict(target)
            order = [n for n in names if n not in chosen]
            rng.shuffle(order)
            for name in order:
                options = [
                    (sum(t in uncovered for t in _new_tuples(chosen, name, v, strength)), rng.random(), v)
                    for v in FACTORS[name]
                    if refusal({**chosen, name: v}) is None
                ]
                if not options:
                    break
                chosen[name] = max(options)[2]
            if len(chosen) == len(names):
                gain = sum(t in uncovered for t in itertools.combinations(_ordered(chosen.items()), strength))
                if best is None or gain > best[0]:
                    best = (gain, chosen)
        if best is None:  # the tuple occurs only in refused cells after all
            uncovered.discard(target)
            refused.add(_minimal_refused(target))
            continue
        cells.append(Cell(**best[1]))
        uncovered -= set(itertools.combinations(_ordered(best[1].items()), strength))
    cells = _fewer_costly(cells, strength)
    cells += [Cell(**dict(t)) for t in sorted(refused, key=repr)]
    return cells


# Factor values that make a cell expensive (compiling costs seconds per cell and rank), with what to use
# instead where the coverage allows: the greedy above picks them as often as any other value.
COSTLY = {"compile": ("blocks", "off")}


def _fewer_costly(cells: list[Cell], strength: int) -> list[Cell]:
    """Turn a costly value back to its cheap one in every cell where each tuple stays covered by some
    cell that trains (last cells first); the set of covered tuples never shrinks."""
    def tuples(cell: Cell) -> set[tuple]:
        return set(itertools.combinations(_ordered((n, getattr(cell, n)) for n in FACTORS), strength))

    counts: dict[tuple, int] = {}
    for cell in cells:
        for t in tuples(cell):
            counts[t] = counts.get(t, 0) + 1
    out = list(cells)
    for i in reversed(range(len(out))):
        for name, (costly, cheap) in COSTLY.items():
            cell = out[i]
            if getattr(cell, name) != costly:
                continue
            cheaper = replace(cell, **{name: cheap})
            if refusal(asdict(cheaper)) is not None:
                continue
            lost, gained = tuples(cell) - tuples(cheaper), tuples(cheaper) - tuples(cell)
            if all(counts[t] > 1 for t in lost):
                for t in lost:
                    counts[t] -= 1
                for t in gained:
                    counts[t] = counts.get(t, 0) + 1
                out[i] = cheaper
    return out


def full_matrix() -> list[Cell]:
    """``make test-matrix``: the full product of the core factors (layout x ZeRO x precision x
    accumulation) with every value of every other factor, one feature at a time, plus the 3-wise
    covering array (every triple of values, so features also meet each other and the core in threes).
    The literal product of all fourteen factors (see :func:`product_size`) would take weeks here."""
    cells: list[Cell] = []
    features = [n for n in FACTORS if n not in CORE]
    for core in itertools.product(*[FACTORS[n] for n in CORE]):
        base = dict(zip(CORE, core))
        cells.append(Cell(**base))
        for name in features:
            for value in FACTORS[name][1:]:
                cells.append(Cell(**base, **{name: value}))
    seen = set(cells)
    cells += [c for c in covering_array(strength=3) if c not in seen]
    return cells


def product_size() -> int:
    return int(np.prod([len(v) for v in FACTORS.values()]))


# -- one cell ------------------------------------------------------------------------------------------------
class MatrixGPT(GPTModule):
    """The tiny GPT of the matrix, with the cell's model-side features:

    * ``targets="masked"``: targets whose input token is a multiple of 5 are ``IGNORE_INDEX``
      (counts differ between samples, micro-batches and replicas).
    * ``params="unused-frozen"``: a layer that never gets a gradient, and the position embedding
      frozen for batches 2-3 and trained again after (its Adam step count falls behind the rest).
    * ``optimizers="two"``: manual optimization with AdamW on the blocks and SGD with momentum on
      the rest, accumulation and clipping done by the step code as users write them.
    """

    def __init__(self, cell: Cell) -> None:
        # a fixed schedule length: a resumed cell runs epoch 1 alone first and must see the same LRs
        super().__init__(GPTConfig(**MODEL, **(EXPERTS if cell.experts == "moe" else {})), lr=LR, warmup_steps=1, decay_steps=8)
        self.cell = cell
        self.automatic_optimization = cell.optimizers == "one"
        self.unused: Optional[nn.Linear] = None
        self.unused_initial: list[torch.Tensor] = []
        self.batches_seen = 0

    def configure_model(self) -> None:
        super().configure_model()
        if self.cell.params == "unused-frozen" and self.unused is None:
            self.unused = nn.Linear(8, 8)
            self.unused_initial = [t.detach().clone() for t in (self.unused.weight, self.unused.bias)]

    def _targets(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        input_ids, targets = batch
        if self.cell.targets == "masked":
            targets = targets.masked_fill(input_ids % 5 == 0, IGNORE_INDEX)
        return input_ids, targets

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        wpe = getattr(self.model.wpe, "weight", None)  # a pipeline stub on later stages
        if self.cell.params == "unused-frozen" and wpe is not None:
            wpe.requires_grad_(self.batches_seen not in (2, 3))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        input_ids, targets = self._targets(batch)
        if self.cell.forwards == 1:
            loss = self(input_ids, targets)
        else:  # the model called on parts of the batch, one backward for all (pipelined: one schedule each)
            parts = zip(input_ids.tensor_split(self.cell.forwards), targets.tensor_split(self.cell.forwards))
            loss = sum(self(x, y) for x, y in parts) / self.cell.forwards
        self.batches_seen += 1
        if self.automatic_optimization:
            return loss
        optimizers = self.optimizers()
        self.manual_backward(loss / self.cell.accumulate)
        last = self.trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        if self.batches_seen % self.cell.accumulate == 0 or last:
            for opt in optimizers:
                if self.cell.clip != "none":
                    algorithm, value = CLIP[self.cell.clip]
                    self.clip_gradients(opt, gradient_clip_val=value, gradient_clip_algorithm=algorithm)
                opt.step()
                opt.zero_grad()
        return loss.detach()

    def configure_optimizers(self) -> Any:
        if self.automatic_optimization:
            return super().configure_optimizers()
        blocks = {id(p) for p in self.model.blocks.parameters()}
        params = list({id(p): p for p in self.parameters()}.values())
        # param groups as dicts: a pipeline rank may hold none of a group (under a V the middle ranks hold
        # no embedding or head), and torch refuses an empty list but not an empty group
        first = torch.optim.AdamW([{"params": [p for p in params if id(p) in blocks]}], lr=LR, weight_decay=0.1)
        second = torch.optim.SGD([{"params": [p for p in params if id(p) not in blocks]}], lr=0.05, momentum=0.9)
        return first, second

    def configure_callbacks(self) -> list:
        return []


def matrix_loader(last_batch: str, dp: int) -> DataLoader:
    tokens = torch.from_numpy(stdlib_bytes(20_000).astype(np.int64))
    n, t = SAMPLES[last_batch], MODEL["block_size"]
    windows = tokens[: n * (t + 1)].view(n, t + 1)
    return DataLoader(TensorDataset(windows[:, :-1], windows[:, 1:]), batch_size=GLOBAL_BATCH // dp, drop_last=False)


def _strategy(cell: Cell, layout: str, tmp: Path) -> ThreeDParallelStrategy:
    kwargs: dict[str, Any] = dict(LAYOUTS[layout])
    kwargs.update(
        zero_stage=cell.zero, bucket_size_mb=0.02, activation_checkpointing=None if cell.recompute == "none" else cell.recompute,
        offload_optimizer=None if cell.offload == "none" else cell.offload, sequence_parallel=cell.sequence_parallel, timeout=300,
        compile=False if cell.compile == "off" else {"backend": cell.compile_backend},
    )
    if cell.offload == "nvme":
        path = tmp / "nvme"
        path.mkdir(parents=True, exist_ok=True)
        kwargs["nvme_path"] = str(path)
    return ThreeDParallelStrategy(**kwargs)


def _trainer(cell: Cell, layout: str, tmp: Path, recorder: LossRecorder, epochs: int, checkpoints: Optional[Path] = None) -> L.Trainer:
    """``checkpoints``: save the way users do, through Lightning's ModelCheckpoint (``last.ckpt``)."""
    callbacks: list[Any] = [recorder]
    if checkpoints is not None:
        callbacks.append(ModelCheckpoint(dirpath=checkpoints, save_last=True))
    kwargs: dict[str, Any] = dict(
        max_epochs=epochs, limit_val_batches=0, callbacks=callbacks, strategy=_strategy(cell, layout, tmp),
        default_root_dir=str(tmp), enable_checkpointing=checkpoints is not None,
    )
    if cell.precision == "16-mixed":
        # On CPU, Lightning turns precision="16-mixed" into bf16 before the strategy sees it; the plugin
        # keeps fp16. A first scale of 2**10: the default 2**16 overflows fp16 on a loss of ~5.5 and
        # skips the first steps, which one process in fp32 does not.
        kwargs["plugins"] = [ThreeDPrecision("16-mixed", initial_scale=2.0**10)]
    else:
        kwargs["precision"] = cell.precision
    if cell.optimizers == "one":
        kwargs["accumulate_grad_batches"] = cell.accumulate
        if cell.clip != "none":
            algorithm, value = CLIP[cell.clip]
            kwargs.update(gradient_clip_val=value, gradient_clip_algorithm=algorithm)
    return quiet_trainer(**kwargs)


def _partner(cell: Cell) -> tuple[str, Cell]:
    """The layout to resume under, and the cell's settings there: sequence parallelism (a no-op at
    tp=1, where the cell may have asked for it) is dropped if the partner's ZeRO stage refuses it."""
    for layout in PARTNERS[cell.layout]:
        for settings in (cell, replace(cell, sequence_parallel=False)):
            if refusal({**asdict(settings), "layout": layout}) is None:
                return layout, settings
    raise AssertionError(f"no partner layout for {cell.id}")


class FinalWeights(L.Callback):
    """The dense weights when training ends (the fp32 masters under mixed precision), gathered over
    every layout's shards the way a consolidated checkpoint is; rank 0 keeps them. A collective: every
    rank runs it. Losses alone can miss an error in weights that move the loss little (experts)."""

    def __init__(self, initial: bool = False) -> None:
        self.initial: Optional[dict[str, np.ndarray]] = None  # also the weights before step 1, if asked
        self.weights: Optional[dict[str, np.ndarray]] = None
        self._take_initial = initial

    @staticmethod
    def _dense(trainer: L.Trainer) -> Optional[dict[str, np.ndarray]]:
        from lightning_3d.checkpoint.formats import ConsolidatedFormat

        state = ConsolidatedFormat().model_state(trainer.strategy._job())
        if trainer.global_rank != 0:
            return None
        return {k: v.detach().double().cpu().numpy() for k, v in state.items() if isinstance(v, torch.Tensor)}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._take_initial:
            self.initial = self._dense(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.weights = self._dense(trainer)


def run_cell(cell: Cell, tmp: str, model_type: type = MatrixGPT) -> dict[str, Any]:
    """Train the cell on this world (every rank calls it). Returns this rank's losses and whether the
    unused layer stayed untouched, or ``{"refused": message}``. ``model_type``: a MatrixGPT with a
    change of the test's own (another optimizer class, say)."""
    work = Path(tmp) / re.sub(r"[^A-Za-z0-9_.=-]+", "_", cell.id)
    dp = LAYOUTS[cell.layout]["data_parallel"]
    L.seed_everything(0)
    model = model_type(cell)
    recorder = LossRecorder()
    expected = refusal(asdict(cell))
    try:
        resuming = cell.resume != "no"
        trainer = _trainer(cell, cell.layout, work, recorder, 1 if resuming else EPOCHS, work / "ckpt" if resuming else None)
        final = FinalWeights(initial=cell.layout == "one")
        trainer.callbacks.append(final)
        trainer.fit(model, matrix_loader(cell.last_batch, dp))
    except (ValueError, NotImplementedError, TypeError) as err:
        if expected is None:
            raise
        return {"refused": str(err)}
    losses = list(recorder.losses)
    if cell.resume != "no":
        # the path Lightning users take: ModelCheckpoint(save_last=True) during fit, a fresh Trainer, ckpt_path=last.ckpt
        path = str(work / "ckpt" / "last.ckpt")
        partner, settings = _partner(cell)
        L.seed_everything(0)
        model = model_type(cell)
        model.batches_seen = len(losses)
        recorder = LossRecorder()
        trainer = _trainer(settings, partner, work / "resumed", recorder, EPOCHS)
        final = FinalWeights()
        trainer.callbacks.append(final)
        trainer.fit(model, matrix_loader(cell.last_batch, LAYOUTS[partner]["data_parallel"]), ckpt_path=path)
        losses += recorder.losses
    return {"losses": losses, "unused_unchanged": _unchanged(model), "weights": final.weights, "initial": final.initial}


def _unchanged(model: MatrixGPT) -> bool:
    """The unused layer still holds its initial values (it never had a gradient). Collective under ZeRO-3."""
    if model.unused is None:
        return True
    from lightning_3d.checkpoint.dense_state import to_dense

    current = [to_dense(t, None) for t in (model.unused.weight, model.unused.bias)]
    return all(torch.equal(c.detach().float(), i.to(c.dtype).float()) for c, i in zip(current, model.unused_initial))


def reference_of(cell: Cell, model_type: type = MatrixGPT) -> dict[str, Any]:
    """One process, fp32, no parallel features: the losses and final weights every layout must
    reproduce (and the initial weights, to measure how far they moved)."""
    one = replace(cell, layout="one", zero=0, precision="32-true", recompute="none", offload="none", sequence_parallel=False, resume="no")
    with tempfile.TemporaryDirectory(prefix="l3d-ref-") as tmp:
        run = run_cell(one, tmp, model_type)
    return {k: run[k] for k in ("losses", "weights", "initial")}


def weight_errors(ours: dict[str, np.ndarray], reference: dict[str, Any]) -> dict[str, float]:
    """How far our final weights are from one process's, relative to how far one process moved them
    from the initial ones (a tensor that did not move must not move here either): per tensor, and the
    whole model under the key ``""``."""
    if set(ours) != set(reference["weights"]):
        raise AssertionError(f"the final weights' names differ: {sorted(set(ours) ^ set(reference['weights']))}")
    errors, apart, moved = {}, 0.0, 0.0
    for name, ref in reference["weights"].items():
        d, m = float(np.linalg.norm(ours[name] - ref)), float(np.linalg.norm(ref - reference["initial"][name]))
        errors[name] = d / (m + 1e-6 * float(np.linalg.norm(ref)) + 1e-12)
        apart, moved = apart + d * d, moved + m * m
    errors[""] = float(np.sqrt(apart / moved)) if moved else float(apart > 0)
    return errors


def check_weights(cell: "Cell", ours: dict[str, np.ndarray], reference: dict[str, Any]) -> None:
    errors = weight_errors(ours, reference)
    whole, each = WEIGHT_RTOL[cell.precision]
    assert errors[""] <= whole, f"{cell.id}: the final weights are {errors['']:.2e} from one process's (relative to their movement), over {whole}"
    worst = max((n for n in errors if n and not n.endswith(NOISE_ONLY)), key=errors.get)
    assert errors[worst] <= each, f"{cell.id}: {worst} ends {errors[worst]:.2e} from one process's (relative to its movement), over {each}"


def global_losses(per_rank: list[dict[str, Any]]) -> np.ndarray:
    """The batch loss of each step: the mean over ranks (tp and pp peers hold the same value; data-
    parallel replicas' losses average to the batch's target mean)."""
    return np.mean(np.array([r["losses"] for r in per_rank]), axis=0)


def cells_by_world(cells: Iterable[Cell]) -> dict[int, list[Cell]]:
    worlds: dict[int, list[Cell]] = {}
    for cell in cells:
        worlds.setdefault(cell.world, []).append(cell)
    return worlds


def run_world(cells: list[Cell], tmp: str) -> dict[str, Any]:
    """Every cell of one world size, in order, on every rank (a failure is kept as a traceback)."""
    from tests.helpers import run_checks

    return run_checks({cell.id: (lambda cell=cell: run_cell(cell, tmp)) for cell in cells})


def run_references(cells: list[Cell]) -> dict[str, Any]:
    from tests.helpers import run_checks

    keys = {cell.reference_key(): cell for cell in cells}
    return run_checks({repr(key): (lambda cell=cell: reference_of(cell)) for key, cell in keys.items()})


def check_cell(cell: Cell, per_rank: list[Any], references: dict[str, Any]) -> str:
    """Assert the cell's outcome; returns "refused" or "trained"."""
    from tests.helpers import result_of

    outcomes = [result_of(r, cell.id) for r in per_rank]
    expected = refusal(asdict(cell))
    if expected is not None:
        for outcome in outcomes:
            assert "refused" in outcome, f"{cell.id}: expected a refusal matching {expected!r}, but it trained"
            assert re.search(expected, outcome["refused"]), f"{cell.id}: refused with {outcome['refused']!r}, expected {expected!r}"
        return "refused"
    reference = result_of(references, repr(cell.reference_key()))
    ours = global_losses(outcomes)
    assert len(ours) == len(reference["losses"]), (cell.id, len(ours), len(reference["losses"]))
    np.testing.assert_allclose(ours, reference["losses"], rtol=RTOL[cell.precision], err_msg=cell.id)
    assert all(o["unused_unchanged"] for o in outcomes), f"{cell.id}: a parameter without gradients changed"
    check_weights(cell, outcomes[0]["weights"], reference)
    return "trained"
