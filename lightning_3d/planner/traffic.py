"""Bytes each process group moves per training step, per rank: the planner's model of what the dry
run (:mod:`lightning_3d.apps.dry_run`) counts at the collective and point-to-point calls.

"Bytes moved" is what one rank sends over the wire under NCCL's ring algorithms: an all-reduce of
``B`` bytes over ``n`` ranks ``2 (n - 1) / n B``, an all-gather (``B`` the gathered output) or a
reduce-scatter (``B`` the input) ``(n - 1) / n B``, a point-to-point send its tensor. Counting the
wire rather than the buffers makes sequence parallelism (an all-gather and a reduce-scatter where
tensor parallelism has one all-reduce) move the same bytes, as it does.

Per micro-batch and layer, with ``A = b (s / cp) h c`` (one activation of this rank's tokens):

* ``tp``: forward 2 all-reduces of ``A`` (sequence parallel: 2 all-gathers + 2 reduce-scatters), the
  same in backward and again in full recomputation's forward; under sequence parallel backward also
  all-gathers again the sequence shards the column layers kept (q/k/v input, MLP input: 2 more); the vocab-parallel embedding one
  more in forward, the LM head's input one in backward (all-gather + reduce-scatter under SP, and the
  re-gather of its kept shard), and
  the vocab-parallel cross-entropy three fp32 all-reduces per token (max, sum of exponentials,
  the target's logit). Sequence parallel adds, once per step, the all-reduce of the norm weights'
  gradients (fp32 under ZeRO 1-2 and mixed precision, else the compute dtype).
* ``cp``: the ring's hops (:mod:`context_parallel`): forward ``cp - 1`` K/V blocks, backward ``cp``
  K/V + fp32 dK/dV; full recomputation runs the forward ring again.
* ``pp``: an activation sent per micro-batch and piece that feeds another stage, an input gradient
  per piece that has an input: ``b (s / cp) h c`` (``/ t`` under sequence parallelism).
* ``dp`` (the dp x cp weight replicas): ZeRO 1-2 reduce-scatter fp32 gradients and all-gather the
  16-bit parameters once per step; ZeRO 0 all-reduces fp32 gradients; ZeRO 3 gathers every layer
  twice and reduce-scatters its gradients per micro-batch.
* ``ep`` (the expert group): per MoE block and micro-batch, the dispatch and the combine
  all-to-all of the routed rows (``top_k`` per token, this tp rank's ``1 / t`` of them, ``h c`` bytes
  each) in forward, both again in backward and in full recomputation's forward, and one all-to-all
  of the ``E`` per-expert counts per forward. Balanced routing (``expert_imbalance`` scales the rows).
* ``edp`` (the expert replicas, ``dp x cp / ep``): the routed experts' gradients and ZeRO gathers, as
  ``dp`` for the dense weights (which ``dp`` then leaves out). Under tp, the MoE routers' gradients
  (partial on each tp rank) are all-reduced over tp once per step.
* ``embedding``: with tied embeddings over pp > 1, the first and last stage all-reduce the tied
  weight's gradient once per step (its tp shard, in the compute dtype).
"""

from __future__ import annotations

from typing import Any

from lightning_3d.core.model_shape import ModelShape


def ring(op: str, nbytes: float, n: int) -> float:
    """Bytes one rank sends for a collective of ``nbytes`` over ``n`` ranks (NCCL's ring)."""
    if n <= 1:
        return 0.0
    if op == "all_reduce":
        return 2.0 * (n - 1) / n * nbytes
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n * nbytes
    if op == "broadcast":
        return float(nbytes)
    raise ValueError(f"unknown collective {op!r}")


def step_traffic(planner: Any, layout: Any, layers: list[int], index: int, chunks: list[int]) -> dict[str, float]:
    """Bytes per group (``tp``, ``cp``, ``pp``, ``ep``, ``dp``, ``edp``, ``embedding``) pipeline stage ``index`` sends per
    step. ``chunks``: the pieces it holds, in the runtime's numbering (for which sends exist)."""
    problem = planner.problem
    model: ModelShape = problem.model
    c = planner.c
    t, pp, cp, v = layout.tp, layout.pp, layout.cp, layout.virtual_stages
    d = layout.dp * cp
    mb, m = layout.micro_batch_size, layout.micro_batches(problem.global_batch)
    local = model.seq_len / cp
    act = mb * local * model.hidden * c
    full = layout.recompute == "full"
    from lightning_3d.planner.search import V_SHAPED, expert_all_to_alls, head_stage
    from lightning_3d.planner.timing import partial_gradient_params

    first, last = index == 0, index == head_stage(layout.schedule, pp)  # (a V: the head beside the embedding)
    out: dict[str, float] = {}

    # -- tensor parallel, per micro-batch ---------------------------------------------------------
    if t > 1:
        # forward and backward 2 each; torch's non-reentrant checkpoint stops the recomputed forward once
        # backward has what it saved, before the MLP's output all-reduce, unless a dropout after it keeps a mask
        calls = 4 + ((2 if model.dropout else 1) if full else 0)
        if layout.sequence_parallel:  # backward all-gathers the kept sequence shards of the q/k/v and MLP inputs again
            # (two all-gathers: one all-reduce's bytes); an MoE block keeps its gathered input, unless a full
            # recompute gathers it again (as measured by the dry run)
            calls += 1 if full else 1 - 0.5 * model.moe_share
        per_micro = layers[index] * calls * ring("all_reduce", act, t)  # an all-reduce, or an AG + RS pair under SP
        if first:  # vocab-parallel embedding: its output summed (reduce-scattered under SP)
            per_micro += ring("reduce_scatter" if layout.sequence_parallel else "all_reduce", act, t)
        if last:
            per_micro += ring("all_reduce", act, t)  # the head input: its gradient (AG + RS under SP)
            if layout.sequence_parallel:
                per_micro += ring("all_gather", act, t)  # its kept sequence shard, gathered again in backward
            per_micro += 3 * ring("all_reduce", mb * local * 4.0, t)  # vocab-parallel cross-entropy, fp32 per token
        out["tp"] = m * per_micro
        # weights whose gradient is partial on each tp rank, summed once per step (the reducers' bucket at
        # the synchronizing backward or a pipeline's hand-over; ZeRO-3 at the step): the norms under sequence
        # parallelism, MoE routers under any tp; in the precision the gradients are reduced in
        partial = partial_gradient_params(model, layers[index], last, layout.sequence_parallel)
        if partial:
            reduce_bytes = 4.0 if layout.zero_stage in (1, 2) or "mixed" in problem.precision else c
            out["tp"] += ring("all_reduce", partial * reduce_bytes, t)

    # -- context parallel ----------------------------------------------------------------------------
    if cp > 1:
        cost = planner._cp_cost(mb, t, layout.recompute, cp, layout.context_parallel_mode)
        forward = cost.forward_transfers * cost.forward_bytes
        per_layer = forward * (2 if full else 1) + cost.backward_transfers * cost.backward_bytes
        out["cp"] = m * layers[index] * per_layer

    # -- pipeline --------------------------------------------------------------------------------------
    if pp > 1:
        boundary = mb * local * model.hidden * c / (t if layout.sequence_parallel else 1)
        pieces = pp * v
        sends = sum((piece < pieces - 1) + (piece > 0) for piece in chunks)
        if layout.schedule in V_SHAPED and index == pp - 1:
            sends -= 2  # the V's bottom: pieces pp-1 and pp on this rank hand over without a send
        out["pp"] = m * sends * boundary

    # -- expert parallel: each MoE block's row exchanges (dispatch and combine per forward and backward,
    # again in a full recompute) and the per-expert counts before each forward's -------------------------
    if layout.ep > 1:
        rows, counts = expert_all_to_alls(layout.recompute)
        exchange = planner.expert_exchange(mb, t, cp, layout.ep)
        per_layer = rows * ring("all_to_all", exchange["row_bytes"], layout.ep) + counts * ring("all_to_all", exchange["count_bytes"], layout.ep)
        out["ep"] = m * layers[index] * model.moe_share * per_layer

    # -- data parallel: the dense weights over their replicas (dp x cp), the experts over theirs (edp) -------
    dense, expert = planner.stage_params(layout, layers, index)
    if layout.ep == 1:  # (the experts are then the replicas' like any weight)
        dense, expert = dense + expert, 0.0
    for name, psi, replicas in (("dp", dense, d), ("edp", expert, d // layout.ep)):
        if replicas > 1 and psi:
            out[name] = _replica_traffic(layout.zero_stage, psi, replicas, c, problem.software.grad_reduce_bytes, m)

    # -- tied embedding copies over the pipeline ------------------------------------------------------
    if pp > 1 and model.tied_embeddings and (first or last) and head_stage(layout.schedule, pp) != 0:
        out["embedding"] = ring("all_reduce", model.vocab * model.hidden / t * c, 2)
    return out


def _replica_traffic(zero_stage: int, psi: float, replicas: int, c: float, grad_bytes: float, micro_batches: int) -> float:
    """Bytes one rank sends per step for ``psi`` parameters replicated over ``replicas`` ranks: ZeRO 0
    all-reduces the gradients, ZeRO 1-2 reduce-scatter them and all-gather the parameters, ZeRO 3
    gathers twice and reduce-scatters per micro-batch."""
    if zero_stage == 0:
        return ring("all_reduce", psi * grad_bytes, replicas)
    if zero_stage in (1, 2):
        return ring("reduce_scatter", psi * grad_bytes, replicas) + ring("all_gather", psi * c, replicas)
    return micro_batches * (2 * ring("all_gather", psi * c, replicas) + ring("reduce_scatter", psi * grad_bytes, replicas))
