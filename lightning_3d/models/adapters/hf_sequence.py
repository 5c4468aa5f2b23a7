"""A Hugging Face causal LM as a layer sequence, from its ``base_model_pp_plan`` and its own code.

transformers' pipeline plan names the pieces (``embed_tokens`` -> ``layers`` -> ``norm``, and the
causal LM's ``lm_head``) but not what the model's ``forward`` does between them: Granite multiplies
the embeddings, Gemma 3 computes one rotary table per layer type, Qwen2 and Gemma give sliding
layers another mask, Gemma 2 soft-caps the logits, Granite scales them. Rewriting each family's
forward piece by piece is where silent differences hide, so this module runs the model's *own*
``forward`` and only swaps its decoder layers for recorders:

* **embed**: the base model's forward runs on the micro-batch's ``input_ids`` with every layer
  replaced by a recorder that passes the hidden states through. What reaches layer 0 is the
  embedding exactly as HF computes it (scaled, with positions, dropout), and each recorder keeps
  the arguments its layer would get (masks, rotary tables, positions); the forward is stopped
  after the last recorder, before the final norm.
* **block** ``i``: layer ``i`` called with the hidden states and the arguments recorded for ``i``.
  A stage without the embedding records them the same way from zeros of the micro-batch's token
  shape as ``inputs_embeds`` (no gradient; only shapes, dtype and device are read by the masks).
* **head**: the causal LM's class ``forward`` runs with the recorders again, the last one
  returning the stage's hidden states: HF's own final norm, ``lm_head``, soft-capping or logit
  scaling and loss follow.

The one structural assumption -- the base model calls its layers in order with the hidden states
as first argument and the next layer gets what the previous returned -- is checked on every
capture (a family that indexes a layer's output tuple fails loudly, naming itself).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Union

import torch
from torch import Tensor, nn

from lightning_3d.models.adapters.hf_context_parallel import before_split
from lightning_3d.pipeline.sequences import HeadOutput, Inputs, LayerSequence

# what a pipelined HF model takes: each is split along the batch with the micro-batches
HF_INPUTS = ("input_ids", "labels", "attention_mask", "position_ids", "shift_labels")


def hf_inputs(args: tuple, kwargs: dict) -> Inputs:
    """``input_ids``, ``labels`` (-100 ignored), ``attention_mask`` (1 = token, 0 = padding),
    ``position_ids`` and ``shift_labels`` (labels already shifted: context parallelism passes
    them): what supervised fine-tuning batches carry."""
    known = {*HF_INPUTS, "use_cache"}
    unsupported = {k for k, v in kwargs.items() if v is not None} - known
    if unsupported:
        raise NotImplementedError(
            f"pipelined Hugging Face models take {sorted(known - {'use_cache', 'shift_labels'})}; got {sorted(unsupported)}. "
            f"Compute other inputs inside the model, or use pipeline_parallel=1."
        )
    mask = kwargs.get("attention_mask")
    if mask is not None and mask.dim() != 2:
        raise ValueError(
            f"pipelined Hugging Face models take a 2-D attention_mask [batch, sequence] (1 = token, 0 = padding); "
            f"got shape {tuple(mask.shape)}. Pass the tokenizer's padding mask, not a 4-D attention bias."
        )
    out = {name: kwargs.get(name) for name in HF_INPUTS}
    out["input_ids"] = args[0] if args else kwargs.get("input_ids")
    return out


def hf_loss_inputs(args: tuple, kwargs: dict) -> Inputs:
    """The labels, whatever else an unpipelined HF forward is given (for the dp loss weighting)."""
    return {"labels": kwargs.get("labels"), "shift_labels": kwargs.get("shift_labels")}


def hf_target_count(batch: Inputs) -> Union[int, Tensor]:
    """Targets HF's causal-LM loss averages over: labels after the shift that are not -100 (a device
    count: nothing read on the host)."""
    shifted = batch.get("shift_labels")
    if shifted is not None:
        return (shifted != -100).sum()
    labels = batch["labels"]
    return (labels[..., 1:] != -100).sum() if labels is not None else 0


def hf_output(loss: Optional[Tensor], logits: Optional[Tensor]) -> Any:
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return CausalLMOutputWithPast(loss=loss, logits=logits)


def _loss_of(out: Any) -> Optional[Tensor]:
    return getattr(out, "loss", None)


def _with_loss(out: Any, loss: Tensor) -> Any:
    out.loss = loss
    return out


def first_output(out: Any) -> Tensor:
    """A decoder layer's hidden states (older families return a tuple)."""
    return out[0] if isinstance(out, tuple) else out


class _Stop(Exception):
    """Ends a base model's forward after the last recorder (the stage's blocks run separately)."""


@dataclass
class _Capture:
    """One pass of the base model's forward through the recorders."""

    family: str
    inject: Optional[Tensor] = None  # the last recorder returns this (the head's hidden states)
    stop: bool = True  # raise after the last recorder instead of letting the forward finish
    first: Optional[Tensor] = None
    calls: list[tuple[tuple, dict]] = field(default_factory=list)

    def visit(self, index: int, count: int, hidden: Tensor, args: tuple, kwargs: dict) -> Tensor:
        if index != len(self.calls) or (self.first is not None and hidden.shape != self.first.shape):
            raise RuntimeError(
                f"{self.family}: its forward does not call its decoder layers in order, each with the previous "
                f"layer's hidden states (layer {index} got shape {tuple(hidden.shape)}), so lightning_3d cannot "
                f"pipeline it from its own code; register an adapter with its layer sequence "
                f"(lightning_3d.models.adapters.register_adapter), or use pipeline_parallel=1."
            )
        if self.first is None:
            self.first = hidden
        self.calls.append((args, kwargs))
        if index == count - 1:
            if self.stop:
                raise _Stop()
            if self.inject is not None:
                return self.inject
        return hidden


class _Recorder(nn.Module):
    """Stands in for decoder layer ``index`` during a capture."""

    def __init__(self, owner: "HFSequence", index: int) -> None:
        super().__init__()
        self.owner, self.index = [owner], index  # (a list: not a submodule)

    def forward(self, hidden: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        owner = self.owner[0]
        assert owner.capture is not None
        return owner.capture.visit(self.index, owner.count, hidden, args, kwargs)


def _split_path(path: str) -> tuple[str, str]:
    parent, _, child = path.rpartition(".")
    return parent, child


class HFSequence:
    """The pieces of one HF causal LM (see the module docstring).

    Args:
        model: the causal LM (``...ForCausalLM``).
        base: its attribute holding the base model (``base_model_prefix``: ``"model"``, ``"transformer"``).
        layers: the decoder layers' attribute inside the base model (``"layers"``, ``"h"``).
    """

    def __init__(self, model: nn.Module, base: str, layers: str) -> None:
        self.model, self.base_name, self.layers_name = model, base, layers
        self.base = model.get_submodule(base)
        self.blocks: nn.ModuleList = self.base.get_submodule(layers)
        self.count = len(self.blocks)
        self.recorders = nn.ModuleList([_Recorder(self, i) for i in range(self.count)])
        self.capture: Optional[_Capture] = None
        self.family = type(model).__name__

    @contextmanager
    def _recording(self, capture: _Capture) -> Iterator[_Capture]:
        parent_path, child = _split_path(self.layers_name)
        parent = self.base.get_submodule(parent_path) if parent_path else self.base
        original = parent._modules[child]
        parent._modules[child] = self.recorders
        self.capture = capture
        try:
            yield capture
        except _Stop:
            pass
        finally:
            parent._modules[child] = original
            self.capture = None

    def _base_inputs(self, batch: Inputs) -> dict[str, Any]:
        return {
            "attention_mask": batch.get("attention_mask"),
            "position_ids": batch.get("position_ids"),
            "use_cache": False,
        }

    def _record(self, batch: Inputs, **inputs: Any) -> _Capture:
        with self._recording(_Capture(self.family)) as capture:
            self.base(**inputs, **self._base_inputs(batch))
        if len(capture.calls) != self.count:
            raise RuntimeError(
                f"{self.family}: its forward called {len(capture.calls)} of its {self.count} decoder layers; "
                f"register an adapter with its layer sequence, or use pipeline_parallel=1."
            )
        batch["_layer_calls"] = capture.calls
        return capture

    # -- LayerSequence callables ---------------------------------------------------------------------------
    def embed(self, batch: Inputs) -> Tensor:
        capture = self._record(batch, input_ids=batch["input_ids"])
        assert capture.first is not None
        return capture.first

    @staticmethod
    def _placeholder(batch: Inputs, x: Tensor) -> Tensor:
        """What a stage without the embedding gives the forward as ``inputs_embeds``: zeros (no memory)
        of the micro-batch's token shape, whole sequences even when ``x`` is a sequence shard (the
        masks and positions are the whole sequence's)."""
        ids = batch["input_ids"]
        return torch.zeros((), dtype=x.dtype, device=x.device).expand(ids.shape[0], ids.shape[1], x.shape[-1])

    def block(self, layer: nn.Module, x: Tensor, batch: Inputs) -> Tensor:
        if "_layer_calls" not in batch:  # a stage without the embedding: record from the received hidden states
            with torch.no_grad():
                self._record(batch, inputs_embeds=self._placeholder(batch, x))
        index = next(i for i, b in enumerate(self.blocks) if b is layer)
        args, kwargs = batch["_layer_calls"][index]
        return first_output(layer(x, *args, **kwargs))

    def head(self, x: Tensor, batch: Inputs) -> HeadOutput:
        labels, shifted = batch.get("labels"), batch.get("shift_labels")
        extra = {"shift_labels": shifted} if shifted is not None else {}
        with self._recording(_Capture(self.family, inject=x, stop=False)):
            # the class's forward: not the instance's (the pipeline runtime's) nor the hooks around it
            out = type(self.model).forward(
                self.model, input_ids=None, inputs_embeds=self._placeholder(batch, x), labels=labels,
                **self._base_inputs(batch), **extra,
            )
        if labels is None:
            return HeadOutput(logits=out.logits)
        return HeadOutput(loss=out.loss)

    def sequence(self, embed_modules: tuple[str, ...], head_modules: tuple[str, ...]) -> LayerSequence:
        return LayerSequence(
            blocks=self.blocks,
            blocks_name=f"{self.base_name}.{self.layers_name}",
            embed_modules=embed_modules,
            head_modules=head_modules,
            inputs=hf_inputs,
            embed=self.embed,
            block=self.block,
            head=self.head,
            target_count=hf_target_count,
            output=hf_output,
            loss_of=_loss_of,
            with_loss=_with_loss,
            loss_inputs=hf_loss_inputs,
            before_split=before_split,
        )


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


@dataclass(frozen=True)
class PipelinePlan:
    """What a ``base_model_pp_plan`` says, resolved against the model: paths from the causal LM."""

    base: str
    layers: str
    embed_modules: tuple[str, ...]
    head_modules: tuple[str, ...]


def pipeline_plan(model: nn.Module, plan: Optional[dict[str, Any]]) -> tuple[Optional[PipelinePlan], str]:
    """The model's pipeline pieces from transformers' plan (``model._pp_plan``: the base model's
    ``base_model_pp_plan`` prefixed, and the causal LM's head): ``(plan, "")``, or ``(None, why)``
    when the plan is missing or says what this engine cannot split."""
    if not plan:
        return None, (
            f"transformers' config of {type(model).__name__} has no base_model_pp_plan (the decoder layers and "
            f"what runs before and after them)"
        )
    base_prefix = (getattr(model, "base_model_prefix", "") or "model") + "."
    # the base model's entries in its plan's order, then the causal LM's own (lm_head: after them all)
    names = [n for n in plan if n.startswith(base_prefix)] + [n for n in plan if not n.startswith(base_prefix)]
    lists = [n for n in names if isinstance(_find(model, n), nn.ModuleList)]
    if len(lists) != 1 or "." not in lists[0]:
        return None, f"its pipeline plan {names} does not name exactly one list of decoder layers inside the base model"
    layers = lists[0]
    before, after = names[: names.index(layers)], names[names.index(layers) + 1 :]
    embeddings = getattr(model, "get_input_embeddings", lambda: None)()
    for name in before:
        module = _find(model, name)
        if module is not embeddings and module is not None and _has_parameters(module):
            return None, (
                f"{name} runs before the decoder layers and has weights of its own besides the token embedding (a "
                f"stage without it could not rebuild the layers' inputs)"
            )
    base, _, inner = layers.partition(".")
    unnamed = [f"{base}.{n}" for n, m in model.get_submodule(base).named_children() if f"{base}.{n}" not in names and _has_parameters(m)]
    if unnamed:  # kept on every stage, updated by one: refuse rather than train copies that drift
        return None, f"{unnamed} hold weights but are not in its pipeline plan (which stage runs them is unknown)"
    embed = tuple(n for n in before if (m := _find(model, n)) is not None and _has_parameters(m))
    head = [n for n in after if (m := _find(model, n)) is not None and _has_parameters(m)]
    head += [n for n, m in model.named_children() if n != base and n not in head and _has_parameters(m)]
    return PipelinePlan(base, inner, embed, tuple(head)), ""


def _find(model: nn.Module, path: str) -> Optional[nn.Module]:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def hf_pipeline_sequence(model: nn.Module, plan: PipelinePlan) -> LayerSequence:
    """The layer sequence of ``model`` described by ``plan`` (see :class:`HFSequence`)."""
    return HFSequence(model, plan.base, plan.layers).sequence(plan.embed_modules, plan.head_modules)
