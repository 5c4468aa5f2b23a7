"""The stacks users would pick instead, on the GPU check's model, data, seed and step: DeepSpeed's
ZeRO 1-3 and ZeRO-Offload, and a plain torch FSDP2 loop (torchtitan's recipe for data parallelism:
``fully_shard`` per block and at the root, bf16 parameters, fp32 reduction), one GPU each.

``gpu_check.py`` runs each peer case in its own process, as it runs ours, and compares losses,
step time and peak memory with the lightning_3d case of the same layout. A peer whose package is
not installed is reported as not run (DeepSpeed is not a dependency of this project).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any, Callable, Optional

Step = Callable[[Any, Any], Any]  # (input ids, targets) -> the loss, after the optimizer step


def missing_package(stack: str) -> Optional[str]:
    """Why the stack cannot run here, or None."""
    if stack == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not installed (pip install deepspeed; make bench-peers builds it into .venv-peers)"
    return None


def init_one_rank(gpu: bool) -> None:
    """A one-rank process group (NCCL on the GPU, gloo on the CPU), as Lightning starts ours."""
    import torch.distributed as dist

    from lightning_3d.testing.harness import free_port

    if dist.is_initialized():
        return
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    dist.init_process_group("nccl" if gpu else "gloo", rank=0, world_size=1)


def batches(corpus: str, seq: int, batch: int, seed: int) -> Any:
    """The batches our Trainer feeds the GPU check, in its order: Lightning wraps the datamodule's
    dataset in a ``DistributedSampler`` (shuffled, seeded with the global seed) since our strategy
    is distributed, also at one rank."""
    from torch.utils.data import DataLoader, DistributedSampler

    from lightning_3d.data import TextDataModule

    data = TextDataModule(source=corpus, block_size=seq, batch_size=batch)
    data.setup("fit")
    loader = data.train_dataloader()
    sampler = DistributedSampler(loader.dataset, num_replicas=1, rank=0, shuffle=True, seed=seed)
    return iter(DataLoader(loader.dataset, batch_size=batch, sampler=sampler, drop_last=loader.drop_last, collate_fn=loader.collate_fn))


def build(config: Any, lr: float, device: Any) -> tuple[Any, Callable[[], Any]]:
    """The GPU check's model, built as our strategy builds it (seeded beforehand, on the device), and a
    function that makes its ``GPTModule``'s optimizer and schedule (``configure_optimizers``) over the
    model's parameters as they are when called (after a stack has wrapped them)."""
    import torch

    from lightning_3d.models import GPT, GPTModule
    from lightning_3d.zero.optimizer_kinds import prefer_fused_adam

    module = GPTModule(config, lr=lr, warmup_steps=1, decay_steps=10**9)  # a constant rate, as ours
    with torch.device(device):
        module.model = GPT(config)

    def recipe() -> Any:
        built = module.configure_optimizers()
        prefer_fused_adam(built["optimizer"])  # the kernel our ZeRO picks, and torchtitan's default
        return built

    return module.model, recipe


def deepspeed_step(model: Any, recipe: Callable[[], Any], stage: int, offload: bool, batch: int) -> Step:
    """DeepSpeed's engine on the model: bf16 parameters with fp32 masters (its ``bf16`` mode; its
    ``engine.forward`` turns the caller's autocast off -- ``autocast_if_enabled`` in DeepSpeed 0.19 --
    so its forward and loss run in bf16, where ours and FSDP2 keep autocast's fp32 ops), the
    recipe's AdamW (DeepSpeed's ``DeepSpeedCPUAdam`` with offload, as ZeRO-Offload requires) and
    schedule, no clipping; ZeRO-3 shards every parameter, as ours does."""
    import deepspeed

    built = recipe()
    optimizer = built["optimizer"]
    schedule = built["lr_scheduler"]["scheduler"].lr_lambdas[0]
    if offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        first = optimizer.defaults
        optimizer = DeepSpeedCPUAdam(optimizer.param_groups, lr=first["lr"], betas=first["betas"], adamw_mode=True)
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    config = {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "bf16": {"enabled": True},
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    import torch

    scheduler = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule)  # noqa: E731
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)

    def step(x: Any, y: Any) -> Any:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss

    return step


def fsdp2_step(model: Any, recipe: Callable[[], Any]) -> Step:
    """torch's FSDP2 as torchtitan applies it: each block and the root sharded, bf16 parameters in
    compute, fp32 gradient reduction, fp32 parameters and AdamW."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    built = recipe()
    optimizer, scheduler = built["optimizer"], built["lr_scheduler"]["scheduler"]

    def step(x: Any, y: Any) -> Any:
        loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        return loss

    return step


def run_peer(stack: str, stage: int, offload: str, config: Any, args: Any, corpus: str, on_step: Callable[[float, float], None]) -> str:
    """Train ``args.steps`` steps of the peer in this process, calling ``on_step(loss, seconds)``
    after each (device synchronized, batch on the device before the clock starts); returns the
    process group's backend."""
    import time

    import lightning as L
    import torch
    import torch.distributed as dist

    gpu = not args.cpu_dry_run
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    if stack == "deepspeed" and not gpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    init_one_rank(gpu)
    L.seed_everything(args.seed, verbose=False)
    model, recipe = build(config, args.lr, device)
    if stack == "deepspeed":
        step = deepspeed_step(model, recipe, stage, offload == "cpu", args.batch)
    elif stack == "fsdp2":
        step = fsdp2_step(model, recipe)
    else:
        raise ValueError(f"unknown peer stack {stack!r}")
    stream = batches(corpus, args.seq, args.batch, args.seed)
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    for _ in range(args.steps):
        x, y = (t.to(device) for t in next(stream))
        sync()
        start = time.perf_counter()
        # bf16-mixed as Lightning's and ours run it: autocast around the step (DeepSpeed's bf16 mode turns
        # it off inside its engine's forward), so what stays fp32 (the
        # loss's log-softmax) is fp32 in every stack
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = step(x, y)
        sync()
        on_step(float(loss.detach()), time.perf_counter() - start)
    backend = dist.get_backend()
    dist.destroy_process_group()
    return backend
