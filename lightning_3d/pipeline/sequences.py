"""Models as layer sequences: ``inputs -> embed -> blocks[0..n) -> head``.

This is the contract a model meets to be pipelined. Only one tensor (the hidden states) crosses
a stage boundary; everything else a piece needs (targets, positions, masks) is recomputed from
the batch, which every pipeline rank loads. Each model family's sequence lives in its adapter
(``lightning_3d/models/adapters/``: ``ModelAdapter.layer_sequence``); a user's model declares its
own by defining ``pipeline_sequence(self) -> LayerSequence``. This module knows no model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

from torch import Tensor, nn

Inputs = dict[str, Any]


@dataclass
class HeadOutput:
    loss: Optional[Tensor] = None  # mean over this micro-batch's counted targets
    logits: Optional[Tensor] = None


@dataclass
class LayerSequence:
    """How to run a model piece by piece.

    Args:
        blocks: the repeated layers (``hidden -> hidden``) that pipeline stages divide.
        blocks_name: their attribute path inside the model (unowned blocks are replaced by stubs).
        embed_modules / head_modules: module paths only the first / last stage needs.
        inputs: ``forward``'s ``(args, kwargs)`` -> named tensors (split along dim 0 into micro-batches).
        embed: named micro-batch inputs -> hidden states.
        block: ``(layer, hidden, inputs)`` -> hidden states.
        head: ``(hidden, inputs)`` -> :class:`HeadOutput` (the loss when targets are present).
        target_count: how many targets a micro-batch's loss averages over (weights micro-batch losses,
            so uneven micro-batches and ignored labels give the full-batch mean): an int, or a 0-dim
            integer tensor on the inputs' device, which the data-parallel loss rescaling uses
            without reading it on the host.
        output: ``(loss, logits)`` -> what ``forward`` returns at ``pipeline_parallel=1``.
        loss_of: what ``forward`` returned -> its loss (``None`` without targets).
        with_loss: ``(what forward returned, new loss)`` -> the same output carrying the new loss.
        loss_inputs: ``forward``'s ``(args, kwargs)`` -> what ``target_count`` needs, read without
            ``inputs``' rules (at ``pipeline_parallel=1`` the model takes any argument of its own;
            only the data-parallel loss weighting reads it). ``None``: ``inputs``.
        before_split: ``forward``'s ``(args, kwargs)`` -> the same, with what needs the whole
            sequence made explicit before context parallelism cuts it (labels shifted by one,
            positions); ``None``: nothing to do (the model reads true positions from its seams).
        aux_loss: a block -> the auxiliary loss its last training forward produced (taken once: an
            MoE layer's balance and z-losses), which the model adds to its loss; a pipeline stage
            adds its blocks' to the gradient it propagates and to the reported loss. ``None``: none.
            Auxiliary losses are means over sequences: the loss weighting weighs them by sequences.
        aux_in_loss: what ``forward`` returned -> the auxiliary part its loss includes (``None``:
            none), which the data-parallel loss normalization weighs by sequences, not targets.
    """

    blocks: nn.ModuleList
    blocks_name: str
    embed_modules: tuple[str, ...]
    head_modules: tuple[str, ...]
    inputs: Callable[[tuple, dict], Inputs]
    embed: Callable[[Inputs], Tensor]
    block: Callable[[nn.Module, Tensor, Inputs], Tensor]
    head: Callable[[Tensor, Inputs], HeadOutput]
    target_count: Callable[[Inputs], Union[int, Tensor]]
    output: Callable[[Optional[Tensor], Optional[Tensor]], Any]
    loss_of: Callable[[Any], Optional[Tensor]] = field(default=lambda out: _tensor_loss_of(out))
    with_loss: Callable[[Any, Tensor], Any] = field(default=lambda out, loss: loss)
    loss_inputs: Optional[Callable[[tuple, dict], Inputs]] = None
    before_split: Optional[Callable[[tuple, dict], tuple[tuple, dict]]] = None
    aux_loss: Optional[Callable[[nn.Module], Optional[Tensor]]] = None
    aux_in_loss: Optional[Callable[[Any], Optional[Tensor]]] = None


def _tensor_loss_of(out: Any) -> Optional[Tensor]:
    """A forward that returns a 0-dim tensor with targets (a loss) and logits without."""
    return out if isinstance(out, Tensor) and out.dim() == 0 else None
