"""DeepSpeed's side of ``deepspeed_zero_stages``: the bench GPT trained by ``deepspeed.initialize``.

    .venv-peers/bin/python benchmarks/peers/deepspeed_run.py --stage 2 [--offload] --steps 30

DeepSpeed runs on its CPU accelerator; its training collectives go through torch's gloo group, as
ours do (it JIT-builds a shared-memory op it uses only for inference, and ``cpu_adam`` for
``--offload``). fp32, no gradient clipping, the client AdamW on torch's fused kernel as our ZeRO runs
it (DeepSpeed's ``DeepSpeedCPUAdam`` in AdamW mode with ``--offload``, as ZeRO-Offload requires), our
schedule. ZeRO-3 shards every
parameter (``stage3_param_persistence_threshold: 0``), as ours does.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import WARMUP, bench_optimizer, peer_parser, replica_batches, run_and_print, timed_loop  # noqa: E402


def train(model_dims: dict, stage: int, offload: bool, steps: int, global_batch: int) -> dict:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch
    import torch.distributed as dist

    from lightning_3d.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(**model_dims))
    optimizer, schedule = bench_optimizer(model, WARMUP + steps)
    # the AdamW kernel our ZeRO steps the same recipe with (torch's fused one where the user left the choice
    # to torch): the same kernel on the same flat shards, so the losses can be compared bit for bit
    from lightning_3d.zero.optimizer_kinds import prefer_fused_adam

    if not offload:  # (offload steps DeepSpeedCPUAdam, its own kernel)
        prefer_fused_adam(optimizer)
    if offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        first = optimizer.defaults
        optimizer = DeepSpeedCPUAdam(optimizer.param_groups, lr=first["lr"], betas=first["betas"], adamw_mode=True)
    zero: dict = {"stage": stage}
    if stage == 3:  # DeepSpeed keeps tensors under 100k elements whole by default: every one of this model's
        zero["stage3_param_persistence_threshold"] = 0  # shard them all, as our ZeRO-3 (FSDP2) does
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    world = dist.get_world_size()
    config = {
        "train_micro_batch_size_per_gpu": global_batch // world,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=schedule, config=config)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss.item()

    block = model_dims["block_size"]
    return timed_loop(step, replica_batches(block, global_batch, dist.get_rank(), world), steps, global_batch, block)


if __name__ == "__main__":
    parser = peer_parser()
    parser.add_argument("--stage", type=int, choices=(1, 2, 3), required=True)
    parser.add_argument("--offload", action="store_true")
    args = parser.parse_args()
    run_and_print(train, args.world, args.model, args.stage, args.offload, args.steps, args.global_batch)
