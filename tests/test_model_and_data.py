"""The reference GPT and the datasets, in one process."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_3d.data import TokenWindows, prepare_byte_tokens, read_token_file, split_tokens, stdlib_bytes
from lightning_3d.data.corpus import stdlib_source_files
from lightning_3d.models import GPT, GPTConfig, GPTModule
from lightning_3d.models.gpt import warmup_cosine

SMALL = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=16)


def test_parameter_count_formula_matches_the_module():
    for config in (SMALL, GPTConfig(bias=False), GPTConfig(tie_embeddings=False, ffn_hidden=100, n_layer=3)):
        model = GPT(config)
        assert sum(p.numel() for p in model.parameters()) == config.num_parameters()


def test_embedding_and_head_are_tied():
    model = GPT(SMALL)
    assert model.lm_head.weight is model.wte.weight
    assert GPT(GPTConfig(tie_embeddings=False)).lm_head.weight is not None


def test_attention_is_causal():
    torch.manual_seed(0)
    model = GPT(SMALL).eval()
    x = torch.randint(0, 256, (1, 16))
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 7) % 256  # change only the future of position 9
    with torch.no_grad():
        a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_same_seed_same_model():
    torch.manual_seed(3)
    a = GPT(SMALL)
    torch.manual_seed(3)
    b = GPT(SMALL)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_loss_falls_when_overfitting_one_batch():
    torch.manual_seed(0)
    model = GPT(SMALL)
    x = torch.randint(0, 256, (4, 17))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = None
    for _ in range(30):
        loss = model(x[:, :-1], x[:, 1:])
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.5 * first


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(n_embd=30, n_head=4), "n_embd=30 is not divisible by n_head=4"),
        (dict(n_layer=0), "n_layer=0 is invalid"),
        (dict(dropout=1.0), "dropout=1.0"),
    ],
)
def test_bad_model_config_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**kwargs)


def test_too_long_sequence_is_refused():
    with pytest.raises(ValueError, match="sequence length 17 exceeds block_size=16"):
        GPT(SMALL)(torch.zeros(1, 17, dtype=torch.long))


def test_module_builds_model_once_and_checkpoints_plain_hparams():
    module = GPTModule({"n_layer": 1, "n_embd": 16, "n_head": 2, "block_size": 8})
    module.configure_model()
    model = module.model
    module.configure_model()
    assert module.model is model  # idempotent: Lightning calls it on every fit/validate/test
    assert isinstance(module.hparams["config"], dict) and module.hparams["config"]["n_layer"] == 1


def test_warmup_cosine_schedule():
    assert warmup_cosine(0, warmup=10, total=100, min_ratio=0.1) == pytest.approx(0.1)
    assert warmup_cosine(9, warmup=10, total=100, min_ratio=0.1) == pytest.approx(1.0)
    assert warmup_cosine(10, warmup=10, total=100, min_ratio=0.1) == pytest.approx(1.0)
    assert warmup_cosine(55, warmup=10, total=100, min_ratio=0.1) == pytest.approx(0.55)
    assert warmup_cosine(100, warmup=10, total=100, min_ratio=0.1) == pytest.approx(0.1)
    assert warmup_cosine(500, warmup=10, total=100, min_ratio=0.1) == pytest.approx(0.1)


def test_stdlib_corpus_is_deterministic_real_text():
    files = stdlib_source_files()
    assert len(files) > 100 and all(f.suffix == ".py" for f in files)
    assert not any("site-packages" in f.parts for f in files)
    a, b = stdlib_bytes(50_000), stdlib_bytes(50_000)
    assert a.dtype == np.uint8 and len(a) == 50_000 and np.array_equal(a, b)
    text = a.tobytes().decode("utf-8", errors="replace")
    assert "def " in text and "import " in text


def test_token_windows_shift_targets_by_one():
    tokens = np.arange(100, dtype=np.uint16)
    ds = TokenWindows(tokens, block_size=8)
    assert len(ds) == 12  # (100 - 1) // 8
    x, y = ds[3]
    assert x.dtype == torch.int64 and x.tolist() == list(range(24, 32)) and y.tolist() == list(range(25, 33))
    train, val = split_tokens(tokens, 0.1)
    assert len(train) == 90 and len(val) == 10 and val[0] == 90


def test_prepare_writes_a_memory_mapped_token_file(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "b.txt").write_bytes(b"world")
    (tmp_path / "in" / "a.txt").write_bytes("héllo ".encode())
    (tmp_path / "in" / "skip.bin").write_bytes(b"\x00\x01")
    meta = prepare_byte_tokens([tmp_path / "in"], tmp_path / "out" / "c.bin")
    tokens, read_meta = read_token_file(tmp_path / "out" / "c.bin")
    assert meta == read_meta and meta["dtype"] == "uint16" and meta["vocab_size"] == 256
    assert isinstance(tokens, np.memmap)
    assert bytes(tokens.astype(np.uint8)) == "héllo ".encode() + b"world"  # sorted paths, .bin skipped


def test_missing_token_file_says_how_to_make_one(tmp_path):
    with pytest.raises(FileNotFoundError, match="lightning-3d prepare"):
        read_token_file(tmp_path / "nope.bin")


def test_prepare_never_overwrites_its_input_or_a_file_it_did_not_write(tmp_path):
    """Issue 32: `lightning-3d prepare X X` overwrote the text with its tokens, and a text file given as a
    token file was answered with that very command."""
    text = tmp_path / "notes.txt"
    text.write_text("keep me")
    with pytest.raises(ValueError, match="is also an input: writing it would overwrite the text"):
        prepare_byte_tokens([text], text)
    other = tmp_path / "other.bin"
    other.write_bytes(b"not ours")
    with pytest.raises(FileExistsError, match="is not a token file written by `lightning-3d prepare`"):
        prepare_byte_tokens([text], other)
    assert text.read_text() == "keep me" and other.read_bytes() == b"not ours"
    prepare_byte_tokens([text], tmp_path / "notes.bin")
    prepare_byte_tokens([text], tmp_path / "notes.bin")  # a token file of ours is replaced
    with pytest.raises(FileNotFoundError) as info:
        read_token_file(text)
    assert "is not a token file (it has no" in str(info.value) and f"prepare {tmp_path / 'notes.bin'} {text}" in str(info.value)
