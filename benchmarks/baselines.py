"""Baselines built from torch/Lightning parts, for side-by-side benchmark cases."""

from __future__ import annotations

from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from lightning_3d.models.gpt import GPT, GPTModule


class DTensorGPTModule(GPTModule):
    """GPTModule parallelized the ``ModelParallelStrategy`` way: a DTensor TP plan on attention and MLP
    (column-wise q/k/v/fc, row-wise o/proj), then FSDP2 ``fully_shard`` over the data-parallel mesh.
    Embeddings and the LM head stay replicated (DTensor TP of tied embeddings is not supported)."""

    def configure_model(self) -> None:
        if self.model is not None:
            return
        model = GPT(self.config)
        tp_mesh, dp_mesh = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        for block in model.blocks:
            parallelize_module(
                block,
                tp_mesh,
                {
                    "attn.q_proj": ColwiseParallel(),
                    "attn.k_proj": ColwiseParallel(),
                    "attn.v_proj": ColwiseParallel(),
                    "attn.o_proj": RowwiseParallel(),
                    "mlp.fc": ColwiseParallel(),
                    "mlp.proj": RowwiseParallel(),
                },
            )
            fully_shard(block, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
        self.model = model


class FullyShardGPTModule(GPTModule):
    """GPTModule sharded with plain FSDP2 (``fully_shard`` per block, then the model) over all ranks:
    the torch-native ZeRO-3, used with ``ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1)``."""

    def configure_model(self) -> None:
        if self.model is not None:
            return
        model = GPT(self.config)
        dp_mesh = self.device_mesh["data_parallel"]
        for block in model.blocks:
            fully_shard(block, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
        self.model = model
