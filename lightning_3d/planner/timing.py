"""Step time of one layout: compute at a calibrated fraction of peak, plus what it cannot hide.

Per micro-batch and pipeline stage, a transformer layer costs

* GEMMs: its forward FLOPs (Narayanan et al. 2021 counting) x (3 + recompute passes) / t, at
  ``device.gemm_efficiency`` x peak -- the one calibrated constant per device model;
* element-wise kernels (norms, dropout, residual adds, the activation function, and with unfused
  attention the scale-mask-softmax-dropout over ``a s^2`` scores): bytes moved / HBM bandwidth.
  The bytes per element below are counted from the kernels (read + write, 16-bit), not fitted;
* tensor-parallel collectives: two per layer per pass (all-reduce, or all-gather + reduce-scatter
  under sequence parallelism; the same bytes), each costed by :mod:`collectives` (latency +
  2 (t-1)/t x bytes over the link), not overlapped (as in Megatron-LM 2021; a stack that overlaps
  them with its GEMMs says so in its software profile).

A step is (m + (pp - 1) / v) micro-batch times of the slowest stage (the pipeline bubble of
1F1B and GPipe; interleaving divides it by ``v``) plus point-to-point sends, the data-parallel
gradient collectives that backward could not hide, and the optimizer step.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_3d.core.model_shape import ModelShape
from lightning_3d.planner.collective_cost import LINK_EFFICIENCY, Group, NcclVersion, collective_cost
from lightning_3d.planner.hardware import ClusterSpec
# Fraction of HBM bandwidth element-wise kernels reach.
HBM_EFFICIENCY = 0.8
# Element-wise bytes per element per forward (16-bit), counted from the kernels:
# per hidden element (b s h): two norms (read + write: 4 + 4) and two fused bias-dropout-add
# kernels (read input and residual, write: 6 + 6); with dropout, their 1-byte masks (1 + 1).
HIDDEN_BYTES = 20.0
HIDDEN_DROPOUT_BYTES = 2.0
# per ffn element (b s ffn): bias + GELU (4), or SwiGLU's silu(gate) * up (6).
FFN_BYTES = {False: 4.0, True: 6.0}
# per attention score (b a s^2), unfused: scale + mask + softmax (4), dropout (5).
SCORE_BYTES = 4.0
SCORE_DROPOUT_BYTES = 5.0
# Backward moves about twice the forward's element-wise bytes (reads saved inputs and grads).
BACKWARD_FACTOR = 2.0
# Optimizer step bytes per parameter of the local shard (fp32 master + two moments read and
# written, fp32 gradient read, 16-bit weight written).
OPTIMIZER_BYTES = 30.0


@dataclass(frozen=True)
class MicroBatchCost:
    """Seconds one layer takes for one micro-batch, split by kind."""

    forward: float
    backward: float  # includes recompute
    tp_comm: float
    linear_forward: float = 0.0  # of ``forward``: the GEMMs of the layer's weight matrices alone
    attention_forward: float = 0.0  # of ``forward``: the attention core (scores and values), what cp splits
    cp_comm: float = 0.0  # context parallelism's exposed K/V exchange (planner/context_parallel.py)
    ep_comm: float = 0.0  # expert parallelism's all-to-alls (averaged over the blocks, MoE or dense)

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.tp_comm + self.cp_comm + self.ep_comm


def p2p_seconds(nbytes: float, gb_per_s: float, latency_us: float = 0.0) -> float:
    """One point-to-point send of ``nbytes`` over a link of ``gb_per_s``; with a measured collective
    latency (``ClusterSpec.collective_latency_us``, a 2-rank all-reduce: two ring steps), one step's."""
    return nbytes / (gb_per_s * 1e9 * LINK_EFFICIENCY) + latency_us / 2 * 1e-6


def elementwise_forward_bytes(
    model: ModelShape, micro_batch: int, tp: int, sequence_parallel: bool, flash_attention: bool, cp: int = 1
) -> tuple[float, float]:
    """Bytes one layer's element-wise kernels move in forward for one micro-batch on one device, and of
    them the attention scores' (unfused attention only): what :func:`layer_cost` charges at HBM speed."""
    tokens = micro_batch * model.seq_len / cp
    hidden = tokens * model.hidden * (HIDDEN_BYTES + (HIDDEN_DROPOUT_BYTES if model.dropout else 0.0))
    hidden /= tp if sequence_parallel else 1  # outside the tp region, replicated unless split by SP
    ffn = tokens * model.ffn / tp * FFN_BYTES[model.gated_mlp]
    if model.n_experts:  # MoE blocks: their routed rows' and shared experts' SwiGLUs in place of the MLP
        dense = (1 - model.moe_share) * model.ffn
        ffn = tokens / tp * (dense * FFN_BYTES[model.gated_mlp] + (model.layer_ffn_width - dense) * FFN_BYTES[True])
    scores = 0.0
    if not flash_attention:
        per_score = SCORE_BYTES + (SCORE_DROPOUT_BYTES if model.dropout else 0.0)
        scores = micro_batch * model.n_head / tp * model.seq_len**2 / cp * per_score
    return hidden + ffn + scores, scores


def layer_cost(
    model: ModelShape,
    cluster: ClusterSpec,
    micro_batch: int,
    tp: int,
    sequence_parallel: bool,
    recompute: str,
    flash_attention: bool,
    tp_group: Group,
    nccl: NcclVersion,
    cp: int = 1,
    activation_bytes: float = 2.0,
) -> MicroBatchCost:
    """One transformer layer, one micro-batch, on one device. With context parallelism ``cp`` the
    device holds ``s / cp`` of each sequence's tokens, and each of them still attends over the
    (causal) full sequence: every term below is ``1 / cp`` of the cp=1 one. ``activation_bytes``: an
    activation element's size (2 under mixed precision, 4 in fp32), what the tp all-reduces carry."""
    device = cluster.device
    tokens = micro_batch * model.seq_len / cp
    gemm_rate = device.tflops(cluster.devices_per_node, tp) * 1e12 * device.gemm_efficiency
    hbm_rate = device.memory_bandwidth_gb_per_s * 1e9 * HBM_EFFICIENCY
    gemm_fwd = tokens * model.layer_forward_flops_per_token() / tp / gemm_rate

    elementwise, scores = elementwise_forward_bytes(model, micro_batch, tp, sequence_parallel, flash_attention, cp)
    elem_fwd = elementwise / hbm_rate

    # Host dispatch (a profiled CPU process): a third in forward, two thirds in backward, once more with full recompute.
    overhead = device.layer_overhead_us * 1e-6
    recompute_fwd = {"none": 0.0, "full": gemm_fwd + elem_fwd + overhead / 3, "selective": scores / hbm_rate}[recompute]
    forward = gemm_fwd + elem_fwd + overhead / 3
    backward = 2.0 * gemm_fwd + BACKWARD_FACTOR * elem_fwd + recompute_fwd + overhead * 2 / 3
    collectives = 4 + (2 if recompute == "full" else 0)  # two in forward, two in backward, two in recompute
    activation = tokens * model.hidden * activation_bytes
    tp_comm = collectives * tp_exchange_seconds(activation, tp, sequence_parallel, tp_group, nccl)
    linear = gemm_fwd * 2.0 * model.layer_active_matmul_params / model.layer_forward_flops_per_token()
    attention = gemm_fwd * model.attention_forward_flops_per_token() / model.layer_forward_flops_per_token()
    return MicroBatchCost(forward, backward, tp_comm, linear, attention)


def tp_exchange_seconds(nbytes: float, tp: int, sequence_parallel: bool, tp_group: Group, nccl: NcclVersion) -> float:
    """One tensor-parallel exchange of an activation of ``nbytes``: an all-reduce, or with sequence
    parallelism the reduce-scatter and all-gather that replace it (the same bytes and ring steps under
    NCCL's model, with two start-ups; a measured transport may run them at their own rates)."""
    kinds = ("reduce_scatter", "all_gather") if sequence_parallel and tp > 1 else ("all_reduce",)
    return sum(collective_cost(kind, nbytes, tp_group, nccl).seconds for kind in kinds)


def partial_grad_sum_seconds(
    model: ModelShape, layers_on_stage: int, last_stage: bool, sequence_parallel: bool, tp_group: Group, nccl: NcclVersion, grad_bytes: float
) -> float:
    """Replicated parameters that see a partial input on each tp rank (MoE routers under tp; with
    sequence parallelism also the norms and row-parallel biases, and the last stage's final norm) get
    partial gradients: one all-reduce of all of a stage's over tp per step. Backward produces them
    last, so nothing hides it (lightning_3d's reducers: one bucket; Megatron-Core: its coalesced
    layer-norm all-reduce after the backward)."""
    params = partial_gradient_params(model, layers_on_stage, last_stage, sequence_parallel)
    return collective_cost("all_reduce", params * grad_bytes, tp_group, nccl).seconds if params else 0.0


def partial_gradient_params(model: ModelShape, layers_on_stage: int, last_stage: bool, sequence_parallel: bool) -> float:
    """A stage's replicated parameters whose gradient is partial on each tp rank: the MoE routers; with
    sequence parallelism every replicated parameter of its layers (norms, row-parallel biases, routers)
    and, on the last stage, the final norm."""
    if not sequence_parallel:
        return layers_on_stage * model.moe_share * model.hidden * model.n_experts
    return layers_on_stage * model.layer_replicated_params + (model.hidden * (2 if model.bias else 1) if last_stage else 0)


def head_cost(model: ModelShape, cluster: ClusterSpec, micro_batch: int, tp: int, cp: int = 1) -> float:
    """The LM head and loss for one micro-batch (forward + backward, never recomputed) on the
    ``s / cp`` tokens this device holds."""
    device = cluster.device
    tokens = micro_batch * model.seq_len / cp
    gemm = 3.0 * tokens * model.head_forward_flops_per_token() / tp / (device.tflops(cluster.devices_per_node, tp) * 1e12 * device.gemm_efficiency)
    # softmax cross-entropy over fp32 logits: read/write them in forward and backward
    elem = 4.0 * tokens * model.vocab / tp * 4.0 / (device.memory_bandwidth_gb_per_s * 1e9 * HBM_EFFICIENCY)
    return gemm + elem


def optimizer_seconds(params_in_shard: float, cluster: ClusterSpec, offload: str, devices_sharing_host: int) -> float:
    """The optimizer step over this rank's shard: on the device, or on the host for offload."""
    if offload == "none":
        return params_in_shard * OPTIMIZER_BYTES / (cluster.device.memory_bandwidth_gb_per_s * 1e9 * HBM_EFFICIENCY)
    # Host Adam is memory-bound on the host's DRAM, shared by the node's ranks; gradients go down
    # and updated 16-bit weights come back over PCIe; NVMe streams master + moments both ways.
    seconds = params_in_shard * OPTIMIZER_BYTES * devices_sharing_host / (cluster.host_memory_gb_per_s * 1e9)
    if cluster.pcie_gb_per_s > 0:
        seconds += params_in_shard * 6.0 / (cluster.pcie_gb_per_s * 1e9)
    if offload == "nvme" and cluster.nvme_gb_per_s > 0:
        seconds += params_in_shard * 24.0 * devices_sharing_host / (cluster.nvme_gb_per_s * 1e9)
    return seconds
