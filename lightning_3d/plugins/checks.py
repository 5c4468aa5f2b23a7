"""What the strategy refuses or warns about on Lightning's objects before step 1.

The layout itself is validated by :class:`~lightning_3d.core.config.ParallelConfig`; these checks
need the Trainer (its loaders, its checkpoint callbacks) or explain an error Lightning raised, so they
run at set-up and at the start of training. The strategy only calls them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_3d.core.config import ParallelConfig
from lightning_3d.core.distributed import current_compute_device


def check_before_first_step(trainer: Optional[Trainer], config: ParallelConfig) -> None:
    """Before the first step: refuse a batch the configured micro-batch count cannot split and a
    checkpoint directory that cannot be written; say when the sampler will repeat samples."""
    loader = trainer.fit_loop._combined_loader if trainer is not None else None
    loaders = loader.flattened if loader is not None else []
    if config.pipeline.micro_batches is not None and config.layout.pipeline_parallel > 1:
        for size in [getattr(dl, "batch_size", None) for dl in loaders]:
            config.check_batch(size)  # the planner's rule too (layout_rules.batch_refusals)
    for dl in loaders:
        warn_if_sampler_pads(getattr(dl, "sampler", None))
    if trainer is not None:
        check_checkpoint_dirs_writable(trainer)


def empty_stage_error(err: ValueError, pp_rank: int, pipeline_parallel: int) -> Optional[ValueError]:
    """torch's "empty parameter list", explained: ``configure_optimizers`` sees only this pipeline
    stage's parameters, and a stage may hold none of a group (a middle stage: no embedding, no head).
    None when ``err`` is another error, or there is no pipeline."""
    if "empty parameter list" not in str(err) or pipeline_parallel == 1:
        return None
    return ValueError(
        f"{err} on pipeline rank {pp_rank} of {pipeline_parallel}: configure_optimizers "
        f"runs after the model is cut into stages, and this stage holds no parameter of one of its optimizers "
        f"or groups (the embedding and head live on the first and last stage; under a V both on rank 0). Pass "
        f"parameters as groups, e.g. torch.optim.SGD([{{'params': [...]}}], ...), which torch accepts empty."
    )


def check_checkpoint_dirs_writable(trainer: Trainer) -> None:
    """Every rank writes its pieces of a sharded checkpoint: a directory that cannot be written is
    refused before step 1, not at the first save hours later. One rank per node tries (O(nodes) files
    on a shared filesystem), and the world agrees on the verdict, so every rank stops together."""
    import tempfile

    from lightning.pytorch.callbacks import ModelCheckpoint

    problem = ""
    if getattr(trainer, "local_rank", 0) == 0:
        for callback in getattr(trainer, "callbacks", []):
            directory = getattr(callback, "dirpath", None) if isinstance(callback, ModelCheckpoint) else None
            if not directory or "://" in str(directory):
                continue
            try:
                Path(directory).mkdir(parents=True, exist_ok=True)
                with tempfile.NamedTemporaryFile(dir=directory, prefix=".lightning_3d-write-check-"):
                    pass
            except OSError as err:
                problem = f"ModelCheckpoint(dirpath={str(directory)!r}) cannot be written ({err.strerror or err})"
                break
    rank = getattr(trainer, "global_rank", 0)
    first = rank if problem else None
    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
        flag = torch.tensor([rank if problem else world], device=current_compute_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        first = int(flag.item()) if int(flag.item()) < world else None
    if first is not None:
        what = problem if problem else f"rank {first} cannot write a ModelCheckpoint directory (see its message)"
        raise PermissionError(
            f"{what} (rank {first}); checkpoints would fail at the first save. Give a directory every node can write."
        )




def warn_if_sampler_pads(sampler: Any) -> None:
    """A DistributedSampler without drop_last repeats samples so every replica gets as many: the
    epoch then differs from one process's. Say so once, with the numbers."""
    from torch.utils.data import DistributedSampler

    from lightning_3d.data.sampler import GlobalCursorSampler

    if isinstance(sampler, GlobalCursorSampler):  # (the strategy's: torch's order with a data cursor)
        n = sampler.length
    elif isinstance(sampler, DistributedSampler):
        n = len(sampler.dataset)  # type: ignore[arg-type]
    else:
        return
    if sampler.drop_last:
        return
    replicas = sampler.num_replicas
    if n % replicas:
        rank_zero_warn(
            f"lightning_3d: the training set has {n} samples, which {replicas} data-parallel replicas do not "
            f"divide: the distributed sampler repeats {replicas - n % replicas} of them every epoch (one process "
            f"would not). Use a sample count divisible by {replicas}, or drop the remainder."
        )
