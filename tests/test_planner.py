"""The planner: its memory formulas against the papers, its predictions against published runs,
its configs and its command line. No processes are spawned here (see test_recipes.py)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from dataclasses import replace

import pytest
from omegaconf import OmegaConf

from lightning_3d.apps.plan_cli import parse_layout
from lightning_3d.core.compose import CONF_DIR, compose_config
from lightning_3d.planner import (
    SOFTWARE,
    ActivationOptions,
    Layout,
    ModelShape,
    Planner,
    Problem,
    activations_in_flight,
    best_completion,
    layer_activation_bytes,
    load_cluster,
    rank,
    with_nodes,
    zero_model_state_bytes,
)
from lightning_3d.planner.published import A100_3D, PublishedRun
from lightning_3d.planner.published import problem as published_problem
from lightning_3d.planner.search import stage_layers



def compose(*overrides: str):  # type: ignore[no-untyped-def]
    return compose_config(list(overrides))


def shape_of(model: str, seq_len: int | None = None) -> ModelShape:
    cfg = compose(f"model={model}")
    return ModelShape.from_config(OmegaConf.to_container(cfg.model), seq_len=seq_len)  # type: ignore[arg-type]


def cluster_of(name: str, nodes: int | None = None):  # type: ignore[no-untyped-def]
    return with_nodes(load_cluster(compose(f"cluster={name}").cluster), nodes)


# -- ZeRO (Rajbhandari et al. 2020) ---------------------------------------------------------------
@pytest.mark.parametrize("psi", [1.5e9, 7.5e9, 175e9, 1e12])
@pytest.mark.parametrize("n", [1, 8, 64, 1024])
def test_model_states_are_the_zero_papers_formulas(psi: float, n: int) -> None:
    """Section 5 of the ZeRO paper, mixed-precision Adam (K = 12): 16 psi, 4 psi + 12 psi / N,
    2 psi + 14 psi / N, 16 psi / N."""
    expected = {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}
    for stage, total in expected.items():
        assert sum(zero_model_state_bytes(psi, stage, n).values()) == pytest.approx(total, rel=1e-12)


def test_zero_papers_figure_1_example() -> None:
    """ZeRO paper, Figure 1: 7.5B parameters on 64 GPUs -> 120 GB, 31.4 GB, 16.6 GB, 1.88 GB."""
    paper = {0: 120e9, 1: 31.4e9, 2: 16.6e9, 3: 1.88e9}
    for stage, gb in paper.items():
        assert sum(zero_model_state_bytes(7.5e9, stage, 64).values()) == pytest.approx(gb, rel=0.01)


def test_zero_stage_is_validated() -> None:
    with pytest.raises(ValueError, match="zero_stage=4"):
        zero_model_state_bytes(1e9, 4, 8)


# -- activations (Korthikanti et al. 2022) ---------------------------------------------------------
# Their Table 3 models (s = 2048, t = 8): 22B, 175B (GPT-3), 530B (MT-NLG), 1T.
KORTHIKANTI_MODELS = [(6144, 64, 48), (12288, 96, 96), (20480, 128, 105), (25600, 160, 128)]


def _gpt(h: int, a: int, layers: int, s: int = 2048) -> ModelShape:
    return ModelShape(n_layer=layers, hidden=h, n_head=a, n_kv_head=a, ffn=4 * h, vocab=51200, seq_len=s, dropout=True)


@pytest.mark.parametrize("h,a,layers", KORTHIKANTI_MODELS)
@pytest.mark.parametrize("b", [1, 4])
def test_activations_are_korthikantis_formulas(h: int, a: int, layers: int, b: int) -> None:
    """Section 4 of Korthikanti et al.: bytes per layer for 16-bit activations with dropout and
    unfused attention, t = 8."""
    model, s, t = _gpt(h, a, layers), 2048, 8
    sbh = s * b * h

    def ours(**kw) -> float:  # type: ignore[no-untyped-def]
        return layer_activation_bytes(model, b, ActivationOptions(**kw))

    assert ours(tp=1) == pytest.approx(sbh * (34 + 5 * a * s / h))
    assert ours(tp=t) == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    assert ours(tp=t, sequence_parallel=True) == pytest.approx(sbh / t * (34 + 5 * a * s / h))
    assert ours(tp=t, recompute="selective") == pytest.approx(sbh * (10 + 24 / t))
    assert ours(tp=t, sequence_parallel=True, recompute="selective") == pytest.approx(34 * sbh / t)
    assert ours(tp=t, recompute="full") == pytest.approx(2 * sbh)
    assert ours(tp=t, sequence_parallel=True, recompute="full") == pytest.approx(2 * sbh / t)


def test_sequence_parallel_and_selective_recompute_save_what_the_paper_reports() -> None:
    """Korthikanti et al. (abstract, Figure 7): the two together cut activation memory ~5x vs
    tensor parallelism alone on their models."""
    for h, a, layers in KORTHIKANTI_MODELS:
        model = _gpt(h, a, layers)
        tp_only = layer_activation_bytes(model, 1, ActivationOptions(tp=8))
        both = layer_activation_bytes(model, 1, ActivationOptions(tp=8, sequence_parallel=True, recompute="selective"))
        assert 4.0 < tp_only / both < 6.5


def test_in_flight_micro_batches_per_schedule() -> None:
    assert activations_in_flight("1f1b", 1, 64) == 1
    assert activations_in_flight("1f1b", 8, 64) == 8  # the first stage holds p micro-batches
    assert activations_in_flight("1f1b", 8, 4) == 4
    assert activations_in_flight("gpipe", 8, 64) == 64
    assert activations_in_flight("interleaved_1f1b", 8, 64, 4) == pytest.approx(8 * (1 + 7 / 32))  # their eq. 5


# -- model shapes and FLOPs --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "model,billions",
    [
        ("gpt3_175b", 175.0),
        ("bloom_176b", 176.2),
        ("mt_nlg_530b", 530.0),
        ("llama3_8b", 8.0),
        ("llama3_70b", 70.6),
        ("llama3_405b", 405.9),
        ("megatron_gpt_1p7b", 1.7),
        ("megatron_gpt_18p4b", 18.4),
        ("megatron_gpt_145p6b", 145.6),
        ("megatron_gpt_1t", 1008.0),
    ],
)
def test_published_parameter_counts(model: str, billions: float) -> None:
    """The configs' dimensions give the published sizes (within 3%: vocab padding, biases)."""
    assert shape_of(model).num_parameters / 1e9 == pytest.approx(billions, rel=0.03)


@pytest.mark.parametrize("config", [
    {},
    {"n_kv_head": 2, "mlp": "swiglu", "norm": "rmsnorm", "position": "rope", "bias": False, "tie_embeddings": False, "ffn_hidden": 96},
    {"n_experts": 4, "top_k": 2},  # every block MoE, learned positions, biases elsewhere
    {"n_experts": 8, "top_k": 2, "n_shared_experts": 1, "moe_every": 2, "expert_hidden": 24, "mlp": "swiglu", "bias": False},
])
def test_parameter_count_equals_the_real_model(config: dict) -> None:
    from lightning_3d.models.gpt import GPT, GPTConfig

    fields = dict(vocab_size=256, block_size=32, n_layer=3, n_head=4, n_embd=32, **config)
    model = GPT(GPTConfig(**fields))
    real = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    assert ModelShape.from_config(fields).num_parameters == real


@pytest.mark.parametrize("model", ["megatron_gpt_1p7b", "megatron_gpt_145p6b", "megatron_gpt_1t", "gpt3_175b"])
def test_flops_are_narayanans_formula(model: str) -> None:
    """Narayanan et al. 2021, eq. (3): 96 B s l h^2 (1 + s / 6h + V / 16 l h) with recomputation."""
    m, batch = shape_of(model), 1536
    s, l, h, v = m.seq_len, m.n_layer, m.hidden, m.vocab
    expected = 96 * batch * s * l * h**2 * (1 + s / (6 * h) + v / (16 * l * h))
    assert m.step_flops(batch, recompute_passes=1) == pytest.approx(expected, rel=1e-9)


# -- published runs -------------------------------------------------------------------------------
# The published 3D runs (lightning_3d/planner/published.py): Narayanan et al. 2021 Table 1,
# BLOOM-176B, MT-NLG 530B, each with the software profile of its time.
PUBLISHED = [pytest.param(run, id=run.name) for run in A100_3D]
# Where the planner ranks the published layout below 5th: it predicts lower tensor parallelism
# (tp 2-4 with a short pipeline) faster by 10-20%. Narayanan et al. did not measure those layouts
# for these rows; their controlled sweeps (section 5.4, pinned below) order layouts as the
# planner does. See docs/planner.md ("Known disagreements").
KNOWN_RANK = {"megatron_gpt_18p4b": 7, "megatron_gpt_39p1b": 8}


@pytest.mark.parametrize("run", PUBLISHED)
def test_published_layouts(run: PublishedRun) -> None:
    """The published layout fits, ranks near the top, and its predicted TFLOP/s per GPU is within
    15% of the reported figure -- with the one calibrated constant of the A100 config for all."""
    problem = published_problem(run)
    assert problem.cluster.device.model == "A100-SXM4-80GB"
    assert problem.cluster.device.gemm_efficiency == compose("cluster=a100_80g_1node").cluster.device.gemm_efficiency
    planner = Planner(problem)
    estimate = best_completion(planner, run.layout)
    assert estimate.fits, estimate.why_not
    ranked = [e.layout.degrees for e in rank(planner.search())]
    position = ranked.index(estimate.layout.degrees) + 1
    assert position <= KNOWN_RANK.get(run.name, 5), (position, ranked[:8])
    assert estimate.tflops_per_device == pytest.approx(run.reported_tflops, rel=0.15)


# Narayanan et al. 2021, section 5.4: controlled sweeps on 64 A100s (8 DGX nodes), micro-batch 1,
# with the throughput per GPU of each (t, p, d) plotted. Fig. 13: a 161B GPT (32 layers, 128 heads,
# hidden 20480), t x p = 64, batch 32 and 128: t = 8, p = 8 is fastest. Fig. 14: a 5.9B GPT
# (32 layers, 32 heads, hidden 3840), p x d = 64, batch 32/128/512: throughput falls as p grows.
# Fig. 15: the same model, t x d = 64: throughput falls as t grows. We pin the orderings (the
# figures give no table of values); the non-interleaved 1F1B schedule is assumed.
FIG_161B = ModelShape(n_layer=32, hidden=20480, n_head=128, n_kv_head=128, ffn=4 * 20480, vocab=51200, seq_len=2048, dropout=True)
FIG_5P9B = ModelShape(n_layer=32, hidden=3840, n_head=32, n_kv_head=32, ffn=4 * 3840, vocab=51200, seq_len=2048, dropout=True)


def _sweep_tflops(model: ModelShape, batch: int, degrees: list[tuple[int, int, int]]) -> list[float]:
    software = replace(SOFTWARE["megatron_2021"], schedules=("1f1b",))
    planner = Planner(Problem(model, cluster_of("selene_mtnlg", 8), batch, software, precision="16-mixed", cross_node_tp=True))
    return [
        planner.evaluate(Layout(d, t, p, micro_batch_size=1, recompute="full")).tflops_per_device for d, t, p in degrees
    ]


@pytest.mark.parametrize("batch", [32, 128])
def test_narayanan_figure_13_tensor_times_pipeline_peaks_at_a_node(batch: int) -> None:
    degrees = [(1, 2, 32), (1, 4, 16), (1, 8, 8), (1, 16, 4), (1, 32, 2)]
    tflops = _sweep_tflops(FIG_161B, batch, degrees)
    assert degrees[tflops.index(max(tflops))] == (1, 8, 8), tflops


@pytest.mark.parametrize("batch", [32, 128, 512])
def test_narayanan_figures_14_and_15_throughput_falls_with_pipeline_and_tensor_degree(batch: int) -> None:
    for degrees in ([(64 // p, 1, p) for p in (2, 4, 8, 16, 32)], [(64 // t, t, 1) for t in (2, 4, 8, 16, 32)]):
        tflops = _sweep_tflops(FIG_5P9B, batch, degrees)
        assert tflops == sorted(tflops, reverse=True), (degrees, tflops)


def test_megatron_interleaves_only_beyond_two_stages() -> None:
    """Megatron-LM raises "pipeline-model-parallel size should be greater than 2 with interleaved
    schedule"; lightning_3d interleaves two stages too."""
    model = shape_of("megatron_gpt_18p4b")
    for name, interleaves_two in (("megatron_2021", False), ("lightning_3d", True)):
        planner = Planner(Problem(model, cluster_of("selene_mtnlg", 4), 512, SOFTWARE[name]))
        stages = {layout.pp for d, t, pp in planner.degrees() for layout in planner.options(d, t, pp) if layout.virtual_stages > 1}
        assert (2 in stages) == interleaves_two and {4, 8} <= stages, (name, sorted(stages))


# Independent evidence on the 18.4B disagreement: GPT-NeoX-20B (Black et al. 2022, section 2.3 and
# EleutherAI/gpt-neox configs/20B.yml) was tuned on 12 nodes of 8 A100-SXM4-40GB (NVSwitch, four
# 200 Gb/s HDR adapters per node) with DeepSpeed's pipeline engine and chose tp2 x pp4 x dp12,
# micro-batch 4 x 32 accumulation steps (batch 1536), ZeRO-1, full recompute -- not tp 8.
# 44 layers, hidden 6144, 64 heads, untied embeddings, rotary, vocab padded to 50432. Its
# parallel attention + MLP block is not modelled (it saves one all-reduce per layer).
NEOX_20B = ModelShape(
    n_layer=44, hidden=6144, n_head=64, n_kv_head=64, ffn=4 * 6144, vocab=50432, seq_len=2048,
    tied_embeddings=False, learned_positions=False,
)


def test_gpt_neox_20b_layout_ranks_near_the_top_on_its_cluster() -> None:
    a100 = cluster_of("a100_80g_1node")
    # A100 40GB datasheet: 40 GB HBM2 at 1,555 GB/s; same tensor-core peak (the A100 constant).
    device = replace(a100.device, model="A100-SXM4-40GB", memory_gb=40, memory_bandwidth_gb_per_s=1555)
    cluster = replace(a100, name="eleuther_neox", num_nodes=12, device=device, inter_node_gb_per_s=4 * 25.0)
    planner = Planner(Problem(NEOX_20B, cluster, 1536, SOFTWARE["megatron_deepspeed_2022"], precision="16-mixed"))
    ranked = [e.layout.degrees for e in rank(planner.search())]
    published = best_completion(planner, dict(dp=12, tp=2, pp=4, micro_batch_size=4, zero_stage=1))
    node_wide_tp = best_completion(planner, dict(dp=12, tp=8, pp=1))
    assert published.fits and node_wide_tp.fits
    assert ranked.index(published.layout.degrees) + 1 <= 3, ranked[:8]
    assert published.tflops_per_device > 1.1 * node_wide_tp.tflops_per_device


def test_an_unfitting_layout_is_reported_with_the_reason() -> None:
    planner = Planner(Problem(shape_of("gpt3_175b"), cluster_of("a100_80g_1node"), 64, SOFTWARE["megatron_2021"]))
    estimate = best_completion(planner, dict(dp=8, tp=1, pp=1))
    assert not estimate.fits and "GB per device" in estimate.why_not
    assert not rank([estimate])


def test_search_covers_a_1024_gpu_cluster() -> None:
    """128 nodes x 8 GPUs, Llama 3 70B: thousands of layouts, every one of them runnable by the
    strategy (ParallelConfig accepts it), the best fitting in memory."""
    from lightning_3d.core.config import ParallelConfig

    cfg = compose("model=llama3_70b", "cluster=h100_80g_64nodes", "data.global_batch_size=512", "trainer.precision=bf16-mixed")
    from lightning_3d.planner import plan, problem_from_config

    result = plan(problem_from_config(cfg, nodes=128))
    assert result.searched > 1000 and result.ranked
    for estimate in result.ranked[:20]:
        kwargs = estimate.layout.strategy_kwargs(512, estimate.split_points)
        kwargs.pop("pipeline_partition", None)
        config = ParallelConfig(**{**kwargs, "nvme_path": "/tmp" if estimate.layout.offload == "nvme" else None})
        config.require_implemented()
        assert config.check_world(1024, 8).world_size == 1024
        assert estimate.memory["total"] < 80e9


def test_lightning_3d_profile_prefers_its_features_when_they_pay() -> None:
    """With sequence parallelism and selective recompute available, a 70B model on one H100 node
    needs them (or ZeRO/offload) to fit at all; the old Megatron profile cannot fit it."""
    cfg = compose("model=llama3_70b", "cluster=h100_80g_1node", "data.global_batch_size=64", "trainer.precision=bf16-mixed")
    from lightning_3d.planner import plan, problem_from_config

    ours = plan(problem_from_config(cfg)).ranked
    assert ours and (ours[0].layout.zero_stage >= 1 or ours[0].layout.offload != "none")
    assert not plan(problem_from_config(cfg, software="megatron_2021")).ranked


# -- configs ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name", ["local_cpu", "a100_80g_1node", "h100_80g_1node", "h100_80g_64nodes", "h200_141g_1node", "jean_zay_bloom", "selene_mtnlg"]
)
def test_cluster_configs_load_and_cite_their_figures(name: str) -> None:
    spec = cluster_of(name)
    assert spec.world_size >= 8 and spec.device.peak_tflops > 0
    text = (CONF_DIR / "cluster" / f"{name}.yaml").read_text()
    assert "#" in text.split("name:")[0] or name == "local_cpu"  # a sourcing comment above the figures


def test_published_cluster_figures() -> None:
    bloom, selene = cluster_of("jean_zay_bloom"), cluster_of("selene_mtnlg")
    assert (bloom.num_nodes, bloom.devices_per_node, bloom.inter_node_gb_per_s, bloom.cpu_ram_gb) == (48, 8, 50, 512)
    assert (selene.num_nodes, selene.inter_node_gb_per_s) == (280, 200)
    assert bloom.device.memory_gb == 80 and bloom.device.peak_tflops == 312


def test_cluster_schema_names_a_wrong_key() -> None:
    base = OmegaConf.to_container(compose("cluster=a100_80g_1node").cluster)
    with pytest.raises(Exception, match="nvlnk_gb_per_s"):
        load_cluster({**base, "nvlnk_gb_per_s": 300})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="launcher='mpi'"):
        load_cluster({**base, "launcher": "mpi"})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="devices_per_node=-1"):
        load_cluster(compose("cluster=local_gpu").cluster)


def test_parse_layout() -> None:
    assert parse_layout("tp=4,pp=12,dp=8,mb=2,zero=1,sp=true,schedule=interleaved,v=2,recompute=full") == dict(
        tp=4, pp=12, dp=8, micro_batch_size=2, zero_stage=1, sequence_parallel=True,
        schedule="interleaved_1f1b", virtual_stages=2, recompute="full",
    )
    with pytest.raises(ValueError, match="tq=4"):
        parse_layout("tq=4")
    with pytest.raises(ValueError, match="must be an integer"):
        parse_layout("tp=four")


def test_layout_world_mismatch_is_explained() -> None:
    planner = Planner(Problem(shape_of("bloom_176b"), cluster_of("jean_zay_bloom"), 2048))
    with pytest.raises(ValueError, match="does not match the 384 devices"):
        best_completion(planner, dict(dp=4, tp=4, pp=12))


# -- the command -------------------------------------------------------------------------------------
def _plan(capsys: pytest.CaptureFixture[str], *args: str) -> subprocess.CompletedProcess:
    """``lightning-3d plan ARGS`` in this process (tests/test_packaging.py runs the installed command)."""
    from lightning_3d.apps.plan_cli import plan_main

    capsys.readouterr()
    code = plan_main(list(args))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["lightning-3d", "plan", *args], code, out, err)


def test_plan_command_table_json_and_layout(capsys: pytest.CaptureFixture[str]) -> None:
    table = _plan(capsys, "recipe=bloom_176b", "--top", "3")
    assert table.returncode == 0, table.stderr
    assert "jean_zay_bloom: 48 x 8 A100-SXM4-80GB" in table.stdout and "TFLOP/s" in table.stdout
    assert len([line for line in table.stdout.splitlines() if line.strip()[:1].isdigit() and "|" in line]) == 3

    as_json = _plan(capsys, "recipe=bloom_176b", "--format", "json", "--top", "5")
    rows = json.loads(as_json.stdout)
    assert [r["rank"] for r in rows] == [1, 2, 3, 4, 5]
    first = rows[0]
    assert {"layout", "strategy", "memory_gib", "step_seconds", "tflops_per_device", "mfu"} <= set(first)
    assert {"params", "grads", "optimizer", "activations", "total"} <= set(first["memory_gib"])
    assert first["step_seconds"] <= rows[-1]["step_seconds"]
    assert first["memory_gib"]["total"] < 80 / 1.073741824

    one = _plan(capsys, "recipe=bloom_176b", "--format", "json", "--software", "megatron_deepspeed_2022",
                "--layout", "tp=4,pp=12,dp=8,mb=2,zero=1")
    (row,) = json.loads(one.stdout)
    assert row["layout"]["tp"] == 4 and row["layout"]["pp"] == 12 and row["fits"]
    assert row["strategy"]["micro_batches"] == 128

    bad = _plan(capsys, "model=bloom_176b", "cluster=jean_zay_bloom", "--layout", "tp=3,pp=12,dp=8")
    assert bad.returncode != 0 and "does not match the 384 devices" in bad.stderr


def test_one_calibration_constant_per_device_model() -> None:
    """Every A100 cluster uses the same device config, hence the same calibrated efficiency."""
    for name in ("a100_80g_1node", "jean_zay_bloom", "selene_mtnlg"):
        text = (CONF_DIR / "cluster" / f"{name}.yaml").read_text()
        assert "gemm_efficiency" not in text
        assert cluster_of(name).device.model == "A100-SXM4-80GB"


# -- zero bubble (ZB-H1) ------------------------------------------------------------------------------
def _zb_problem() -> Problem:
    """GPT 39.1B (Narayanan et al. 2021) on two DGX H100 nodes, 128 sequences: zb_h1 fits without
    recomputation and wins (test_search_picks_zb_h1_where_it_fits_without_recompute)."""
    from lightning_3d.planner import problem_from_config

    cfg = compose("model=megatron_gpt_39p1b", "cluster=h100_80g_64nodes", "data.global_batch_size=128", "trainer.precision=bf16-mixed")
    return problem_from_config(cfg, nodes=2)


@pytest.mark.parametrize("pp", [2, 3, 4, 8, 16])
def test_zb_h1_in_flight_is_1f1bs_and_its_step_its_own_simulation(pp: int) -> None:
    """The planner's ZB-H1 is the runtime's schedule run on paper: step = makespan / 3 micro-batch
    times (F = 1, B = 2), the most micro-batches any stage holds = 1F1B's first stage's, min(pp, m)."""
    from lightning_3d.pipeline.schedules import build_schedule
    from lightning_3d.pipeline.simulator import simulate
    from lightning_3d.planner.memory import last_stage_in_flight
    from lightning_3d.planner.zero_bubble import SIMULATED_WORK, zb_h1_pipeline

    for m in sorted({1, pp - 1, pp, pp + 1, 2 * pp, 3 * pp, 8 * pp} - {0}):
        zb = zb_h1_pipeline(pp, m)
        assert activations_in_flight("zb_h1", pp, m) == activations_in_flight("1f1b", pp, m) == min(pp, m)
        assert max(zb.in_flight) == min(pp, m)
        assert 1 <= last_stage_in_flight("zb_h1", pp, m) <= min(pp, m)
        assert zb.step_units <= m + pp - 1  # never above 1F1B's
        if m >= pp:
            assert zb.step_units < m + pp - 1
        assert zb.step_units >= m + (pp - 1) / 3 - 1e-9  # never below the paper's
        if zb.simulated:
            sim = simulate(build_schedule("zb_h1", pp, m))
            assert zb.step_units == pytest.approx(sim.makespan / 3)
            assert zb.in_flight == tuple(sim.max_in_flight)
        else:  # too slow to build in a search: the paper's formula
            assert pp * pp * (3 * m + pp) > SIMULATED_WORK
            assert zb.step_units == pytest.approx(m + (pp - 1) / 3)


def test_zb_h1_predicts_less_bubble_than_1f1b_at_the_same_layout() -> None:
    planner = Planner(_zb_problem())
    for pp, tp, mb in [(2, 2, 1), (4, 2, 1), (8, 2, 1), (16, 1, 1), (4, 2, 4)]:
        base = Layout(16 // (tp * pp), tp, pp, micro_batch_size=mb, zero_stage=1, sequence_parallel=tp > 1)
        m = base.micro_batches(planner.problem.global_batch)
        assert m >= pp
        one = planner.evaluate(base)
        zb = planner.evaluate(replace(base, schedule="zb_h1"))
        assert zb.time["pp_bubble"] < one.time["pp_bubble"]
        assert zb.step_seconds < one.step_seconds
        # the bubble of 1F1B is (pp - 1) micro-batch times; ZB-H1's its simulation's (or the paper's)
        per_micro_batch = one.time["pp_bubble"] / (pp - 1)
        from lightning_3d.planner.zero_bubble import zb_h1_pipeline

        assert zb.time["pp_bubble"] == pytest.approx(zb_h1_pipeline(pp, m).bubble_units * per_micro_batch)
        # the same activations on the first stage; where the head's stage is the peak it may hold more
        assert zb.memory["activations"] >= one.memory["activations"]


def test_zb_h1_keeps_1f1bs_activation_memory_where_the_first_stage_is_the_peak() -> None:
    planner = Planner(_zb_problem())
    base = Layout(2, 2, 4, zero_stage=1, sequence_parallel=True)
    one, zb = planner.evaluate(base), planner.evaluate(replace(base, schedule="zb_h1"))
    assert zb.memory["activations"] == pytest.approx(one.memory["activations"])
    assert zb.memory["total"] == pytest.approx(one.memory["total"])


def test_zb_h1_with_recompute_is_never_proposed() -> None:
    """The planner refuses zb_h1 with recomputation itself (the strategy runs it: the runtime may
    recompute a block for both I and W, which the time model does not count), and every layout it
    proposes passes the strategy's rules."""
    import lightning_3d.core.layout_rules as layout_rules

    planner = Planner(_problem_small())
    proposed = [layout for degrees in planner.degrees() for layout in planner.options(*degrees)]
    zb = [layout for layout in proposed if layout.schedule == "zb_h1"]
    assert zb and all(layout.recompute == "none" for layout in zb)
    vee = [layout for layout in proposed if layout.schedule in ("zb_v", "dualpipe_v")]
    assert vee and all(layout.recompute == "none" and layout.virtual_stages == 2 for layout in vee)
    assert any(layout.recompute != "none" for layout in proposed if layout.schedule == "1f1b" and layout.pp > 1)
    for recompute in ("selective", "full"):
        assert "planner:zero_bubble_recompute" in [r.rule for r in planner.refusals(replace(zb[0], recompute=recompute))]
    with pytest.raises(ValueError, match="zb_h1 with recompute=full"):
        best_completion(planner, dict(dp=zb[0].dp, tp=zb[0].tp, pp=zb[0].pp, schedule="zb_h1", recompute="full"))
    for layout in proposed:  # every proposed layout passes the strategy's rules with its recomputation
        kw = layout.strategy_kwargs(planner.problem.global_batch)
        assert not layout_rules.feature_refusals(
            tp=layout.tp, pp=layout.pp, zero_stage=layout.zero_stage, sequence_parallel=layout.sequence_parallel,
            schedule=layout.schedule, virtual_stages=layout.virtual_stages, micro_batches=kw["micro_batches"],
            offload_optimizer=kw["offload_optimizer"] or "none", offload_params=kw["offload_params"] or "none",
        )


def _problem_small() -> Problem:
    from lightning_3d.planner import problem_from_config

    return problem_from_config(compose("cluster.devices_per_node=8", "model.n_head=8", "model.n_layer=8"))


def test_search_picks_a_zero_bubble_schedule_where_it_fits_without_recompute() -> None:
    """GPT 39.1B on 16 H100s: tp2 x pp2 x dp4 with ZB-V (32 micro-batches, no recomputation) ranks
    first, ahead of ZB-H1 at the same layout, which is ahead of 1F1B and the interleaved pipelines;
    the zero-bubble schedules only in lightning_3d's profile."""
    from lightning_3d.planner import plan

    ranked = plan(_zb_problem()).ranked
    best = ranked[0]
    assert best.layout.schedule == "zb_v" and best.layout.virtual_stages == 2 and best.layout.recompute == "none"
    assert (best.layout.tp, best.layout.pp) == (2, 2)
    planner = Planner(_zb_problem())
    steps = {s: planner.evaluate(replace(best.layout, schedule=s, virtual_stages=1)).step_seconds for s in ("zb_h1", "1f1b")}
    assert best.step_seconds < steps["zb_h1"] < steps["1f1b"]
    for name, software in SOFTWARE.items():
        for schedule in ("zb_h1", "zb_v", "dualpipe_v"):
            assert (schedule in software.schedules) == (name == "lightning_3d")


@pytest.mark.parametrize("schedule", ["zb_v", "dualpipe_v"])
@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_v_schedules_step_and_in_flight_are_their_simulation(schedule: str, pp: int) -> None:
    """The planner's ZB-V / DualPipeV is the runtime's schedule on paper (F = 0.5, B = 1 per half-size
    chunk): step = makespan / 3 micro-batch times, in flight = half-size chunks / 2. From m >= 2pp - 1
    the exact formula stands in: m + (pp - 1)/6, and pp (ZB-V) or pp + 1/2 (DualPipeV) micro-batches of
    a rank's layers on every rank -- 1F1B's first stage's memory, below ZB-H1's bubble."""
    from lightning_3d.pipeline.schedules import build_schedule
    from lightning_3d.pipeline.simulator import simulate
    from lightning_3d.planner.zero_bubble import v_pipeline, zb_h1_pipeline

    for m in sorted({1, pp, 2 * pp - 1, 2 * pp, 3 * pp, 8 * pp}):
        if schedule == "dualpipe_v" and m < 2 * pp:
            continue  # (refused by the layout rules)
        sim = simulate(build_schedule(schedule, pp, m, 2), forward_time=0.5, backward_time=1.0)
        zb = v_pipeline(schedule, pp, m)
        assert zb.step_units == pytest.approx(sim.makespan / 3)
        assert zb.in_flight == pytest.approx(tuple(n / 2 for n in sim.max_in_flight))
        assert activations_in_flight(schedule, pp, m, 2) == pytest.approx(max(sim.max_in_flight) / 2)
        if m >= 2 * pp - 1:
            assert not zb.simulated and zb.step_units == pytest.approx(m + (pp - 1) / 6)
            assert zb.step_units < zb_h1_pipeline(pp, m).step_units
            assert max(zb.in_flight) == pp + (0.5 if schedule == "dualpipe_v" else 0)


def test_v_schedules_put_the_head_beside_the_embedding() -> None:
    """Under a V, rank 0 holds the first and the last piece: the head's parameters and logits are
    counted there (with a tied embedding, once), and the last rank holds only blocks."""
    planner = Planner(_zb_problem())
    layout = Layout(4, 2, 2, zero_stage=1, sequence_parallel=True, schedule="zb_v", virtual_stages=2)
    layers, _ = stage_layers(48, 2, 2, 0.0, v_shape=True)
    assert layers == [24, 24]
    first, last = planner.stage_psi(layout, layers, 0), planner.stage_psi(layout, layers, 1)
    one = Layout(4, 2, 2, zero_stage=1, sequence_parallel=True)
    assert first > planner.stage_psi(one, layers, 0) and last < planner.stage_psi(one, layers, 1)
    assert first + last == pytest.approx(planner.stage_psi(one, layers, 0) + planner.stage_psi(one, layers, 1) - (
        planner.problem.model.vocab * planner.problem.model.hidden / 2 if planner.problem.model.tied_embeddings else 0))
    assert "zb_v" in layout.short() and "interleaved" not in layout.short()


def test_plan_imports_neither_torch_nor_lightning():
    """Issue 37: ``lightning-3d plan`` is interactive; torch's import alone took 1.8 s of its 3.8 s.
    The degrees' arithmetic (core.dims) and the pipeline schedules load without torch."""
    import subprocess
    import sys

    code = (
        "import sys; from lightning_3d.apps.cli import main; status = main(['plan', 'recipe=llama3_70b']); "
        "print(sorted(m for m in ('torch', 'lightning') if m in sys.modules), status)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.stdout.strip().splitlines()[-1] == "[] 0", proc.stdout[-2000:] + proc.stderr[-2000:]


# -- mixture of experts (issue 34) ----------------------------------------------------------------------
MOE_SHAPE = dict(n_layer=4, hidden=256, n_head=4, n_kv_head=4, ffn=1024, vocab=512, seq_len=128, gated_mlp=True,
                 tied_embeddings=False, learned_positions=False, bias=False, rms_norm=True,
                 n_experts=16, top_k=4, n_shared_experts=1, moe_every=1, expert_ffn=96)


def test_moe_activations_are_the_layers_saved_tensors() -> None:
    """The planner's MoE block term against the tensors one MoE layer keeps for backward (meta, balanced
    routing as the dry run routes), less its input, which the block's formula counts as the MLP input."""
    import torch

    from lightning_3d.apps.dry_run.balanced_routing import balanced_routing
    from lightning_3d.core.saved_tensors import SavedBytes
    from lightning_3d.moe.layer import MoE
    from lightning_3d.planner.memory import moe_layer_activation_bytes

    shape = ModelShape(**MOE_SHAPE)
    with torch.device("meta"):
        layer = MoE(shape.hidden, shape.expert_ffn, shape.n_experts, shape.top_k, shape.n_shared_experts).to(torch.bfloat16)
    x = torch.empty(2, shape.seq_len, shape.hidden, device="meta", dtype=torch.bfloat16, requires_grad=True)
    saved = SavedBytes(exclude=list(layer.parameters()))
    with balanced_routing(), saved.hooks():
        out = layer(x)
    measured = saved.current - x.numel() * 2  # (the input: the MLP input of the dense formula)
    predicted = moe_layer_activation_bytes(shape, 2, ActivationOptions(bytes_per_element=2.0))
    assert measured == pytest.approx(predicted, rel=0.01), (measured, predicted)
    skewed = moe_layer_activation_bytes(shape, 2, ActivationOptions(bytes_per_element=2.0, expert_imbalance=2.0))
    assert skewed > 1.8 * predicted and out.shape == x.shape


def test_experts_split_over_ep_and_their_state_over_the_expert_replicas() -> None:
    """ep divides the routed experts' weights among the ranks of an expert group and shards their ZeRO state over
    the dp x cp / ep expert replicas; the dense weights keep dp x cp. Its all-to-alls are costed and counted."""
    problem = Problem(ModelShape(**MOE_SHAPE), cluster_of("h100_80g_64nodes", nodes=2), global_batch=64, precision="32-true")
    planner = Planner(problem)
    base = Layout(dp=16, tp=1, pp=1, zero_stage=1, micro_batch_size=4)
    dense_only, experts = planner.stage_params(base, [4], 0)
    assert experts == 4 * 16 * 3 * 256 * 96
    one, eight = planner.evaluate(base), planner.evaluate(replace(base, ep=8))
    assert one.memory["params"] - eight.memory["params"] == pytest.approx(4.0 * experts * 7 / 8)
    # Adam's fp32 state (K = 8 bytes in 32-true): dense over 16 replicas, experts over 16 / 8 = 2
    assert eight.memory["optimizer"] == pytest.approx(8.0 * (dense_only / 16 + experts / 8 / 2))
    assert "ep" in eight.comm and "ep" not in one.comm and eight.time["ep_comm"] > 0
    skewed = Planner(replace(problem, expert_imbalance=2.0))  # the busiest rank of a group: twice the rows
    assert skewed.evaluate(base).memory == one.memory  # (one rank holding every expert computes all its rows anyway)
    assert skewed.evaluate(replace(base, ep=8)).memory["activations"] > eight.memory["activations"]
    assert skewed.evaluate(replace(base, ep=8)).step_seconds > eight.step_seconds
    assert eight.layout.strategy_kwargs(64)["expert_parallel"] == 8
    assert any(e.layout.ep > 1 for e in planner.search())
    rules = {r.rule for r in planner.refusals(replace(base, ep=3))}
    assert {"world_size", "expert_parallel_divides_experts"} <= rules, rules
    dense = Planner(replace(problem, model=replace(problem.model, n_experts=0)))
    assert "expert_parallel_needs_experts" in {r.rule for r in dense.refusals(replace(base, ep=2))}


def test_plan_command_counts_an_moe_model(capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_3d.apps.cli import main

    assert main(["plan", "model=gpt_tiny", "+model.n_experts=4", "cluster=local_cpu", "--layout", "dp=8,tp=1,pp=1,ep=4"]) == 0
    out = capsys.readouterr().out
    assert "active" in out and "MoE blocks of 4 experts" in out and " ep " in out


# -- lightning-3d profile (issue 37) -------------------------------------------------------------------------
RECORDED_PROFILE = {  # this machine, 2026-12-02 (2 processes at once)
    "gemm_tflops": {"256": 0.0717, "512": 0.0860, "1024": 0.0955}, "copy_gb_per_s": 34.74,
    "all_reduce": {"4096": {"seconds": 4.3e-4, "bus_gb_per_s": 0.0095}, "16777216": {"seconds": 0.0103, "bus_gb_per_s": 1.62}},
    "date": "2026-12-02", "host": "vm", "copy_mb": 256, "ram_gb": 24.7,
    "layer_overhead_s": 1.2e-3, "step_s": 9.63e-3, "block": {"seconds": 0.0250, "flops": 1409286144.0},
}


RECORDED_GATHERS = {  # this machine, 2026-12-04, 16 MB (a busy host): gloo's tensor gathers and scatters
    "all_gather": {"bytes": 16777216, "seconds": 0.0381, "bus_gb_per_s": 0.22},
    "reduce_scatter": {"bytes": 16777216, "seconds": 0.0524, "bus_gb_per_s": 0.16},
}


def test_a_recorded_profile_becomes_a_cluster_that_plan_takes(tmp_path: Path) -> None:
    """The method on a recorded profile (no timing): the best GEMM is the device's rate (efficiency 1), the
    largest all-reduce's bus bandwidth the link, the copy the memory bandwidth; the file composes as any cluster."""
    from lightning_3d.apps.profile_cli import cluster_from, write_cluster

    config, comments = cluster_from(RECORDED_PROFILE, "recorded", devices_per_node=2, ranks=2)
    path = write_cluster(config, comments, tmp_path)
    assert path == tmp_path / "cluster" / "recorded.yaml" and path.read_text().startswith("# Written by `lightning-3d profile`")
    cluster = load_cluster(compose(f"hydra.searchpath=[file://{tmp_path}]", "cluster=recorded").cluster)
    # the rate: the block's FLOPs over its time less its dispatch and its element-wise bytes at the copy rate
    elementwise = 3 * 1024 * 128 * (20 + 4 * 4) / 34.74e9
    assert cluster.device.gemm_efficiency == 1.0
    assert cluster.device.peak_tflops == pytest.approx(1409286144.0 / (0.0250 - 1.2e-3 - elementwise) / 1e12, rel=1e-3)
    without_block = cluster_from({k: v for k, v in RECORDED_PROFILE.items() if k != "block"}, "old", devices_per_node=2, ranks=2)[0]
    assert without_block["device"]["peak_tflops"] == 0.0955  # an older profile: the best square GEMM
    # bandwidths written / the planner's efficiency factors, which it applies again: it charges what was measured
    assert (cluster.intra_node_gb_per_s, cluster.device.memory_bandwidth_gb_per_s, cluster.world_size) == (2.025, 43.42, 2)
    # the host terms: the small all-reduce's latency, the tiny block's dispatch, the minimal step less both
    assert (cluster.collective_latency_us, cluster.device.layer_overhead_us, cluster.step_overhead_ms) == (430.0, 1200.0, 8.0)
    assert (cluster.all_gather_gb_per_s, cluster.reduce_scatter_gb_per_s) == (0.0, 0.0)  # not in this profile: as the all-reduce
    assert cluster.device.peak_tflops_alone == 0.0  # nor the block alone: one rate for any process count
    alone = cluster_from({**RECORDED_PROFILE, "block_alone": {"seconds": 0.0200, "flops": 1409286144.0}}, "alone", devices_per_node=2, ranks=2)[0]
    assert alone["device"]["peak_tflops_alone"] == pytest.approx(1409286144.0 / (0.0200 - 1.2e-3 - elementwise) / 1e12, rel=1e-3)
    # ZeRO-3's host terms: the step difference's growth per layer (3 more units at 4 layers) and the rest per step
    from lightning_3d.apps.profile_cli import zero3_overheads

    # (steps at ZeRO 0 / 3 x 1 / 2 micro-batches, less the planner's charge for each): 5 units grow by 15 ms a micro-batch
    zero3 = zero3_overheads([0.030, 0.055, 0.050, 0.091], [0.010, 0.012, 0.015, 0.018])
    assert zero3 == pytest.approx({"unit_s": 0.003, "step_s": 0.008})
    assert zero3_overheads([0.030, 0.055, 0.050, 0.070], [0.0] * 4)["unit_s"] == 0.0  # noise that shrinks it: no per-unit part
    from lightning_3d.apps.profile_cli import zero3_charged

    steps = [0.030, 0.055, 0.050, 0.091]
    charged = zero3_charged(load_cluster(cluster_from(RECORDED_PROFILE, "c", devices_per_node=2, ranks=2)[0]), 2)
    assert charged[1] > charged[0] and charged[3] > charged[2]  # the planner charges ZeRO-3's collectives itself
    terms = cluster_from({**RECORDED_PROFILE, "zero3_steps": [steps, [s * 2 for s in steps], steps]}, "zero3", devices_per_node=2, ranks=2)[0]
    want = zero3_overheads(steps, charged)  # the median of the rounds: the two equal ones
    assert terms["zero3_step_overhead_ms"] == pytest.approx(want["step_s"] * 1e3, rel=1e-3)
    assert terms["zero3_unit_overhead_us"] == pytest.approx(want["unit_s"] * 1e6, rel=1e-3)
    # a tp shard's rate: half the block's FLOPs over its time less dispatch, element-wise bytes and 4 all-reduces
    from lightning_3d.core.model_shape import ModelShape
    from lightning_3d.planner.timing import elementwise_forward_bytes

    shape = ModelShape.from_config(dict(vocab_size=256, block_size=128, n_layer=1, n_head=4, n_embd=128), seq_len=128)
    shard_bytes = 3 * elementwise_forward_bytes(shape, 8, tp=2, sequence_parallel=False, flash_attention=True)[0] / 34.74e9
    all_reduces = 4 * (4.3e-4 + 8 * 128 * 128 * 4 / 1.62e9)
    tp = cluster_from({**RECORDED_PROFILE, "block_tp": {"seconds": 0.0200, "tp": 2}}, "tp", devices_per_node=2, ranks=2)[0]
    assert tp["device"]["peak_tflops_tp"] == pytest.approx(1409286144.0 / 2 / (0.0200 - 1.2e-3 - shard_bytes - all_reduces) / 1e12, rel=1e-3)
    assert cluster.device.peak_tflops_tp == 0.0  # not in this profile: the full-width rate for shards too
    gathers = cluster_from({**RECORDED_PROFILE, **RECORDED_GATHERS}, "gathers", devices_per_node=2, ranks=2)[0]
    assert (gathers["all_gather_gb_per_s"], gathers["reduce_scatter_gb_per_s"]) == (0.275, 0.2)  # / the link efficiency
    problem = Problem(shape_of("gpt_tiny"), cluster, global_batch=16, precision="32-true")
    assert Planner(problem).search()
    with pytest.raises(ValueError):  # a figure that makes no valid cluster: no file
        cluster_from({**RECORDED_PROFILE, "ram_gb": 0.0}, "empty", devices_per_node=2, ranks=2)


def test_the_host_terms_add_what_they_say_to_a_step() -> None:
    """A profiled cluster's dispatch per layer pass and loop time per step enter the step exactly (one rank:
    no collective); its measured latency replaces NCCL's tables (a 2-rank all-reduce costs it, plus the wire)."""
    from dataclasses import replace as copy_with

    from lightning_3d.planner.collective_cost import Group, collective_cost

    base = load_cluster(compose("cluster=local_cpu").cluster)
    base = copy_with(base, devices_per_node=1)
    timed = copy_with(base, device=copy_with(base.device, layer_overhead_us=500.0), step_overhead_ms=7.0)
    layout = parse_layout("dp=1,tp=1,pp=1,mb=4,zero=0")
    steps = [best_completion(Planner(Problem(shape_of("gpt_tiny"), c, global_batch=16, precision="32-true")), layout).step_seconds for c in (base, timed)]
    micro_batches, layers = 4, 4
    assert steps[1] - steps[0] == pytest.approx(micro_batches * layers * 500e-6 + 7e-3, rel=1e-9)
    # the rate of a process alone on the host applies to one-process layouts only
    faster = copy_with(base, device=copy_with(base.device, peak_tflops_alone=2 * base.device.peak_tflops))
    computes = [best_completion(Planner(Problem(shape_of("gpt_tiny"), c, global_batch=16, precision="32-true")), layout).time["compute"] for c in (base, faster)]
    assert computes[1] < 0.6 * computes[0]
    two = [copy_with(c, devices_per_node=2) for c in (base, faster)]
    dp2 = parse_layout("dp=2,tp=1,pp=1,mb=4,zero=0")
    assert len({best_completion(Planner(Problem(shape_of("gpt_tiny"), c, global_batch=16, precision="32-true")), dp2).time["compute"] for c in two}) == 1
    # a tp shard's own rate applies to tp > 1 layouts only (their GEMMs, not the element-wise time)
    pair = copy_with(base, devices_per_node=2)
    narrow = copy_with(pair, device=copy_with(pair.device, peak_tflops_tp=pair.device.peak_tflops / 2))
    for spec, slower in (("dp=1,tp=2,pp=1,mb=16", True), ("dp=2,tp=1,pp=1,mb=8", False)):
        got = [best_completion(Planner(Problem(shape_of("gpt_tiny"), c, global_batch=16, precision="32-true")), parse_layout(spec)).time["compute"] for c in (pair, narrow)]
        assert (got[1] > 1.3 * got[0]) if slower else (got[1] == got[0]), (spec, got)
    # ZeRO-3's host terms: per step, and per unit (each layer and the root) and micro-batch; ZeRO 0-2 pay neither
    sharded = copy_with(base, devices_per_node=2, zero3_step_overhead_ms=10.0, zero3_unit_overhead_us=3000.0)
    zero3 = [best_completion(Planner(Problem(shape_of("gpt_tiny"), c, global_batch=16, precision="32-true")), parse_layout("dp=2,tp=1,pp=1,mb=4,zero=3"))
             for c in (copy_with(base, devices_per_node=2), sharded)]
    assert zero3[1].step_seconds - zero3[0].step_seconds == pytest.approx(10e-3 + 3000e-6 * (layers + 1) * 2, rel=1e-9)
    assert zero3[1].time["zero3_host"] == pytest.approx(10e-3 + 3000e-6 * (layers + 1) * 2, rel=1e-9)
    zero1 = [best_completion(Planner(Problem(shape_of("gpt_tiny"), c, global_batch=16, precision="32-true")), parse_layout("dp=2,tp=1,pp=1,mb=4,zero=1"))
             for c in (copy_with(base, devices_per_node=2), sharded)]
    assert zero1[0].step_seconds == zero1[1].step_seconds
    group = Group(2, 1, 1.0, latency_us=400.0)
    assert collective_cost("all_reduce", 1e6, group).seconds == pytest.approx(400e-6 + 1e6 / (1e9 * 0.8), rel=1e-9)
    assert collective_cost("all_gather", 1e6, group).latency == pytest.approx(200e-6)
    # a profile's own gather and scatter bandwidths (gloo's run well below its all-reduce's); 0 keeps the link's
    slow = Group(2, 1, 1.0, latency_us=400.0, all_gather_gb_per_s=0.25, reduce_scatter_gb_per_s=0.125)
    assert collective_cost("all_gather", 1e6, slow).transfer == pytest.approx(0.5e6 / (0.25e9 * 0.8), rel=1e-9)
    assert collective_cost("reduce_scatter", 1e6, slow).transfer == pytest.approx(0.5e6 / (0.125e9 * 0.8), rel=1e-9)
    assert collective_cost("all_reduce", 1e6, slow) == collective_cost("all_reduce", 1e6, group)
    across = Group(4, 2, 1.0, latency_us=400.0, all_gather_gb_per_s=0.25)  # measured on one host: not the network's
    assert collective_cost("all_gather", 1e6, across) == collective_cost("all_gather", 1e6, Group(4, 2, 1.0, latency_us=400.0))


def test_sequence_parallel_pays_the_transports_gathers_and_scatters() -> None:
    """Sequence parallelism's tensor-parallel traffic is a reduce-scatter and an all-gather where tp alone
    all-reduces: the same wire time under NCCL's model (large messages; small ones pay two start-ups),
    more on a transport that runs them slower."""
    from dataclasses import replace as copy_with

    from lightning_3d.planner.collective_cost import Group, collective_cost

    nvlink = Group(8, 1, 450.0)
    split = sum(collective_cost(kind, 2**28, nvlink).seconds for kind in ("reduce_scatter", "all_gather"))
    assert split == pytest.approx(collective_cost("all_reduce", 2**28, nvlink).seconds, rel=0.05)

    def tp_seconds(cluster: ClusterSpec, sp: bool) -> float:
        problem = Problem(shape_of("gpt_tiny"), cluster, global_batch=16, precision="32-true")
        return best_completion(Planner(problem), parse_layout(f"dp=1,tp=2,pp=1,mb=16,sp={str(sp).lower()}")).time["tp_comm"]

    cpu = copy_with(load_cluster(compose("cluster=local_cpu").cluster), devices_per_node=2, collective_latency_us=400.0)
    slow = copy_with(cpu, all_gather_gb_per_s=cpu.intra_node_gb_per_s / 4, reduce_scatter_gb_per_s=cpu.intra_node_gb_per_s / 4)
    assert tp_seconds(slow, True) > 1.5 * tp_seconds(cpu, True)
    # its replicated parameters' partial gradients: one all-reduce of them all over tp per step, exposed
    problem = Problem(shape_of("gpt_tiny"), cpu, global_batch=16, precision="32-true")
    times = [best_completion(Planner(problem), parse_layout(f"dp=1,tp=2,pp=1,mb=16,sp={sp}")).time for sp in ("true", "false")]
    shape = shape_of("gpt_tiny")
    replicated = shape.n_layer * shape.layer_replicated_params + shape.hidden * (2 if shape.bias else 1)
    group = Group(2, 1, cpu.intra_node_gb_per_s, latency_us=400.0)
    assert times[0]["partial_grad_sum"] == pytest.approx(collective_cost("all_reduce", replicated * 4.0, group).seconds, rel=1e-9)
    assert "partial_grad_sum" not in times[1]


def test_plan_measure_runs_the_top_layouts_here(capsys: pytest.CaptureFixture[str]) -> None:
    """``plan --measure K``: the top K fitting layouts run on CPU processes (one accumulates its
    micro-batches), each row with a measured step and model state, the state equal to the prediction;
    a GPU cluster is refused before anything runs."""
    from lightning_3d.apps.cli import main

    tiny = ["model=gpt_tiny", "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "data.global_batch_size=4", "trainer.precision=32-true"]
    assert main(["plan", *tiny, "cluster=local_cpu", "cluster.devices_per_node=2", "--format", "json", "--measure", "2", "--measure-steps", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["measured"]) == 2 and any(p["micro_batches"] > 1 and p["layout"]["pp"] == 1 for p in report["plan"][:2])
    for row in report["measured"]:
        assert row["measured_step_s"] > 0 and row["measured_state_mb"] == pytest.approx(row["predicted_state_mb"], rel=0.01)
    assert main(["plan", *tiny, "cluster=h100_80g_1node", "--measure", "1"]) == 2
    assert "--measure runs the layouts here, on CPU processes" in capsys.readouterr().err


def test_measured_model_state_is_its_peak_before_the_step() -> None:
    """ZeRO-2 frees its reduced gradient slice after each step: a model state read at the end of training
    missed it and made the planner look 25% high. The runner reads the state just before each optimizer
    step (gradients and, from step 2, the optimizer state held at once) and keeps the largest."""
    from lightning_3d.apps.measure import measure
    from lightning_3d.planner import problem_from_config

    cfg = compose_config(["model=gpt_tiny", "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "data.global_batch_size=4",
                          "trainer.precision=32-true", "cluster=local_cpu", "cluster.devices_per_node=2"])
    recipe = OmegaConf.to_container(cfg, resolve=True)
    recipe.pop("hydra", None)
    problem = problem_from_config(cfg)
    estimate = best_completion(Planner(problem), parse_layout("dp=2,tp=1,pp=1,mb=2,zero=2"))
    (row,) = measure(problem, [estimate], recipe, 1)
    assert row["measured_state_mb"] == pytest.approx(row["predicted_state_mb"], rel=0.01)


def test_profile_measures_this_machine_and_writes_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_3d.apps.cli import main

    assert main(["profile", "--quick", "--name", "here", "--out", str(tmp_path)]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    measured = report["measured"]
    assert min(measured["gemm_tflops"].values()) > 0 and measured["copy_gb_per_s"] > 0
    assert measured["layer_overhead_s"] > 0 and measured["step_s"] > 0 and len(measured["zero3_steps"][0]) == 4
    assert all(r["bus_gb_per_s"] > 0 for r in measured["all_reduce"].values())
    assert load_cluster(compose(f"hydra.searchpath=[file://{tmp_path}]", "cluster=here").cluster).devices_per_node == 2
    with pytest.raises(SystemExit):  # Hydra would compose the shipped cluster of that name instead
        main(["profile", "--quick", "--name", "local_cpu", "--out", str(tmp_path)])
    assert "a shipped cluster has that name" in capsys.readouterr().err


def test_tensor_parallel_collectives_carry_the_activation_precisions_bytes() -> None:
    """fp32 activations are 4 bytes: the tp all-reduces of a 32-true run move twice a bf16 run's (the
    planner had charged 2 bytes whatever the precision). Bandwidth-bound sizes, so twice the time."""
    cluster = cluster_of("h100_80g_1node")
    layout = Layout(dp=1, tp=8, pp=1, micro_batch_size=4)
    times = {
        precision: Planner(Problem(shape_of("gpt3_175b", seq_len=2048), cluster, 8, precision=precision)).evaluate(layout).time["tp_comm"]
        for precision in ("bf16-mixed", "32-true")
    }
    assert times["32-true"] == pytest.approx(2 * times["bf16-mixed"], rel=0.1)


def test_the_fp32_loss_backward_is_counted_with_the_buffers_of_the_head_stage():
    """The loss runs in fp32 whatever the parameters' precision: 3 fp32 logits-sized tensors at its
    backward, of which activation_bytes already keeps 2 x c bytes per element."""
    from lightning_3d.planner.memory import ActivationOptions, loss_transient_bytes

    shape = ModelShape(n_layer=2, hidden=64, n_head=4, n_kv_head=4, ffn=256, vocab=1000, seq_len=128)
    elements = 128 * 2 * 1000 / 4  # tokens of a micro-batch of 2, the vocabulary split over tp = 4
    assert loss_transient_bytes(shape, 2, ActivationOptions(tp=4, bytes_per_element=2.0)) == pytest.approx(8.0 * elements)
    assert loss_transient_bytes(shape, 2, ActivationOptions(tp=4, bytes_per_element=4.0)) == pytest.approx(4.0 * elements)
