"""Streaming export to Hugging Face directories: the safetensors writer (headers first, one tensor at a
time, HF shard names and index, staged output), and ``export_hf`` from sharded checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_3d.checkpoint.safetensors_format import INDEX_NAME, SINGLE_NAME, read_header
from lightning_3d.checkpoint.safetensors_write import TensorInfo, parse_size, plan_shards, staged_directory, write_sharded

safetensors_torch = pytest.importorskip("safetensors.torch")


# -- the writer ------------------------------------------------------------------------------------------
def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(30, 40, generator=g),
        "b.bias": torch.randn(50, generator=g).bfloat16(),
        "c.mask": torch.tensor([True, False, True]),
        "d.ids": torch.arange(7),
        "e.weight": torch.randn(20, 10, generator=g).t(),  # non-contiguous input
        "f.empty": torch.zeros(0, 3, dtype=torch.float16),
        "g.scalar": torch.tensor(2.5),
    }


def _write(out: Path, tensors: dict[str, torch.Tensor], max_shard_size) -> dict:
    infos = [TensorInfo(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()]
    produced: list[str] = []

    def produce(info: TensorInfo) -> torch.Tensor:
        produced.append(info.name)
        return tensors[info.name]

    with staged_directory(out) as tmp:
        result = write_sharded(tmp, infos, produce, max_shard_size)
    assert produced == list(tensors)  # each tensor asked for once, in order
    return result


def test_parse_size() -> None:
    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MB") == 500 * 10**6 and parse_size("2GiB") == 2 * 2**30
    assert parse_size(1234) == 1234 and parse_size("1.5kb") == 1500
    for bad in ("5 parsecs", "-1MB", 0, "", True):
        with pytest.raises(ValueError, match="max_shard_size"):
            parse_size(bad)


def test_plan_shards_splits_in_order_and_isolates_huge_tensors() -> None:
    infos = [TensorInfo(n, torch.float32, (s,)) for n, s in [("a", 10), ("b", 10), ("c", 100), ("d", 5)]]
    assert [[i.name for i in g] for g in plan_shards(infos, 80)] == [["a", "b"], ["c"], ["d"]]


def test_single_file_when_it_fits(tmp_path: Path) -> None:
    tensors = _tensors()
    result = _write(tmp_path / "hf", tensors, "5GB")
    assert result["files"] == [SINGLE_NAME] and sorted(p.name for p in (tmp_path / "hf").iterdir()) == [SINGLE_NAME]
    loaded = safetensors_torch.load_file(tmp_path / "hf" / SINGLE_NAME)
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], v) for k, v in tensors.items())
    header, start = read_header(tmp_path / "hf" / SINGLE_NAME)
    assert start % 8 == 0 and header["b.bias"]["dtype"] == "BF16"


def test_shards_and_index_like_save_pretrained(tmp_path: Path) -> None:
    tensors = _tensors()
    result = _write(tmp_path / "hf", tensors, 500)  # a.weight (4800 bytes) and e.weight (800) alone
    files = result["files"]
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((tmp_path / "hf" / INDEX_NAME).read_text())
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in tensors.values())
    assert set(index["weight_map"]) == set(tensors) and set(index["weight_map"].values()) == set(files)
    for name, file in index["weight_map"].items():
        assert torch.equal(safetensors_torch.load_file(tmp_path / "hf" / file)[name], tensors[name])


def test_a_failed_export_leaves_the_previous_one(tmp_path: Path) -> None:
    tensors = _tensors()
    _write(tmp_path / "hf", tensors, "5GB")
    before = (tmp_path / "hf" / SINGLE_NAME).read_bytes()
    infos = [TensorInfo(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()]
    with pytest.raises(ValueError, match="header says"):
        with staged_directory(tmp_path / "hf") as tmp:
            write_sharded(tmp, infos, lambda info: torch.zeros(1), "5GB")  # wrong shape mid-write
    assert (tmp_path / "hf" / SINGLE_NAME).read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no staging directory left behind


def test_an_unrelated_directory_is_never_replaced(tmp_path: Path) -> None:
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match=r"holds files an export does not write \(todo.txt\)"):
        _write(tmp_path / "notes", _tensors(), "5GB")
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"


def test_a_model_directory_with_the_users_files_is_never_replaced(tmp_path: Path) -> None:
    """Issue 32: exporting into a cloned model repository (config.json and weights, but also .git, a
    README and notes) deleted them with the old export. Only a directory of export files is replaced."""
    repo = tmp_path / "repo"
    _write(repo, _tensors(), "5GB")  # a previous export: replaced freely
    _write(repo, _tensors(), "5GB")
    (repo / ".git").mkdir()
    (repo / "README.md").write_text("my notes")
    with pytest.raises(FileExistsError, match=r"holds files an export does not write \(\.git, README\.md\).*delete"):
        _write(repo, _tensors(), "5GB")
    assert (repo / "README.md").read_text() == "my notes" and (repo / ".git").is_dir()


# -- export_hf from sharded checkpoints --------------------------------------------------------------------
import lightning as L  # noqa: E402

from lightning_3d import ThreeDParallelStrategy  # noqa: E402
from lightning_3d.checkpoint.hf_export import export_hf  # noqa: E402
from lightning_3d.models import GPTConfig, GPTModule  # noqa: E402
from lightning_3d.testing.harness import run_on_ranks  # noqa: E402
from tests.helpers import TINY_GPT, quiet_trainer, result_of, run_checks, tiny_data  # noqa: E402
from tests.test_tensor_parallel_training import HFCausalLM  # noqa: E402

PROBE = torch.arange(32).view(2, 16) * 7 % 256
LLAMA = dict(TINY_GPT, n_head=4, n_kv_head=2, ffn_hidden=64, mlp="swiglu", norm="rmsnorm", position="rope",
             bias=False, tie_embeddings=False, rope_theta=5000.0)


def _train_and_save(path: str, config: dict, steps: int = 2, **strategy) -> list:
    """A few steps at the given layout, a sharded checkpoint, and the logits of PROBE after."""
    L.seed_everything(0)
    trainer = quiet_trainer(max_steps=steps, limit_val_batches=0, strategy=ThreeDParallelStrategy(**strategy))
    module = GPTModule(GPTConfig(**config), lr=3e-3, warmup_steps=1)
    trainer.fit(module, tiny_data(global_batch_size=8))
    trainer.save_checkpoint(path)
    module.eval()
    with torch.no_grad():
        return module(PROBE).tolist()


def _train_hf_and_save(tmp: str, kind: str) -> list:
    """A Hugging Face model trained inside a LightningModule at tp2; its config saved for ``hf_config``."""
    L.seed_everything(0)
    trainer = quiet_trainer(max_steps=2, limit_val_batches=0, strategy=ThreeDParallelStrategy(tensor_parallel=2))
    module = HFCausalLM(kind)
    trainer.fit(module, tiny_data(global_batch_size=8))
    trainer.save_checkpoint(f"{tmp}/hf_{kind}.ckpt")
    if torch.distributed.get_rank() == 0:
        type(module.model.config)(**module.model.config.to_dict()).save_pretrained(f"{tmp}/hf_{kind}_config")
    module.model.eval()
    with torch.no_grad():
        return module.model(input_ids=PROBE).logits.tolist()  # gathered over tp by the plan


def _saving_world(tmp: str) -> dict:
    return run_checks({
        "gpt2": lambda: _train_and_save(f"{tmp}/gpt2.ckpt", TINY_GPT, tensor_parallel=2),
        "llama": lambda: _train_and_save(f"{tmp}/llama.ckpt", LLAMA, tensor_parallel=2),
        "hf_llama": lambda: _train_hf_and_save(tmp, "llama"),
        "hf_gpt2": lambda: _train_hf_and_save(tmp, "gpt2"),
    })


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    tmp = str(tmp_path_factory.mktemp("tp2"))
    results = run_on_ranks(_saving_world, 2, tmp, timeout=300)[0]
    return {"dir": tmp, **{name: result_of(results, name) for name in ("gpt2", "llama", "hf_llama", "hf_gpt2")}}


def _hf_logits(directory: Path, cls_name: str) -> torch.Tensor:
    import transformers

    model = getattr(transformers, cls_name).from_pretrained(str(directory), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=PROBE).logits


def test_gpt_exports_as_gpt2_streaming(saved, tmp_path: Path) -> None:
    out = export_hf(f"{saved['dir']}/gpt2.ckpt", tmp_path / "hf", max_shard_size="40KB")
    assert out["model_type"] == "gpt2" and len(out["files"]) > 1 and (tmp_path / "hf" / INDEX_NAME).is_file()
    torch.testing.assert_close(_hf_logits(tmp_path / "hf", "GPT2LMHeadModel"), torch.tensor(saved["gpt2"]), atol=1e-5, rtol=1e-5)


def test_hf_models_trained_here_export_with_their_config(saved, tmp_path: Path) -> None:
    """HF Llama (GQA, tied) with --hf-config; HF GPT-2 at tp2 (Conv1D: TPSpec.transposed) from the config
    the manifest recorded."""
    llama = export_hf(f"{saved['dir']}/hf_llama.ckpt", tmp_path / "llama", hf_config=f"{saved['dir']}/hf_llama_config/config.json")
    assert llama["config_from"].startswith("hf_config") and llama["files"] == [SINGLE_NAME]
    assert "lm_head.weight" not in read_header(tmp_path / "llama" / SINGLE_NAME)[0]  # tied: written once, as HF does
    torch.testing.assert_close(_hf_logits(tmp_path / "llama", "LlamaForCausalLM"), torch.tensor(saved["hf_llama"]), atol=1e-5, rtol=1e-5)
    gpt2 = export_hf(f"{saved['dir']}/hf_gpt2.ckpt", tmp_path / "gpt2")
    assert gpt2["config_from"] == "the checkpoint's recorded config"
    torch.testing.assert_close(_hf_logits(tmp_path / "gpt2", "GPT2LMHeadModel"), torch.tensor(saved["hf_gpt2"]), atol=1e-5, rtol=1e-5)


def test_llama_style_gpt_exports_as_llama(saved, tmp_path: Path) -> None:
    """GQA, rotary (rope_theta 5000), SwiGLU, RMSNorm, no biases, untied head, trained and saved at tp2."""
    out = export_hf(f"{saved['dir']}/llama.ckpt", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert out["model_type"] == "llama" and config["num_key_value_heads"] == 2 and config["rope_parameters"]["rope_theta"] == 5000.0
    assert not config["tie_word_embeddings"] and not config["attention_bias"]
    torch.testing.assert_close(_hf_logits(tmp_path / "hf", "LlamaForCausalLM"), torch.tensor(saved["llama"]), atol=1e-5, rtol=1e-5)


def test_cli_export_copies_the_tokenizer_and_casts(saved, tmp_path: Path, capsys) -> None:
    from lightning_3d.apps.cli import main

    tok = tmp_path / "tok"
    tok.mkdir()
    files = {"tokenizer.json": "{}", "tokenizer_config.json": "{}", "merges.txt": "#", "vocab.json": "{}", "generation_config.json": "{}"}
    for name, text in files.items():
        (tok / name).write_text(text)
    (tok / "notes.txt").write_text("not a tokenizer file")
    out = tmp_path / "hf"
    assert main(["export", f"{saved['dir']}/gpt2.ckpt", str(out), "--tokenizer", str(tok), "--max-shard-size", "60000", "--dtype", "bf16"]) == 0
    assert set(files) <= {p.name for p in out.iterdir()} and not (out / "notes.txt").exists()
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    index = json.loads((out / INDEX_NAME).read_text())
    assert {read_header(out / f)[0]["transformer.wte.weight"]["dtype"] for f in [index["weight_map"]["transformer.wte.weight"]]} == {"BF16"}
    capsys.readouterr()
    assert main(["export", f"{saved['dir']}/gpt2.ckpt", str(tmp_path / "x"), "--tokenizer", str(tmp_path)]) == 2
    assert "holds no tokenizer files" in capsys.readouterr().err and not (tmp_path / "x").exists()


# -- memory: streaming, not the model -----------------------------------------------------------------------
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from dataclasses import asdict  # noqa: E402

from lightning_3d.checkpoint.sharded import RankShard, build_manifest, publish, temporary_dir, write_rank_shard  # noqa: E402
from lightning_3d.models import GPT  # noqa: E402
from lightning_3d.tensor_parallel.spec import spec_record  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def write_checkpoint(path: Path, config: GPTConfig, ranks: int = 2, hparams: dict | None = None) -> dict[str, int]:
    """A GPTModule sharded checkpoint written directly (no training): random weights."""
    with torch.device("meta"):
        shapes = {f"model.{k}": tuple(v.shape) for k, v in GPT(config).state_dict().items()}
    return write_shapes(path, shapes, {"config": asdict(config)} if hparams is None else hparams, ranks)


def write_shapes(path: Path, shapes: dict[str, tuple[int, ...]], hparams: dict, ranks: int = 2) -> dict[str, int]:
    """A sharded checkpoint of random tensors, every tensor cut into ``ranks`` flat ranges in separate
    rank files, as ZeRO-1/2 writes them."""
    shards = [RankShard(r) for r in range(ranks)]
    g = torch.Generator().manual_seed(0)
    largest = 0
    for name, shape in shapes.items():
        flat = torch.randn(torch.Size(shape).numel(), generator=g) * 0.02
        largest = max(largest, flat.numel() * 4)
        bounds = [flat.numel() * r // ranks for r in range(ranks + 1)]
        for r in range(ranks):
            shards[r].add("model", name, spec_record(None, shape), list(shape), bounds[r], bounds[r + 1], flat[bounds[r] : bounds[r + 1]])
    tmp = temporary_dir(path, "t", "memtest")
    tmp.mkdir(parents=True)
    written = [write_rank_shard(tmp, s) for s in shards]
    model = {"class": "lightning_3d.models.gpt.GPTModule", "config": {}}
    publish(tmp, path, build_manifest(0, {"ranks": ranks}, written, [], "memtest", model), {"hyper_parameters": hparams})
    return {"bytes": sum(torch.Size(s).numel() * 4 for s in shapes.values()), "largest": largest}


def test_export_memory_follows_the_largest_tensor_not_the_model(tmp_path: Path) -> None:
    """A 239 MB checkpoint (GPT-2 architecture, 4 x 1024, untied; largest tensor 16.8 MB) exported into
    50 MB shards in a fresh process. Measured on the 2-core CI box: peak RSS growth 42 MB for the
    streaming export (2.5x the largest tensor: its pieces, the assembled tensor and the fused c_attn's
    concatenation) and 99 MB for the first export of the process (transformers' model modules imported
    on the way); before rank files were unmapped after each tensor, their read pages stayed resident and
    the growth was 240 MB, the whole model."""
    config = GPTConfig(vocab_size=4096, block_size=1024, n_layer=4, n_head=16, n_embd=1024, tie_embeddings=False)
    sizes = write_checkpoint(tmp_path / "big.ckpt", config)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "scripts" / "export_memory.py"), str(tmp_path / "big.ckpt"), str(tmp_path / "out"), "50MB"],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["bytes"] == sizes["bytes"] and len(result["files"]) == 7
    assert result["growth"] < 3 * sizes["largest"] + 48 * 2**20, result
    assert result["first_growth"] < 0.6 * sizes["bytes"], result
    index = json.loads((tmp_path / "out" / "second" / INDEX_NAME).read_text())
    first = safetensors_torch.load_file(tmp_path / "out" / "second" / index["weight_map"]["lm_head.weight"])
    assert first["lm_head.weight"].shape == (4096, 1024)


# -- refusals ------------------------------------------------------------------------------------------------
TINY = dict(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16)


def test_what_no_hugging_face_model_computes_is_refused(tmp_path: Path) -> None:
    mixed = GPTConfig(**TINY, position="rope")  # rotary positions with LayerNorm and GELU
    write_checkpoint(tmp_path / "mixed.ckpt", mixed)
    with pytest.raises(ValueError, match="and not Llama architecture") as err:
        export_hf(tmp_path / "mixed.ckpt", tmp_path / "hf")
    assert "position='rope' (GPT-2: 'learned')" in str(err.value) and "norm='layernorm' (Llama: 'rmsnorm')" in str(err.value)
    assert not (tmp_path / "hf").exists()


def test_unknown_models_wrong_prefixes_and_mismatched_configs_are_refused(tmp_path: Path) -> None:
    config = GPTConfig(**TINY)
    write_checkpoint(tmp_path / "plain.ckpt", config, hparams={})
    with pytest.raises(ValueError, match="cannot tell which Hugging Face model this checkpoint holds"):
        export_hf(tmp_path / "plain.ckpt", tmp_path / "hf")
    write_checkpoint(tmp_path / "gpt.ckpt", config)
    with pytest.raises(ValueError, match="is not in the checkpoint; check prefix="):
        export_hf(tmp_path / "gpt.ckpt", tmp_path / "hf", prefix="net.")
    import transformers

    small = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    with torch.device("meta"):
        shapes = {f"model.{k}": tuple(v.shape) for k, v in transformers.GPT2LMHeadModel(small).state_dict().items()}
    write_shapes(tmp_path / "hf_gpt2.ckpt", {k: v for k, v in shapes.items() if "lm_head" not in k}, {})
    transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2).save_pretrained(tmp_path / "wide")
    with pytest.raises(ValueError, match="the export does not match gpt2's Hugging Face model") as err:
        export_hf(tmp_path / "hf_gpt2.ckpt", tmp_path / "hf", hf_config=tmp_path / "wide")
    assert "transformer.wte.weight: [64, 16] (expected [64, 32])" in str(err.value)
    with pytest.raises(ValueError, match="is not a size"):
        export_hf(tmp_path / "gpt.ckpt", tmp_path / "hf", max_shard_size="lots")
    assert not (tmp_path / "hf").exists()


def test_init_from_in_the_hyper_parameters_gives_the_config(tmp_path: Path) -> None:
    """A checkpoint of a model built by ``from_pretrained`` (HFCausalLMModule): config.json of ``init_from``
    with the run's ``config_overrides``; the tensors are written as stored."""
    import transformers

    from lightning_3d.checkpoint.sharded import ShardedCheckpoint

    transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2).save_pretrained(tmp_path / "base")
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(transformers.AutoConfig.from_pretrained(tmp_path / "base"))
    shapes = {f"model.{k}": tuple(v.shape) for k, v in model.state_dict().items() if k != "lm_head.weight"}
    write_shapes(tmp_path / "ft.ckpt", shapes, {"init_from": str(tmp_path / "base"), "config_overrides": {"attn_pdrop": 0.25}})
    out = export_hf(tmp_path / "ft.ckpt", tmp_path / "hf")
    assert out["config_from"] == f"init_from={tmp_path / 'base'}"
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["attn_pdrop"] == 0.25
    written = safetensors_torch.load_file(tmp_path / "hf" / SINGLE_NAME)
    stored = ShardedCheckpoint(tmp_path / "ft.ckpt")
    assert written.keys() == {k[len("model.") :] for k in shapes}
    assert all(torch.equal(v, stored.dense("model", "model." + k)) for k, v in written.items())
