"""Context parallelism's own communication: what one layer's attention exchanges per micro-batch
over the cp group, and how much of it the attention itself hides.

Context parallelism (cp) cuts every sequence into ``2 cp`` chunks; cp rank ``i`` holds chunks ``i``
and ``2cp-1-i`` (``lightning_3d/context_parallel/layout.py``), so each rank holds ``s / cp`` tokens
and does ``1 / cp`` of the causal attention. Everything outside attention is token-local and needs
no communication; attention does, in one of two ways (``context_parallel/ring.py``, ``ulysses.py``):

* **ring**: K/V blocks (kv heads only: GQA keeps them small) travel around the ring. Forward:
  ``cp - 1`` hops, each of ``2 b (s/cp) (kv/t) d`` elements in the compute dtype, posted before the
  attention of the block in hand, so a hop is exposed only by what it outlasts that block
  (``1 / cp`` of the rank's attention). Backward: a second ring pass; each block's hop carries K/V
  and the previous block's fp32 dK/dV accumulator (``c + 4`` bytes per element pair), again behind
  one block's attention backward; the last accumulator hop (fp32 dK/dV only) has nothing left to
  hide behind. Full recomputation runs the forward ring again.
* **all_to_all** (DeepSpeed-Ulysses): forward, three all-to-alls (q, k, v: sequence-sharded to
  head-sharded; kv heads replicated up to ``lcm(kv/t, cp)``) and one for the output; backward,
  the same four in reverse. None overlapped. Each rank sends ``(cp - 1) / cp`` of its tensor; the
  part for peers on other nodes goes through the device's share of the node's adapters.

A hop is costed as NCCL costs it (:mod:`collectives`): a 2-rank all-gather of twice the hop's bytes
moves exactly one send and one receive per rank, with NCCL's latency and protocol choice, over the
cp group's per-device bandwidth (the planner's topology rule: NVLink inside a node; across nodes,
the ring's members on a node x the per-device network share).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lightning_3d.core.layout_rules import CONTEXT_PARALLEL_MODES
from lightning_3d.planner.collective_cost import LINK_EFFICIENCY, Group, NcclVersion, collective_cost

CP_MODES = CONTEXT_PARALLEL_MODES  # the strategy's (lightning_3d.core.layout_rules)
# Context parallelism pays off where attention's s^2 term dominates or activations do not fit; the
# search tries cp > 1 from this sequence length on (and for any length when nothing fits at cp=1).
CP_MIN_SEQUENCE = 16384


@dataclass(frozen=True)
class ContextParallelCost:
    """One layer, one micro-batch, on one device: cp communication seconds and what is exposed."""

    mode: str
    forward_transfers: int  # hops (ring) or all-to-alls in forward
    backward_transfers: int
    forward_bytes: float  # per transfer, sent by each rank
    backward_bytes: float
    forward_seconds: float  # per transfer
    backward_seconds: float
    forward_window: float  # compute each transfer may hide behind (one block's attention)
    backward_window: float
    total: float  # all transfers of the layer (forward, backward, recompute), before overlap
    exposed: float  # what compute does not hide

    def to_dict(self, scale: float = 1.0) -> dict[str, Any]:
        """Per layer and micro-batch; ``scale`` (layers x micro-batches) gives the step's totals."""
        return {
            "mode": self.mode,
            "per_layer_micro_batch": {
                "forward_transfers": self.forward_transfers,
                "backward_transfers": self.backward_transfers,
                "forward_bytes_each": round(self.forward_bytes),
                "backward_bytes_each": round(self.backward_bytes),
                "forward_seconds_each": round(self.forward_seconds, 7),
                "backward_seconds_each": round(self.backward_seconds, 7),
                "forward_block_attention_s": round(self.forward_window, 7),
                "backward_block_attention_s": round(self.backward_window, 7),
                "exposed_s": round(self.exposed, 7),
            },
            "transfer_s": round(self.total * scale, 4),
            "hidden_s": round((self.total - self.exposed) * scale, 4),
            "exposed_s": round(self.exposed * scale, 4),
        }


def hop_seconds(nbytes: float, group_nodes: int, gb_per_s: float, nccl: NcclVersion, amd_host: bool = False) -> float:
    """One send + receive of ``nbytes`` per rank to the ring's neighbours: NCCL's cost of a 2-rank
    all-gather of ``2 nbytes`` (which moves exactly that), across nodes when the group spans nodes."""
    if nbytes <= 0:
        return 0.0
    group = Group(2, 2 if group_nodes > 1 else 1, gb_per_s, amd_host=amd_host)
    return collective_cost("all_gather", 2 * nbytes, group, nccl).seconds


def all_to_all_seconds(
    nbytes: float, ranks: int, nodes: int, intra_gb_per_s: float, device_net_gb_per_s: float, nccl: NcclVersion
) -> float:
    """One all-to-all of a ``nbytes`` tensor per rank over ``ranks`` ranks on ``nodes`` nodes: each
    peer gets ``nbytes / ranks``; peers on this node over NVLink, the others over the device's
    share of the node's adapters (every device of the node sends at once), both at once; one
    Simple-protocol start-up (NCCL posts all peers' sends and receives together)."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    per_node = max(1, ranks // max(1, nodes))
    intra = (per_node - 1) / ranks * nbytes / (intra_gb_per_s * 1e9 * LINK_EFFICIENCY)
    inter = 0.0
    if nodes > 1:
        inter = (ranks - per_node) / ranks * nbytes / (device_net_gb_per_s * 1e9 * LINK_EFFICIENCY)
    hop = nccl.ring_net_hop[2] if nodes > 1 else nccl.ring_nvlink_hop[2]
    return (nccl.ring_base[2] + hop) * 1e-6 + max(intra, inter)


def layer_cp_cost(
    *,
    mode: str,
    cp: int,
    tp: int,
    micro_batch: int,
    seq_len: int,
    n_head: int,
    n_kv_head: int,
    head_dim: int,
    c: float,
    attention_forward: float,
    recompute: str,
    nccl: NcclVersion,
    group_nodes: int,
    ring_gb_per_s: float,
    intra_gb_per_s: float,
    device_net_gb_per_s: float,
    amd_host: bool = False,
) -> ContextParallelCost:
    """The cp communication of one layer for one micro-batch on one device.

    ``attention_forward``: this rank's attention-core forward seconds for the micro-batch (its
    ``1 / cp`` share of the causal attention); a ring block is ``1 / cp`` of it, its backward twice
    that."""
    if mode not in CP_MODES:
        raise ValueError(f"context_parallel_mode={mode!r}: choose one of {CP_MODES}.")
    if cp <= 1:
        return ContextParallelCost(mode, 0, 0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    local_tokens = micro_batch * seq_len / cp
    kv_heads = n_kv_head / tp
    recompute_passes = 1 if recompute == "full" else 0
    if mode == "ring":
        kv_elements = 2 * local_tokens * kv_heads * head_dim  # K and V of the local tokens
        fwd_bytes, bwd_bytes = kv_elements * c, kv_elements * (c + 4.0)
        fwd_hop = hop_seconds(fwd_bytes, group_nodes, ring_gb_per_s, nccl, amd_host)
        bwd_hop = hop_seconds(bwd_bytes, group_nodes, ring_gb_per_s, nccl, amd_host)
        last_hop = hop_seconds(kv_elements * 4.0, group_nodes, ring_gb_per_s, nccl, amd_host)  # fp32 dK/dV home
        fwd_block = attention_forward / cp
        bwd_block = 2.0 * fwd_block
        forward_exposed = (cp - 1) * max(0.0, fwd_hop - fwd_block)
        backward_exposed = (cp - 1) * max(0.0, bwd_hop - bwd_block) + last_hop
        total = (1 + recompute_passes) * (cp - 1) * fwd_hop + (cp - 1) * bwd_hop + last_hop
        exposed = (1 + recompute_passes) * forward_exposed + backward_exposed
        return ContextParallelCost(
            mode, cp - 1, cp, fwd_bytes, bwd_bytes, fwd_hop, bwd_hop, fwd_block, bwd_block, total, exposed
        )
    # all_to_all: q and the output at the rank's query heads, k and v at the replicated kv heads
    q_heads = n_head / tp
    kv_replicated = math.lcm(max(1, int(kv_heads)), cp) if kv_heads >= 1 else cp
    q_bytes = local_tokens * q_heads * head_dim * c
    kv_bytes = local_tokens * kv_replicated * head_dim * c

    def a2a(nbytes: float) -> float:
        return all_to_all_seconds(nbytes, cp, group_nodes, intra_gb_per_s, device_net_gb_per_s, nccl)

    one_pass = 2 * a2a(q_bytes) + 2 * a2a(kv_bytes)  # q, k, v in; the output back
    total = (2 + recompute_passes) * one_pass  # backward is the same four, reversed
    fwd_bytes = 2 * q_bytes + 2 * kv_bytes
    return ContextParallelCost(
        mode, 4, 4, fwd_bytes / 4, fwd_bytes / 4, one_pass / 4, one_pass / 4, 0.0, 0.0, total, total
    )
