"""The peer-stack bench cases (issue 36) stay registered, say why they did not run without the peers'
environment, and hand torchtitan a state dict under exactly its Llama 3 names. No stack is imported
and no timing is asserted: `make bench-peers` runs them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from lightning_3d.models import GPT, GPTConfig

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"

# torchtitan 0.3.0's Llama3Model.state_dict() at these dimensions (1 layer), printed in .venv-peers.
TORCHTITAN_KEYS = {
    "layers.0.attention.qkv_linear.wk.weight": (128, 128), "layers.0.attention.qkv_linear.wq.weight": (128, 128),
    "layers.0.attention.qkv_linear.wv.weight": (128, 128), "layers.0.attention.wo.weight": (128, 128),
    "layers.0.attention_norm.weight": (128,), "layers.0.feed_forward.w1.weight": (512, 128),
    "layers.0.feed_forward.w2.weight": (128, 512), "layers.0.feed_forward.w3.weight": (512, 128),
    "layers.0.ffn_norm.weight": (128,), "lm_head.weight": (256, 128), "norm.weight": (128,),
    "tok_embeddings.weight": (256, 128),
}


@pytest.fixture(scope="module")
def bench():
    saved = list(sys.path)
    sys.path[:0] = [str(BENCH), str(BENCH / "peers")]  # the cases import their helpers when called
    try:
        import cases
        import torchtitan_run

        yield cases, torchtitan_run
    finally:
        sys.path[:] = saved


def test_peer_cases_report_why_they_did_not_run(bench, monkeypatch):
    cases, _ = bench
    monkeypatch.setenv("L3D_PEERS_PYTHON", "/nonexistent/python")
    for name in ("deepspeed_zero_stages", "torchtitan_llama", "torchtitan_pipeline"):
        result = cases.CASES[name](1, 1)
        assert result["case"] == name and "make bench-peers" in result["not_run"]


def test_our_llama_weights_map_onto_torchtitans_names(bench):
    cases, torchtitan_run = bench
    state = GPT(GPTConfig(**dict(cases.LLAMA_BENCH_GPT, n_layer=1))).state_dict()
    mapped = torchtitan_run.our_keys_to_torchtitan(state)
    assert {k: tuple(v.shape) for k, v in mapped.items()} == TORCHTITAN_KEYS
    with pytest.raises(KeyError, match="blocks.0.mystery"):
        torchtitan_run.our_keys_to_torchtitan({"blocks.0.mystery.weight": state["lm_head.weight"]})


def test_torchtitan_stages_hold_our_uniform_cut(bench):
    _, torchtitan_run = bench
    assert torchtitan_run.stage_modules(4, 2) == [["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "layers.3", "norm", "lm_head"]]
    assert torchtitan_run.stage_modules(5, 4) == [
        ["tok_embeddings", "layers.0", "layers.1"], ["layers.2"], ["layers.3"], ["layers.4", "norm", "lm_head"]
    ]
