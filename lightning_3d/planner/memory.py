"""Per-device memory: model states by ZeRO stage, activations by Korthikanti et al. 2022.

Model states (Rajbhandari et al. 2020, "ZeRO", section 3/5): with mixed precision and Adam, a
parameter costs 2 bytes (16-bit weight) + 2 (16-bit gradient) + K = 12 (fp32 master, momentum,
variance). On ``N`` data-parallel ranks:

* stage 0: (2 + 2 + K) psi     stage 1: (2 + 2) psi + K psi / N
* stage 2: 2 psi + (2 + K) psi / N     stage 3: (2 + 2 + K) psi / N

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", section 4), bytes per transformer layer for micro-batch ``b``, sequence ``s``, hidden
``h``, ``a`` heads, tensor parallel ``t``, 16-bit activations and 1-byte dropout masks:

* no parallelism: s b h (34 + 5 a s / h)
* tensor parallel: s b h (10 + 24 / t + 5 a s / (h t))
* tensor + sequence parallel: s b h / t (34 + 5 a s / h)
* selective recompute (attention core re-run) drops the 5 a s / h term
* full recompute keeps only each layer's input: 2 s b h (/ t with sequence parallel).
* context parallel ``cp``: each rank keeps ``s / cp`` tokens, so every term above is ``/ cp``; the
  attention kernels (ring, all-to-all) keep their output and a log-sum-exp per row, never the
  scores (the ``5 a s / h`` term becomes ``4 a`` fp32 bytes per token).

The formula is written here per stored tensor, so that it also covers what the paper fixes:
the activation dtype (``c`` bytes), dropout off (no masks, no dropout outputs), grouped-query
attention (narrower k, v), SwiGLU (three ffn tensors) and fused ("flash") attention, which keeps
its output and a log-sum-exp per row instead of the ``a s^2`` score tensors. With c = 2, dropout
on, multi-head attention, a 4h GELU MLP and unfused attention it is exactly the paper's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from lightning_3d.core.layout_rules import V_SHAPED
from lightning_3d.core.model_shape import ModelShape
from lightning_3d.planner.zero_bubble import ZERO_BUBBLE, v_stage_in_flight, zero_bubble_pipeline

ZERO_STAGES = (0, 1, 2, 3)


def zero_model_state_bytes(
    psi: float, stage: int, n: int, k: float = 12.0, c: float = 2.0, grad_bytes: float | None = None
) -> dict[str, float]:
    """Parameters, gradients and optimizer states per rank for ``psi`` parameters: the ZeRO paper's
    formulas with ``c``-byte weights, ``grad_bytes``-byte gradients (default ``c``) and ``k`` bytes
    of optimizer state. (Megatron-LM keeps an fp32 gradient copy too: ``grad_bytes = c + 4``.)"""
    if stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage={stage!r}: choose one of {ZERO_STAGES}.")
    g = c if grad_bytes is None else grad_bytes
    return {
        "params": c * psi / (n if stage == 3 else 1),
        "grads": g * psi / (n if stage >= 2 else 1),
        "optimizer": k * psi / (n if stage >= 1 else 1),
    }


LOSS_FP32_BUFFERS = 3  # fp32 logits-sized tensors alive at once at the loss's backward (loss_transient_bytes)


@dataclass(frozen=True)
class ActivationOptions:
    tp: int = 1
    sequence_parallel: bool = False
    recompute: str = "none"  # none | selective | full
    flash_attention: bool = False
    bytes_per_element: float = 2.0
    cp: int = 1  # context parallel: the rank holds s / cp of each sequence
    expert_imbalance: float = 1.0  # routed rows on the busiest rank / the mean (1: balanced routing)


def layer_activation_bytes(model: ModelShape, micro_batch: int, opts: ActivationOptions) -> float:
    """Bytes one layer keeps for backward for one micro-batch (what is alive between its forward
    and its backward); under full recompute, only its input."""
    s, b, h, t = model.seq_len / opts.cp, micro_batch, model.hidden, opts.tp
    c = opts.bytes_per_element
    sbh = s * b * h
    if opts.recompute == "full":
        return c * sbh / (t if opts.sequence_parallel else 1)
    mask = 1.0 if model.dropout else 0.0
    kv = model.kv_width / h  # k and v widths relative to h
    ffn = model.ffn / h * (1 - model.moe_share)  # (MoE blocks: moe_layer_activation_bytes)
    norm = 2.0 if model.rms_norm else 1.0  # tensors each norm keeps per element
    # Tensors every tp rank holds whole (split along the sequence under sequence parallel):
    # the two norms' inputs, the q/k/v input, the MLP input, two dropout masks.
    replicated = sbh * (2 * norm * c + c + c + 2 * mask)
    # Tensors split by tensor parallelism: q, k, v; the output projection's input; the MLP's
    # GELU input and output (SwiGLU: gate, silu(gate), up and their product).
    sharded = sbh * (c * (1 + 2 * kv) + c + c * ffn * (4 if model.gated_mlp else 2))
    # The attention core: the a s^2 scores (softmax output; with dropout its mask and output), or
    # for fused attention one fp32 log-sum-exp per (head, position) -- its output is the output
    # projection's input, counted above.
    if opts.flash_attention or opts.cp > 1:  # the cp kernels keep out + log-sum-exp, like flash
        core = 4.0 * model.n_head * s * b
    else:
        core = model.n_head * s * s * b * (c + (mask + c if model.dropout else 0.0))
    if not model.learned_positions:
        core += 2 * 4.0 * s * model.head_dim  # fp32 rotary cos/sin tables, per layer
    if opts.recompute == "selective":
        core = 0.0
    moe = moe_layer_activation_bytes(model, micro_batch, opts) if model.n_experts else 0.0
    if opts.sequence_parallel:
        return (replicated + sharded + core) / t + moe
    return replicated + (sharded + core) / t + moe


def moe_layer_activation_bytes(model: ModelShape, micro_batch: int, opts: ActivationOptions) -> float:
    """What an MoE block keeps beyond the attention half, averaged over the blocks (``moe_share``).

    Counted from the layer's saved tensors. Per token: the router's fp32 scores (``4 E`` bytes; a
    router z-loss keeps the logits too, ``4 E`` more, not counted) and its top-k weights, choices and sums (``12 k + 12``), on every tp rank (the
    layer routes every token, gathered under sequence parallelism, whose gathered input the router's
    gate keeps too); the shared experts' SwiGLU (``4 c`` per element of their width, split by tp); and
    ``top_k`` routed rows, of which each tp rank computes its ``1 / t`` (scaled by the routing
    imbalance on the busiest rank): each keeps the expert input and output (``2 c h``, the output for
    the weighted combine), the SwiGLU's four intermediates (``4 c expert_ffn``), its weight (``c``) and
    three int64 indices."""
    s, b, h, t, c = model.seq_len / opts.cp, micro_batch, model.hidden, opts.tp, opts.bytes_per_element
    k = model.top_k
    router = 4.0 * model.n_experts + 12.0 * k + 12.0 + (c * h if opts.sequence_parallel and t > 1 else 0.0)
    shared = 4 * c * model.shared_expert_width / t
    routed = k * opts.expert_imbalance * (c * (2 * h + 4 * model.expert_ffn + 1) + 24.0) / t
    return model.moe_share * s * b * (router + shared + routed)


def activations_in_flight(schedule: str, pp: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """How many micro-batches' worth of a stage's layer activations the first stage holds at its
    peak, as a multiple of (its layers x one micro-batch). 1F1B: ``pp`` (Narayanan et al. 2021);
    interleaved: ``pp`` (1 + (pp - 1) / (pp v)) (Korthikanti et al. eq. 5); GPipe: all ``m``; ZB-H1:
    the most any stage but the last holds in its simulation (F to W; at most ``pp``, 1F1B's first
    stage), an upper bound for all of them since the first stage has the most layers among them;
    ZB-V / DualPipeV: the most any rank holds (``pp``, ``pp + 1/2`` on every rank from m >= 2pp - 1)."""
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(micro_batches)
    if schedule == "zb_h1":
        return float(max(zero_bubble_pipeline(schedule, pp, micro_batches).in_flight[:-1]))
    if schedule in ZERO_BUBBLE:  # (a V: every rank holds as many layers; with m < 2pp - 1 not rank 0 the most)
        return float(max(zero_bubble_pipeline(schedule, pp, micro_batches).in_flight))
    warm = float(min(pp, micro_batches))
    if schedule == "interleaved_1f1b" and virtual_stages > 1:
        return warm * (1.0 + (pp - 1) / (pp * virtual_stages))
    return warm


def last_stage_in_flight(schedule: str, pp: int, micro_batches: int) -> float:
    """Micro-batches the last stage (the head's) holds at its peak: 1 under 1F1B (each finishes at
    once), all ``m`` under GPipe; under ZB-H1 those whose weight-gradient half W is held back too
    (its simulation: up to ``pp``)."""
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(micro_batches)
    if schedule in ZERO_BUBBLE:
        return float(zero_bubble_pipeline(schedule, pp, micro_batches).in_flight[-1])
    return 1.0


def activation_bytes(
    model: ModelShape,
    micro_batch: int,
    layers_on_stage: int,
    in_flight: float,
    opts: ActivationOptions,
    head_on_stage: bool,
    head_pending: float = 0.0,
    held_outputs: float = 0.0,
    embed_on_stage: bool = False,
) -> dict[str, float]:
    """Peak activation bytes on one pipeline stage: ``stored`` (kept for backward across layers,
    logits included) and ``recompute`` (under full recomputation, the one layer being re-run
    holds its full activations on top of the stored inputs). ``held_outputs``: stage outputs the
    pipeline runtime keeps until their backward (hidden states, ``/ t`` under sequence parallel).
    ``embed_on_stage``: the embedding's dropout keeps c bytes per element (measured by the dry run), per micro-batch in flight."""
    stored = layers_on_stage * in_flight * layer_activation_bytes(model, micro_batch, opts)
    c = opts.bytes_per_element
    hidden = c * model.seq_len / opts.cp * micro_batch * model.hidden / (opts.tp if opts.sequence_parallel else 1)
    stored += held_outputs * hidden
    if embed_on_stage and model.dropout:
        stored += in_flight * hidden
    if head_on_stage:
        # the final norm's saved tensors and the LM head's input (found by the dry run's count); under
        # sequence parallel the head, a column-parallel layer, keeps its input's sequence shard
        stored += (2.0 if model.rms_norm else 1.0) * hidden + hidden
    if head_on_stage:
        # Logits and their gradient, split over the vocabulary by tensor parallelism.
        logits = opts.bytes_per_element * model.seq_len / opts.cp * micro_batch * model.vocab / opts.tp
        # ``head_pending`` more micro-batches (ZB-H1's held-back W) each keep the logits' gradient for
        # the head's weight gradient
        stored += (2 + head_pending) * logits
    recompute = 0.0
    if opts.recompute == "full":
        working = replace(opts, recompute="none")
        recompute = layer_activation_bytes(model, micro_batch, working)
    return {"stored": stored, "recompute": recompute}


def loss_transient_bytes(model: ModelShape, micro_batch: int, opts: ActivationOptions) -> float:
    """What the loss allocates at its backward beyond the 2 x c bytes per logit element that
    :func:`activation_bytes` keeps for it (what it saves, and the logits' gradient). The loss runs in
    fp32 whatever c is -- autocast upcasts cross-entropy, the vocab-parallel loss computes in fp32 --
    and at its backward three fp32 logits-sized tensors are alive at once: the log-probabilities (or
    softmax) it kept, the incoming gradient and the outgoing one. A transient, not a saved tensor (the
    dry run counts saved tensors), so it goes with the buffers. On an H200 a plain FSDP2 loop's peak
    was 4.3 GiB above the prediction without it, at 16,384 tokens x 32,768 vocabulary, where this term
    is 4.0 GiB (docs/gpu.md)."""
    elements = model.seq_len / opts.cp * micro_batch * model.vocab / opts.tp
    return max(0.0, LOSS_FP32_BUFFERS * 4.0 - 2.0 * opts.bytes_per_element) * elements


def stage_in_flight(
    schedule: str, pp: int, micro_batches: int, virtual_stages: int, stage: int, chunk_layers: Optional[tuple[int, int]] = None
) -> float:
    """Micro-batches' worth of its layer activations pipeline stage ``stage`` holds at its peak (in
    units of its layers x one micro-batch). 1F1B: ``min(pp - stage, m)``; interleaved: the warm-up
    of Narayanan et al. 2021 ((pp - stage - 1) x 2 + (v - 1) pp + 1 pieces, over v), which is
    :func:`activations_in_flight`'s Korthikanti formula on the first stage; GPipe: all ``m``; the
    last stage: :func:`last_stage_in_flight`; ZB-H1: its simulation; a V given its ``chunk_layers``:
    :func:`~lightning_3d.planner.zero_bubble.v_stage_in_flight`."""
    if pp == 1:
        return 1.0
    if chunk_layers is not None and schedule in V_SHAPED:  # a V: weighed by its two chunks' layers
        return v_stage_in_flight(schedule, pp, micro_batches, stage, chunk_layers)
    interleaved = schedule == "interleaved_1f1b" and virtual_stages > 1
    if stage == pp - 1 and not interleaved:  # (interleaved: the last rank's other chunks stay in flight)
        return last_stage_in_flight(schedule, pp, micro_batches)
    if stage == 0:
        return activations_in_flight(schedule, pp, micro_batches, virtual_stages)
    if schedule == "gpipe":
        return float(micro_batches)
    if schedule in ZERO_BUBBLE:
        return float(zero_bubble_pipeline(schedule, pp, micro_batches).in_flight[stage])
    if schedule == "interleaved_1f1b" and virtual_stages > 1:
        v = virtual_stages
        return min((pp - stage - 1) * 2 + (v - 1) * pp + 1, micro_batches * v) / v
    return float(min(pp - stage, micro_batches))
