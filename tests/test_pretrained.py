"""from_pretrained: slice math, the safetensors slice reader, the meta build, clear errors; per-rank
memory when loading into tp2 x pp2; the first loss of a loaded model equals Hugging Face's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import lightning as L
import pytest
import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from lightning_3d.checkpoint.pretrained import (
    SOURCE_ATTR,
    from_pretrained,
    load_pretrained_,
    local_slice_index,
    meta_parameters,
)
from lightning_3d.checkpoint.safetensors_format import INDEX_NAME
from lightning_3d.checkpoint.safetensors_read import SafetensorsFile, read_slice
from lightning_3d.tensor_parallel.spec import TPSpec, padded, set_spec, shard_tensor


# -- slice math ------------------------------------------------------------------------------------------
def _take(dense: Tensor, index: list[Optional[Tensor]]) -> Tensor:
    """``dense`` at per-dimension indices, -1 giving zeros (what the reader must return)."""
    out = dense
    for dim, idx in enumerate(index):
        if idx is None:
            continue
        out = out.index_select(dim, idx.clamp(min=0))
        shape = [1] * out.dim()
        shape[dim] = -1
        out = out.masked_fill((idx < 0).view(shape), 0)
    return out


def _local_from_index(dense: Tensor, spec: Optional[TPSpec], rows: Optional[tuple[int, int]] = None) -> Tensor:
    index, transposed = local_slice_index(tuple(dense.shape), spec, rows)
    got = _take(dense, index)
    return got.t() if transposed else got


def _dp_chunk(local: Tensor, dp: int, r: int) -> tuple[Tensor, tuple[int, int]]:
    """FSDP2's dim-0 chunk of a tp-local tensor for dp rank r (torch.chunk semantics), and its rows."""
    per = -(-local.shape[0] // dp)
    first = min(local.shape[0], r * per)
    chunk = local[first : first + per]
    return chunk, (first, chunk.shape[0])


SPEC_CASES = {
    # name: (dense shape, spec fields)
    "column": ((12, 5), dict(dim=0)),
    "column_qkv": ((18, 5), dict(dim=0, num_blocks=3)),
    "row": ((5, 12), dict(dim=1)),
    "vocab_padded": ((11, 4), dict(dim=0, padded=True)),
    "vocab_head_padded": ((7, 4), dict(dim=0, padded=True)),
    "transposed_column": ((5, 12), dict(dim=0, transposed=True)),  # Conv1D [in, out], held [out/tp, in]
    "transposed_qkv": ((5, 18), dict(dim=0, num_blocks=3, transposed=True)),
    "transposed_row": ((12, 5), dict(dim=1, transposed=True)),  # Conv1D c_proj [in, out], held [out, in/tp]
    "replicated_1d": ((6,), dict(dim=None)),
}


@pytest.mark.parametrize("case", sorted(SPEC_CASES))
@pytest.mark.parametrize("world", [2, 3])
def test_slice_index_equals_shard_tensor(case: str, world: int) -> None:
    shape, fields = SPEC_CASES[case]
    fields = dict(fields)
    dense = torch.randn(shape)
    transposed = fields.pop("transposed", False)
    layout = dense.t() if transposed else dense
    dim = fields["dim"]
    if dim is not None and not fields.pop("padded", False) and layout.shape[dim] % (world * fields.get("num_blocks", 1)):
        pytest.skip("not divisible (the layers refuse it)")
    for rank in range(world):
        padded_size = padded(layout.shape[dim], world) if dim is not None and case.startswith("vocab") else None
        spec = TPSpec(
            dim=dim, world=world, rank=rank, full_shape=tuple(shape), padded_size=padded_size,
            num_blocks=fields.get("num_blocks", 1), transposed=transposed,
        )
        expected = layout if dim is None else shard_tensor(layout, dim, world, rank, spec.num_blocks, padded_size)
        assert torch.equal(_local_from_index(dense, spec), expected), (case, rank)
        for dp in (2, 3):  # ZeRO-3 rows of the tp-local tensor on top
            for r in range(dp):
                chunk, rows = _dp_chunk(expected, dp, r)
                assert torch.equal(_local_from_index(dense, spec, rows), chunk), (case, rank, dp, r)


def test_padding_rows_are_minus_one() -> None:
    spec = TPSpec(dim=0, world=2, rank=1, full_shape=(5, 3), padded_size=6)
    index, transposed = local_slice_index((5, 3), spec)
    assert not transposed and index[0].tolist() == [3, 4, -1] and index[1] is None


# -- the reader -------------------------------------------------------------------------------------------
def _write_sharded(directory: Path, tensors: dict[str, Tensor], shards: int) -> dict[str, str]:
    """safetensors shards plus model.safetensors.index.json (the Hugging Face layout)."""
    names = sorted(tensors)
    weight_map: dict[str, str] = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[s::shards]}
        save_file(part, str(directory / file))
        weight_map.update({n: file for n in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (directory / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return weight_map


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sharded", [False, True])
def test_reader_matches_save_file(tmp_path: Path, dtype: torch.dtype, sharded: bool) -> None:
    torch.manual_seed(0)
    tensors = {
        "a.weight": torch.randn(37, 9).to(dtype),
        "b.weight": torch.randn(4, 6, 5).to(dtype),
        "c.bias": torch.randn(13).to(dtype),
        "scalar": torch.tensor(3.5).to(dtype),
        "wide": torch.randn(6, 1024).to(dtype),
    }
    if sharded:
        weight_map = {k: tmp_path / v for k, v in _write_sharded(tmp_path, tensors, 2).items()}
    else:
        save_file(tensors, str(tmp_path / "model.safetensors"))
        weight_map = {k: tmp_path / "model.safetensors" for k in tensors}
    rows = torch.tensor([0, 1, 2, 10, 11, 36, -1, -1, 5])
    cols = torch.tensor([8, 0, -1, 3])
    a = tensors["a.weight"]
    # small chunks: runs are read in several requests
    with SafetensorsFile(weight_map["a.weight"], chunk_bytes=3 * 9 * a.element_size()) as f:
        assert torch.equal(f.read("a.weight"), a)
        assert f.read("a.weight").dtype == dtype
        assert torch.equal(f.read("a.weight", [rows, cols]), _take(a, [rows, cols]))
        assert torch.equal(f.read("a.weight", [None, cols], dtype=torch.float64), _take(a, [None, cols]).double())
        out = torch.full((9, 37), float("nan"), dtype=torch.float32)  # a strided view (transposed target)
        f.read("a.weight", [torch.arange(37).flip(0), None], out=out.t())
        assert torch.equal(out, a.flip(0).float().t())
    b = tensors["b.weight"]
    idx = [torch.tensor([3, -1, 1]), None, torch.tensor([4, 0])]
    assert torch.equal(read_slice(weight_map["b.weight"], "b.weight", idx), _take(b, idx))
    assert torch.equal(read_slice(weight_map["c.bias"], "c.bias", [torch.tensor([12, -1, 0])]), _take(tensors["c.bias"], [torch.tensor([12, -1, 0])]))
    assert torch.equal(read_slice(weight_map["scalar"], "scalar"), tensors["scalar"])
    wide = tensors["wide"]
    with SafetensorsFile(weight_map["wide"], chunk_bytes=4096) as f:  # a row-parallel slice: column ranges only
        cols = torch.cat([torch.arange(512, 1024), torch.full((3,), -1)])
        rows = torch.tensor([5, 0, 1, -1])
        assert torch.equal(f.read("wide", [rows, cols]), _take(wide, [rows, cols]))
        assert f.bytes_read == 3 * 512 * wide.element_size()
    with SafetensorsFile(weight_map["a.weight"]) as f:
        f.read("a.weight", [torch.tensor([5, 6])])
        assert f.bytes_read == 2 * 9 * a.element_size()  # only the rows asked for
        with pytest.raises(ValueError, match=r"index of dimension 0 selects .*outside \[0, 37\)"):
            f.read("a.weight", [torch.tensor([37])])
        with pytest.raises(KeyError, match="holds no tensor 'nope'"):
            f.read("nope")


# -- building on meta; loading in one process ---------------------------------------------------------------
def _tiny_llama_config(**overrides: Any) -> Any:
    import transformers

    kwargs = dict(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
    )
    kwargs.update(overrides)
    return transformers.LlamaConfig(**kwargs)


def _tiny_gpt2_config(**overrides: Any) -> Any:
    import transformers

    kwargs = dict(vocab_size=256, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    kwargs.update(overrides)
    return transformers.GPT2Config(**kwargs)


FAMILIES = {"llama": _tiny_llama_config, "gpt2": _tiny_gpt2_config}


def save_tiny(directory: Path, family: str, seed: int = 0, **overrides: Any) -> Path:
    """A tiny seeded Hugging Face checkpoint written by save_pretrained (no hub)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(FAMILIES[family](**overrides))
    model.save_pretrained(str(directory))
    return directory


def test_meta_build_keeps_computed_buffers() -> None:
    import transformers

    config = _tiny_llama_config()
    dense = transformers.LlamaForCausalLM(config)
    with meta_parameters():
        meta = transformers.LlamaForCausalLM(config)
    assert all(p.is_meta for p in meta.parameters())
    assert meta.lm_head.weight is meta.model.embed_tokens.weight
    assert torch.equal(meta.model.rotary_emb.inv_freq, dense.model.rotary_emb.inv_freq)
    assert not any(b.is_meta for b in meta.buffers())
    assert not nn.Linear(2, 2).weight.is_meta  # the patch ends with the context


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_from_pretrained_then_load_equals_transformers(tmp_path: Path, family: str) -> None:
    import transformers

    path = save_tiny(tmp_path, family, tie_word_embeddings=False) if family == "llama" else save_tiny(tmp_path, family)
    model = from_pretrained(path)
    assert all(p.is_meta for p in model.parameters())
    assert getattr(model, SOURCE_ATTR).directory == path
    report = load_pretrained_(model, torch.device("cpu"))
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(path))
    expected = reference.state_dict()
    got = model.state_dict()
    assert got.keys() == expected.keys()
    for key in expected:
        assert torch.equal(got[key], expected[key]), key
    assert report.tensors == len(list(model.parameters())) and report.bytes_read > 0
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_dtype_and_bf16_file(tmp_path: Path) -> None:
    import transformers

    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(_tiny_llama_config())
    model.to(torch.bfloat16).save_pretrained(str(tmp_path))
    loaded = from_pretrained(tmp_path, dtype="fp32")
    load_pretrained_(loaded)
    assert loaded.model.embed_tokens.weight.dtype == torch.float32
    assert torch.equal(loaded.model.embed_tokens.weight, model.model.embed_tokens.weight.float())
    assert loaded.model.rotary_emb.inv_freq.dtype == torch.float32


def test_hub_style_keys_without_base_prefix(tmp_path: Path) -> None:
    """GPT-2 checkpoints on the hub store ``h.0...``/``wte.weight``, without ``transformer.``."""
    import transformers

    torch.manual_seed(2)
    config = _tiny_gpt2_config()
    model = transformers.GPT2LMHeadModel(config)
    state = {k.removeprefix("transformer."): v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(tmp_path / "model.safetensors"))
    config.save_pretrained(str(tmp_path))
    loaded = from_pretrained(tmp_path)
    load_pretrained_(loaded)
    assert torch.equal(loaded.transformer.h[1].attn.c_attn.weight, model.transformer.h[1].attn.c_attn.weight)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight


def test_missing_key_and_shape_mismatch_are_named(tmp_path: Path) -> None:
    import transformers

    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(_tiny_llama_config())
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    _tiny_llama_config().save_pretrained(str(tmp_path))
    missing = dict(state)
    del missing["model.layers.1.mlp.up_proj.weight"]
    save_file(missing, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"{tmp_path}.*no tensor for 1 weight.*'model\.layers\.1\.mlp\.up_proj\.weight'"):
        from_pretrained(tmp_path)
    wrong = dict(state)
    wrong["model.norm.weight"] = torch.ones(31)
    save_file(wrong, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.norm\.weight: file shape \[31\], model expects \[32\]"):
        from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        from_pretrained(tmp_path / "nowhere")
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor"):
        from_pretrained(tmp_path)


def test_unsupported_model_type_is_named(tmp_path: Path) -> None:
    import transformers

    transformers.AutoConfig.for_model("vit").save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match=r"model_type='vit'.*not a causal language model.*register_adapter"):
        from_pretrained(tmp_path)


def test_load_checks_the_local_shape(tmp_path: Path) -> None:
    """A parameter whose tensor-parallel spec does not describe it is refused by name."""
    path = save_tiny(tmp_path, "llama")
    model = from_pretrained(path)
    weight = model.model.layers[0].mlp.down_proj.weight
    set_spec(weight, TPSpec(dim=1, world=2, rank=0, full_shape=tuple(weight.shape)))  # claims a half it does not hold
    with pytest.raises(ValueError, match=r"down_proj\.weight: this rank's slice of .* has shape \[32, 32\], but the parameter holds \[32, 64\]"):
        load_pretrained_(model)


# -- memory: each rank of tp2 x pp2 reads only its quarter ----------------------------------------------------
BIG_LLAMA = dict(
    vocab_size=32000, hidden_size=512, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=4, max_position_embeddings=64, tie_word_embeddings=False,
)
# M = 185 MiB (fp32). Measured on CPU (torch 2.13, transformers 5.24, 4 ranks on 2 cores): each rank
# holds 46.3 MiB of parameters (~M/4) and its peak RSS grew by 58-61 MiB; the ~13 MiB above its share are
# the meta build, the 4 MiB read buffer and allocator slack. The bound is M/2 + 24 MiB (a rank that
# materialized the dense model, or even half of it plus its share, fails it).
LOAD_OVERHEAD_BYTES = 24 * 2**20


def _rss_bytes() -> int:
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    """This process's peak resident memory (VmHWM; ru_maxrss where /proc is missing)."""
    import resource

    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):  # pragma: no cover - Linux has /proc
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_peak_rss() -> None:
    """Start the peak at the current RSS (Linux >= 4.0), so imports before the build do not count."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:  # pragma: no cover - then the peak is conservative (includes earlier peaks)
        pass


def write_big_checkpoint(directory: Path) -> int:
    """A seeded Llama checkpoint of ~194 MB (fp32) in 3 safetensors shards with an index; its bytes."""
    import transformers

    config = transformers.LlamaConfig(**BIG_LLAMA)
    with meta_parameters():
        meta = transformers.LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(0)
    tensors = {name: torch.randn(p.shape, generator=generator) * 0.02 for name, p in meta.named_parameters()}
    _write_sharded(directory, tensors, shards=3)
    config.save_pretrained(str(directory))
    return sum(t.numel() * t.element_size() for t in tensors.values())


def tp2_pp2_load_memory(path: str) -> dict[str, Any]:
    """Build with from_pretrained, apply tp2 (Llama plan) and pp2 (this stage's layers), load; the peak
    RSS growth, then every local tensor compared with the file's tensor split by shard_like."""
    import transformers
    from safetensors import safe_open

    from lightning_3d.checkpoint.safetensors_format import weight_files
    from lightning_3d.core.topology import ParallelDims, Topology
    from lightning_3d.models.adapters.hf_generic import HF_GENERIC
    from lightning_3d.pipeline.runtime import PipelineConfig, pipeline_model
    from lightning_3d.tensor_parallel.plans import PlanContext, apply_plan
    from lightning_3d.tensor_parallel.random import RNGStatesTracker, seed_tracker
    from lightning_3d.tensor_parallel.spec import get_spec, shard_like

    topology = Topology.build(ParallelDims(dp=1, tp=2, pp=2).resolve(4))
    tracker = RNGStatesTracker("cpu")
    seed_tracker(tracker, topology.tp_rank, topology.pp_rank, 0)
    with meta_parameters():  # warm up the code paths (lazy imports, first allocations) before measuring
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**BIG_LLAMA, "vocab_size": 64, "num_hidden_layers": 1}))
    _reset_peak_rss()
    before = _rss_bytes()
    model = from_pretrained(path)
    apply_plan(model, HF_GENERIC.tp_plan(model), PlanContext(topology.tp_group, False, tracker))
    pipeline_model(model, HF_GENERIC.layer_sequence(model), topology, PipelineConfig())
    report = load_pretrained_(model, torch.device("cpu"))
    growth = _peak_rss_bytes() - before
    local_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    files = weight_files(path)
    wrong = []
    for name, p in model.named_parameters():
        with safe_open(str(files[name]), "pt") as f:
            dense = f.get_tensor(name)
        spec = get_spec(p)
        if not torch.equal(p.detach(), shard_like(dense, spec) if spec is not None else dense):
            wrong.append(name)
    return {
        "growth": growth, "local_bytes": local_bytes, "bytes_read": report.bytes_read, "wrong": wrong,
        "names": sorted(n for n, _ in model.named_parameters()), "seconds": report.seconds,
    }


def test_tp2_pp2_load_reads_only_each_ranks_quarter(tmp_path: Path) -> None:
    from lightning_3d.testing.harness import run_on_ranks

    m_bytes = write_big_checkpoint(tmp_path)
    assert 180e6 < m_bytes < 220e6
    results = run_on_ranks(tp2_pp2_load_memory, 4, str(tmp_path), timeout=120)
    stages = [set(r["names"]) for r in results]
    assert "model.embed_tokens.weight" in stages[0] and "lm_head.weight" not in stages[0]  # ranks 0, 1: stage 0
    assert "lm_head.weight" in stages[3] and "model.embed_tokens.weight" not in stages[3]  # ranks 2, 3: stage 1
    for rank, r in enumerate(results):
        assert r["wrong"] == [], (rank, r["wrong"])
        assert r["local_bytes"] < 0.27 * m_bytes, (rank, r["local_bytes"])
        assert r["bytes_read"] == r["local_bytes"], (rank, r["bytes_read"])  # fp32 file into fp32: nothing more
        assert r["growth"] < m_bytes / 2 + LOAD_OVERHEAD_BYTES, (rank, r["growth"], m_bytes)
    print("peak RSS growth per rank (MB):", [round(r["growth"] / 2**20, 1) for r in results], "M:", round(m_bytes / 2**20, 1))


# -- parity: the first loss of a loaded model equals Hugging Face's in one process -----------------------------
class FirstBatch(L.Callback):
    """Keeps this rank's first training batch (its input ids)."""

    def __init__(self) -> None:
        self.input_ids: Optional[list[list[int]]] = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if self.input_ids is None:
            self.input_ids = batch[0].tolist()


def pretrained_losses(root: str, family: str, layout: dict[str, Any], steps: int = 1) -> dict[str, Any]:
    """``steps`` fine-tuning steps of the tiny ``family`` checkpoint under ``root`` with ``layout``
    (ThreeDParallelStrategy keywords): this rank's losses and first batch."""
    from lightning_3d import ThreeDParallelStrategy
    from lightning_3d.models.hf_module import HFCausalLMModule
    from tests.helpers import LossRecorder, quiet_trainer, tiny_data

    L.seed_everything(0)
    recorder, first = LossRecorder(), FirstBatch()
    trainer = quiet_trainer(
        max_steps=steps, limit_val_batches=0, callbacks=[recorder, first], strategy=ThreeDParallelStrategy(**layout)
    )
    trainer.fit(HFCausalLMModule(str(Path(root) / family), lr=1e-3), tiny_data(global_batch_size=8))
    return {"losses": recorder.losses, "input_ids": first.input_ids}


def parity_world(root: str, cases: dict[str, tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """Every case (family, layout) in one world, one after the other."""
    from tests.helpers import run_checks

    return run_checks({name: (lambda f=family, l=layout: pretrained_losses(root, f, l)) for name, (family, layout) in cases.items()})


def hf_reference_loss(path: Path, input_ids: list[list[int]]) -> float:
    """Hugging Face's own loss for the batch, one process, transformers' from_pretrained."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    ids = torch.tensor(input_ids)
    with torch.no_grad():
        return float(model(input_ids=ids, labels=ids).loss)


# (family, ThreeDParallelStrategy keywords) per case; 2 ranks each
PARITY_CASES_2 = {
    "llama-tp2": ("llama", {"tensor_parallel": 2}),
    "llama-pp2": ("llama", {"pipeline_parallel": 2}),
    "llama-zero3-dp2": ("llama", {"zero_stage": 3}),
    "gpt2-tp2": ("gpt2", {"tensor_parallel": 2}),
}


# 4 ranks: ZeRO-3 shards of tensor-parallel slices (dp2 x tp2); tensor and pipeline parallel together
PARITY_CASES_4 = {
    "llama-dp2-tp2-zero3": ("llama", {"tensor_parallel": 2, "zero_stage": 3}),
    "gpt2-tp2-pp2": ("gpt2", {"tensor_parallel": 2, "pipeline_parallel": 2}),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hf")
    save_tiny(root / "llama", "llama", seed=11)  # GQA (4 heads, 2 kv heads), tied embeddings
    save_tiny(root / "gpt2", "gpt2", seed=12)  # Conv1D weights [in, out]: transposed slices under tp
    return root


@pytest.fixture(scope="module")
def parity2(checkpoints: Path) -> list[dict[str, Any]]:
    from lightning_3d.testing.harness import run_on_ranks

    return run_on_ranks(parity_world, 2, str(checkpoints), PARITY_CASES_2, timeout=240)


@pytest.fixture(scope="module")
def parity4(checkpoints: Path) -> list[dict[str, Any]]:
    from lightning_3d.testing.harness import run_on_ranks

    return run_on_ranks(parity_world, 4, str(checkpoints), PARITY_CASES_4, timeout=240)


def _check_parity(worlds: list[dict[str, Any]], checkpoints: Path, family: str, case: str) -> None:
    """Every rank's first loss is transformers' loss on the batch that rank trained on."""
    from tests.helpers import result_of

    for rank, results in enumerate(worlds):
        run = result_of(results, case)
        expected = hf_reference_loss(checkpoints / family, run["input_ids"])
        assert run["losses"][0] == pytest.approx(expected, rel=1e-5), (case, rank)


@pytest.mark.parametrize("case", sorted(PARITY_CASES_2))
def test_first_loss_equals_transformers(parity2: list[dict[str, Any]], checkpoints: Path, case: str) -> None:
    _check_parity(parity2, checkpoints, PARITY_CASES_2[case][0], case)


@pytest.mark.parametrize("case", sorted(PARITY_CASES_4))
def test_first_loss_equals_transformers_4_ranks(parity4: list[dict[str, Any]], checkpoints: Path, case: str) -> None:
    _check_parity(parity4, checkpoints, PARITY_CASES_4[case][0], case)


# -- recipes and the CLI: model.init_from ------------------------------------------------------------------
def test_recipe_init_from_builds_the_hf_module(tmp_path: Path) -> None:
    from lightning_3d.apps.recipe import build_model
    from lightning_3d.core.compose import compose_config
    from lightning_3d.models import GPTModule
    from lightning_3d.models.hf_module import HFCausalLMModule

    path = save_tiny(tmp_path / "llama", "llama")
    module = build_model(compose_config([f"model.init_from={path}", "optim.lr=1e-4"]))
    assert isinstance(module, HFCausalLMModule)
    assert module.hparams.init_from == str(path) and module.hparams.lr == 1e-4
    module.configure_model()
    assert getattr(module.model, SOURCE_ATTR).directory == path and all(p.is_meta for p in module.model.parameters())
    assert isinstance(build_model(compose_config([])), GPTModule)  # init_from: null keeps the GPT
    with pytest.raises(FileNotFoundError, match=r"model\.init_from=.*not a Hugging Face model directory.*ckpt_path"):
        build_model(compose_config([f"model.init_from={tmp_path / 'nowhere'}"]))
    with pytest.raises(ValueError, match=r"parallel=auto plans the GPT"):
        build_model(compose_config([f"model.init_from={path}", "parallel=auto"]))


def test_cli_picks_the_hf_module_for_init_from(tmp_path: Path) -> None:
    from lightning_3d.apps.cli import _init_from_given

    assert _init_from_given(["fit", "--model.init_from=/x"]) and _init_from_given(["fit", "--model.init_from", "/x"])
    assert not _init_from_given(["fit", "--model.lr=1e-3"])
    config = tmp_path / "run.yaml"
    config.write_text("model:\n  init_from: /x\n")
    assert _init_from_given(["fit", "--config", str(config)]) and _init_from_given(["fit", f"--config={config}"])
    config.write_text("model:\n  lr: 0.1\n")
    assert not _init_from_given(["fit", "--config", str(config)])


def test_a_weight_file_cut_in_half_is_named_before_anything_is_built(tmp_path: Path) -> None:
    """Issue 32: a truncated model.safetensors surfaced as "Cannot copy out of meta tensor" at the end."""
    path = save_tiny(tmp_path, "llama")
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"model.safetensors is cut short: its header describes \d+ bytes, the file has \d+; download it again"):
        from_pretrained(path)
