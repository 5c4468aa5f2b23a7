"""Published training runs the planner is held against: one list for the tests
(tests/test_planner*.py) and the validation benchmark (benchmarks/planner_cases.py).

Each run states its model, cluster, software of its time, global batch, layout and what it
reported. ``reported_tflops`` is per GPU as Narayanan et al. count it (hardware FLOPs, the
recompute forward included); runs that report a step time are converted with the planner's own
count (:meth:`ModelShape.step_flops`), so that prediction and report use one formula.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from lightning_3d.core.model_shape import ModelShape

# Nemotron-4 (NVIDIA 2024): squared-ReLU MLP (two ffn matrices, as GELU's), GQA with 8 kv heads,
# RoPE, no biases, untied 256k vocabulary. 15B: arXiv:2402.16819, Table 1; 340B: NVIDIA's
# Nemotron-4 340B technical report (2024), Table 1; both as in NeMo's nemotron4 configs.
NEMOTRON4_15B = ModelShape(
    n_layer=32, hidden=6144, n_head=48, n_kv_head=8, ffn=24576, vocab=256000, seq_len=4096,
    tied_embeddings=False, learned_positions=False, bias=False,
)
NEMOTRON4_340B = ModelShape(
    n_layer=96, hidden=18432, n_head=96, n_kv_head=8, ffn=73728, vocab=256000, seq_len=4096,
    tied_embeddings=False, learned_positions=False, bias=False,
)


@dataclass(frozen=True)
class PublishedRun:
    name: str
    model: Union[str, ModelShape]  # a conf/model name, or the shape itself
    cluster: str
    nodes: Optional[int]  # None: the cluster config's own count
    software: str
    global_batch: int
    layout: dict[str, Any]
    source: str
    reported_tflops: Optional[float] = None
    reported_step_seconds: Optional[float] = None
    precision: str = "bf16-mixed"
    notes: str = ""
    seq_len: Optional[int] = None  # None: the model config's block_size

    @property
    def gpus(self) -> int:
        return self.layout["dp"] * self.layout["tp"] * self.layout["pp"] * self.layout.get("cp", 1)

    def reported(self, shape: ModelShape) -> float:
        """TFLOP/s per GPU as the planner counts them."""
        if self.reported_tflops is not None:
            return self.reported_tflops
        assert self.reported_step_seconds is not None
        passes = 1.0 if self.layout.get("recompute") == "full" else 0.0
        return shape.step_flops(self.global_batch, passes) / self.gpus / self.reported_step_seconds / 1e12


def _table_1() -> list[PublishedRun]:
    # Narayanan et al. 2021 (SC'21), Table 1: Selene, A100 80GB, s = 2048, V = 51200, fp16, full
    # recompute. (model, t, p, GPUs, global batch, achieved TFLOP/s per GPU)
    rows = [
        ("1p7b", 1, 1, 32, 512, 137), ("3p6b", 2, 1, 64, 512, 138), ("7p5b", 4, 1, 128, 512, 142),
        ("18p4b", 8, 1, 256, 1024, 135), ("39p1b", 8, 2, 512, 1536, 138), ("76p1b", 8, 4, 1024, 1792, 140),
        ("145p6b", 8, 8, 1536, 2304, 148), ("310p1b", 8, 16, 1920, 2160, 155), ("529p6b", 8, 35, 2520, 2520, 163),
        ("1t", 8, 64, 3072, 3072, 163),
    ]
    return [
        PublishedRun(
            f"megatron_gpt_{n}", f"megatron_gpt_{n}", "selene_mtnlg", g // 8, "megatron_2021", b,
            dict(dp=g // (t * p), tp=t, pp=p), "Narayanan et al. 2021, Table 1", reported_tflops=tf,
        )
        for n, t, p, g, b, tf in rows
    ]


A100_3D: list[PublishedRun] = _table_1() + [
    # BLOOM paper (BigScience 2022), section 3.4 / model card: 384 A100 80GB, tp4 pp12 dp8, ZeRO-1,
    # micro-batch 2, global batch 2048; "about 150 TFLOP/s per GPU" (156 at the best of the run).
    PublishedRun("bloom_176b", "bloom_176b", "jean_zay_bloom", None, "megatron_deepspeed_2022", 2048,
                 dict(dp=8, tp=4, pp=12, micro_batch_size=2, zero_stage=1), "BigScience 2022", reported_tflops=150),
    # Smith et al. 2022 (MT-NLG), section 2.3: 280 DGX A100 nodes, tp8 pp35 dp8, global batch 1920,
    # micro-batch 1: 126 TFLOP/s per GPU (60.1 s per iteration).
    PublishedRun("mt_nlg_530b", "mt_nlg_530b", "selene_mtnlg", None, "megatron_deepspeed_2022", 1920,
                 dict(dp=8, tp=8, pp=35, micro_batch_size=1), "Smith et al. 2022", reported_tflops=126),
]

# Narayanan et al. 2021, Table 2 and section 5.2: GPT-3 175B (global batch 1536) with ZeRO-3 and no
# model parallelism (DeepSpeed, integrated into Megatron-LM), against PTD-P (t8 x p12 for 175B,
# t8 x p35 for 530B) on the same GPUs: (GPUs, global batch, ZeRO-3 micro-batch, ZeRO-3 TFLOP/s,
# PTD-P TFLOP/s).
ZERO3_TABLE_2 = {
    "gpt3_175b": [(384, 1536, 4, 144, 153), (768, 1536, 2, 88, 149), (1536, 1536, 1, 44, 141)],
    "megatron_gpt_529p6b": [(640, 2560, 4, 138, 171), (1120, 2240, 2, 98, 167), (2240, 2240, 1, 48, 159)],
}


def zero3_table_2(model: str = "gpt3_175b") -> list[PublishedRun]:
    return [
        PublishedRun(
            f"{model} ZeRO-3 {g} GPUs", model, "selene_mtnlg", g // 8, "deepspeed_zero3_2021", batch,
            dict(dp=g, tp=1, pp=1, micro_batch_size=mb, zero_stage=3, recompute="full"),
            "Narayanan et al. 2021, Table 2", reported_tflops=z, precision="16-mixed",
        )
        for g, batch, mb, z, _ in ZERO3_TABLE_2[model]
    ]


# NVIDIA DGX Cloud benchmarking recipes (github.com/NVIDIA/dgxc-benchmarking @ 8f5cbb3, "v25.02",
# NeMo 24.12; the Nemotron-4 340B row @ 35a9aec, "v24.11.1"): BF16 training step times on DGX H100
# (8 x 400 Gb/s InfiniBand per node) with every degree stated in the committed NeMo configs:
# Megatron-Core distributed optimizer with gradient and parameter overlap, TP communication
# overlap, sequence parallelism, fused attention. Rows with context parallelism (Llama 3.1 8B,
# 70B, 405B) wait for the planner's context-parallel dimension.
H100: list[PublishedRun] = [
    PublishedRun("gpt3_175b (NeMo 24.12)", "gpt3_175b", "h100_80g_1node", 16, "megatron_core_2024", 256,
                 dict(dp=4, tp=4, pp=8, micro_batch_size=1, schedule="interleaved_1f1b", virtual_stages=6,
                      zero_stage=1, sequence_parallel=True, recompute="none"),
                 "dgxc-benchmarking nemo_megatron/README_175b.md", reported_step_seconds=8.309),
    PublishedRun("nemotron4_340b (NeMo 24.11)", NEMOTRON4_340B, "h100_80g_1node", 16, "megatron_core_2024", 32,
                 dict(dp=2, tp=8, pp=8, micro_batch_size=1, schedule="interleaved_1f1b", virtual_stages=12,
                      zero_stage=1, sequence_parallel=True, recompute="selective"),
                 "dgxc-benchmarking nemotron/README_340b.md", reported_step_seconds=4.61,
                 notes="the 25.02 script runs bf16 with context parallelism 2 at the same step time"),
    PublishedRun("nemotron4_15b (NeMo 24.12)", NEMOTRON4_15B, "h100_80g_1node", 2, "megatron_core_2024", 64,
                 dict(dp=4, tp=4, pp=1, micro_batch_size=4, zero_stage=1, sequence_parallel=True, recompute="none"),
                 "dgxc-benchmarking nemotron/README_15b.md", reported_step_seconds=2.812),
]


# Llama 3 405B pre-training (Llama Team 2024, "The Llama 3 Herd of Models", Table 4 and section
# 3.3.2): Meta's stack on up to 16K H100s (RoCE, 400 Gb/s per GPU), BF16, 16M tokens per step;
# TFLOP/s per GPU as reported (= BF16 MFU x 989: 43%, 41%, 38%). What the paper states and the
# planner can model: the degrees, interleaved 1F1B, uneven stages, and no activation checkpointing
# at 8K ("we could pre-train Llama 3 on sequences of 8K tokens without activation checkpointing";
# at 128K with cp16 each rank holds the same 8K tokens). Assumed, not stated: micro-batch 1, v = 4
# (the fastest v the planner offers: pp x v <= 126 layers), sequence parallelism. Meta's CP
# all-gathers K/V (not a ring); the ring's bytes are the same and hide behind attention here.
_LLAMA3_8K = dict(tp=8, pp=16, micro_batch_size=1, schedule="interleaved_1f1b", virtual_stages=4,
                  sequence_parallel=True, recompute="none")
LLAMA3_405B: list[PublishedRun] = [
    PublishedRun("llama3_405b 8K, 8,192 GPUs", "llama3_405b", "h100_80g_2048nodes", 1024, "lightning_3d", 2048,
                 dict(dp=64, **_LLAMA3_8K), "Llama 3 paper, Table 4", reported_tflops=430, seq_len=8192,
                 notes="batch size per DP 32"),
    PublishedRun("llama3_405b 8K, 16,384 GPUs", "llama3_405b", "h100_80g_2048nodes", 2048, "lightning_3d", 2048,
                 dict(dp=128, **_LLAMA3_8K), "Llama 3 paper, Table 4", reported_tflops=400, seq_len=8192,
                 notes="batch size per DP 16"),
    PublishedRun("llama3_405b 128K, 16,384 GPUs, CP16", "llama3_405b", "h100_80g_2048nodes", 2048, "lightning_3d", 128,
                 dict(dp=8, cp=16, **_LLAMA3_8K), "Llama 3 paper, Table 4", reported_tflops=380, seq_len=131072,
                 notes="batch size per DP 16"),
]


def model_shape(run: PublishedRun) -> ModelShape:
    if isinstance(run.model, ModelShape):
        return run.model
    from omegaconf import OmegaConf

    from lightning_3d.core.compose import compose_config

    config = OmegaConf.to_container(compose_config([f"model={run.model}"]).model)
    return ModelShape.from_config(config, seq_len=run.seq_len)  # type: ignore[arg-type]


def problem(run: PublishedRun):  # type: ignore[no-untyped-def]
    """The planning problem of a published run (its cluster, node count, software, precision)."""
    from lightning_3d.core.compose import compose_config
    from lightning_3d.planner.hardware import load_cluster, with_nodes
    from lightning_3d.planner.search import SOFTWARE, Problem

    cluster = with_nodes(load_cluster(compose_config([f"cluster={run.cluster}"]).cluster), run.nodes)
    return Problem(model_shape(run), cluster, run.global_batch, SOFTWARE[run.software], precision=run.precision)
