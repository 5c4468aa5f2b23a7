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
    with pytest.raises(FileExistsError, match="does not look like a Hugging Face model directory"):
        _write(tmp_path / "notes", _tensors(), "5GB")
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"
