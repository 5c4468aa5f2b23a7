"""transformers' mixture-of-experts blocks under expert and tensor parallelism.

transformers 5 gives every MoE family one convention (``@use_experts_implementation``): a block
(the decoder layer's ``mlp``) runs its own router (``gate``), then calls its ``experts`` module as
``experts(hidden (N, H), top_k_index (N, k), top_k_weights (N, k))``, which holds the experts as two
stacks, ``gate_up_proj`` ``(E, 2I, H)`` and ``down_proj`` ``(E, H, I)`` (``(E, H, 2I)`` and
``(E, I, H)`` where ``is_transposed``), and gates with its own ``_apply_gate``; some blocks add
shared experts (DeepSeek-V3's ``shared_experts``).

Only the experts' computation is replaced here: the rows each token routes are sorted by expert,
sent to the rank holding their expert (expert parallelism: two uneven all-to-alls), multiplied by
the stacks with grouped GEMM and summed back per token -- ``lightning_3d.moe``'s dispatch, the one
the reference GPT's MoE layers use. Everything else is the family's own code: the router (Mixtral's
softmax, Qwen3-MoE's and OLMoE's ``norm_topk_prob``, DeepSeek-V3's sigmoid scores, score-correction
bias, group-limited top-k and scaling factor), the gate, the shared experts, the block's sum. The
parameters keep their names and stacked shapes, so checkpoints, ``from_pretrained`` and the export
are unchanged; an expert slice records its place in the stack (dim 0) like the reference GPT's.

Under tensor parallelism the tp ranks hold the same tokens and split the experts further (``E / (ep
x tp)`` each, as the reference GPT does; docs/moe.md): each computes its experts' rows and its slice
of the shared experts, and the block's output is their sum over tp (under sequence parallelism the
block gathers the sequence first and reduce-scatters its output). transformers' own plan entries for
the experts (``moe_tp_experts``, ``packed_colwise`` stacks, the shared experts' columns and rows) are
therefore not applied (:func:`is_expert_entry`).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_3d.core.eager import communicates
from lightning_3d.core.forward_wrappers import wrap_forward
from lightning_3d.models.adapters.base import model_parallel_degrees
from lightning_3d.moe.expert_parallel import keep_slice, split_shared_experts
from lightning_3d.moe.experts import grouped_mm
from lightning_3d.moe.layer import backpropagate_share, enter_tensor_parallel_share, leave_tensor_parallel_share, run_experts
from lightning_3d.moe.router import Routing
from lightning_3d.tensor_parallel.spec import mark_sequence_parallel

STACKS = ("gate_up_proj", "down_proj")
SHARED = "shared_experts"
SHARED_LINEARS = ("gate_proj", "up_proj", "down_proj")
EXPERTS_KIND, BLOCK_KIND, ROUTER_KIND = "hf_experts", "hf_moe_tensor_parallel", "hf_router_logits"


def _stacked(experts: nn.Module) -> Optional[str]:
    """Why ``experts`` is not a stack this module computes (None: it is)."""
    own = {name for name, _ in experts.named_parameters(recurse=False)}
    if own != set(STACKS):
        return f"its experts hold {sorted(own)}, not exactly {list(STACKS)}"
    if not hasattr(experts, "is_transposed") or not callable(getattr(experts, "_apply_gate", None)):
        return "its experts are not transformers' stacked experts (@use_experts_implementation)"
    unsupported = [flag for flag in ("has_bias", "has_post_expert_norm") if getattr(experts, flag, False)]
    if not getattr(experts, "has_gate", True):
        unsupported.append("no gate")
    if unsupported:
        return f"its experts have {', '.join(unsupported)}"
    gate_up, down = experts.gate_up_proj, experts.down_proj
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[0] != down.shape[0]:
        return f"its stacks are shaped {tuple(gate_up.shape)} and {tuple(down.shape)}"
    return None


def moe_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The MoE blocks of a transformers model: modules with a router (``gate``) and ``experts``
    holding stacked weights (a dense block's ``gate_proj`` is not a ``gate``)."""
    return [
        (name, m) for name, m in model.named_modules()
        if isinstance(getattr(m, "experts", None), nn.Module) and isinstance(getattr(m, "gate", None), nn.Module)
        and any(p.dim() == 3 for p in m.experts.parameters(recurse=False))
    ]


def moe_refusal(model: nn.Module, tensor_parallel: int) -> Optional[str]:
    """Why the model's MoE blocks cannot run split (None: they can): experts of another convention, or
    under tensor parallelism a part of the block other than router, experts and shared SwiGLU experts
    (its output would be summed over tp without being split)."""
    for name, block in moe_blocks(model):
        why = _stacked(block.experts)
        if why:
            return f"{name}: {why}"
        if tensor_parallel > 1 and float(getattr(block, "jitter_noise", 0.0) or 0.0) > 0:
            return (
                f"{name} multiplies its input by random jitter before routing (router_jitter_noise="
                f"{block.jitter_noise}), in place, which tensor-parallel ranks would draw apart and route apart; set "
                f"router_jitter_noise=0 under tensor parallelism"
            )
        if tensor_parallel > 1:
            for child, module in block.named_children():
                if child in ("gate", "experts") or not any(True for _ in module.parameters()):
                    continue
                linears = {n for n, m in module.named_children() if type(m) is nn.Linear and m.bias is None}
                if child != SHARED or linears != set(SHARED_LINEARS) or any(True for _ in module.parameters(recurse=False)):
                    return (
                        f"{name}.{child} ({type(module).__name__}) is neither the router, the experts nor shared SwiGLU experts "
                        f"(gate_proj, up_proj, down_proj without bias), which tensor parallelism would have to split"
                    )
    return None


def is_expert_entry(pattern: str, style: str) -> bool:
    """A transformers plan entry for the experts or shared experts of an MoE block, which the experts'
    own split replaces (the dense MLPs of DeepSeek's first blocks keep theirs: ``mlp.gate_proj``)."""
    parts = pattern.split(".")
    return style.startswith("moe_") or "experts" in parts or SHARED in parts


class _Stack:
    """A block's stacked experts as :class:`~lightning_3d.moe.experts.ExpertStack`: rows sorted by
    expert times the module's own weights (read at each call: ZeRO-3 gathers them into the module),
    gated by the module's own ``_apply_gate``."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    @property
    def n_experts(self) -> int:
        """The experts this rank holds (its slice of the stack)."""
        return self.module.gate_up_proj.shape[0]

    def __call__(self, x: Tensor, offsets: Tensor, counts: Optional[list[int]] = None) -> Tensor:
        m = self.module
        gate_up, down = m.gate_up_proj, m.down_proj
        if not m.is_transposed:  # (E, out, in) as nn.Linear stores it: grouped GEMM takes (E, in, out)
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
        return grouped_mm(m._apply_gate(grouped_mm(x, gate_up, offsets, counts)), down, offsets, counts)


def _experts_forward(experts: nn.Module, n_experts: int, group: Any, tp: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    stack = _Stack(experts)

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        @communicates
        def forward(hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
            # (only the choices and their weights are read: the router's scores and logits stay transformers')
            routing = Routing(weights=top_k_weights, experts=top_k_index, scores=top_k_weights, logits=top_k_weights)
            # weighted and summed as transformers does: the rows times the router's (fp32) weights, promoted
            combine_dtype = torch.promote_types(hidden_states.dtype, top_k_weights.dtype)
            out = run_experts(hidden_states, routing, n_experts, stack, group, tp, combine_dtype=combine_dtype)
            return out.to(hidden_states.dtype)

        return forward

    return make


def _block_forward(tp: Any, sequence_parallel: bool) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The block under tensor parallelism: every tp rank routes every token and computes a share of the
    output (its experts' rows, its slice of the shared experts), summed over tp, as the reference GPT's
    MoE layer does."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        @communicates
        def forward(hidden_states: Tensor, *args: Any, **kwargs: Any) -> Tensor:
            out = original(enter_tensor_parallel_share(hidden_states, tp, sequence_parallel), *args, **kwargs)
            if not isinstance(out, Tensor):
                raise TypeError(
                    f"a Hugging Face MoE block under tensor parallelism returned {type(out).__name__}, not the hidden states "
                    f"(transformers 5's blocks return a tensor); use tensor_parallel=1 for this model."
                )
            return leave_tensor_parallel_share(out, tp, sequence_parallel)

        return forward

    return make


def _router_forward(tp: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Under tensor parallelism the router's logits, which transformers records for its router loss
    (``output_router_logits``), are the same on every tp rank, and the router's gradients are summed
    over tp: each rank backpropagates ``1 / tp`` of that loss (the block drops the logits otherwise)."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        @communicates
        def forward(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            if isinstance(out, tuple) and out and isinstance(out[0], Tensor) and out[0].requires_grad:
                out = (backpropagate_share(out[0], tp), *out[1:])
            return out

        return forward

    return make


def apply_expert_parallel(
    model: nn.Module, group: Any = None, replica_mesh: Any = None, tp_group: Any = None, owners: Any = None,
    sequence_parallel: bool = False,
) -> int:
    """Split every MoE block of a transformers ``model`` from outside (the arguments of
    :func:`lightning_3d.moe.expert_parallel.apply_expert_parallel`); returns how many blocks it has.
    Idempotent: a block split by an earlier set-up is left as it is."""
    owners = owners if owners is not None else (group if group is not None else tp_group)
    blocks = moe_blocks(model)
    tp = tp_group if tp_group is not None and dist.get_world_size(tp_group) > 1 else None
    why = moe_refusal(model, dist.get_world_size(tp) if tp is not None else 1)
    if why and owners is not None:
        raise NotImplementedError(f"{type(model).__name__}'s experts cannot be split: {why}. Use expert_parallel=1 and tensor_parallel=1.")
    for _, block in blocks:
        experts = block.experts
        n_experts = experts.gate_up_proj.shape[0]
        if owners is None or not wrap_forward(experts, EXPERTS_KIND, _experts_forward(experts, n_experts, group, tp)):
            continue  # nothing to split, or split by an earlier set-up
        for name in STACKS:
            keep_slice(getattr(experts, name), 0, owners, "expert_parallel x tensor_parallel", "n_experts", replica_mesh)
        if tp is None:
            continue
        wrap_forward(block, BLOCK_KIND, _block_forward(tp, sequence_parallel))
        wrap_forward(block.gate, ROUTER_KIND, _router_forward(tp))
        for p in block.gate.parameters():  # (its gradient is partial on each tp rank)
            mark_sequence_parallel(p, tp)
        shared = getattr(block, SHARED, None)
        if shared is not None:
            split_shared_experts(shared, tp)
    return len(blocks)


# -- which layouts, and transformers' router loss ---------------------------------------------------------------
def router_loss_requested(model: nn.Module) -> bool:
    """Whether transformers adds a router loss to the model's loss: ``output_router_logits`` on a
    family that computes one (it has ``router_aux_loss_coef``; DeepSeek-V3 computes none)."""
    config = getattr(model, "config", None)
    return bool(getattr(config, "output_router_logits", False)) and hasattr(model, "router_aux_loss_coef")


def expert_refusal(model: nn.Module, layout: Any) -> Optional[str]:
    """Why ``model``'s MoE blocks cannot run at ``layout`` (:meth:`ModelAdapter.expert_refusal`)."""
    degrees = model_parallel_degrees(layout)
    if not degrees or not moe_blocks(model):
        return None
    why = moe_refusal(model, layout.tensor_parallel)
    if why:
        return f"{why}, so its experts cannot be split at {', '.join(degrees)}; set those degrees to 1"
    if router_loss_requested(model) and layout.pipeline_parallel > 1:
        return (
            "transformers computes its router loss (output_router_logits=True) in the whole model's forward from every "
            "layer's router logits, which no pipeline stage runs; use pipeline_parallel=1, or output_router_logits=False"
        )
    if router_loss_requested(model) and layout.context_parallel > 1:
        return (
            f"its router loss (output_router_logits=True) is computed from statistics over whole sequences' tokens, which "
            f"context_parallel={layout.context_parallel} splits; use context_parallel=1, or output_router_logits=False"
        )
    return None


def switch_balance_terms(logits: list[Tensor], n_experts: int, top_k: int, mask: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """transformers' Switch-style balance loss (``load_balancing_loss_func``, shared by Mixtral,
    Qwen3-MoE, OLMoE) as sums: (top-k choices per expert, router probability per expert, rows), over
    every layer's logits, padding rows (``mask`` 0) left out. The loss is ``E * sum_e (choices_e /
    rows) * (probability_e / rows)``: summed over ranks, the sums give the whole batch's."""
    device = logits[0].device
    choices = torch.zeros(n_experts, dtype=torch.float32, device=device)
    probability = torch.zeros(n_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    weight = mask.reshape(-1).to(device=device, dtype=torch.float32) if mask is not None else None
    for layer in logits:
        scores = torch.softmax(layer, dim=-1)
        chosen = torch.topk(scores, top_k, dim=-1).indices.reshape(-1)
        if weight is None:
            choices = choices.scatter_add(0, chosen, torch.ones_like(chosen, dtype=torch.float32))
            probability = probability + scores.float().sum(dim=0)
            rows = rows + scores.shape[0]
        else:
            choices = choices.scatter_add(0, chosen, weight.repeat_interleave(top_k))
            probability = probability + (scores.float() * weight[:, None]).sum(dim=0)
            rows = rows + weight.sum()
    return choices, probability, rows


def _balance_loss(choices: Tensor, probability: Tensor, rows: Tensor, n_experts: int) -> Tensor:
    return n_experts * torch.sum((choices / rows) * (probability / rows))


def _family_loss_agrees(model: nn.Module, n_experts: int, top_k: int) -> bool:
    """Whether the family's own ``load_balancing_loss_func`` is the loss :func:`switch_balance_terms`
    sums (checked on a random sample, with and without padding, from a generator of its own)."""
    import sys

    # (the modeling module of the model's class, or of the class it was made from: ZeRO-3's FSDP2 subclasses it)
    theirs = next((f for c in type(model).__mro__ if (f := getattr(sys.modules.get(c.__module__), "load_balancing_loss_func", None))), None)
    if theirs is None:
        return False
    generator = torch.Generator().manual_seed(0)
    sample = [torch.randn(12, n_experts, generator=generator) for _ in range(2)]
    mask = (torch.rand(3, 4, generator=generator) > 0.3).long()
    for m in (None, mask):
        ours = _balance_loss(*switch_balance_terms(sample, n_experts, top_k, m), n_experts)
        if not torch.allclose(torch.as_tensor(theirs(tuple(sample), n_experts, top_k, m), dtype=torch.float32), ours, rtol=1e-5):
            return False
    return True


class _RouterRecorder:
    """A forward hook on a router: while ``active``, keeps the logits it returns (after every wrapper
    of its forward: under tensor parallelism, with their gradient scaled to ``1 / tp``)."""

    def __init__(self) -> None:
        self.active = False
        self.logits: list[Tensor] = []

    def __call__(self, module: nn.Module, args: Any, out: Any) -> None:
        if self.active:
            self.logits.append(out[0] if isinstance(out, tuple) else out)


def _recorder(router: nn.Module) -> _RouterRecorder:
    """The router's recorder, registered once (a second set-up finds it)."""
    found = router.__dict__.get("_lightning_3d_router_recorder")
    if found is None:
        found = router.__dict__["_lightning_3d_router_recorder"] = _RouterRecorder()
        router.register_forward_hook(found)
    return found


AVERAGED_KIND = "hf_router_loss_over_replicas"


def average_router_loss(model: nn.Module, replicas: Any, context_parallel: int) -> None:
    """Under data parallelism, transformers' router loss from the whole batch's statistics.

    transformers computes it from the micro-batch of one forward: at ``R`` replicas, from each
    replica's part, and the replicas' mean of those losses is not the batch's (a product of two
    means). Here the model's forward runs without it, each router records its logits, and the loss
    is rebuilt from the sums of :func:`switch_balance_terms` over the replicas (one all-reduce of
    ``2E + 1`` numbers per forward): each replica adds ``R`` times its share of the batch's loss,
    whose mean over the replicas -- what the gradient reduction takes -- is the batch's; the value
    it reports is the batch's loss itself. A family whose own loss is not that one is refused."""
    size = dist.get_world_size(replicas) if replicas is not None else 1
    blocks = moe_blocks(model)
    if size == 1 or not blocks or not hasattr(model, "num_experts_per_tok"):
        return
    n_experts, top_k = int(blocks[0][1].experts.gate_up_proj.shape[0]), int(model.num_experts_per_tok)
    n_experts = int(getattr(model, "num_experts", n_experts))
    agrees: list[bool] = []  # (checked once, when the loss is first asked for)
    coefficient = float(getattr(model, "router_aux_loss_coef", getattr(model.config, "router_aux_loss_coef", 0.0)))
    recorders = [_recorder(block.gate) for _, block in blocks]
    signature = inspect.signature(model.forward)

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            wanted = kwargs.get("output_router_logits")
            wanted = router_loss_requested(model) if wanted is None else bool(wanted) and hasattr(model, "router_aux_loss_coef")
            if not (wanted and model.training and torch.is_grad_enabled()):  # (evaluation: each replica's, no collective)
                return original(*args, **kwargs)
            if not agrees:
                agrees.append(_family_loss_agrees(model, n_experts, top_k))
            if not agrees[0]:
                raise NotImplementedError(
                    f"{type(model).__name__}'s router loss (output_router_logits=True) is not transformers' Switch-style "
                    f"load_balancing_loss_func, which lightning_3d computes over the {size} data-parallel replicas' whole "
                    f"batch; use output_router_logits=False, or data_parallel=1."
                )
            if kwargs.get("return_dict") is False:
                raise NotImplementedError(
                    f"output_router_logits=True at {size} data-parallel replicas: lightning_3d rebuilds the router loss "
                    f"from the whole batch into the model's output, which return_dict=False would make a tuple; leave "
                    f"return_dict at its default."
                )
            if context_parallel > 1:
                raise NotImplementedError(
                    f"output_router_logits=True: the router loss needs whole sequences, which context_parallel="
                    f"{context_parallel} splits; use context_parallel=1, or output_router_logits=False."
                )
            for recorder in recorders:
                recorder.active, recorder.logits = True, []
            try:
                out = original(*args, **{**kwargs, "output_router_logits": False})
            finally:
                logits = [t for recorder in recorders for t in recorder.logits]
                for recorder in recorders:
                    recorder.active, recorder.logits = False, []
            if not logits:
                return out
            mask = signature.bind_partial(*args, **kwargs).arguments.get("attention_mask")
            choices, probability, rows = switch_balance_terms(logits, n_experts, top_k, mask)
            total = torch.cat([choices, probability.detach(), rows.reshape(1)])
            dist.all_reduce(total, group=replicas)
            whole_choices, whole_probability, whole_rows = total[:n_experts], total[n_experts : 2 * n_experts], total[-1]
            batch = _balance_loss(whole_choices, whole_probability, whole_rows, n_experts)
            share = size * _balance_loss(whole_choices, probability, whole_rows, n_experts)
            aux = batch + (share - share.detach())  # the batch's value; R x this replica's share's gradient
            if getattr(out, "loss", None) is not None:  # (without labels: the user adds out.aux_loss to their own loss)
                out.loss = out.loss + coefficient * aux.to(out.loss.dtype)
            out.aux_loss, out.router_logits = aux, tuple(logits)  # (as transformers returns them; the logits this replica's)
            return out

        return forward

    wrap_forward(model, AVERAGED_KIND, make)
