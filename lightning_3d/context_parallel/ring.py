"""Ring attention: exact causal attention over a sequence sharded across the cp group.

Each cp rank holds its load-balanced local q/k/v (:mod:`.layout`: chunks ``i`` and ``2cp-1-i``).
K/V blocks travel around the ring (rank ``i`` sends to ``i+1``, receives from ``i-1``); the
exchange for the next step is posted before the attention of the block in hand, so it overlaps.
Partial results are merged exactly with their log-sum-exp (online softmax), in fp32.

Backward is the standard ring-attention backward: a second ring pass in which each K/V block
travels with an fp32 dK/dV accumulator; every rank adds its contribution (computed from the
*global* output and log-sum-exp saved by forward), and after ``cp`` hops the accumulator is back
at the block's owner. dQ stays local.

Causality is decided per (q chunk, kv chunk) pair: skipped when the kv chunk comes after the q
chunk, causal-masked when it is the same chunk, unmasked when it comes before.

Kernels: on CPU torch's ``_scaled_dot_product_flash_attention_for_cpu`` (and its backward) return
and take the log-sum-exp; elsewhere an explicit fp32 math kernel is used (exact, but it
materializes the scores of one chunk pair: CUDA's flash/efficient ops are not wired in yet).

Communication follows NCCL's rules: device tensors only, contiguous pre-allocated receive buffers,
each step's send and receive in one ``batch_isend_irecv`` (no deadlock when a send blocks until
received), no tags, peers named by their global ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_3d.core.eager import communicates
from lightning_3d.context_parallel.layout import chunks_of

# (q, k, v, causal, scale) -> (out fp32, lse fp32 of shape q.shape[:-1])
ForwardKernel = Callable[[Tensor, Tensor, Tensor, bool, float], tuple[Tensor, Tensor]]
# (dout, q, k, v, out, lse, causal, scale) -> (dq, dk, dv)
BackwardKernel = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, bool, float], tuple[Tensor, Tensor, Tensor]]


@dataclass(frozen=True)
class Kernels:
    forward: ForwardKernel
    backward: BackwardKernel
    name: str


# -- block kernels -----------------------------------------------------------------------------------------------
def _causal_mask(q_len: int, k_len: int, device: torch.device) -> Tensor:
    """True where a key must be hidden (square blocks of the same chunk: top-left aligned)."""
    return torch.ones(q_len, k_len, dtype=torch.bool, device=device).triu(1)


def _scores(q: Tensor, k: Tensor, causal: bool, scale: float) -> Tensor:
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(_causal_mask(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    return s


def _math_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.float())
    return out, lse


def _math_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    p = torch.exp(_scores(q, k, causal, scale) - lse.unsqueeze(-1))
    do = dout.float()
    dv = torch.matmul(p.transpose(-1, -2), do)
    dp = torch.matmul(do, v.float().transpose(-1, -2))
    ds = p * (dp - (do * out.float()).sum(-1, keepdim=True))
    dq = torch.matmul(ds, k.float()) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q.float()) * scale
    return dq, dk, dv


def _cpu_flash_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out.float(), lse.float()


def _cpu_flash_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    # Given the global output and log-sum-exp, the flash backward of one block is that block's exact
    # share of the full gradient (P = exp(S - lse), D = rowsum(dO * O)).
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.contiguous(), q, k, v, out.to(q.dtype).contiguous(), lse.contiguous(), 0.0, causal, scale=scale
    )
    return dq.float(), dk.float(), dv.float()


MATH = Kernels(_math_forward, _math_backward, "math")
CPU_FLASH = Kernels(_cpu_flash_forward, _cpu_flash_backward, "cpu_flash")


def kernels_for(device: torch.device) -> Kernels:
    """The CPU flash op on CPU, the exact fp32 math kernel elsewhere."""
    has_cpu_flash = hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")
    return CPU_FLASH if device.type == "cpu" and has_cpu_flash else MATH


# -- chunk-pair bookkeeping --------------------------------------------------------------------------------------
def _pairs(q_chunks: tuple[int, int], kv_chunks: tuple[int, int]) -> list[tuple[int, list[int], bool]]:
    """For each local q half: (q half, kv halves it attends to, causal). A causal pair (same chunk)
    is alone; kv chunks strictly before the q chunk are attended unmasked, together."""
    work = []
    for qh, qc in enumerate(q_chunks):
        full = [kh for kh, kc in enumerate(kv_chunks) if kc < qc]
        same = [kh for kh, kc in enumerate(kv_chunks) if kc == qc]
        if full:
            work.append((qh, full, False))
        if same:
            work.append((qh, same, True))
    return work


def _halves(x: Tensor, which: list[int]) -> Tensor:
    """The listed halves of ``x`` along the sequence dim (-2), concatenated."""
    parts = x.chunk(2, dim=-2)
    return parts[which[0]] if len(which) == 1 else torch.cat([parts[w] for w in which], dim=-2)


def _expand_kv(x: Tensor, groups: int) -> Tensor:
    """GQA: kv head ``j`` serves q heads ``j*groups .. (j+1)*groups-1``."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _reduce_kv_grad(g: Tensor, groups: int) -> Tensor:
    if groups == 1:
        return g
    b, h, t, d = g.shape
    return g.view(b, h // groups, groups, t, d).sum(dim=2)


def _merge(acc: Optional[tuple[Tensor, Tensor]], out: Tensor, lse: Tensor) -> tuple[Tensor, Tensor]:
    """Exact online-softmax merge of two partial attentions over disjoint keys."""
    if acc is None:
        return out, lse
    acc_out, acc_lse = acc
    new_lse = torch.logaddexp(acc_lse, lse)
    merged = acc_out * torch.exp(acc_lse - new_lse).unsqueeze(-1) + out * torch.exp(lse - new_lse).unsqueeze(-1)
    return merged, new_lse


# -- the ring ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Ring:
    group: Any
    rank: int  # within the group
    size: int
    next_peer: int  # global ranks
    prev_peer: int

    @staticmethod
    def of(group: Any) -> "_Ring":
        group = dist.group.WORLD if group is None else group
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        return _Ring(
            group, rank, size, dist.get_global_rank(group, (rank + 1) % size), dist.get_global_rank(group, (rank - 1) % size)
        )

    def source(self, step: int) -> int:
        """The cp rank whose block this rank holds at ``step``."""
        return (self.rank - step) % self.size

    def shift(self, send: Tensor, recv: Tensor) -> list[Any]:
        """Post one hop around the ring: send to the next rank, receive from the previous, one batch."""
        ops = [
            dist.P2POp(dist.isend, send, self.next_peer, self.group),
            dist.P2POp(dist.irecv, recv, self.prev_peer, self.group),
        ]
        return dist.batch_isend_irecv(ops)


def _wait(works: Optional[list[Any]]) -> None:
    for w in works or ():
        w.wait()


def _ring_forward(q: Tensor, k: Tensor, v: Tensor, ring: _Ring, scale: float, kernels: Kernels) -> tuple[Tensor, Tensor]:
    groups = q.shape[1] // k.shape[1]
    q_chunks = chunks_of(ring.rank, ring.size)
    acc: list[Optional[tuple[Tensor, Tensor]]] = [None, None]
    current = torch.stack([k, v]).contiguous()
    spare = torch.empty_like(current)
    q_halves = q.chunk(2, dim=-2)
    for step in range(ring.size):
        works = ring.shift(current, spare) if step + 1 < ring.size else None
        kv_chunks = chunks_of(ring.source(step), ring.size)
        for qh, kvh, causal in _pairs(q_chunks, kv_chunks):
            kb = _expand_kv(_halves(current[0], kvh), groups)
            vb = _expand_kv(_halves(current[1], kvh), groups)
            out, lse = kernels.forward(q_halves[qh].contiguous(), kb.contiguous(), vb.contiguous(), causal, scale)
            acc[qh] = _merge(acc[qh], out, lse)
        _wait(works)
        current, spare = spare, current
    assert acc[0] is not None and acc[1] is not None  # the diagonal chunks are always attended (step 0)
    out = torch.cat([acc[0][0], acc[1][0]], dim=-2)
    lse = torch.cat([acc[0][1], acc[1][1]], dim=-1)
    return out, lse


def _ring_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, ring: _Ring, scale: float, kernels: Kernels
) -> tuple[Tensor, Tensor, Tensor]:
    groups = q.shape[1] // k.shape[1]
    q_chunks = chunks_of(ring.rank, ring.size)
    q_halves, do_halves, out_halves = q.chunk(2, dim=-2), dout.chunk(2, dim=-2), out.chunk(2, dim=-2)
    lse_halves = lse.chunk(2, dim=-1)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dq_halves = dq.chunk(2, dim=-2)
    kv, kv_spare = torch.stack([k, v]).contiguous(), None
    # the dK/dV accumulator travelling with the block in hand; the one arriving for the next block
    dkv_in: Optional[Tensor] = None
    dkv_works: Optional[list[Any]] = None
    dkv_out: Optional[Tensor] = None  # kept alive until its send completed
    for step in range(ring.size):
        kv_works = None
        if step + 1 < ring.size:
            kv_spare = torch.empty_like(kv)
            kv_works = ring.shift(kv, kv_spare)
        kv_chunks = chunks_of(ring.source(step), ring.size)
        local = torch.zeros((2, *k.shape), dtype=torch.float32, device=q.device)
        for qh, kvh, causal in _pairs(q_chunks, kv_chunks):
            kb = _expand_kv(_halves(kv[0], kvh), groups).contiguous()
            vb = _expand_kv(_halves(kv[1], kvh), groups).contiguous()
            dqb, dkb, dvb = kernels.backward(
                do_halves[qh], q_halves[qh].contiguous(), kb, vb, out_halves[qh], lse_halves[qh], causal, scale
            )
            dq_halves[qh].add_(dqb)
            _add_halves(local[0], _reduce_kv_grad(dkb, groups), kvh)
            _add_halves(local[1], _reduce_kv_grad(dvb, groups), kvh)
        _wait(dkv_works)  # the accumulator of this block, from the previous rank (none at step 0)
        if dkv_in is not None:
            local.add_(dkv_in)
        if ring.size == 1:
            dkv_in = local  # no ring: the block is our own
        else:
            dkv_out, dkv_in = local, torch.empty_like(local)
            dkv_works = ring.shift(dkv_out, dkv_in)  # to the next rank: it holds this block at the next step
        _wait(kv_works)
        if kv_works is not None:
            kv = kv_spare
    _wait(dkv_works)  # after cp hops, our own block's complete dK/dV is back
    assert dkv_in is not None
    return dq.to(q.dtype), dkv_in[0].to(k.dtype), dkv_in[1].to(v.dtype)


def _add_halves(target: Tensor, grad: Tensor, which: list[int]) -> None:
    """Add ``grad`` (the listed halves of the sequence, concatenated) into ``target``'s halves."""
    parts, pieces = target.chunk(2, dim=-2), grad.chunk(len(which), dim=-2)
    for w, piece in zip(which, pieces):
        parts[w].add_(piece)


class _RingAttention(torch.autograd.Function):
    """Autocast is off inside: the merge statistics must stay fp32 (under bf16-mixed an autocast
    matmul would make the scores, out and lse bf16 and the backward's softmax rows would no longer
    sum to 1). The output comes back in the autocast dtype when autocast is on, as SDPA's would."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, ring: _Ring, scale: float, kernels: Kernels) -> Tensor:
        device = q.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else q.dtype
        with torch.autocast(device, enabled=False):
            out, lse = _ring_forward(q, k, v, ring, scale, kernels)
        out = out.to(dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.scale, ctx.kernels = ring, scale, kernels
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Optional[Tensor], ...]:
        q, k, v, out, lse = ctx.saved_tensors
        with torch.autocast(q.device.type, enabled=False):
            dq, dk, dv = _ring_backward(dout.contiguous(), q, k, v, out, lse, ctx.ring, ctx.scale, ctx.kernels)
        return dq, dk, dv, None, None, None


def check_shapes(q: Tensor, k: Tensor, v: Tensor) -> None:
    """Raise a ValueError naming the shapes unless q/k/v are (B, heads, T_local, head_dim) with GQA heads."""
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(
            f"expected q, k, v of shape (B, heads, T_local, head_dim), k and v alike; "
            f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}."
        )
    if q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"q {tuple(q.shape)} and k/v {tuple(k.shape)} differ in batch, local length or head_dim.")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"q heads {q.shape[1]} are not a multiple of kv heads {k.shape[1]} (grouped-query attention).")


@communicates
def ring_attention(
    q: Tensor, k: Tensor, v: Tensor, group: Any, scale: Optional[float] = None, *, kernels: Optional[Kernels] = None
) -> Tensor:
    """Causal attention over the full sequence, each cp rank holding its load-balanced local q/k/v.

    ``q``: (B, heads, T_local, head_dim); ``k``, ``v``: (B, kv_heads, T_local, head_dim) with
    ``heads % kv_heads == 0`` (each kv head serves ``heads // kv_heads`` consecutive q heads).
    ``T_local`` must be even (the two chunks of :mod:`.layout`). Returns the local output, (B,
    heads, T_local, head_dim), in the load-balanced layout. ``kernels``: :data:`MATH` or
    :data:`CPU_FLASH` (default: :func:`kernels_for` the device).
    """
    check_shapes(q, k, v)
    if q.shape[2] % 2:
        raise ValueError(
            f"local sequence length {q.shape[2]} is odd: the load-balanced layout holds two equal chunks per "
            f"cp rank (shard with lightning_3d.context_parallel.shard_sequence)."
        )
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return _RingAttention.apply(q, k, v, _Ring.of(group), scale, kernels or kernels_for(q.device))
