"""One object that decides, per ZeRO stage and precision, what reduces gradients and what steps.

=============  ===========================================================================
stage 0, fp32  :class:`GradientReducer` (DDP-like all-reduce); the user's optimizer as is
stage 0, mixed :class:`ZeroOptimizer` without sharding (fp32 masters for bf16/fp16 params)
stages 1, 2    :class:`ZeroOptimizer` (sharded masters and state; stage 2 also gradients)
stage 3        FSDP2 ``fully_shard`` per block; the user's optimizer over sharded parameters
=============  ===========================================================================

Offload: stages 1-2 keep masters and state on the CPU or NVMe (``ZeroOptimizer``); stage 3 uses
FSDP2's ``CPUOffloadPolicy`` (sharded parameters, gradients and the step on the CPU).

The strategy only calls :meth:`prepare_module`, :meth:`wrap_optimizers`, :meth:`no_sync`,
:meth:`after_backward` and the checkpoint/memory helpers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_3d.core.topology import Topology
from lightning_3d.zero.fsdp import apply_zero3, materialize_meta, restore_specs
from lightning_3d.zero.grad_reducer import GradientReducer
from lightning_3d.zero.optimizer_kinds import check_optimizer_layout, prefer_fused_adam
from lightning_3d.zero.sharded_optimizer import ZeroOptimizer


class ZeroCoordinator:
    def __init__(
        self,
        stage: int,
        topology: Topology,
        compute_dtype: torch.dtype,
        master_dtype: torch.dtype,
        bucket_bytes: int,
        offload_optimizer: str = "none",
        offload_params: str = "none",
        nvme_path: Optional[str] = None,
    ) -> None:
        self.stage, self.topology = stage, topology
        self.offload_optimizer, self.offload_params, self.nvme_path = offload_optimizer, offload_params, nvme_path
        self.compute_dtype, self.master_dtype = compute_dtype, master_dtype
        self.bucket_bytes = bucket_bytes
        self.reducer: Optional[GradientReducer] = None
        self.zero_optimizers: list[ZeroOptimizer] = []
        self.fsdp_roots: list[Any] = []

    @property
    def mixed(self) -> bool:
        return self.compute_dtype != self.master_dtype

    @property
    def separate_masters(self) -> bool:
        """Whether some ZeRO optimizer keeps masters apart from the parameters (mixed precision, offload)."""
        return any(opt.separate_master for opt in self.zero_optimizers)

    def prepare_module(
        self, module: nn.Module, device: torch.device, initialize: Optional[Callable[[], Iterable[nn.Module]]] = None
    ) -> None:
        """Stage 3: shard the module (and materialize it if it was built on the meta device; ``initialize``
        fills the shards instead of ``reset_parameters``, e.g. from pretrained weights)."""
        if self.stage != 3 or self.fsdp_roots:
            return
        mixed = (self.compute_dtype, torch.float32) if self.mixed else (None, None)
        offload = "cpu" in (self.offload_optimizer, self.offload_params)
        self.fsdp_roots = apply_zero3(module, self.topology.dp_mesh, *mixed, cpu_offload=offload)
        # a seed per rank: dp chunks and tp slices of one weight must not repeat each other's values
        materialize_meta(
            module, device, seed=torch.initial_seed() + 104729 * (self.topology.rank + 1), mesh=self.topology.dp_mesh, initialize=initialize
        )
        restore_specs(module)  # to_empty() re-created FSDP2's parameters

    def module_moved(self, module: nn.Module) -> None:
        """After Lightning moved the module (``.cpu()`` at teardown): FSDP2 re-created its parameters."""
        if self.fsdp_roots:
            restore_specs(module)

    def wrap_optimizers(self, module: nn.Module, optimizers: list[Optimizer]) -> list[Any]:
        for opt in self.zero_optimizers:  # a new fit replaces them: release their state (NVMe files)
            opt.close()
        self.remove()
        for opt in optimizers:  # before step 1: refuse optimizers that would see pieces of parameters
            check_optimizer_layout(opt, self.stage, self.topology.dims.tp, self.topology.dims.ep)
        if self.stage == 3:
            self.optimizers_loaded(optimizers)  # the kernel choice; the optimizers stay the user's
            return optimizers
        if self.stage == 0 and not self.mixed:
            self.reducer = GradientReducer(module.parameters(), self.topology.dp_group, self.bucket_bytes)
            return optimizers
        seen: dict[int, int] = {}
        for i, opt in enumerate(optimizers):
            for group in opt.param_groups:
                for p in group["params"]:
                    if seen.setdefault(id(p), i) != i:
                        raise ValueError(
                            f"zero_stage={self.stage}: a parameter belongs to optimizers {seen[id(p)]} and {i}; with "
                            f"ZeRO (or mixed precision) every parameter must have exactly one optimizer."
                        )
        self.zero_optimizers = [
            ZeroOptimizer(
                opt,
                self.topology.dp_group,
                self.stage,
                compute_dtype=self.compute_dtype,
                master_dtype=self.master_dtype,
                tp_group=self.topology.tp_group,
                bucket_bytes=self.bucket_bytes,
                pp_group=self.topology.pp_group,
                offload=self.offload_optimizer,
                nvme_path=self.nvme_path,
            )
            for opt in optimizers
        ]
        return list(self.zero_optimizers)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation without communication (stages 0-2). Stage 3 keeps reduce-scattering
        every micro-step, as DeepSpeed does: holding unsharded gradients across micro-steps would
        cost a full gradient copy per rank, and FSDP2 cannot accumulate them in fp32 when a parameter
        misses a micro-step (it mixes dtypes in the next reduce-scatter and fails)."""
        with ExitStack() as stack:
            if self.reducer is not None:
                stack.enter_context(self.reducer.no_sync())
            for opt in self.zero_optimizers:
                stack.enter_context(opt.grads.no_sync())
            yield

    def after_backward(self) -> None:
        if self.reducer is not None:
            self.reducer.after_backward()
        for opt in self.zero_optimizers:
            opt.grads.after_backward()

    def dense_master_weights(self) -> dict[int, Tensor]:
        """id(param) -> dense fp32 master weight, for checkpoints (mixed precision, stages 0-2)."""
        out: dict[int, Tensor] = {}
        for opt in self.zero_optimizers:
            out.update(opt.dense_master())
        return out

    def load_dense_master_weights(self, dense: dict[int, Tensor]) -> None:
        for opt in self.zero_optimizers:
            opt.load_dense_master(dense)

    def optimizers_loaded(self, optimizers: list[Any]) -> None:
        """Stage 3 chooses the user's optimizers' kernel (:func:`prefer_fused_adam`): DTensor parameters
        make a per-tensor step dispatch every element-wise op (41 ms of a 0.2 s step on the CPU bench
        GPT), and FSDP2's CPU offload steps them on the host. At set-up, and again after a checkpoint's
        optimizer states were loaded: torch's ``load_state_dict`` replaced each group with the saved
        one, whose ``fused``/``foreach`` may be unset (saved under ZeRO 0-2). The ZeRO 0-2 optimizers
        keep their inner optimizer's choice themselves."""
        if self.stage == 3:
            for opt in optimizers:
                prefer_fused_adam(opt, foreach_otherwise=True)

    def remove(self) -> None:
        if self.reducer is not None:
            self.reducer.remove()
            self.reducer = None
        for opt in self.zero_optimizers:
            opt.remove()
        self.zero_optimizers = []
