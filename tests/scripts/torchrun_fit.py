"""Run under torchrun: the parity workload, then a tp=2 mesh to check groups stay on a node."""

import json
import os
import sys

import torch.distributed as dist

from lightning_3d.core.topology import ParallelDims, Topology
from tests.helpers import gpt_losses, quiet_trainer  # noqa: F401

if __name__ == "__main__":
    out_dir = sys.argv[1]
    result = gpt_losses()
    topo = Topology.build(ParallelDims(dp=2, tp=2, pp=1))
    result.update(
        rank=dist.get_rank(),
        node=int(os.environ["GROUP_RANK"]),
        local_rank=int(os.environ["LOCAL_RANK"]),
        tp_group=dist.get_process_group_ranks(topo.tp_group),
        coords=list(topo.coords),
    )
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(result, f)
