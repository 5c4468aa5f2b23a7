"""All-to-all (DeepSpeed-Ulysses) context-parallel attention.

Instead of moving K/V blocks around a ring, one all-to-all turns the sequence-sharded q/k/v
(each cp rank: all heads, its load-balanced local tokens) into head-sharded ones (each cp rank:
``heads / cp`` heads over the whole sequence, in natural order), plain causal attention runs
locally, and a second all-to-all brings the output back to the local load-balanced layout. Its
communication volume does not grow with cp, but cp must divide the number of heads.

GQA: kv heads are sharded the same way, so ``kv_heads`` must be a multiple of cp. When it is not
(e.g. 2 kv heads at cp=4), each kv head is replicated (``repeat_interleave``) up to
``lcm(kv_heads, cp)`` heads first; autograd sums the replicas' gradients back.

Both all-to-alls are one custom autograd Function whose backward is the reverse all-to-all. Buffers
live on the input's device, contiguous, and are allocated before each collective (NCCL's rules).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from lightning_3d.core.eager import communicates
from lightning_3d.context_parallel.layout import chunk_order, chunks_of
from lightning_3d.context_parallel.ring import check_shapes


def _all_to_all(x: Tensor, group: Any) -> Tensor:
    """all_to_all_single along dim 0 (one slice per cp rank)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def sequence_to_heads(x: Tensor, group: Any) -> Tensor:
    """(B, H, T_local, D) load-balanced -> (B, H/cp, T, D) in natural sequence order (no autograd)."""
    cp = dist.get_world_size(group)
    b, h, t_local, d = x.shape
    send = x.view(b, cp, h // cp, t_local, d).movedim(1, 0)  # slice r: the heads of cp rank r
    recv = _all_to_all(send, group)  # slice r: my heads over cp rank r's local tokens
    halves = recv.view(cp, b, h // cp, 2, t_local // 2, d)
    return torch.cat([halves[r, :, :, half] for r, half in chunk_order(cp)], dim=2)


def heads_to_sequence(x: Tensor, group: Any) -> Tensor:
    """(B, H/cp, T, D) natural order -> (B, H, T_local, D) load-balanced: the inverse of :func:`sequence_to_heads`."""
    cp = dist.get_world_size(group)
    b, h_local, t, d = x.shape
    chunks = x.chunk(2 * cp, dim=2)
    send = torch.stack([torch.cat([chunks[c] for c in chunks_of(r, cp)], dim=2) for r in range(cp)])
    recv = _all_to_all(send, group)  # slice r: cp rank r's heads over my local tokens
    return recv.movedim(0, 1).reshape(b, cp * h_local, t // cp, d)


class _Reshard(torch.autograd.Function):
    """Sequence shards -> head shards (``to_heads``) or back; the backward is the other direction."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any, to_heads: bool) -> Tensor:
        ctx.group, ctx.to_heads = group, to_heads
        return (sequence_to_heads if to_heads else heads_to_sequence)(x, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return (heads_to_sequence if ctx.to_heads else sequence_to_heads)(grad, ctx.group), None, None


def kv_replication(heads: int, kv_heads: int, cp: int) -> int:
    """How many times each kv head is replicated so that cp divides the kv heads (1: none).
    Raises a ValueError naming the values and the fix when cp does not divide ``heads``."""
    if heads % cp:
        raise ValueError(
            f"all-to-all context parallelism shards attention heads: heads={heads} is not divisible by cp={cp}. "
            f"Use a cp that divides {heads}, or ring attention (lightning_3d.context_parallel.ring_attention), "
            f"which has no such constraint."
        )
    return (kv_heads * cp // math.gcd(kv_heads, cp)) // kv_heads


def windowed_causal_attention(
    q: Tensor, k: Tensor, v: Tensor, scale: Optional[float], window: Optional[int] = None, softcap: Optional[float] = None
) -> Tensor:
    """Causal attention over whole sequences (natural order), optionally within a sliding ``window``
    (query ``i`` sees keys ``j`` with ``i - window < j <= i``, as transformers' sliding layers) and
    with soft-capped scores (``softcap * tanh(s / softcap)``, Gemma 2). Soft-capping runs as explicit
    math in fp32 (SDPA has no soft cap); otherwise SDPA with the mask."""
    gqa = k.shape[1] != q.shape[1]
    if window is None and softcap is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    t = q.shape[2]
    pos = torch.arange(t, device=q.device)
    allowed = pos.unsqueeze(1) >= pos.unsqueeze(0)
    if window is not None:
        allowed &= pos.unsqueeze(0) > pos.unsqueeze(1) - window
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=gqa)
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
    scores = torch.tanh(scores / softcap) * softcap
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.matmul(probs, v.float()).to(q.dtype)


@communicates
def all_to_all_attention(
    q: Tensor, k: Tensor, v: Tensor, group: Any, scale: Optional[float] = None, *,
    window: Optional[int] = None, softcap: Optional[float] = None,
) -> Tensor:
    """Causal attention over the full sequence by two all-to-alls over the cp ``group``.

    Same contract as :func:`~lightning_3d.context_parallel.ring.ring_attention`: local
    load-balanced q (B, heads, T_local, head_dim), k/v (B, kv_heads, T_local, head_dim); returns the
    local output. Requires ``heads % cp == 0``; kv heads are replicated when cp does not divide them.
    Each rank holds whole sequences of its heads, so a sliding ``window`` and a ``softcap`` of the
    scores apply as in one process (:func:`windowed_causal_attention`).
    """
    check_shapes(q, k, v)
    cp = dist.get_world_size(group)
    if q.shape[2] % 2:
        raise ValueError(f"local sequence length {q.shape[2]} is odd: the load-balanced layout holds two equal chunks per cp rank.")
    repeat = kv_replication(q.shape[1], k.shape[1], cp)
    if cp == 1:
        return windowed_causal_attention(q, k, v, scale, window, softcap)
    if repeat > 1:
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    qh, kh, vh = (_Reshard.apply(x, group, True) for x in (q, k, v))
    out = windowed_causal_attention(qh, kh, vh, scale, window, softcap)
    return _Reshard.apply(out, group, False)
