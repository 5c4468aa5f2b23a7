"""The typed schema of ``conf/cluster/*.yaml`` (and the ``conf/device/*.yaml`` they include).

A cluster file is what a Trainer needs (accelerator, devices per node, nodes, launcher) plus
what the planner needs: the device model (memory, peak dense 16-bit FLOP/s, HBM bandwidth and the
calibrated fraction of peak its GEMMs reach) and the links (intra-node per device, inter-node
per node), host RAM and NVMe per node. Units are decimal: GB, GB/s, TFLOP/s.

Loading goes through :func:`OmegaConf.structured`, so a missing, misspelled or mistyped key is
an error that names the key rather than a wrong plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

LAUNCHERS = ("local", "torchrun", "slurm")


@dataclass
class DeviceSpec:
    """One accelerator (or, for ``local_cpu``, one CPU process's share of the machine)."""

    model: str = "???"
    memory_gb: float = 0.0  # usable device memory (per process for CPU "devices")
    peak_tflops: float = 0.0  # dense bf16/fp16 tensor-core peak
    memory_bandwidth_gb_per_s: float = 0.0  # HBM (or DRAM share for CPU)
    gemm_efficiency: float = 0.7  # calibrated fraction of peak that large GEMMs reach in training
    reserved_gb: float = 0.0  # runtime context, communicator buffers, allocator slack
    # Host time of one transformer layer's forward + backward beyond its arithmetic: eager operator
    # dispatch and autograd, which a CPU process pays in line (``lightning-3d profile`` measures it);
    # 0 where kernels are queued ahead of the device (GPUs with a busy queue).
    layer_overhead_us: float = 0.0
    # A CPU process's rate when it is the only one computing on the host (``lightning-3d profile``
    # measures both): processes sharing cores and memory bandwidth slow each other. 0: peak_tflops.
    peak_tflops_alone: float = 0.0
    # A CPU process's rate on a tensor-parallel shard of a block (GEMMs 1/t as wide, heads split), the
    # profile's processes computing at once: narrow GEMMs reach less per FLOP on a CPU. 0: peak_tflops.
    peak_tflops_tp: float = 0.0

    def tflops(self, processes_on_host: int, tp: int = 1) -> float:
        """The peak rate with ``processes_on_host`` devices of the node computing at once, on ``1 / tp``
        of each layer's width."""
        if tp > 1 and self.peak_tflops_tp > 0:
            return self.peak_tflops_tp
        return self.peak_tflops_alone if processes_on_host == 1 and self.peak_tflops_alone > 0 else self.peak_tflops

    def validate(self) -> None:
        for name in ("peak_tflops_alone", "peak_tflops_tp"):
            if getattr(self, name) < 0:
                raise ValueError(f"device.{name}={getattr(self, name)!r} must be >= 0 (0: peak_tflops).")
        for name in ("memory_gb", "peak_tflops", "memory_bandwidth_gb_per_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"device.{name}={getattr(self, name)!r} must be positive (device model {self.model!r}).")
        if not 0 < self.gemm_efficiency <= 1:
            raise ValueError(f"device.gemm_efficiency={self.gemm_efficiency!r} must be in (0, 1].")
        if self.layer_overhead_us < 0:
            raise ValueError(f"device.layer_overhead_us={self.layer_overhead_us!r} must be >= 0 (0: none).")


@dataclass
class ClusterSpec:
    """A set of identical nodes. Bandwidths are per direction."""

    name: str = "???"
    accelerator: str = "gpu"
    devices_per_node: int = 8
    num_nodes: int = 1
    launcher: str = "local"
    device: DeviceSpec = field(default_factory=DeviceSpec)
    intra_node_gb_per_s: float = 0.0  # per device, e.g. NVLink
    inter_node_gb_per_s: float = 0.0  # per node, all network adapters together (0: single node)
    cpu_ram_gb: float = 0.0  # per node
    host_memory_gb_per_s: float = 100.0  # per node, what host-side (offloaded) Adam streams through
    nvme_gb: float = 0.0  # per node, node-local (0: none)
    nvme_gb_per_s: float = 0.0  # per node
    pcie_gb_per_s: float = 0.0  # host <-> device, per device (0: the device is the host)
    host_cpu: str = "intel"  # intel | amd: NCCL's per-step network overhead depends on it
    # Measured start-up of one collective between two ranks (gloo between CPU processes); it replaces
    # NCCL's latency tables, growing with the ring's n - 1 steps. 0: NCCL's tables.
    collective_latency_us: float = 0.0
    # Measured gathers and scatters on that transport (a profile's): gloo runs them at a fraction of its
    # all-reduce's bus bandwidth. Bus bandwidth as nccl-tests counts it ((n - 1) / n x the gathered or
    # scattered bytes / seconds), nominal like intra_node_gb_per_s. 0: the intra-node bandwidth.
    all_gather_gb_per_s: float = 0.0
    reduce_scatter_gb_per_s: float = 0.0
    # Per optimizer step, what the training loop itself costs on the host (Lightning's loop, callbacks,
    # the finite-gradient vote, logging), measured on a model too small to compute. 0: not modelled.
    step_overhead_ms: float = 0.0
    # What ZeRO-3 (FSDP2) adds on the host over ZeRO-0, measured on models too small to compute: per
    # optimizer step (the root unit, the sharded optimizer step, DTensor dispatch) and per FSDP unit
    # (a layer) and micro-batch (its gathers, reduce-scatter, hooks and copies). 0: not modelled.
    zero3_step_overhead_ms: float = 0.0
    zero3_unit_overhead_us: float = 0.0

    @property
    def world_size(self) -> int:
        return self.devices_per_node * self.num_nodes

    def validate(self) -> None:
        if self.devices_per_node < 1 or self.num_nodes < 1:
            raise ValueError(
                f"cluster {self.name!r}: devices_per_node={self.devices_per_node} and num_nodes={self.num_nodes} must be "
                f">= 1 (the planner needs a concrete count; -1 'all visible' is only for running)."
            )
        if self.host_cpu not in ("intel", "amd"):
            raise ValueError(f"cluster {self.name!r}: host_cpu={self.host_cpu!r}; choose intel or amd.")
        if self.launcher not in LAUNCHERS:
            raise ValueError(f"cluster {self.name!r}: launcher={self.launcher!r}; choose one of {LAUNCHERS}.")
        if self.intra_node_gb_per_s <= 0:
            raise ValueError(f"cluster {self.name!r}: intra_node_gb_per_s must be positive.")
        if self.num_nodes > 1 and self.inter_node_gb_per_s <= 0:
            raise ValueError(f"cluster {self.name!r}: {self.num_nodes} nodes need inter_node_gb_per_s > 0.")
        for name in (
            "collective_latency_us", "step_overhead_ms", "all_gather_gb_per_s", "reduce_scatter_gb_per_s", "zero3_step_overhead_ms",
            "zero3_unit_overhead_us",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"cluster {self.name!r}: {name}={getattr(self, name)!r} must be >= 0 (0: not modelled).")
        self.device.validate()


def load_cluster(config: Any) -> ClusterSpec:
    """A :class:`ClusterSpec` from a composed ``cfg.cluster`` node or a plain dict."""
    node = config if isinstance(config, DictConfig) else OmegaConf.create(dict(config))
    name = node.get("name", "?")
    if node.get("devices_per_node", 1) < 1 or "device" not in node:
        raise ValueError(
            f"cluster {name!r} (devices_per_node={node.get('devices_per_node')}) does not describe its devices: it is for "
            f"running only. Plan with a cluster that names a device model and count, e.g. cluster=h100_80g_1node."
        )
    merged = OmegaConf.merge(OmegaConf.structured(ClusterSpec), node)
    spec = OmegaConf.to_object(merged)
    assert isinstance(spec, ClusterSpec)
    spec.validate()
    return spec


def with_nodes(cluster: ClusterSpec, num_nodes: Optional[int]) -> ClusterSpec:
    """The same cluster with another node count (``--nodes``)."""
    if num_nodes is None:
        return cluster
    merged = OmegaConf.merge(OmegaConf.structured(cluster), {"num_nodes": num_nodes})
    spec = OmegaConf.to_object(merged)
    assert isinstance(spec, ClusterSpec)
    spec.validate()
    return spec
