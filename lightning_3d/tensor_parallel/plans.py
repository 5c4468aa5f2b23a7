"""Tensor-parallel plans: which module of a model becomes which parallel layer, applied from outside.

A plan maps module-name patterns (``fnmatch`` per dotted segment, e.g. ``"blocks.*.attn.q_proj"``)
to styles. Styles are strings for the common cases or :class:`Style` objects:

=================  ==========================================================================
``"column"``       ``nn.Linear``/``Conv1D`` -> :class:`ColumnParallelLinear` (output split)
``"column_prepared"`` the same, without its own input collective (see ``"prepare_input"``)
``"row"``          ``nn.Linear``/``Conv1D`` -> :class:`RowParallelLinear` (input split, output reduced)
``"vocab"``        ``nn.Embedding`` -> :class:`VocabParallelEmbedding`
``"vocab_head"``   the LM head: column-parallel over the (padded) vocabulary, logits stay split
``"prepare_input"`` enter the tp region once at this module's input (copy, or all-gather with
                   sequence parallel) so that several ``"column_prepared"`` layers share it
``"rng"``          run the module's forward with per-tp-rank dropout randomness
``"replicated_rng"`` inside an ``"rng"`` module: draw from the replicated stream again (a dropout
                   after the row-parallel reduction, e.g. HF GPT-2's ``resid_dropout``)
``"sequence_split"`` split the module's output along the sequence (sequence parallel only)
``"sequence_norm"`` mark the module's parameters as computed on a sequence shard (SP only)
``"sequence_rng"``  ``"rng"`` only under sequence parallel (dropout on a sequence shard)
``"row_split_input"`` ``"row"`` for a replicated input: split it here (backward all-gathers)
``"sum_gradients"`` the module's own parameters are replicated but see partial inputs (e.g. a
                   per-head norm on this rank's heads): their gradients are summed over tp
``"share_entry"``  the column-parallel children of this module that read one tensor enter the tp
                   region once for it (one backward all-reduce), whatever else reads it; under
                   sequence parallelism the module's input is all-gathered at its entry
``"sequence_split_input"`` split the module's first input along the sequence (SP only)
=================  ==========================================================================

This module knows no model: each model family's plan lives in its adapter
(``lightning_3d/models/adapters/``), which ``parallelize`` finds through the registry.
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch.distributed as dist
from torch import Tensor, nn

from lightning_3d.core.eager import communicates
from lightning_3d.core.forward_wrappers import wrap_forward, wrapper
from lightning_3d.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from lightning_3d.tensor_parallel.mappings import (
    copy_to_tensor_parallel,
    gather_for_column_parallel,
    gather_from_tensor_parallel,
    scatter_to_sequence_parallel,
    scatter_to_tensor_parallel,
)
from lightning_3d.tensor_parallel.random import RNGStatesTracker, run_forward_in_rng_region, run_forward_outside_rng_region
from lightning_3d.tensor_parallel.spec import get_spec, mark_sequence_parallel, replicated_spec, set_spec

PARALLEL_LAYERS = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)


@dataclass
class PlanContext:
    tp_group: dist.ProcessGroup
    sequence_parallel: bool
    tracker: Optional[RNGStatesTracker]

    @property
    def world(self) -> int:
        return dist.get_world_size(self.tp_group)


class Style:
    """How one module is parallelized. Returns a replacement module, or ``None`` (changed in place)."""

    def apply(self, module: nn.Module, ctx: PlanContext) -> Optional[nn.Module]:
        raise NotImplementedError


@dataclass
class Column(Style):
    gather_output: bool = False
    input_is_prepared: bool = False
    num_blocks: int = 1
    pad_output: bool = False

    def apply(self, module: nn.Module, ctx: PlanContext) -> nn.Module:
        return ColumnParallelLinear.from_dense(
            module,
            tp_group=ctx.tp_group,
            gather_output=self.gather_output,
            sequence_parallel=ctx.sequence_parallel,
            input_is_prepared=self.input_is_prepared,
            num_blocks=self.num_blocks,
            pad_output=self.pad_output,
        )


@dataclass
class Row(Style):
    input_is_parallel: bool = True

    def apply(self, module: nn.Module, ctx: PlanContext) -> nn.Module:
        if not self.input_is_parallel and not ctx.sequence_parallel:
            return RowParallelLinear.from_dense(module, tp_group=ctx.tp_group, input_is_parallel=False)
        row = RowParallelLinear.from_dense(module, tp_group=ctx.tp_group, sequence_parallel=ctx.sequence_parallel)
        if not self.input_is_parallel:  # a replicated input: split it here, then reduce-scatter the sequence
            row.register_forward_pre_hook(lambda mod, args: (scatter_to_tensor_parallel(args[0], ctx.tp_group), *args[1:]))
        return row


@dataclass
class VocabEmbedding(Style):
    """``split_sequence=False``: the output stays whole under sequence parallelism (a model whose
    forward reads the embedding's sequence length for its masks; ``"sequence_split_input"`` on the
    first layer cuts it there instead)."""

    split_sequence: bool = True

    def apply(self, module: nn.Module, ctx: PlanContext) -> nn.Module:
        if not isinstance(module, nn.Embedding):
            raise TypeError(f"'vocab' style needs an nn.Embedding, got {type(module).__name__}.")
        split = ctx.sequence_parallel and self.split_sequence
        return VocabParallelEmbedding.from_dense(module, tp_group=ctx.tp_group, sequence_parallel=split)


def _map_first_input(args: tuple, kwargs: dict, fn: Callable[[Tensor], Tensor], names: tuple[str, ...]) -> tuple[tuple, dict]:
    if args:
        return (fn(args[0]), *args[1:]), kwargs
    for name in names:
        if name in kwargs:
            return args, {**kwargs, name: fn(kwargs[name])}
    raise ValueError(f"prepare_input: no positional input and none of {names} in the keyword arguments.")


@dataclass
class PrepareInput(Style):
    """One entry collective for everything the module's first input feeds. Under sequence parallelism
    the column layers reading the gathered input keep its sequence shard for backward, not the
    gathered tensor (:func:`~lightning_3d.tensor_parallel.mappings.gather_for_column_parallel`)."""

    names: tuple[str, ...] = ("hidden_states", "x", "input")

    def apply(self, module: nn.Module, ctx: PlanContext) -> None:
        group = ctx.tp_group
        enter = functools.partial(gather_for_column_parallel if ctx.sequence_parallel else copy_to_tensor_parallel, group=group)

        def pre_hook(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            return _map_first_input(args, kwargs, enter, self.names)

        module.register_forward_pre_hook(pre_hook, with_kwargs=True)


@dataclass
class RNGRegion(Style):
    only_with_sequence_parallel: bool = False

    def apply(self, module: nn.Module, ctx: PlanContext) -> None:
        if self.only_with_sequence_parallel and not ctx.sequence_parallel:
            return
        if ctx.tracker is None:
            raise ValueError("an 'rng' style needs an RNGStatesTracker in the plan context.")
        run_forward_in_rng_region(module, ctx.tracker)


class ReplicatedRNG(Style):
    def apply(self, module: nn.Module, ctx: PlanContext) -> None:
        if ctx.tracker is None:
            raise ValueError("a 'replicated_rng' style needs an RNGStatesTracker in the plan context.")
        run_forward_outside_rng_region(module, ctx.tracker)


@dataclass
class SequenceSplit(Style):
    dim: int = -2

    def apply(self, module: nn.Module, ctx: PlanContext) -> None:
        if not ctx.sequence_parallel:
            return
        module.register_forward_hook(lambda mod, args, out: scatter_to_sequence_parallel(out, ctx.tp_group, self.dim))


class SequenceNorm(Style):
    def apply(self, module: nn.Module, ctx: PlanContext) -> None:
        if not ctx.sequence_parallel:
            return
        for p in module.parameters(recurse=False):
            mark_sequence_parallel(p, ctx.tp_group)


class SumGradients(Style):
    def apply(self, module: nn.Module, ctx: PlanContext) -> None:
        for p in module.parameters(recurse=False):
            mark_sequence_parallel(p, ctx.tp_group)


class SharedEntry:
    """One entry into the tp region per input tensor, for the column layers of one module's forward.

    Several column-parallel layers reading the same tensor (q/k/v, gate/up) then share one
    ``copy_to_tensor_parallel``: one backward all-reduce of their summed input gradients instead of
    one each. Anything else reading the tensor (a replicated router, a residual) reads it as it is,
    so its gradient is not summed over tp. Under sequence parallelism the module's first input is
    all-gathered at its entry (its own code then sees whole sequences), and that gathered tensor is
    the prepared input of the column layers reading it; a column layer reading anything else enters
    by a copy. The table lives only while the module's forward runs (opened and closed around it,
    also when recompute re-runs it or stops it early), so no tensor outlives the forward here."""

    def __init__(self, group: dist.ProcessGroup, sequence_parallel: bool) -> None:
        self.group, self.sequence_parallel = group, sequence_parallel
        self.entered: dict[int, tuple[Tensor, Tensor]] = {}
        self.depth = 0

    def enter(self, x: Tensor) -> Tensor:
        known = self.entered.get(id(x))
        if known is not None and known[0] is x:
            return known[1]
        entered = copy_to_tensor_parallel(x, self.group)
        if self.depth:  # (outside the module's forward nothing is kept)
            self.entered[id(x)] = (x, entered)
        return entered

    def gather(self, x: Tensor) -> Tensor:
        """Sequence parallelism: the module's input, whole, already inside the region."""
        gathered = gather_for_column_parallel(x, self.group)
        self.entered[id(gathered)] = (gathered, gathered)
        return gathered


SHARED_ENTRY = "tp_shared_entry"  # the forward wrapper of a module whose readers share one entry into tp


class ShareEntry(Style):
    names: tuple[str, ...] = ("hidden_states", "x", "input")

    def apply(self, module: nn.Module, ctx: PlanContext) -> None:
        scope = SharedEntry(ctx.tp_group, ctx.sequence_parallel)

        def make(original: Any) -> Any:
            @functools.wraps(original)
            @communicates  # (it gathers under SP, and keeps Python state across its children's calls)
            def forward(*args: Any, **kwargs: Any) -> Any:
                for child in module.children():
                    if isinstance(child, ColumnParallelLinear) and not child.input_is_prepared:
                        child.shared_entry = scope
                scope.depth += 1
                try:
                    if scope.sequence_parallel:
                        args, kwargs = _map_first_input(args, kwargs, scope.gather, self.names)
                    return original(*args, **kwargs)
                finally:
                    scope.depth -= 1
                    if not scope.depth:
                        scope.entered.clear()

            return forward

        wrap_forward(module, SHARED_ENTRY, make, state=scope)  # what runs inside sees whole sequences


class SequenceSplitInput(Style):
    """Under sequence parallelism: split the module's first input along the sequence (the first
    decoder layer of a model whose forward needs whole sequences before it)."""

    names: tuple[str, ...] = ("hidden_states", "x", "input")

    def apply(self, module: nn.Module, ctx: PlanContext) -> None:
        if not ctx.sequence_parallel:
            return

        def split(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            return _map_first_input(args, kwargs, lambda x: scatter_to_sequence_parallel(x, ctx.tp_group), self.names)

        module.register_forward_pre_hook(split, with_kwargs=True)


def mark_sequence_sharded_replicas(module: nn.Module, group: dist.ProcessGroup, skip: Collection[nn.Module] = ()) -> int:
    """Under sequence parallelism: every replicated parameter of ``module`` that is applied to a
    sequence shard (outside the modules whose input a ``"share_entry"`` gathers, and outside ``skip``:
    modules that gather their input themselves) gets partial gradients, summed over tp (the norms of
    a decoder layer); returns how many were marked."""
    count = 0
    skipped = {id(m) for m in skip}

    def visit(m: nn.Module) -> None:
        nonlocal count
        if wrapper(m, SHARED_ENTRY) is not None or id(m) in skipped:
            return  # inside: whole sequences, the plan's own marks apply
        for p in m.parameters(recurse=False):
            spec = get_spec(p)
            if spec is None or spec.dim is None:
                mark_sequence_parallel(p, group)
                count += 1
        for child in m.children():
            visit(child)

    visit(module)
    return count


@dataclass
class DivideAttributes(Style):
    """Per-rank head counts and split sizes for code that reads them (e.g. HF GPT-2 attention)."""

    names: tuple[str, ...]

    def apply(self, module: nn.Module, ctx: PlanContext) -> None:
        for name in self.names:
            value = getattr(module, name)
            if value % ctx.world:
                raise ValueError(f"{type(module).__name__}.{name}={value} is not divisible by tensor_parallel={ctx.world}.")
            setattr(module, name, value // ctx.world)


NAMED_STYLES: dict[str, Style] = {
    "column": Column(),
    "column_prepared": Column(input_is_prepared=True),
    "row": Row(),
    "vocab": VocabEmbedding(),
    "vocab_head": Column(pad_output=True),
    "prepare_input": PrepareInput(),
    "rng": RNGRegion(),
    "replicated_rng": ReplicatedRNG(),
    "sequence_split": SequenceSplit(),
    "sequence_norm": SequenceNorm(),
    "sequence_rng": RNGRegion(only_with_sequence_parallel=True),
    "row_split_input": Row(input_is_parallel=False),
    "sum_gradients": SumGradients(),
    "share_entry": ShareEntry(),
    "sequence_split_input": SequenceSplitInput(),
}

StyleSpec = Union[str, Style, Iterable[Union[str, Style]]]


@dataclass
class TensorParallelPlan:
    """Module-name patterns -> styles, plus model-level steps (validation, loss, outputs)."""

    styles: dict[str, StyleSpec]
    check: Optional[Callable[[nn.Module, int], None]] = None
    finalize: Optional[Callable[[nn.Module, PlanContext], None]] = None
    supports_sequence_parallel: bool = True
    name: str = "custom"
    notes: list[str] = field(default_factory=list)


def _styles_of(spec: StyleSpec) -> list[Style]:
    items = [spec] if isinstance(spec, (str, Style)) else list(spec)
    styles = []
    for item in items:
        if isinstance(item, str):
            if item not in NAMED_STYLES:
                raise ValueError(f"unknown tensor-parallel style {item!r}; known: {', '.join(NAMED_STYLES)}.")
            item = NAMED_STYLES[item]
        styles.append(item)
    return styles


def matches_pattern(name: str, pattern: str) -> bool:
    """Whether module ``name`` matches a plan pattern (``fnmatch`` per dotted segment)."""
    parts, pats = name.split("."), pattern.split(".")
    return len(parts) == len(pats) and all(fnmatch.fnmatchcase(a, b) for a, b in zip(parts, pats))


def shared_parameters(model: nn.Module) -> list[list[tuple[str, str]]]:
    """Groups of (module name, attribute) that hold one and the same Parameter (tied weights)."""
    owners: dict[int, list[tuple[str, str]]] = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for attr, p in mod.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append((mod_name, attr))
    return [sorted(set(o)) for o in owners.values() if len(set(o)) > 1]


def _get(model: nn.Module, name: str) -> nn.Module:
    return model.get_submodule(name) if name else model


def apply_plan(model: nn.Module, plan: TensorParallelPlan, ctx: PlanContext) -> nn.Module:
    """Parallelize ``model`` in place (idempotent) and return it."""
    if getattr(model, "_tensor_parallel_plan", None) is not None:
        return model
    if ctx.sequence_parallel and not plan.supports_sequence_parallel:
        raise NotImplementedError(f"the {plan.name} plan does not support sequence_parallel=True yet; use sequence_parallel=False.")
    if plan.check is not None:
        plan.check(model, ctx.world)
    ties = shared_parameters(model)
    names = [name for name, _ in model.named_modules()]
    unmatched = set(plan.styles)
    for name in names:
        for pattern, spec in plan.styles.items():
            if not matches_pattern(name, pattern):
                continue
            unmatched.discard(pattern)
            for style in _styles_of(spec):
                module = _get(model, name)
                try:
                    replacement = style.apply(module, ctx)
                except (ValueError, TypeError) as err:
                    raise type(err)(f"tensor-parallel plan {plan.name!r}, module {name!r}: {err}") from err
                if replacement is not None:
                    parent, _, child = name.rpartition(".")
                    setattr(_get(model, parent), child, replacement)
    if unmatched:
        raise ValueError(f"tensor-parallel plan {plan.name!r}: patterns {sorted(unmatched)} matched no module.")
    _retie(model, ties)
    for p in model.parameters():
        if get_spec(p) is None:
            set_spec(p, replicated_spec(p, ctx.tp_group))
    if plan.finalize is not None:
        plan.finalize(model, ctx)
    model._tensor_parallel_plan = plan
    return model


def _retie(model: nn.Module, ties: list[list[tuple[str, str]]]) -> None:
    """Tied weights (embedding / LM head) stay tied when both sides were parallelized alike."""
    for group in ties:
        params = [getattr(_get(model, m), a) for m, a in group]
        if all(p is params[0] for p in params):
            continue
        specs = [get_spec(p) for p in params]
        if any(s is None for s in specs) or len({(s.dim, s.padded_size, tuple(p.shape)) for s, p in zip(specs, params)}) != 1:
            names = [f"{m}.{a}" for m, a in group]
            raise ValueError(f"tied parameters {names} must be parallelized the same way (e.g. 'vocab' and 'vocab_head').")
        first_module, first_attr = group[0]
        for m, a in group[1:]:
            setattr(_get(model, m), a, getattr(_get(model, first_module), first_attr))


# -- shared by the model families' plans (lightning_3d/models/adapters) ------------------------------------
def gather_logits_hook(vocab_size: int, ctx: PlanContext) -> Callable[..., Any]:
    """Without targets a model returns logits: give callers the full vocabulary, as at tp=1 (a plan's
    ``finalize`` registers it as the model's forward hook; the loss stays vocab-parallel)."""

    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        if isinstance(output, Tensor):  # GPT: a 0-dim loss with targets, logits without
            return output if output.dim() == 0 else gather_from_tensor_parallel(output, ctx.tp_group).narrow(-1, 0, vocab_size)
        if getattr(output, "loss", None) is None and getattr(output, "logits", None) is not None:
            output.logits = gather_from_tensor_parallel(output.logits, ctx.tp_group).narrow(-1, 0, vocab_size)
        return output

    return hook
