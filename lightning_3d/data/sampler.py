"""One global data cursor: where an epoch's sample order stands, the same at every layout.

The order of an epoch is a function of (seed, epoch) over the whole dataset -- torch's
``DistributedSampler``'s: ``randperm(n)`` seeded with ``seed + epoch`` (or ``0..n-1`` unshuffled),
repeated at the end up to a multiple of the replicas, or cut there with ``drop_last``. Replica ``r`` of
``R`` takes positions ``r, r + R, r + 2R, ...``, so a loader batch of ``b`` samples per replica takes
the next ``b x R`` positions of the order between the replicas, and the global batches of a step are
consecutive runs of the order whatever ``R`` is (with the same global batch). The cursor is therefore
one number: how many positions of this epoch the finished batches consumed. A checkpoint records it,
and a resumed sampler starts there -- at any data-parallel size -- without reading what came before.

:class:`ResumableDataLoader` is the loader Lightning saves and restores (``state_dict`` /
``load_state_dict``); :func:`with_global_cursor` turns a loader that Lightning gave a
``DistributedSampler`` (a user's map-style dataset, no change to their code) into one.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, Callable, Optional

import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, Sampler


class GlobalCursorSampler(Sampler[int]):
    """This replica's positions of the epoch's order, from the cursor on (see the module's docstring)."""

    def __init__(
        self, length: int, num_replicas: int = 1, rank: int = 0, shuffle: bool = True, seed: int = 0, drop_last: bool = False
    ) -> None:
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"rank={rank} must be in [0, num_replicas={num_replicas}).")
        self.length, self.num_replicas, self.rank = int(length), int(num_replicas), int(rank)
        self.shuffle, self.seed, self.drop_last = bool(shuffle), int(seed), bool(drop_last)
        self.epoch = 0
        self._start: Optional[tuple[int, int]] = None  # (epoch, position): where that epoch's next iteration starts

    @classmethod
    def like(cls, sampler: DistributedSampler) -> "GlobalCursorSampler":
        """The same order and slice as torch's ``sampler``, with a cursor."""
        out = cls(len(sampler.dataset), sampler.num_replicas, sampler.rank, sampler.shuffle, sampler.seed, sampler.drop_last)  # type: ignore[arg-type]
        out.epoch = sampler.epoch
        return out

    @property
    def total_size(self) -> int:
        """Positions in an epoch's order: the dataset repeated or cut to a multiple of the replicas."""
        r = self.num_replicas
        return r * (self.length // r) if self.drop_last else r * math.ceil(self.length / r)

    def __len__(self) -> int:
        """Samples of a whole epoch per replica (a resumed epoch yields only those after the cursor, and
        Lightning's own progress counts the ones before)."""
        return self.total_size // self.num_replicas

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def start_at(self, position: int, epoch: int) -> None:
        """Resume epoch ``epoch``'s next iteration at ``position`` of its order (the samples finished batches
        consumed: a multiple of the replicas). A position at or past the epoch's end starts nothing: the
        checkpoint ended that epoch, and the next one starts at its beginning."""
        if position < 0 or position % self.num_replicas:
            raise ValueError(
                f"data cursor {position}: it must be a non-negative multiple of the {self.num_replicas} replicas; the "
                f"checkpoint was written with another dataset or batch."
            )
        self.set_epoch(epoch)  # (a loader with workers draws its first indices before Lightning sets the epoch)
        self._start = (int(epoch), int(position)) if position < self.total_size else None

    def order(self, epoch: int) -> list[int]:
        """The epoch's sample order (every replica's positions), as torch's ``DistributedSampler`` has it."""
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + epoch)
            indices = torch.randperm(self.length, generator=generator).tolist()
        else:
            indices = list(range(self.length))
        size = self.total_size
        if size > len(indices):
            indices += (indices * math.ceil((size - len(indices)) / max(1, len(indices))))[: size - len(indices)]
        return indices[:size]

    def __iter__(self) -> Iterator[int]:
        def positions() -> Iterator[int]:
            # read when the first index is drawn; the cursor applies to the epoch it was saved in only
            start = 0
            if self._start is not None and self._start[0] == self.epoch:
                start, self._start = self._start[1], None
            yield from self.order(self.epoch)[start + self.rank :: self.num_replicas]

        return positions()


class ResumableDataLoader(DataLoader):
    """A DataLoader that resumes mid-epoch at the next unseen batch, at any data-parallel size.

    Lightning saves and restores the state of loaders that have ``state_dict``/``load_state_dict``.
    The state is the cursor: the batches the *training loop* finished this epoch (``progress``; not
    how many this loader yielded, since Lightning prefetches one) times the samples a loader batch
    takes over all replicas. With a :class:`GlobalCursorSampler` a resume seeks there in O(1); with
    any other sampler it skips that many batches by reading them (torch's ``DistributedSampler``
    under another strategy), which is right only at the same layout.
    """

    def __init__(
        self, *args: Any, progress: Optional[Callable[[], int]] = None, recount: Optional[Callable[[int, int], None]] = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.progress = progress
        self.recount = recount  # (batches done at the checkpoint's size, at this size): the loop's progress recounted
        self._skip = 0

    def _replicas(self) -> int:
        return int(getattr(self.sampler, "num_replicas", 1))

    def samples_per_batch(self) -> Optional[int]:
        """Samples one loader batch takes over all replicas (None: a custom batch sampler)."""
        return None if self.batch_size is None else int(self.batch_size) * self._replicas()

    def state_dict(self) -> dict[str, Any]:
        done = int(self.progress()) if self.progress is not None else 0
        per_batch = self.samples_per_batch()
        state: dict[str, Any] = {"batches_done": done, "epoch": int(getattr(self.sampler, "epoch", 0))}
        if per_batch is not None:
            state.update(samples_per_batch=per_batch, samples_consumed=done * per_batch)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        done = int(state.get("batches_done", 0))
        per_batch = self.samples_per_batch()
        saved = int(state.get("samples_per_batch", per_batch or 0))
        if isinstance(self.sampler, GlobalCursorSampler) and per_batch is not None:
            consumed = int(state.get("samples_consumed", done * saved))
            if saved != per_batch:
                if self.recount is None or consumed % per_batch:
                    raise ValueError(
                        f"resuming with {self.batch_size} samples per batch on each of {self._replicas()} data-parallel "
                        f"replicas ({per_batch} per loader batch), where the checkpoint's run took {saved}"
                        + (f" and stopped after {consumed} samples, not a whole number of such batches" if self.recount else "")
                        + ": Lightning counts an epoch's progress in loader batches, so keep the samples per optimizer step "
                        "(ThreeDParallelStrategy(global_batch_size=...) derives the gradient accumulation from it at any "
                        "data-parallel size; TextDataModule(global_batch_size=...) adapts the per-replica batch)."
                    )
                self.recount(done, consumed // per_batch)
            epoch = int(state.get("epoch", self.sampler.epoch))
            if consumed >= len(self) * per_batch:  # the checkpoint ended its epoch: the next one starts at its beginning
                self.sampler.start_at(0, epoch + 1)
            else:
                self.sampler.start_at(consumed, epoch)
        else:
            self._skip = done

    def __iter__(self) -> Iterator[Any]:
        skip, self._skip = self._skip, 0
        iterator = super().__iter__()
        if not skip:
            return iterator

        def resumed() -> Iterator[Any]:
            for _ in range(skip):
                if next(iterator, None) is None:
                    return
            yield from iterator

        return resumed()


def batches_done_this_epoch(trainer: Any) -> int:
    """The batches the training loop finished in this epoch (what a loader's state counts)."""
    return int(trainer.fit_loop.epoch_loop.batch_progress.current.processed)


def reload_loader_built_before_restore(trainer: Any) -> bool:
    """Have the training loader built again if it was built before the checkpoint's loop state came in.

    Lightning builds it early when ``configure_optimizers`` reads ``trainer.estimated_stepping_batches``
    (a schedule over the whole run), before it restores the checkpoint, and then never hands the loader
    the state it saved: the resumed epoch would start again at its first sample, in silence. Dropping
    that loader makes the fit loop build it once more after the restore, with the state. Returns
    whether it did."""
    loop = trainer.fit_loop
    if getattr(loop, "_combined_loader", None) is not None and getattr(loop, "_combined_loader_states_to_load", None):
        loop._combined_loader = None
        return True
    return False


def recount_batches(trainer: Any, saved: int, now: int) -> None:
    """The training loop's restored progress in this epoch, ``saved`` loader batches of the checkpoint's
    size, recounted as ``now`` batches of this run's (the same samples: a restart at another
    data-parallel size with the same samples per optimizer step). Every counter moves by the same
    amount, so their differences (a batch started but not completed) stay. Once only: a second training
    loader finds the progress already recounted."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    if progress.current.processed != saved:
        return
    for tracker in (progress.current, progress.total):
        for name in ("ready", "started", "processed", "completed"):
            setattr(tracker, name, getattr(tracker, name) + now - saved)


def with_global_cursor(loader: Any, progress: Callable[[], int], recount: Optional[Callable[[int, int], None]] = None) -> Any:
    """``loader`` with a :class:`GlobalCursorSampler` in place of the ``DistributedSampler`` Lightning gave
    it, as a :class:`ResumableDataLoader` whose state is the cursor; any other loader unchanged (a custom
    DataLoader class, batch sampler or sampler, an iterable dataset: their order is theirs)."""
    if type(loader) not in (DataLoader, ResumableDataLoader) or type(loader.sampler) is not DistributedSampler:
        return loader
    if type(loader.batch_sampler) is not BatchSampler:
        return loader
    kwargs: dict[str, Any] = dict(
        batch_size=loader.batch_size, sampler=GlobalCursorSampler.like(loader.sampler), num_workers=loader.num_workers,
        collate_fn=loader.collate_fn, pin_memory=loader.pin_memory, drop_last=loader.drop_last, timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn, multiprocessing_context=loader.multiprocessing_context,
        generator=loader.generator, persistent_workers=loader.persistent_workers, pin_memory_device=loader.pin_memory_device,
    )
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    if hasattr(loader, "in_order"):
        kwargs["in_order"] = loader.in_order
    existing = getattr(loader, "progress", None)
    return ResumableDataLoader(loader.dataset, progress=existing or progress, recount=getattr(loader, "recount", None) or recount, **kwargs)


def accumulation_for(global_batch: int, loader: Any, replicas: int, current: int) -> int:
    """The gradient accumulation that makes an optimizer step take ``global_batch`` samples with
    ``loader``'s batch on each of the ``replicas`` data-parallel replicas. ``current``: the Trainer's
    value, which must be 1 (its default) or that one; anything that does not divide is refused,
    naming the numbers."""
    batch = getattr(loader, "batch_size", None)
    if batch is None:
        raise ValueError(
            f"global_batch_size={global_batch} needs the training loader's batch_size to derive the gradient accumulation; "
            f"this loader has a batch sampler of its own. Use a DataLoader(batch_size=...), or global_batch_size=None."
        )
    per_step = int(batch) * replicas
    if global_batch % per_step:
        raise ValueError(
            f"global_batch_size={global_batch} is not a whole number of loader batches: {batch} samples on each of {replicas} "
            f"data-parallel replicas take {per_step} per batch. Choose a global batch that {per_step} divides, or a per-replica "
            f"batch size that divides {global_batch // replicas if global_batch % replicas == 0 else global_batch} evenly."
        )
    accumulation = global_batch // per_step
    if current not in (1, accumulation):
        raise ValueError(
            f"global_batch_size={global_batch} derives accumulate_grad_batches={accumulation} ({batch} samples x {replicas} "
            f"replicas x {accumulation}), but the Trainer has accumulate_grad_batches={current}; set only one of them."
        )
    return accumulation
