"""What one NCCL collective costs: a latency that grows with the hops it takes, plus its bytes
over the bus bandwidth, for the algorithm and protocol NCCL's own tuner would pick.

The model is NCCL's (``src/graph/tuning.cc`` of NVIDIA/nccl), written out so that the planner can
show each term:

* **algorithms**: a ring for every collective; a double binary tree for all-reduce only.
  All-gather and reduce-scatter had no tree in the NCCL of 2021 and still have none with more
  than one GPU per node (PAT, NCCL 2.23, is for one rank per node), so their latency grows with
  the rank count.
* **latency** (microseconds): ``base + (steps - inter_steps) x intra_hop + inter_steps x net_hop``
  for a ring (``steps`` = N - 1 for all-gather / reduce-scatter, 2 (N - 1) for all-reduce; one
  step in ``ranks_per_node`` leaves the node), ``base + 2 ((ranks_per_node - 1) x intra_hop +
  log2(nodes) x net_hop)`` for a tree; per protocol (LL, LL128, Simple): LL's 8-byte flagged
  stores are quick to start and slow to stream, Simple the opposite. Today's NCCL charges every
  ring step of a multi-node ring at least a network overhead (1 us on Intel hosts, 2 on AMD).
* **bandwidth**: the bus bandwidth of the group (the planner's topology rule gives it per device)
  at ``LINK_EFFICIENCY``; LL128 reaches 0.92 of it, LL a third to a half (capped per node count),
  a tree 0.92 and moves twice the all-reduce's bytes.

The tuner picks the fastest (algorithm, protocol) per call; so does :func:`collective_cost`, which
is what makes the cost of a 1 MB gather at 1,536 ranks mostly latency and that of a 1 GB gather
mostly bandwidth. Constants are per NCCL version: the 2021 software profiles run with 2.9's, the
current ones with today's (2.30); the values are the tables of those releases.
"""

from __future__ import annotations

import functools

import math
from dataclasses import dataclass

# Fraction of a link's nominal bandwidth that large collectives reach (NCCL bus bandwidth over
# NVLink/InfiniBand is typically 75-85% of nominal; 192 of 200 GB/s per DGX A100 node in
# NVIDIA/nccl#812); a global constant, not per row or device.
LINK_EFFICIENCY = 0.8

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")
PROTOCOLS = ("LL", "LL128", "Simple")


@dataclass(frozen=True)
class NcclVersion:
    """One release's latency tables (microseconds), per protocol (LL, LL128, Simple), and the rules
    that cap a protocol's bandwidth."""

    name: str
    ring_base: tuple[float, float, float]
    tree_base: tuple[float, float, float]
    ring_nvlink_hop: tuple[float, float, float]
    ring_net_hop: tuple[float, float, float]
    tree_nvlink_hop: tuple[float, float, float]
    tree_net_hop: tuple[float, float, float]
    ll_max_gb_per_s: tuple[float, float, float]  # LL's bus bandwidth cap on 1, 2, more nodes
    ll_share: tuple[float, float]  # LL's share of the bus: one node (not all-reduce), otherwise
    ll128_one_per_node: float  # LL128's share of the bus with one rank per node (else 0.92)
    ll_intra_factor: float  # LL's intra-node hop latency is multiplied by this across nodes (2.9: 1.8)
    ring_allreduce_plateau: float  # Simple ring all-reduce across nodes: latency x this ...
    plateau_bytes_per_rank: float  # ... from this many bytes per rank
    net_overhead_us: tuple[float, float]  # every ring step across nodes costs at least this (Intel, AMD host)


# NVIDIA/nccl v2.9.9-1 (3fec2fa5), src/graph/tuning.cc: baseLat, hwLat[NVLINK], hwLat[NET],
# llMaxBws (Ampere row: 87.7 / 22.5 / 19.0), LL at 1/3 of the bus on one node and 1/4 otherwise,
# LL128 at 0.7 with one rank per node, the 1.8 LL intra-node factor across nodes, "Plateau effect
# of ring" (x1.9 from nRanks/16 x 64 KiB). Same constants in 2.8.3.
NCCL_2_9 = NcclVersion(
    name="2.9",
    ring_base=(3.6, 10.0, 8.4),
    tree_base=(4.4, 4.4, 0.0),
    ring_nvlink_hop=(0.47, 1.9, 3.4),
    ring_net_hop=(2.7, 4.0, 9.6),
    tree_nvlink_hop=(0.52, 1.25, 28.0),
    tree_net_hop=(5.0, 8.5, 28.0),
    ll_max_gb_per_s=(87.7, 22.5, 19.0),
    ll_share=(1 / 3, 1 / 4),
    ll128_one_per_node=0.7,
    ll_intra_factor=1.8,
    ring_allreduce_plateau=1.9,
    plateau_bytes_per_rank=4096.0,
    net_overhead_us=(0.0, 0.0),
)
# NVIDIA/nccl 2.30.7 (5067397c), src/graph/tuning.cc: baseLatencies, hwLatencies, llMaxBws
# (Hopper row: 141 / 45 / 35), LL at half the bus, plateau 1.4 for compute capability >= 8.0 (from
# 64 bytes per channel and rank: 2 KiB per rank at 32 channels), and the network overhead every
# inter-node ring step pays at least (1 us on Intel hosts, 2 us on AMD, x3 for Simple).
NCCL_2_30 = NcclVersion(
    name="2.30",
    ring_base=(6.6, 14.0, 8.4),
    tree_base=(6.8, 14.0, 8.4),
    ring_nvlink_hop=(0.6, 1.9, 3.4),
    ring_net_hop=(2.7, 4.0, 14.0),
    tree_nvlink_hop=(0.6, 1.25, 4.0),
    tree_net_hop=(5.0, 8.5, 14.0),
    ll_max_gb_per_s=(141.0, 45.0, 35.0),
    ll_share=(0.5, 0.5),
    ll128_one_per_node=0.92,
    ll_intra_factor=1.0,
    ring_allreduce_plateau=1.4,
    plateau_bytes_per_rank=2048.0,
    net_overhead_us=(1.0, 2.0),
)
NCCL_VERSIONS = {v.name: v for v in (NCCL_2_9, NCCL_2_30)}


@dataclass(frozen=True)
class Group:
    """A process group as the network sees it: ``ranks`` on ``nodes`` nodes (``ranks // nodes``
    per node), with ``gb_per_s`` nominal bus bandwidth per device (the topology rule's)."""

    ranks: int
    nodes: int
    gb_per_s: float
    amd_host: bool = False  # NCCL charges AMD hosts more per network step
    latency_us: float = 0.0  # measured start-up between two ranks (ClusterSpec.collective_latency_us); 0: NCCL's tables
    # a measured transport's own bus bandwidth for gathers and scatters (ClusterSpec's); 0: gb_per_s
    all_gather_gb_per_s: float = 0.0
    reduce_scatter_gb_per_s: float = 0.0

    @property
    def ranks_per_node(self) -> int:
        return max(1, self.ranks // max(1, self.nodes))


@dataclass(frozen=True)
class CollectiveCost:
    """Seconds of one collective, split into its start-up latency and its transfer."""

    latency: float
    transfer: float
    algorithm: str = "none"
    protocol: str = "none"

    @property
    def seconds(self) -> float:
        return self.latency + self.transfer

    def times(self, n: float) -> "CollectiveCost":
        return CollectiveCost(self.latency * n, self.transfer * n, self.algorithm, self.protocol)


NO_COST = CollectiveCost(0.0, 0.0)


def _intra_hop_us(table: tuple[float, float, float], group: Group, nccl: NcclVersion, proto: int) -> float:
    hop = table[proto] * (nccl.ll_intra_factor if proto == 0 and group.nodes > 1 else 1.0)
    if group.nodes > 1:  # "inter-node rings still have to launch nsteps x net overhead"
        hop = max(hop, nccl.net_overhead_us[group.amd_host] * (3.0 if proto == 2 else 1.0))
    return hop


def _ring_latency_us(kind: str, nbytes: float, group: Group, nccl: NcclVersion, proto: int) -> float:
    n, nodes = group.ranks, group.nodes
    steps = (2 if kind == "all_reduce" else 1) * (n - 1)
    inter = (2 if kind == "all_reduce" else 1) * (nodes - 1)
    intra_hop = _intra_hop_us(nccl.ring_nvlink_hop, group, nccl, proto)
    latency = nccl.ring_base[proto] + (steps - inter) * intra_hop + inter * nccl.ring_net_hop[proto]
    if kind == "all_reduce" and proto == 2 and nodes > 1 and nbytes >= nccl.plateau_bytes_per_rank * n:
        latency *= nccl.ring_allreduce_plateau
    return latency


def _tree_latency_us(group: Group, nccl: NcclVersion, proto: int) -> float:
    hops = (group.ranks_per_node - 1) * nccl.tree_nvlink_hop[proto] * (nccl.ll_intra_factor if proto == 0 else 1.0)
    hops += math.floor(math.log2(group.nodes)) * nccl.tree_net_hop[proto]  # NCCL's log2i
    return nccl.tree_base[proto] + 2.0 * hops


def _protocol_bandwidth(kind: str, bus: float, proto: int, group: Group, nccl: NcclVersion) -> float:
    """Bytes per second a protocol streams at, given the group's achievable bus bandwidth."""
    if proto == 2:
        return bus
    if proto == 1:
        return bus * (nccl.ll128_one_per_node if group.nodes > 1 and group.ranks_per_node == 1 else 0.92)
    share = nccl.ll_share[0] if group.nodes == 1 and kind != "all_reduce" else nccl.ll_share[1]
    cap = nccl.ll_max_gb_per_s[min(group.nodes, 3) - 1] * 1e9
    return min(bus * share, cap)


def collective_cost(kind: str, nbytes: float, group: Group, nccl: NcclVersion = NCCL_2_30) -> CollectiveCost:
    """The fastest (algorithm, protocol) for one collective over ``nbytes`` (the full tensor: the
    gathered output of an all-gather, the input of a reduce-scatter or all-reduce). Memoized: a
    search asks the same few thousand questions tens of thousands of times (``lightning-3d plan``
    answers in under 2 s)."""
    return _collective_cost(kind, float(nbytes), group, nccl)


@functools.lru_cache(maxsize=65536)
def _collective_cost(kind: str, nbytes: float, group: Group, nccl: NcclVersion) -> CollectiveCost:
    if kind not in COLLECTIVES:
        raise ValueError(f"collective {kind!r}: expected one of {COLLECTIVES}.")
    n = group.ranks
    if n <= 1 or nbytes <= 0:
        return NO_COST
    bus = group.gb_per_s * 1e9 * LINK_EFFICIENCY
    wire = (2.0 if kind == "all_reduce" else 1.0) * (n - 1) / n * nbytes  # what each rank sends
    if group.latency_us > 0:  # a measured transport (gloo): its start-up per ring step, one protocol
        steps = (2 if kind == "all_reduce" else 1) * (n - 1)  # the measured 2-rank all-reduce is 2 steps
        own = {"all_gather": group.all_gather_gb_per_s, "reduce_scatter": group.reduce_scatter_gb_per_s}.get(kind, 0.0)
        if own > 0 and group.nodes == 1:  # (measured between the processes of one host)
            bus = own * 1e9 * LINK_EFFICIENCY
        return CollectiveCost(group.latency_us / 2 * steps * 1e-6, wire / bus, "ring", "measured")
    best = None
    for proto, name in enumerate(PROTOCOLS):
        bandwidth = _protocol_bandwidth(kind, bus, proto, group, nccl)
        options = [("ring", _ring_latency_us(kind, nbytes, group, nccl, proto), wire / bandwidth)]
        if kind == "all_reduce" and group.nodes > 1:  # a tree moves each byte up and down once
            options.append(("tree", _tree_latency_us(group, nccl, proto), 2.0 * nbytes / (bandwidth * 0.92)))
        for algorithm, latency_us, transfer in options:
            cost = CollectiveCost(latency_us * 1e-6, transfer, algorithm, name)
            if best is None or cost.seconds < best.seconds:
                best = cost
    assert best is not None
    return best


def bus_bandwidth(kind: str, nbytes: float, group: Group, nccl: NcclVersion = NCCL_2_30) -> float:
    """nccl-tests' "busbw" (GB/s) the model predicts: the bytes each rank moves over the time."""
    cost = collective_cost(kind, nbytes, group, nccl)
    factor = 2.0 if kind == "all_reduce" else 1.0
    return factor * (group.ranks - 1) / group.ranks * nbytes / cost.seconds / 1e9 if cost.seconds else math.inf
