"""The floor under every Lightning-driven run: torch's ``DistributedDataParallel`` in a plain loop
(forward, backward, AdamW step, schedule step; nothing else), on the bench GPT, data and recipe.

    python benchmarks/peers/torch_ddp_run.py --model '{...}' --steps 30 --world 2

Paired with Lightning's own ``ddp`` strategy in ``deepspeed_zero_stages``: the ratio is what
Lightning's training loop costs per step, which our strategy pays as well and DeepSpeed's plain
loop does not.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import WARMUP, bench_optimizer, peer_parser, plain_step, replica_batches, run_and_print, timed_loop  # noqa: E402


def train(model_dims: dict, steps: int, global_batch: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from lightning_3d.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = DistributedDataParallel(GPT(GPTConfig(**model_dims)))
    optimizer, schedule = bench_optimizer(model, WARMUP + steps)

    def forward_backward(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = model(x, y)
        loss.backward()
        return loss

    step = plain_step(forward_backward, optimizer, schedule(optimizer))
    block = model_dims["block_size"]
    return timed_loop(step, replica_batches(block, global_batch, dist.get_rank(), dist.get_world_size()), steps, global_batch, block)


if __name__ == "__main__":
    args = peer_parser().parse_args()
    run_and_print(train, args.world, args.model, args.steps, args.global_batch)
