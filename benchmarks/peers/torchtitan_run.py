"""torchtitan's side of ``torchtitan_llama`` and ``torchtitan_pipeline``: its Llama 3 model, parallelized by
its own ``parallelize_llama`` (FSDP2 over the data-parallel ranks, optionally its TP plan, with or without SP) or
split into pipeline stages by its own ``pipeline_llm`` (torch's pipelining schedules), holding our Llama-style
GPT's initial weights, trained on our data with our AdamW recipe.

    .venv-peers/bin/python benchmarks/peers/torchtitan_run.py --model '{...}' --tp 2 [--sp] --world 4
    .venv-peers/bin/python benchmarks/peers/torchtitan_run.py --model '{...}' --pp 2 --schedule ZBVZeroBubble --microbatches 8 --world 2

torchtitan's trainer needs Hugging Face assets and a CUDA-only attention; on CPU this runs its model
and parallelization in a plain loop: SDPA (causal) in place of FlexAttention, cos/sin RoPE (the
rotate-half layout our GPT and Hugging Face use), fp32 parameters and reductions, the
``partial_dtensor`` backend (DTensor TP + FSDP2), loss parallel when TP shards the vocabulary, and
torchtitan's default optimizer implementation (torch's fused AdamW).
"""

from __future__ import annotations

import sys
import tempfile
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import WARMUP, bench_optimizer, peer_parser, plain_step, replica_batches, run_and_print, timed_loop  # noqa: E402


def our_keys_to_torchtitan(state: dict) -> dict:
    """Our GPT's state dict under torchtitan's Llama 3 names (its fused wqkv loads from wq/wk/wv)."""
    renames = {
        "wte.": "tok_embeddings.", "ln_f.": "norm.", "lm_head.": "lm_head.",
        "ln_1.": "attention_norm.", "ln_2.": "ffn_norm.", "attn.o_proj.": "attention.wo.",
        "attn.q_proj.": "attention.qkv_linear.wq.", "attn.k_proj.": "attention.qkv_linear.wk.",
        "attn.v_proj.": "attention.qkv_linear.wv.", "mlp.gate_proj.": "feed_forward.w1.",
        "mlp.up_proj.": "feed_forward.w3.", "mlp.down_proj.": "feed_forward.w2.",
    }
    out = {}
    for key, value in state.items():
        name = key.replace("blocks.", "layers.", 1)
        for ours, theirs in renames.items():
            if ours in name:
                name = name.replace(ours, theirs, 1)
                break
        else:
            raise KeyError(f"no torchtitan name for {key}")
        out[name] = value
    return out


def torchtitan_llama(dims: dict):
    """torchtitan's Llama 3 config at our GPT's dimensions (its layer builder, then SDPA and cos/sin RoPE)."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers

    from lightning_3d.models import GPTConfig

    c = GPTConfig(**dims)
    assert (c.mlp, c.norm, c.position, c.bias, c.tie_embeddings) == ("swiglu", "rmsnorm", "rope", False, False), (
        "torchtitan's Llama needs a Llama-style GPT: swiglu, rmsnorm, rope, no bias, untied embeddings"
    )
    layers = _build_llama3_layers(
        n_layers=c.n_layer, dim=c.n_embd, n_heads=c.n_head, n_kv_heads=c.kv_heads, hidden_dim=c.ffn_dim,
        rope=CosSinRoPE.Config(dim=c.head_dim, max_seq_len=c.block_size, theta=c.rope_theta), attn_backend="flex",
    )
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return Llama3Model.Config(
        dim=c.n_embd, vocab_size=c.vocab_size,
        tok_embeddings=Embedding.Config(num_embeddings=c.vocab_size, embedding_dim=c.n_embd),
        norm=RMSNorm.Config(normalized_shape=c.n_embd, eps=1e-5),
        lm_head=Linear.Config(in_features=c.n_embd, out_features=c.vocab_size),
        layers=layers,
    )


def _cpu_torchtitan() -> None:
    """torchtitan reads its device once, at import, and falls back to CUDA: point it at the CPU before any
    module that binds the name is imported."""
    import torch
    import torchtitan.tools.utils as titan_utils

    titan_utils.device_type, titan_utils.device_module = "cpu", torch.cpu


def _loaded_model(model_dims: dict, parallelism):
    """torchtitan's Llama 3 at our dimensions, holding our GPT's seed-0 initial weights; and its config."""
    import torch

    from lightning_3d.models import GPT, GPTConfig

    config = torchtitan_llama(model_dims)
    config.update_from_config(config=types.SimpleNamespace(parallelism=parallelism))
    model = config.build()
    torch.manual_seed(0)
    model.load_state_dict(our_keys_to_torchtitan(GPT(GPTConfig(**model_dims)).state_dict()))
    return model, config


def train(model_dims: dict, tp: int, sp: bool, steps: int, global_batch: int) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    _cpu_torchtitan()
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3 import parallelize_llama

    world, rank = dist.get_world_size(), dist.get_rank()
    dp = world // tp
    parallelism = ParallelismConfig(
        data_parallel_shard_degree=dp, tensor_parallel_degree=tp, enable_sequence_parallel=sp, spmd_backend="partial_dtensor"
    )
    model, _ = _loaded_model(model_dims, parallelism)
    dims = ParallelDims(dp_replicate=1, dp_shard=dp, cp=1, tp=tp, pp=1, ep=1, world_size=world, spmd_backend="partial_dtensor")
    dims.build_mesh()
    with tempfile.TemporaryDirectory() as dump:
        model = parallelize_llama(
            model, parallel_dims=dims, training=TrainingConfig(mixed_precision_param="float32"), parallelism=parallelism,
            compile_config=CompileConfig(enable=False), ac_config=None, dump_folder=dump,
        )
    if dp > 1 and dist.get_backend() == "gloo":  # gloo has no PREMUL_SUM/AVG reduce-scatter: sum, then divide
        for module in model.modules():
            if hasattr(module, "set_force_sum_reduction_for_comms"):
                module.set_force_sum_reduction_for_comms(True)
    optimizer, schedule = bench_optimizer(model, WARMUP + steps)
    for group in optimizer.param_groups:  # torchtitan's default optimizer implementation is torch's fused AdamW
        group["fused"] = True

    def forward_backward(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = model(x)
        if isinstance(logits, DTensor):
            with loss_parallel():
                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
                loss.backward()
            return loss.full_tensor()
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        return loss

    step = plain_step(forward_backward, optimizer, schedule(optimizer))
    block = model_dims["block_size"]
    return timed_loop(step, replica_batches(block, global_batch, rank // tp, dp), steps, global_batch, block)


def stage_modules(n_layer: int, stages: int) -> list[list[str]]:
    """Each pipeline stage's module names, cut by our own ``pipeline_partition="uniform"``: the same blocks
    on each stage as ours, the embedding with the first, the final norm and head with the last."""
    from lightning_3d.pipeline.partition import partition

    parts = [[f"layers.{i}" for i in range(start, end)] for start, end in partition(n_layer, stages)]
    parts[0].insert(0, "tok_embeddings")
    parts[-1] += ["norm", "lm_head"]
    return parts


def train_pipeline(model_dims: dict, schedule_name: str, microbatches: int, steps: int, global_batch: int) -> dict:
    """torchtitan's pipeline: ``pipeline_llm`` splits the model into stages (1 per rank, 2 for looped and V
    schedules) and builds torch's schedule; every rank is a pipeline rank (no data parallelism)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    _cpu_torchtitan()
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.pipeline_parallel import pipeline_llm
    from torchtitan.models.llama3 import parallelize_llama

    pp = dist.get_world_size()
    per_rank = 1 if issubclass(get_schedule_class(schedule_name), PipelineScheduleSingle) else 2
    parallelism = ParallelismConfig(
        pipeline_parallel_degree=pp, pipeline_parallel_schedule=schedule_name,
        pipeline_parallel_microbatch_size=global_batch // microbatches,
        module_fqns_per_model_part=stage_modules(model_dims["n_layer"], pp * per_rank), spmd_backend="partial_dtensor",
    )
    model, config = _loaded_model(model_dims, parallelism)
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=pp, ep=1, world_size=pp, spmd_backend="partial_dtensor")
    dims.build_mesh()

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, None]:
        # Each micro-batch's mean over 1/m: the gradients sum to the global batch's mean, as ours.
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()) / microbatches, None

    with tempfile.TemporaryDirectory() as dump:
        pipeline, parts, has_first, has_last = pipeline_llm(
            model, parallel_dims=dims, training=TrainingConfig(local_batch_size=global_batch, mixed_precision_param="float32"),
            parallelism=parallelism, compile_config=CompileConfig(enable=False), ac_config=None, dump_folder=dump,
            device=torch.device("cpu"), model_config=config, parallelize_fn=parallelize_llama, loss_fn=loss_fn,
        )
    optimizer, schedule = bench_optimizer(torch.nn.ModuleList(parts), WARMUP + steps)
    for group in optimizer.param_groups:  # torchtitan's default optimizer implementation is torch's fused AdamW
        group["fused"] = True

    def forward_backward(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        pipeline.step(*((x,) if has_first else ()), target=y if has_last else None, losses=losses if has_last else None)
        # Every rank reports the step's loss: the last stage's sum, shared over the pipeline.
        loss = torch.stack(losses).sum().detach() if has_last else torch.zeros(())
        dist.all_reduce(loss)
        return loss

    step = plain_step(forward_backward, optimizer, schedule(optimizer))
    block = model_dims["block_size"]
    return timed_loop(step, replica_batches(block, global_batch, 0, 1), steps, global_batch, block)


if __name__ == "__main__":
    parser = peer_parser("GPTConfig fields as JSON (Llama-style)")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--sp", action="store_true", help="torchtitan's sequence parallel with TP")
    parser.add_argument("--schedule", help="a torch pipelining schedule (1F1B, Interleaved1F1B, ZBVZeroBubble, ...): every rank a stage")
    parser.add_argument("--microbatches", type=int, default=8)
    args = parser.parse_args()
    if args.schedule:
        run_and_print(train_pipeline, args.world, args.model, args.schedule, args.microbatches, args.steps, args.global_batch)
    else:
        run_and_print(train, args.world, args.model, args.tp, args.sp, args.steps, args.global_batch)
