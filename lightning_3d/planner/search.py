"""Enumerate 3D layouts, estimate each one's memory and step time, rank the ones that fit.

A *layout* is the degrees (dp, tp, pp, and context parallel cp) plus the options that change
memory or time: micro-batch size, schedule and virtual stages, ZeRO stage, sequence parallelism,
activation recomputation, offload and the context-parallel mode. A *software* profile says which options the training stack offers, so the same planner
can answer "what would lightning_3d do here" and "what could Megatron-LM do in 2021".
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Iterable, Iterator, Optional

from lightning_3d.core.layout_rules import SCHEDULES as PIPELINE_SCHEDULES
from lightning_3d.core.layout_rules import (
    V_SHAPED,
    LayoutRefused,
    Refusal,
    batch_refusals,
    context_parallel_refusals,
    expert_refusals,
    feature_refusals,
    pipeline_refusals,
    sequence_parallel_refusals,
    tensor_parallel_refusals,
    world_refusals,
)
from lightning_3d.core.model_shape import ModelShape
from lightning_3d.planner.collective_cost import NCCL_VERSIONS, Group
from lightning_3d.planner.context_parallel import CP_MIN_SEQUENCE, CP_MODES, ContextParallelCost, all_to_all_seconds, layer_cp_cost
from lightning_3d.planner.data_parallel import DataParallelTime, replicated_params_comm, sharded_params_comm
from lightning_3d.planner.hardware import ClusterSpec
from lightning_3d.planner.memory import (
    ActivationOptions,
    activation_bytes,
    activations_in_flight,
    last_stage_in_flight,
    loss_transient_bytes,
    stage_in_flight,
    zero_model_state_bytes,
)
from lightning_3d.planner.timing import (
    HBM_EFFICIENCY,
    MicroBatchCost,
    head_cost,
    layer_cost,
    optimizer_seconds,
    p2p_seconds,
    partial_grad_sum_seconds,
    tp_exchange_seconds,
)
from lightning_3d.planner.zero_bubble import ZERO_BUBBLE, v_chunk_layers, zero_bubble_pipeline

RECOMPUTE = ("none", "selective", "full")
# the strategy's schedules (layout_rules.SCHEDULES), the classic ones searched first
SCHEDULES = tuple(sorted(PIPELINE_SCHEDULES, key=lambda s: ("1f1b", "interleaved_1f1b", "gpipe").index(s) if s in ("1f1b", "interleaved_1f1b", "gpipe") else 3))
OFFLOAD = ("none", "cpu", "nvme")
# Fraction of device memory the caching allocator can hand out before fragmentation bites; a
# plan that needs more is rejected (PyTorch typically loses 5-10% to fragmentation at peak).
ALLOCATOR_HEADROOM = 0.95
# ZeRO-3 gathers across more nodes than this rest on NCCL's ring physics alone: the one published
# ZeRO-3 at scale (Narayanan et al. 2021, Table 2: DeepSpeed, 48-192 nodes) moved its gathers at
# an eighth of that bandwidth, and no published run of a prefetching stack at that scale checks
# it (docs/planner.md, "ZeRO-3 at scale"). Such estimates carry a caveat.
ZERO3_VALIDATED_NODES = 8
PRECISIONS = {"bf16-mixed": (2.0, 12.0), "16-mixed": (2.0, 12.0), "32-true": (4.0, 8.0)}  # (c, K) bytes


@dataclass(frozen=True)
class Software:
    """What the training stack can do; the planner only proposes what it offers."""

    name: str
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    schedules: tuple[str, ...] = ("1f1b", "interleaved_1f1b")
    recompute: tuple[str, ...] = RECOMPUTE
    sequence_parallel: tuple[bool, ...] = (False, True)
    offload: tuple[str, ...] = OFFLOAD
    flash_attention: bool = True
    zero3_with_pipeline: bool = False  # lightning_3d refuses ZeRO-3 under pp (as DeepSpeed does)
    zero3_with_sequence_parallel: bool = False
    overlap_grad_reduce: bool = True  # gradient collectives run during the last backward
    grad_reduce_bytes: float = 4.0  # fp32 gradient accumulation and reduction
    extra_grad_bytes: float = 0.0  # per parameter, beyond the 16-bit gradient (an fp32 accumulation copy)
    p2p_scatter_gather: bool = False  # each tp rank sends 1/t of a stage's output (Megatron-LM)
    balanced_stages: bool = True  # give the head's stage fewer layers (Megatron-LM 2021 splits layers evenly)
    uneven_stages: bool = True  # pp x v need not divide the layers (Megatron-LM 2021 requires it)
    interleaved_min_stages: int = 2  # fewest pipeline stages that may interleave (Megatron-LM: 3)
    nccl: str = "2.30"  # whose latency tables (planner/collectives.py) its collectives pay
    grad_bucket_mb: float = 25.0  # bytes per gradient / parameter collective (0: one for all)
    overlap_grad_reduce_with_pp: bool = False  # the last micro-batch's backward hides it under pp > 1 too
    overlap_param_gather: bool = False  # ZeRO-1/2's parameter all-gather hides behind the next forward
    tp_comm_overlap: bool = False  # tensor-parallel collectives run inside the GEMMs (userbuffers)
    p2p_overlap: bool = False  # pipeline sends and receives run behind compute
    zero3_per_parameter: bool = False  # one all-gather per parameter tensor, not per layer
    zero3_persist_below: float = 0.0  # tensors with fewer elements stay whole (not gathered)
    zero3_own_adapter: bool = False  # its world-spanning gathers reach one adapter's share per device
    context_parallel_modes: tuple[str, ...] = CP_MODES  # () : no context parallelism
    # ZB-H1 with recomputation: the runtime may recompute a block twice (once for I, once for W),
    # which the time model does not count, so the planner does not propose it
    zero_bubble_recompute: bool = False


SOFTWARE: dict[str, Software] = {
    # lightning_3d alone offers the zero-bubble schedules (the planner never with recomputation)
    "lightning_3d": Software("lightning_3d", schedules=("1f1b", "interleaved_1f1b", "zb_h1", "zb_v", "dualpipe_v")),
    # Megatron-LM as in Narayanan et al. 2021: no ZeRO, no sequence parallelism (2022), unfused
    # softmax attention (FlashAttention is 2022), full recomputation, 1F1B or interleaved 1F1B.
    "megatron_2021": Software(
        "megatron_2021",
        zero_stages=(0,),
        context_parallel_modes=(),
        recompute=("full",),
        sequence_parallel=(False,),
        offload=("none",),
        flash_attention=False,
        overlap_grad_reduce=False,
        grad_reduce_bytes=2.0,  # fp16 training, gradients reduced in fp16
        extra_grad_bytes=4.0,  # fp16 grads + fp32 main grads: 20 bytes/parameter (Megatron-LM docs)
        p2p_scatter_gather=True,
        balanced_stages=False,
        uneven_stages=False,
        interleaved_min_stages=3,
        nccl="2.9",
        grad_bucket_mb=0.0,  # one all-reduce over the contiguous gradient buffer
    ),
    # Megatron-DeepSpeed as used for BLOOM-176B and MT-NLG 530B: ZeRO-1 optional, DeepSpeed's
    # 1F1B pipeline (no interleaving), unfused attention, full recomputation.
    "megatron_deepspeed_2022": Software(
        "megatron_deepspeed_2022",
        zero_stages=(0, 1),
        context_parallel_modes=(),
        schedules=("1f1b",),
        recompute=("full",),
        sequence_parallel=(False,),
        offload=("none",),
        flash_attention=False,
        overlap_grad_reduce=False,
        balanced_stages=False,
        extra_grad_bytes=4.0,  # bf16 grads + fp32 accumulation (DeepSpeed's bf16 optimizer)
        nccl="2.9",
        grad_bucket_mb=1000.0,  # reduce_bucket_size = allgather_bucket_size = 5e8 elements (DeepSpeed default)
    ),
    # DeepSpeed 0.3-0.5 ZeRO-3 under Megatron-LM's GPT, as Narayanan et al. 2021 (Table 2) ran it.
    # From its code (partition_parameters.py / stage3.py, v0.4.0): one all_gather per parameter,
    # tensors under stage3_param_persistence_threshold = 1e5 elements kept whole, the next tensor
    # prefetched on a side stream while a module computes (device-wide synchronizes at every
    # module bound the overlap to that module), reduce-scatters per parameter on a side stream. Its step times (flat from 768 to
    # 1,536 GPUs) say its gathers moved at one adapter's share per GPU, not the node's eight
    # (docs/planner.md, "ZeRO-3 at scale").
    "deepspeed_zero3_2021": Software(
        "deepspeed_zero3_2021",
        zero_stages=(0, 1, 2, 3),
        context_parallel_modes=(),
        schedules=("1f1b",),
        recompute=("none", "full"),
        sequence_parallel=(False,),
        offload=("none",),
        flash_attention=False,
        overlap_grad_reduce=True,
        grad_reduce_bytes=2.0,
        nccl="2.9",
        grad_bucket_mb=1000.0,
        zero3_per_parameter=True,
        zero3_persist_below=1e5,
        zero3_own_adapter=True,
    ),
    # Megatron-Core as NVIDIA's NeMo 24.12 benchmark recipes run it on DGX H100 (the H100
    # calibration rows): distributed optimizer (ZeRO-1) with gradient reduce-scatter and parameter
    # all-gather overlapped, tensor-parallel communication overlapped with the GEMMs, p2p overlap,
    # fused attention, sequence parallelism, fp32 gradient reduction (bf16 main grads in fp32).
    "megatron_core_2024": Software(
        "megatron_core_2024",
        zero_stages=(0, 1),
        offload=("none",),
        grad_reduce_bytes=4.0,
        extra_grad_bytes=2.0,  # fp32 main grads only: gradient_accumulation_fusion writes them directly
        balanced_stages=False,
        uneven_stages=False,
        grad_bucket_mb=160.0,  # Megatron-Core's DDP bucket: max(40M elements, ...) x 4 bytes
        overlap_grad_reduce_with_pp=True,
        overlap_param_gather=True,
        tp_comm_overlap=True,
        p2p_overlap=True,
    ),
}


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    pp: int
    micro_batch_size: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    zero_stage: int = 0
    sequence_parallel: bool = False
    recompute: str = "none"
    offload: str = "none"
    cp: int = 1  # context parallel: each sequence split over cp ranks (same weights, other tokens)
    context_parallel_mode: str = "ring"  # ring | all_to_all (meaningful for cp > 1)
    ep: int = 1  # expert parallel: MoE experts split over ep of the dp x cp replicas (no ranks of its own)

    @property
    def degrees(self) -> tuple[int, int, int, int]:
        """(dp, tp, pp, cp): what :func:`rank` keeps the best of."""
        return (self.dp, self.tp, self.pp, self.cp)

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def micro_batches(self, global_batch: int) -> int:
        """Micro-batches per step: the global batch splits over dp only (cp ranks share sequences)."""
        return global_batch // (self.dp * self.micro_batch_size)

    def short(self) -> str:
        parts = [f"dp={self.dp}", f"tp={self.tp}", f"pp={self.pp}"]
        if self.cp > 1:
            parts.append(f"cp={self.cp}" + ("(a2a)" if self.context_parallel_mode == "all_to_all" else ""))
        if self.ep > 1:
            parts.append(f"ep={self.ep}")
        parts.append(f"mb={self.micro_batch_size}")
        if self.pp > 1:
            interleaved = self.schedule == "interleaved_1f1b" and self.virtual_stages > 1
            parts.append(f"interleaved(v={self.virtual_stages})" if interleaved else self.schedule)
        parts.append(f"zero={self.zero_stage}")
        if self.sequence_parallel:
            parts.append("sp")
        if self.recompute != "none":
            parts.append(f"recompute={self.recompute}")
        if self.offload != "none":
            parts.append(f"offload={self.offload}")
        return " ".join(parts)

    def strategy_kwargs(self, global_batch: int, split_points: Optional[list[int]] = None) -> dict[str, Any]:
        """``ThreeDParallelStrategy`` keywords (``cfg.parallel``) that run this layout."""
        out: dict[str, Any] = {
            "data_parallel": self.dp,
            "tensor_parallel": self.tp,
            "pipeline_parallel": self.pp,
            "zero_stage": self.zero_stage,
            "sequence_parallel": self.sequence_parallel,
            "pipeline_schedule": self.schedule,
            "micro_batches": self.micro_batches(global_batch) if self.pp > 1 else None,
            "virtual_stages": self.virtual_stages,
            "activation_checkpointing": None if self.recompute == "none" else self.recompute,
            "offload_optimizer": self.offload if self.offload != "none" and self.zero_stage < 3 else None,
            "offload_params": self.offload if self.offload != "none" and self.zero_stage == 3 else None,
            "context_parallel": self.cp,
            "context_parallel_mode": self.context_parallel_mode,
            "expert_parallel": self.ep,
        }
        if split_points:
            out["pipeline_partition"] = list(split_points)
        return out


@dataclass
class Estimate:
    layout: Layout
    memory: dict[str, float]  # bytes per device, by kind, and "total"
    host_bytes_per_node: float
    nvme_bytes_per_node: float
    fits: bool
    why_not: str
    step_seconds: float
    time: dict[str, float]  # seconds by kind
    tflops_per_device: float  # hardware FLOPs (recompute included, as Narayanan et al. count)
    mfu: float  # model FLOPs (no recompute) / peak
    tokens_per_second: float
    split_points: list[int] = field(default_factory=list)
    comm: dict[str, Any] = field(default_factory=dict)  # collective counts, latency / transfer / hidden terms
    caveats: list[str] = field(default_factory=list)  # where the estimate leaves what published runs checked

    def to_dict(self, global_batch: int) -> dict[str, Any]:
        gib = 1 / 2**30
        return {
            "layout": asdict(self.layout),
            "strategy": self.layout.strategy_kwargs(global_batch, self.split_points),
            "micro_batches": self.layout.micro_batches(global_batch),
            "fits": self.fits,
            "why_not": self.why_not or None,
            "memory_gib": {k: round(v * gib, 3) for k, v in self.memory.items()},
            "host_gib_per_node": round(self.host_bytes_per_node * gib, 2),
            "nvme_gib_per_node": round(self.nvme_bytes_per_node * gib, 2),
            "step_seconds": round(self.step_seconds, 4),
            "time_seconds": {k: round(v, 4) for k, v in self.time.items()},
            "tflops_per_device": round(self.tflops_per_device, 2),
            "mfu": round(self.mfu, 4),
            "tokens_per_second": round(self.tokens_per_second, 1),
            "comm": self.comm,
            "caveats": self.caveats,
        }


@dataclass(frozen=True)
class Problem:
    model: ModelShape
    cluster: ClusterSpec
    global_batch: int
    software: Software = SOFTWARE["lightning_3d"]
    precision: str = "bf16-mixed"
    cross_node_tp: bool = False
    max_micro_batch_size: int = 16
    # MoE: routed rows on the busiest rank of an expert group over the mean (1: the balance the
    # auxiliary loss aims at); scales that rank's expert GEMMs, all-to-all bytes and routed activations
    expert_imbalance: float = 1.0

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r}: the planner knows {sorted(PRECISIONS)}.")
        if not self.expert_imbalance >= 1.0:
            raise ValueError(
                f"expert_imbalance={self.expert_imbalance}: the busiest rank's routed rows over the mean is at least 1 "
                f"(1: balanced routing); give a value >= 1."
            )
        if self.global_batch < 1:
            raise ValueError(f"global_batch={self.global_batch} must be positive.")


def expert_all_to_alls(recompute: str) -> tuple[int, int]:
    """(row exchanges, count exchanges) of one MoE block per micro-batch under expert parallelism:
    dispatch and combine in each forward and again in backward, the forward run twice under full
    recompute; the per-expert counts once per forward (as the dry run counts them)."""
    forwards = 2 if recompute == "full" else 1
    return 2 * (forwards + 1), forwards


def head_stage(schedule: str, pp: int) -> int:
    """The pipeline rank holding the head (and the loss): the last, or rank 0 under a V."""
    return 0 if schedule in V_SHAPED else pp - 1


def stage_layers(n_layer: int, pp: int, v: int, head_weight: float, v_shape: bool = False) -> tuple[list[int], list[int]]:
    """Layers per physical stage and the split points (block indices where pieces 2.. start).

    ``v == 1``: the last stage carries the head, worth ``head_weight`` layers, so it gets fewer
    layers when that balances the stages. ``v > 1``: uniform pieces, dealt round-robin, or in a V
    (``v_shape``: rank r holds pieces r and 2pp-1-r).
    """
    if pp == 1:
        return [n_layer], []
    if v_shape:
        return [a + b for a, b in v_chunk_layers(n_layer, pp)], []
    if v > 1:
        pieces = pp * v
        base, extra = divmod(n_layer, pieces)
        sizes = [base + (1 if i < extra else 0) for i in range(pieces)]
        per_stage = [sum(sizes[i::pp]) for i in range(pp)]
        return per_stage, []
    best: Optional[tuple[float, list[int]]] = None
    for last in range(1, math.ceil(n_layer / pp) + 1):
        rest = n_layer - last
        if rest < pp - 1:
            break
        base, extra = divmod(rest, pp - 1)
        sizes = [base + (1 if i < extra else 0) for i in range(pp - 1)] + [last]
        load = max(max(sizes[:-1]), last + head_weight)
        if best is None or load < best[0] - 1e-9:
            best = (load, sizes)
    assert best is not None
    sizes = best[1]
    points = [sum(sizes[:i]) for i in range(1, pp)]
    return sizes, points


@functools.lru_cache(maxsize=None)
def _nodes_spanned(stride: int, size: int, devices_per_node: int) -> int:
    """Nodes holding ranks 0, stride, 2 stride, ... (size of them)."""
    if stride >= devices_per_node and stride % devices_per_node == 0:
        return size
    return len({i * stride // devices_per_node for i in range(size)})


class Planner:
    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        self.c, self.k = PRECISIONS[problem.precision]
        self._layer_cost = functools.lru_cache(maxsize=None)(self._layer_cost_uncached)
        self._cp_cost = functools.lru_cache(maxsize=None)(self._cp_cost_uncached)
        self._degree_cache: dict[tuple[int, int, int, int], list[Refusal]] = {}

    # -- bandwidths --------------------------------------------------------------------------
    def _per_device_network(self) -> float:
        cluster = self.problem.cluster
        return cluster.inter_node_gb_per_s / cluster.devices_per_node

    def _bandwidth(self, stride: int, size: int) -> float:
        """Per-device bandwidth of a ring over ``size`` ranks ``stride`` apart. Inside a node: the
        device link. Across nodes, the ring enters and leaves each node once per channel, so a group
        with ``k`` members on a node uses ``k`` of its adapters: ``k`` x the per-device network share
        (the other groups on the node use the rest)."""
        cluster = self.problem.cluster
        nodes = _nodes_spanned(stride, size, cluster.devices_per_node)
        if nodes > 1:
            members_per_node = -(-size // nodes)
            return min(cluster.intra_node_gb_per_s, members_per_node * self._per_device_network())
        return cluster.intra_node_gb_per_s

    def _group(self, stride: int, size: int, own_adapter: bool = False) -> Group:
        """The ``size`` ranks ``stride`` apart as :mod:`collectives` sees them. ``own_adapter``: a
        stack whose gathers reach only the device's own network share (``zero3_own_adapter``)."""
        cluster = self.problem.cluster
        nodes = _nodes_spanned(stride, size, cluster.devices_per_node)
        bandwidth = self._bandwidth(stride, size)
        if own_adapter and nodes > 1:
            bandwidth = min(bandwidth, self._per_device_network())
        return Group(
            size, nodes, bandwidth, amd_host=cluster.host_cpu == "amd", latency_us=cluster.collective_latency_us,
            all_gather_gb_per_s=cluster.all_gather_gb_per_s, reduce_scatter_gb_per_s=cluster.reduce_scatter_gb_per_s,
        )

    @property
    def nccl(self):  # type: ignore[no-untyped-def]
        return NCCL_VERSIONS[self.problem.software.nccl]

    def _layer_cost_uncached(self, mb: int, tp: int, sp: bool, recompute: str, cp: int = 1, mode: str = "ring", ep: int = 1):  # type: ignore[no-untyped-def]
        p = self.problem
        cost = layer_cost(
            p.model, p.cluster, mb, tp, sp, recompute, p.software.flash_attention, self._group(1, tp), self.nccl, cp, self.c
        )
        if p.software.tp_comm_overlap:  # chunked GEMMs hide the collectives they are longer than
            cost = replace(cost, tp_comm=max(0.0, cost.tp_comm - cost.forward - cost.backward))
        if cp > 1:
            cost = replace(cost, cp_comm=self._cp_cost(mb, tp, recompute, cp, mode).exposed)
        if p.model.n_experts:
            cost = self._with_experts(cost, mb, tp, recompute, cp, ep)
        return cost

    def expert_exchange(self, mb: int, tp: int, cp: int, ep: int) -> dict[str, float]:
        """One MoE block's all-to-alls on one rank for one micro-batch and pass: the routed rows it sends
        (``top_k`` per token, its ``1 / tp`` share of them, the busiest rank's under imbalance) over the
        expert group, ``ep`` ranks ``tp`` apart (adjacent replicas), and the per-expert counts before them
        (int64, of its tp rank's ``E / tp`` experts); bytes and seconds of each."""
        model, cluster = self.problem.model, self.problem.cluster
        if ep <= 1:
            return {"row_bytes": 0.0, "rows_s": 0.0, "count_bytes": 0.0, "counts_s": 0.0}
        tokens = mb * model.seq_len / cp
        row_bytes = tokens * model.top_k / tp * self.problem.expert_imbalance * model.hidden * self.c
        count_bytes = 8.0 * model.n_experts / tp
        nodes = _nodes_spanned(tp, ep, cluster.devices_per_node)
        net = self._per_device_network() if nodes > 1 else cluster.intra_node_gb_per_s

        def a2a(nbytes: float) -> float:
            return all_to_all_seconds(nbytes, ep, nodes, cluster.intra_node_gb_per_s, net, self.nccl)

        return {"row_bytes": row_bytes, "rows_s": a2a(row_bytes), "count_bytes": count_bytes, "counts_s": a2a(count_bytes)}

    def _with_experts(self, cost: MicroBatchCost, mb: int, tp: int, recompute: str, cp: int, ep: int) -> MicroBatchCost:
        """Expert parallelism's exchanges (:func:`expert_all_to_alls`), not overlapped: the split sizes are
        read on the host. Under imbalance, the busiest rank's extra expert GEMMs, which the group waits for."""
        model = self.problem.model
        rows, counts = expert_all_to_alls(recompute)
        exchange = self.expert_exchange(mb, tp, cp, ep)
        ep_comm = model.moe_share * (rows * exchange["rows_s"] + counts * exchange["counts_s"])
        extra = self.problem.expert_imbalance - 1.0
        if extra <= 0 or ep * tp <= 1:
            return replace(cost, ep_comm=ep_comm)
        routed = model.moe_share * model.top_k * 3 * model.hidden * model.expert_ffn  # routed GEMM weights per token
        share = routed / model.layer_active_matmul_params * cost.linear_forward  # their forward seconds
        return replace(
            cost, ep_comm=ep_comm, forward=cost.forward + extra * share,
            backward=cost.backward + extra * share * (2 + (1 if recompute == "full" else 0)),
        )

    def _cp_cost_uncached(self, mb: int, tp: int, recompute: str, cp: int, mode: str) -> ContextParallelCost:
        """One layer's context-parallel exchange per micro-batch over the cp group: ``cp`` ranks
        ``tp`` apart (rank order pp, dp, cp, tp), inside a node while cp x tp fits in one."""
        model, cluster = self.problem.model, self.problem.cluster
        # this rank's attention-core forward (a ring block is 1 / cp of it); sp and recompute do not change it
        attention_forward = self._layer_cost(mb, tp, False, "none").attention_forward / cp
        return layer_cp_cost(
            mode=mode, cp=cp, tp=tp, micro_batch=mb, seq_len=model.seq_len, n_head=model.n_head,
            n_kv_head=model.n_kv_head, head_dim=model.head_dim, c=self.c, attention_forward=attention_forward,
            recompute=recompute, nccl=self.nccl, group_nodes=_nodes_spanned(tp, cp, cluster.devices_per_node),
            ring_gb_per_s=self._bandwidth(tp, cp), intra_gb_per_s=cluster.intra_node_gb_per_s,
            device_net_gb_per_s=self._per_device_network() if cluster.num_nodes > 1 else cluster.intra_node_gb_per_s,
            amd_host=cluster.host_cpu == "amd",
        )

    # -- one layout --------------------------------------------------------------------------
    def evaluate(self, layout: Layout) -> Estimate:
        p, model, cluster = self.problem, self.problem.model, self.problem.cluster
        c, k = self.c, self.k
        t, pp, d, mb, v = layout.tp, layout.pp, layout.dp, layout.micro_batch_size, layout.virtual_stages
        cp = layout.cp
        m = layout.micro_batches(p.global_batch)
        if cp > 1 or layout.ep > 1:
            cost = self._layer_cost(mb, t, layout.sequence_parallel, layout.recompute, cp, layout.context_parallel_mode, layout.ep)
        else:  # the cache key of every cp=1 layout, as before cp
            cost = self._layer_cost(mb, t, layout.sequence_parallel, layout.recompute)
        local_seq = model.seq_len / cp  # tokens of each sequence this device holds
        head_seconds = head_cost(model, cluster, mb, t, cp)
        if not p.software.tp_comm_overlap:
            head_seconds += 2 * tp_exchange_seconds(mb * local_seq * model.hidden * c, t, layout.sequence_parallel, self._group(1, t), self.nccl)
        head_weight = head_seconds / cost.total if p.software.balanced_stages else 0.0
        layers, split_points = stage_layers(model.n_layer, pp, v, head_weight, layout.schedule in V_SHAPED)
        head_at = head_stage(layout.schedule, pp)

        # ---- memory, on the first stage (most activations in flight) and the last (head) ----
        in_flight = activations_in_flight(layout.schedule, pp, m, v)
        stages = [(0, in_flight)]
        if pp > 1 and layout.schedule in V_SHAPED:  # every rank holds two chunks: rank 0 with the head, the V's bottom
            chunks = v_chunk_layers(model.n_layer, pp)
            stages = [(i, stage_in_flight(layout.schedule, pp, m, v, i, chunks[i])) for i in (0, pp - 1)]
        elif pp > 1:
            stages.append((pp - 1, last_stage_in_flight(layout.schedule, pp, m)))  # 1F1B: 1, each micro-batch finishes at once
        best_memory: Optional[dict[str, float]] = None
        psi_max = optimizer_shard = 0.0  # (psi_max: what the replicas reduce; at ep > 1 the experts reduce over their own)
        for index, flight in stages:
            _, memory = self.stage_memory(layout, layers, index, flight)
            if best_memory is None or memory["total"] > best_memory["total"]:
                best_memory = memory
            dense, expert = self.stage_params(layout, layers, index)
            psi_max = max(psi_max, dense + (expert if layout.ep == 1 else 0.0))
            optimizer_shard = max(optimizer_shard, self.optimizer_shard(layout, layers, index))
        assert best_memory is not None

        host = nvme = 0.0
        if layout.offload == "cpu":
            host = k * optimizer_shard * cluster.devices_per_node
            if layout.zero_stage == 3:
                host += 2 * c * optimizer_shard * cluster.devices_per_node
            else:  # the kept host buffers: the fp32 gradient slice, and the upload in the compute dtype
                host += (4 + (c if c != 4 else 0)) * optimizer_shard * cluster.devices_per_node
        elif layout.offload == "nvme":
            nvme = k * optimizer_shard * cluster.devices_per_node
            if layout.zero_stage == 2:  # the reduced fp32 gradient slice is kept on the host
                host = 4 * optimizer_shard * cluster.devices_per_node
        capacity = cluster.device.memory_gb * 1e9 * ALLOCATOR_HEADROOM
        why_not = ""
        if best_memory["total"] > capacity:
            why_not = (
                f"needs {best_memory['total'] / 1e9:.1f} GB per device > {capacity / 1e9:.1f} GB usable "
                f"({ALLOCATOR_HEADROOM:.0%} of {cluster.device.memory_gb:g} GB)"
            )
        elif host > cluster.cpu_ram_gb * 1e9:
            why_not = f"offload needs {host / 1e9:.0f} GB host RAM per node > {cluster.cpu_ram_gb:g} GB"
        elif nvme > cluster.nvme_gb * 1e9:
            why_not = f"offload needs {nvme / 1e9:.0f} GB NVMe per node > {cluster.nvme_gb:g} GB"

        # ---- time ----
        stage_seconds = max(
            n * cost.total + (head_seconds if i == head_at else 0.0) for i, n in enumerate(layers)
        )
        p2p = 0.0
        if pp > 1:
            split = layout.sequence_parallel or p.software.p2p_scatter_gather
            nbytes = c * mb * local_seq * model.hidden / (t if split else 1)
            hidden = p.software.p2p_overlap and v > 1  # Megatron-Core overlaps p2p for the interleaved schedule
            p2p = 0.0 if hidden else 2 * p2p_seconds(nbytes, self._bandwidth(t * cp * d, 2), cluster.collective_latency_us)  # a stage is dp x cp x tp ranks
        per_micro_batch = stage_seconds + v * p2p
        if layout.schedule in ZERO_BUBBLE and pp > 1:  # its own simulated (or exact) step (zero_bubble.py)
            bubble = zero_bubble_pipeline(layout.schedule, pp, m).bubble_units * per_micro_batch
        elif v == 1:
            bubble = (pp - 1) * per_micro_batch
        else:  # the warm-up and drain run piece by piece: the largest piece sets the pace
            largest_piece = -(-model.n_layer // (pp * v))
            bubble = (pp - 1) * (largest_piece * cost.total + p2p)
        pipeline = m * per_micro_batch + bubble

        dp_time = self._data_parallel_time(layout, layers, psi_max, cost)
        if layout.ep > 1:
            dp_time = self._expert_data_parallel_time(layout, layers, cost, dp_time)
        exposed_dp = dp_time.exposed
        opt = optimizer_seconds(optimizer_shard, cluster, layout.offload, cluster.devices_per_node)
        loop = cluster.step_overhead_ms * 1e-3  # the training loop's own host time (profiled clusters)
        partial_sum = 0.0
        if t > 1 and (layout.sequence_parallel or model.n_experts):
            partial_sum = max(
                partial_grad_sum_seconds(model, n, i == head_at, layout.sequence_parallel, self._group(1, t), self.nccl, p.software.grad_reduce_bytes)
                for i, n in enumerate(layers)
            )
        zero3_host = 0.0
        if layout.zero_stage == 3:  # a profiled host's FSDP2 work (0 on every shipped cluster)
            zero3_host = cluster.zero3_step_overhead_ms * 1e-3 + cluster.zero3_unit_overhead_us * 1e-6 * (max(layers) + 1) * m
        step = pipeline + exposed_dp + partial_sum + opt + loop + zero3_host

        world = layout.world
        recompute_passes = {"none": 0.0, "full": 1.0, "selective": 0.0}[layout.recompute]
        hardware_flops = model.step_flops(p.global_batch, recompute_passes)
        model_flops = model.step_flops(p.global_batch, 0.0)
        tflops = hardware_flops / world / step / 1e12
        mfu = model_flops / world / step / (cluster.device.tflops(cluster.devices_per_node) * 1e12)  # against the full-width rate, so layouts compare
        time = {
            "compute": m * stage_seconds - m * max(layers) * (cost.tp_comm + cost.cp_comm + cost.ep_comm),
            "tp_comm": m * max(layers) * cost.tp_comm,
            **({"cp_comm_exposed": m * max(layers) * cost.cp_comm} if cp > 1 else {}),
            **({"ep_comm": m * max(layers) * cost.ep_comm} if layout.ep > 1 else {}),
            "pp_bubble": bubble,
            "pp_p2p": m * v * p2p,
            "dp_comm_exposed": exposed_dp,
            **({"partial_grad_sum": partial_sum} if partial_sum else {}),
            "optimizer": opt,
            **({"step_overhead": loop} if loop else {}),
            **({"zero3_host": zero3_host} if zero3_host else {}),
        }
        comm = {"dp": dp_time.to_dict()}
        if cp > 1:
            cp_cost = self._cp_cost(mb, t, layout.recompute, cp, layout.context_parallel_mode)
            cp_nodes = _nodes_spanned(t, cp, cluster.devices_per_node)
            comm["cp"] = {
                "ranks": cp, "stride": t, "nodes": cp_nodes,
                "gb_per_s": self._bandwidth(t, cp) if layout.context_parallel_mode == "ring" else None,
                **cp_cost.to_dict(scale=m * max(layers)),
            }
        if layout.ep > 1:
            exchange = self.expert_exchange(mb, t, cp, layout.ep)
            comm["ep"] = {
                "ranks": layout.ep, "stride": t, "nodes": _nodes_spanned(t, layout.ep, cluster.devices_per_node),
                "moe_layers_on_stage": round(max(layers) * model.moe_share, 2),
                "all_to_alls_per_layer_and_micro_batch": sum(expert_all_to_alls(layout.recompute)),
                "row_bytes_each": round(exchange["row_bytes"]), "rows_s_each": round(exchange["rows_s"], 6),
                "exposed_s": round(m * max(layers) * cost.ep_comm, 4),
            }
        caveats = []
        dp_nodes = self._group(t, d * cp).nodes
        if layout.zero_stage == 3 and not p.software.zero3_own_adapter and dp_nodes > ZERO3_VALIDATED_NODES:
            caveats.append(
                f"ZeRO-3 over {dp_nodes} nodes assumes its gathers reach NCCL's ring bandwidth; the one published "
                f"ZeRO-3 run at this scale (DeepSpeed 2021) reached 1/{cluster.devices_per_node} of it. Measure a few "
                f"steps first; --software deepspeed_zero3_2021 shows that bound."
            )
        return Estimate(
            layout=layout,
            memory=best_memory,
            host_bytes_per_node=host,
            nvme_bytes_per_node=nvme,
            fits=not why_not,
            why_not=why_not,
            step_seconds=step,
            time=time,
            tflops_per_device=tflops,
            mfu=mfu,
            tokens_per_second=p.global_batch * model.seq_len / step,
            split_points=split_points,
            comm=comm,
            caveats=caveats,
        )

    def stage_psi(self, layout: Layout, layers: list[int], index: int) -> float:
        """Parameters pipeline stage ``index`` holds on one rank (dense and routed experts)."""
        return sum(self.stage_params(layout, layers, index))

    def stage_params(self, layout: Layout, layers: list[int], index: int) -> tuple[float, float]:
        """(dense, expert) parameters pipeline stage ``index`` holds on one rank. Dense: its layers'
        tensor-parallel shares, the vocab-parallel embedding on the first stage, the head (final norm,
        untied LM head) on the last, and on the last the tied embedding's copy too; they replicate over
        the dp x cp replicas. Expert: the routed experts' ``1 / (ep x tp)``, replicated over ``dp x cp / ep``."""
        model = self.problem.model
        expert = layers[index] * model.layer_expert_params / (layout.ep * layout.tp)
        return self._dense_stage_psi(layout, layers, index), expert

    def optimizer_shard(self, layout: Layout, layers: list[int], index: int) -> float:
        """Parameters whose optimizer state stage ``index``'s rank updates: with ZeRO >= 1, the dense ones'
        ``1 / (dp x cp)`` and the experts' ``1 / (dp x cp / ep)``."""
        dense, expert = self.stage_params(layout, layers, index)
        if layout.zero_stage == 0:
            return dense + expert
        replicas = layout.dp * layout.cp
        return dense / replicas + expert / (replicas // layout.ep)

    def _dense_stage_psi(self, layout: Layout, layers: list[int], index: int) -> float:
        model, t, pp = self.problem.model, layout.tp, layout.pp
        layer_psi = model.layer_sharded_params / t + model.layer_replicated_params
        token_psi = model.vocab * model.hidden / t  # vocab-parallel
        embed_psi = token_psi + model.embedding_params - model.vocab * model.hidden  # learned positions: whole on every tp rank
        head_psi = model.head_params / t if not model.tied_embeddings else model.hidden * (2 if model.bias else 1)
        psi = layers[index] * layer_psi
        if index == 0:
            psi += embed_psi
        if index == head_stage(layout.schedule, pp):  # (a V puts the head beside the embedding: one tied weight)
            psi += head_psi + (token_psi if model.tied_embeddings and index > 0 else 0)  # the tied copy: token embedding only
        return psi

    def stage_memory(self, layout: Layout, layers: list[int], index: int, flight: float) -> tuple[float, dict[str, float]]:
        """(psi, bytes by kind and ``total``) of pipeline stage ``index`` holding ``flight`` micro-batches'
        activations of its layers at its peak."""
        p, model, cluster = self.problem, self.problem.model, self.problem.cluster
        c, k = self.c, self.k
        t, pp, d, mb, cp = layout.tp, layout.pp, layout.dp, layout.micro_batch_size, layout.cp
        local_seq = model.seq_len / cp
        has_head = index == head_stage(layout.schedule, pp)
        dense, expert = self.stage_params(layout, layers, index)
        psi = dense + expert
        imbalance = p.expert_imbalance if layout.ep * t > 1 else 1.0  # (one rank holding every expert computes all its rows)
        act_opts = ActivationOptions(t, layout.sequence_parallel, layout.recompute, p.software.flash_attention, c, cp, imbalance)
        grad_bytes = c + (p.software.extra_grad_bytes if c == 2.0 else 0.0)
        states = zero_model_state_bytes(dense, layout.zero_stage, d * cp, k=k, c=c, grad_bytes=grad_bytes)  # ZeRO spans dp x cp
        if expert:  # the expert replicas: dp x cp / ep
            experts = zero_model_state_bytes(expert, layout.zero_stage, d * cp // layout.ep, k=k, c=c, grad_bytes=grad_bytes)
            states = {kind: states[kind] + experts[kind] for kind in states}
        if layout.offload != "none":
            states["optimizer"] = 0.0
            if layout.zero_stage == 3:
                states["params"] = states["grads"] = 0.0
        pending = flight - 1 if layout.schedule == "zb_h1" and has_head and pp > 1 else 0.0  # held-back W's
        # the pipeline runtime keeps each in-flight piece's output until that piece's backward (the head's
        # piece returns a loss)
        held = max(0.0, flight * layout.virtual_stages - (1 if has_head else 0)) if pp > 1 else 0.0
        activations = activation_bytes(model, mb, layers[index], flight, act_opts, has_head, pending, held, index == 0)
        buffers = 0.0
        if layout.zero_stage >= 1:  # two in-flight reduce buckets of the stack's size, at most the grads
            bucket = p.software.grad_bucket_mb * 2**20 or psi * p.software.grad_reduce_bytes
            buffers += 2 * min(bucket, psi * p.software.grad_reduce_bytes)
        if layout.zero_stage == 3:  # the gathered unit + the prefetched one: a layer, or a tensor
            unit = max(model.layer_tensor_sizes(t)) if p.software.zero3_per_parameter else model.layer_sharded_params / t
            buffers += 2 * c * unit
            if model.n_experts:  # an MoE block's experts: their own unit, gathered over the expert replicas
                buffers += 2 * c * model.moe_layer_expert_params / (layout.ep * t)
        if pp > 1:
            buffers += 2 * c * mb * local_seq * model.hidden / (t if layout.sequence_parallel else 1)
        if cp > 1:
            buffers += self._cp_buffer_bytes(layout)
        if has_head:  # the fp32 loss's backward, beyond what the activations keep for it
            buffers += loss_transient_bytes(model, mb, act_opts)
        memory = {
            **states,
            "activations": activations["stored"],
            "recompute": activations["recompute"],
            "buffers": buffers,
            "reserved": cluster.device.reserved_gb * 1e9,
        }
        memory["total"] = sum(memory.values())
        return psi, memory

    def _cp_buffer_bytes(self, layout: Layout) -> float:
        """Transient bytes of one layer's cp attention (what the kernels allocate beyond the stored
        activations). Ring: two K/V blocks in forward; in backward the K/V block and its spare,
        three fp32 dK/dV accumulators (local, incoming, outgoing) and the fp32 dQ. All-to-all: the
        head-sharded q, k, v (kv replicated to lcm(kv/t, cp)) and output over the full sequence."""
        model, c, t, cp = self.problem.model, self.c, layout.tp, layout.cp
        tokens = layout.micro_batch_size * model.seq_len / cp
        kv = 2 * tokens * model.n_kv_head / t * model.head_dim  # K and V elements of the local tokens
        q = tokens * model.n_head / t * model.head_dim
        if layout.context_parallel_mode == "ring":
            return max(2 * kv * c, 2 * kv * c + 3 * kv * 4.0 + q * 4.0)
        kv_heads = model.n_kv_head // t
        replicated = math.lcm(max(1, kv_heads), cp) / max(1, kv_heads)
        return (2 * q + kv * replicated) * c

    def _data_parallel_time(self, layout: Layout, layers: list[int], psi: float, cost: Any) -> DataParallelTime:
        """The data-parallel collectives of one step on the heaviest stage (``psi`` parameters on
        this tensor-parallel rank), and how much of them compute hides (data_parallel.py)."""
        p, model, sw = self.problem, self.problem.model, self.problem.software
        t, d, pp = layout.tp, layout.dp * layout.cp, layout.pp  # gradients and ZeRO state span dp x cp
        m = layout.micro_batches(p.global_batch)
        group = self._group(t, d, own_adapter=sw.zero3_own_adapter and layout.zero_stage == 3)
        if layout.zero_stage == 3:
            tensors = model.layer_tensor_sizes(t)
            layer_psi = model.layer_sharded_params / t + model.layer_replicated_params
            if model.n_experts and layout.ep == 1:  # the experts are in the block's unit, over every replica
                tensors = tensors + [model.layer_expert_params / t]
                layer_psi += model.layer_expert_params / t
            return sharded_params_comm(
                tensors, max(layers), max(0.0, psi - max(layers) * layer_psi), m, self.c,
                sw.grad_reduce_bytes, sw.zero3_per_parameter, sw.zero3_persist_below,
                group, self.nccl, cost.forward + cost.tp_comm / 2, cost.backward + cost.tp_comm / 2, cost.linear_forward,
                cost.forward if layout.recompute == "full" else 0.0,
                0.0 if sw.zero3_per_parameter else self.problem.cluster.device.memory_bandwidth_gb_per_s * 1e9 * HBM_EFFICIENCY,
            )
        overlaps = sw.overlap_grad_reduce and (pp == 1 or sw.overlap_grad_reduce_with_pp)
        return replicated_params_comm(
            layout.zero_stage, psi, self.c, sw.grad_reduce_bytes, sw.grad_bucket_mb * 2**20, group, self.nccl,
            backward_window=max(layers) * cost.backward if overlaps else 0.0,
            forward_window=max(layers) * cost.forward if sw.overlap_param_gather else 0.0,  # the first micro-batch waits
        )

    def _expert_data_parallel_time(self, layout: Layout, layers: list[int], cost: Any, dense: DataParallelTime) -> DataParallelTime:
        """At ``ep > 1``: the routed experts' data-parallel collectives, over their replicas (``dp x cp / ep``
        ranks ``tp x ep`` apart), in the backward and forward windows the dense ones (``dense``) left.
        ZeRO-3: each MoE block's experts are then one unit (FSDP2 over the expert replicas) whose gathers
        are counted exposed (no prefetch modelled). At ``ep = 1`` the experts are the replicas' like any
        weight (:meth:`_data_parallel_time` counts them)."""
        p, model, sw = self.problem, self.problem.model, self.problem.software
        t, replicas, ep = layout.tp, layout.dp * layout.cp, layout.ep
        expert = max(layers) * model.layer_expert_params / (ep * t)
        group = self._group(t * ep, replicas // ep)
        m = layout.micro_batches(p.global_batch)
        if layout.zero_stage == 3:  # each MoE block's experts: one FSDP2 unit, gathered twice per micro-batch
            moe_layers = max(1, round(max(layers) * model.moe_share))
            expert_time = sharded_params_comm(
                [model.moe_layer_expert_params / (ep * t)], moe_layers, 0.0, m, self.c, sw.grad_reduce_bytes, False, 0.0,
                group, self.nccl, 0.0, 0.0, 0.0, 0.0,
                self.problem.cluster.device.memory_bandwidth_gb_per_s * 1e9 * HBM_EFFICIENCY,
            )
        else:
            overlaps = sw.overlap_grad_reduce and (layout.pp == 1 or sw.overlap_grad_reduce_with_pp)
            backward = max(layers) * cost.backward if overlaps else 0.0
            forward = max(layers) * cost.forward if sw.overlap_param_gather else 0.0
            expert_time = replicated_params_comm(
                layout.zero_stage, expert, self.c, sw.grad_reduce_bytes, sw.grad_bucket_mb * 2**20, group, self.nccl,
                backward_window=max(0.0, backward - dense.hidden_backward),
                forward_window=max(0.0, forward - dense.hidden_forward),
            )
        return dense.merged(expert_time, "expert_")

    # -- the search space ---------------------------------------------------------------------
    # Candidates come from the software profile's options; a candidate is proposed only when no rule
    # refuses it: the strategy's own (lightning_3d.core.layout_rules, which ParallelConfig raises) and the
    # planner's (the batch must split evenly, the profile must offer the option).
    def degree_refusals(self, d: int, t: int, pp: int, cp: int = 1) -> list[Refusal]:
        """Why (dp, tp, pp, cp) cannot train this model on this cluster with this batch."""
        key = (d, t, pp, cp)
        if key not in self._degree_cache:
            self._degree_cache[key] = self._degree_refusals(d, t, pp, cp)
        return self._degree_cache[key]

    def _degree_refusals(self, d: int, t: int, pp: int, cp: int = 1) -> list[Refusal]:
        p, model, cluster, sw = self.problem, self.problem.model, self.problem.cluster, self.problem.software
        out: list[Refusal] = []
        if d * t * pp * cp != cluster.world_size:
            product = f"dp x tp x pp = {d} x {t} x {pp}" if cp == 1 else f"dp x tp x pp x cp = {d} x {t} x {pp} x {cp}"
            out.append(Refusal(
                "world_size",
                f"layout {product} = {d * t * pp * cp} does not match the {cluster.world_size} devices "
                f"of cluster {cluster.name!r}; choose degrees whose product is {cluster.world_size}.",
            ))
        else:
            node = None if p.cross_node_tp else cluster.devices_per_node
            out += world_refusals(dp=d, tp=t, pp=pp, cp=cp, world_size=cluster.world_size, processes_per_node=node)
        out += tensor_parallel_refusals(t, model) + pipeline_refusals(pp, 1, model)
        if cp > 1 and not sw.context_parallel_modes:
            out.append(Refusal(
                "profile:context_parallel",
                f"software profile {sw.name!r} has no context parallelism; use cp=1 (or --software lightning_3d).",
            ))
        if p.global_batch % d:
            out.append(Refusal(
                "planner:dp_divides_batch",
                f"dp={d} does not divide the global batch {p.global_batch}: the planner models equal batches per "
                f"replica; choose dp dividing {p.global_batch}, or change data.global_batch_size.",
            ))
        if model.n_layer % pp and not sw.uneven_stages:
            out.append(Refusal(
                "profile:even_stages",
                f"software profile {sw.name!r} splits layers evenly, and pp={pp} does not divide the {model.n_layer} "
                f"layers; choose pp dividing {model.n_layer}.",
            ))
        return out

    def refusals(self, layout: Layout) -> list[Refusal]:
        """Every reason ``layout`` is not proposed: the strategy's rules on the keywords it would be
        run with (:meth:`Layout.strategy_kwargs`), then the planner's and the profile's."""
        out = list(self.degree_refusals(layout.dp, layout.tp, layout.pp, layout.cp))
        return out + self._option_refusals(layout)

    def _option_refusals(self, layout: Layout) -> list[Refusal]:
        p, model, sw = self.problem, self.problem.model, self.problem.software
        d, t, pp, v = layout.dp, layout.tp, layout.pp, layout.virtual_stages
        kw = layout.strategy_kwargs(p.global_batch)
        out = feature_refusals(
            tp=t, pp=pp, zero_stage=layout.zero_stage, sequence_parallel=layout.sequence_parallel,
            schedule=layout.schedule, virtual_stages=v, micro_batches=kw["micro_batches"],
            offload_optimizer=kw["offload_optimizer"] or "none", offload_params=kw["offload_params"] or "none",
        )
        allowed = {"zero3_with_pipeline": sw.zero3_with_pipeline, "zero3_with_sequence_parallel": sw.zero3_with_sequence_parallel}
        out = [r for r in out if not allowed.get(r.rule)]  # a profile modelling software that has them
        if v > 1 and pp <= model.n_layer:  # pp alone is checked with the degrees
            out += pipeline_refusals(pp, v, model)
        out += sequence_parallel_refusals(t, layout.sequence_parallel, model)
        if model.n_experts or layout.ep > 1:
            out += expert_refusals(tp=t, pp=pp, cp=layout.cp, model=model, ep=layout.ep, sequence_parallel=layout.sequence_parallel)
            if layout.ep > 1 and (d * layout.cp) % layout.ep:
                out += world_refusals(dp=d, tp=t, pp=pp, cp=layout.cp, ep=layout.ep, world_size=layout.world)
        if layout.cp > 1:
            out += context_parallel_refusals(layout.cp, layout.context_parallel_mode, t, layout.sequence_parallel, model)
            if sw.context_parallel_modes and layout.context_parallel_mode not in sw.context_parallel_modes:
                out.append(Refusal(
                    "profile:option",
                    f"software profile {sw.name!r} offers context-parallel modes {', '.join(sw.context_parallel_modes)}, "
                    f"not {layout.context_parallel_mode}; pick one of those.",
                ))
        per_replica = p.global_batch // d
        mb = layout.micro_batch_size
        if mb < 1 or per_replica % mb:
            out.append(Refusal(
                "planner:micro_batch_divides_batch",
                f"mb={mb} does not divide the per-replica batch {per_replica} (global batch {p.global_batch} / dp={d}); "
                f"choose one of {', '.join(str(b) for b in range(1, per_replica + 1) if per_replica % b == 0)}.",
            ))
        else:
            out += batch_refusals(pp=pp, micro_batches=kw["micro_batches"], per_replica_batch=per_replica)
        if layout.sequence_parallel and t == 1:
            out.append(Refusal(
                "planner:sequence_parallel_needs_tp",
                "sp=true needs tp > 1 (with tensor_parallel=1 the strategy ignores sequence_parallel); drop sp or raise tp.",
            ))
        if pp == 1 and (layout.schedule != "1f1b" or v != 1):
            out.append(Refusal(
                "planner:schedule_needs_pp",
                f"schedule={layout.schedule!r}, v={v} describe a pipeline, but pp=1; leave them out or use pp > 1.",
            ))
        offered = [
            ("zero stages", layout.zero_stage, sw.zero_stages),
            ("recompute", layout.recompute, sw.recompute),
            ("sequence parallelism", layout.sequence_parallel, sw.sequence_parallel),
            ("offload", layout.offload, sw.offload),
        ]
        if pp > 1:
            offered.append(("schedules", layout.schedule, sw.schedules))
        for what, value, choices in offered:
            if value not in choices:
                out.append(Refusal(
                    "profile:option",
                    f"software profile {sw.name!r} offers {what} {', '.join(map(str, choices))}, not {value}; "
                    f"pick one of those (or --software lightning_3d).",
                ))
        if pp > 1 and layout.schedule == "interleaved_1f1b" and pp < sw.interleaved_min_stages:
            out.append(Refusal(
                "profile:interleaved_stages",
                f"software profile {sw.name!r} interleaves only with pp >= {sw.interleaved_min_stages} (got pp={pp}); "
                f"use schedule=1f1b.",
            ))
        if v > 1 and model.n_layer % (pp * v) and not sw.uneven_stages:
            out.append(Refusal(
                "profile:even_stages",
                f"software profile {sw.name!r} splits layers evenly, and pp x v = {pp * v} does not divide the "
                f"{model.n_layer} layers; choose v with pp x v dividing {model.n_layer}.",
            ))
        if pp > 1 and layout.schedule in ZERO_BUBBLE and layout.recompute != "none" and not sw.zero_bubble_recompute:
            out.append(Refusal(
                "planner:zero_bubble_recompute",
                f"schedule={layout.schedule} with recompute={layout.recompute}: the runtime may recompute a block for both halves "
                f"of its backward (I and W), which the planner's time model does not count; use recompute=none, or "
                f"schedule=1f1b / interleaved with recompute.",
            ))
        if layout.offload == "nvme" and p.cluster.nvme_gb <= 0:
            out.append(Refusal(
                "planner:no_nvme",
                f"offload=nvme, but cluster {p.cluster.name!r} has no NVMe (nvme_gb={p.cluster.nvme_gb:g}); use "
                f"offload=cpu or set cluster.nvme_gb.",
            ))
        return out

    def degrees(self) -> Iterator[tuple[int, int, int]]:
        """(dp, tp, pp) at cp=1 that no rule refuses (:meth:`degree_refusals`);
        :meth:`context_degrees` adds context parallelism."""
        world = self.problem.cluster.world_size
        for t, pp in self._model_parallel_pairs():
            if not self.degree_refusals(world // (t * pp), t, pp):
                yield world // (t * pp), t, pp

    def _model_parallel_pairs(self) -> Iterator[tuple[int, int]]:
        """(tp, pp) pairs whose product divides the world, tp within a node unless cross-node tp is allowed."""
        p, model, cluster = self.problem, self.problem.model, self.problem.cluster
        world = cluster.world_size
        tp_limit = world if p.cross_node_tp else cluster.devices_per_node
        for t in range(1, min(tp_limit, world) + 1):
            if world % t:
                continue
            for pp in range(1, min(model.n_layer, world // t) + 1):
                if (world // t) % pp == 0:
                    yield t, pp

    def context_degrees(self) -> Iterator[tuple[int, int, int, int]]:
        """(dp, tp, pp, cp) with cp > 1 (powers of two dividing world / (tp x pp)) that no rule
        refuses; a sequence that cannot split into 2 cp equal chunks stops the cp ladder."""
        p, model = self.problem, self.problem.model
        if not p.software.context_parallel_modes:
            return
        world = p.cluster.world_size
        for t, pp in self._model_parallel_pairs():
            cp = 2
            while (world // (t * pp)) % cp == 0 and model.seq_len % (2 * cp) == 0:
                d = world // (t * pp * cp)
                if not self.degree_refusals(d, t, pp, cp):
                    yield d, t, pp, cp
                cp *= 2

    def candidates(
        self, d: int, t: int, pp: int, fixed: Optional[dict[str, Any]] = None, cp: Optional[int] = None
    ) -> Iterator[Layout]:
        """The profile's option combinations for (dp, tp, pp, cp), unchecked; ``fixed`` pins fields
        (``cp`` there, or the argument; default 1)."""
        p, model, sw = self.problem, self.problem.model, self.problem.software
        fixed = fixed or {}
        cp = int(cp if cp is not None else fixed.get("cp", 1))
        per_replica = p.global_batch // d

        def choices(name: str, default: Iterable[Any]) -> list[Any]:
            return [fixed[name]] if name in fixed else list(default)

        sizes = choices("micro_batch_size", (b for b in _powers_of_two(min(per_replica, p.max_micro_batch_size)) if per_replica % b == 0))
        if pp == 1:
            pairs = [(s, v) for s in choices("schedule", ["1f1b"]) for v in choices("virtual_stages", [1])]
        else:
            pairs = []
            for s in choices("schedule", sw.schedules):
                if s in V_SHAPED:  # two chunks per rank, always
                    pairs += [(s, v) for v in choices("virtual_stages", [2] if 2 * pp <= model.n_layer else [])]
                    continue
                if s != "interleaved_1f1b":
                    pairs += [(s, v) for v in choices("virtual_stages", [1])]
                    continue
                # v pieces per stage; uneven pieces only where the profile splits layers unevenly
                fitting = [v for v in range(2, 9) if pp * v <= model.n_layer and (sw.uneven_stages or model.n_layer % (pp * v) == 0)]
                pairs += [(s, v) for v in choices("virtual_stages", fitting or ([2] if "schedule" in fixed else []))]
        sps = choices("sequence_parallel", [s for s in sw.sequence_parallel if not s or t > 1])
        modes = choices("context_parallel_mode", list(sw.context_parallel_modes or CP_MODES) if cp > 1 else ["ring"])
        experts = model.n_experts
        eps = choices("ep", [1] + [e for e in range(2, d * cp + 1) if (d * cp) % e == 0 and experts % (e * t) == 0] if experts else [1])
        for mb in sizes:
            for schedule, v in pairs:
                for zero in choices("zero_stage", sw.zero_stages):
                    for sp in sps:
                        for recompute in choices("recompute", sw.recompute):
                            for offload in choices("offload", ["none"]):
                                for mode in modes:
                                    for ep in eps:
                                        yield Layout(d, t, pp, mb, schedule, v, zero, sp, recompute, offload, cp, mode, ep)

    def options(self, d: int, t: int, pp: int, cp: int = 1) -> Iterator[Layout]:
        """The candidates for (dp, tp, pp, cp) that no rule refuses (the degrees are checked by
        :meth:`degrees` / :meth:`context_degrees`)."""
        for layout in self.candidates(d, t, pp, cp=cp):
            if not self._option_refusals(layout):
                yield layout

    def search(self) -> list[Estimate]:
        """Every layout in the space, estimated; offload is tried only where nothing else fits.

        Context parallelism (cp > 1) is searched for sequences of ``CP_MIN_SEQUENCE`` tokens and
        more, where attention's s^2 term and the activations make it pay; at shorter sequences
        only when no cp=1 layout fits (it then trades K/V traffic for activation memory)."""
        out = self._search([(d, t, pp, 1) for d, t, pp in self.degrees()])
        if self.problem.model.seq_len >= CP_MIN_SEQUENCE or not any(e.fits for e in out):
            out += self._search(list(self.context_degrees()))
        return out

    def _search(self, degrees: list[tuple[int, int, int, int]]) -> list[Estimate]:
        out: list[Estimate] = []
        sw = self.problem.software
        for d, t, pp, cp in degrees:
            for layout in self.options(d, t, pp, cp):
                estimate = self.evaluate(layout)
                out.append(estimate)
                if estimate.fits or layout.zero_stage == 0:
                    continue
                for target in sw.offload:
                    offloaded = replace(layout, offload=target)
                    if target != "none" and not self._option_refusals(offloaded):
                        out.append(self.evaluate(offloaded))
        return out


def _powers_of_two(limit: int) -> list[int]:
    out, b = [], 1
    while b <= limit:
        out.append(b)
        b *= 2
    return out


def rank(estimates: Iterable[Estimate], distinct_degrees: bool = True) -> list[Estimate]:
    """Feasible layouts, fastest first; with ``distinct_degrees`` only the best per (dp, tp, pp, cp)."""
    feasible = sorted((e for e in estimates if e.fits), key=lambda e: e.step_seconds)
    if not distinct_degrees:
        return feasible
    seen: set[tuple[int, int, int, int]] = set()
    out = []
    for e in feasible:
        if e.layout.degrees not in seen:
            seen.add(e.layout.degrees)
            out.append(e)
    return out


def best_completion(planner: Planner, fixed: dict[str, Any]) -> Estimate:
    """The fastest layout that matches every given field (``dp``/``tp``/``pp`` required);
    unfitting ones too when nothing fits, so a given layout is always reported.

    Raises :class:`~lightning_3d.core.layout_rules.LayoutRefused` (a ``ValueError``) when no rule-abiding
    layout matches: with the reasons every candidate shares (the given fields' own), or else how
    many candidates each rule excluded."""
    missing = [key for key in ("dp", "tp", "pp") if key not in fixed]
    if missing:
        raise LayoutRefused([Refusal("planner:layout_needs_degrees", f"--layout needs {', '.join(k + '=' for k in missing)}; got {sorted(fixed)}.")])
    candidates = list(planner.candidates(fixed["dp"], fixed["tp"], fixed["pp"], fixed))  # cp: fixed's, else 1
    reasons = [planner.refusals(layout) for layout in candidates]
    ok = [layout for layout, why in zip(candidates, reasons) if not why]
    if not ok:
        shared = _shared(reasons)
        if shared:
            raise LayoutRefused(shared, prefix=f"layout {_fields(fixed)} cannot run: ")
        raise LayoutRefused(_counted(reasons), prefix=f"no layout matches {_fields(fixed)}: ")
    estimates = [planner.evaluate(layout) for layout in ok]
    fitting = [e for e in estimates if e.fits]
    pool = fitting or estimates
    return min(pool, key=lambda e: e.step_seconds if e.fits else e.memory["total"])


def _fields(fixed: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in fixed.items())


def _shared(reasons: list[list[Refusal]]) -> list[Refusal]:
    """The refusals every candidate has: those of the given fields themselves."""
    if not reasons:
        return [Refusal("planner:no_candidates", "the software profile offers no option combination for these degrees.")]
    return list(dict.fromkeys(r for r in reasons[0] if all(r in others for others in reasons[1:])))


def _counted(reasons: list[list[Refusal]]) -> list[Refusal]:
    """One refusal per rule: how many of the candidates it excluded, with an example."""
    counts: dict[str, list[Any]] = {}
    for why in reasons:
        for rule in dict.fromkeys(r.rule for r in why):
            entry = counts.setdefault(rule, [0, next(r for r in why if r.rule == rule)])
            entry[0] += 1
    n = len(reasons)
    return [
        Refusal(rule, f"{rule} excluded {count} of the {n} candidates, e.g. {example.message}")
        for rule, (count, example) in sorted(counts.items(), key=lambda item: -item[1][0])
    ]
