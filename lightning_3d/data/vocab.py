"""Does the data fit the model's vocabulary? Found duck-typed, for any model family.

Token ids at or past the model's vocabulary are a silent error under tensor parallelism (the
vocab-parallel embedding would look up padding rows or nothing) and a bare ``IndexError`` without
it. The data module compares the token file's ``vocab_size`` with the model's at set-up, and every
window is checked on the host as it is read (no device sync).

The model's vocabulary size is looked up without importing any model: the input embedding a model
exposes (``get_input_embeddings()``, the Hugging Face convention; a tensor-parallel embedding reports
its full, unpadded ``num_embeddings``), else ``config.vocab_size`` (our GPT, Hugging Face), else a
``vocab_size`` attribute -- on the LightningModule or any module inside it.
"""

from __future__ import annotations

from typing import Any, Optional


def _positive_int(value: Any) -> Optional[int]:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return None
    return value


def _input_embedding_rows(module: Any) -> Optional[int]:
    get = getattr(module, "get_input_embeddings", None)
    if not callable(get):
        return None
    try:
        embedding = get()
    except (AttributeError, NotImplementedError, TypeError):  # a pipeline stage without the embedding, ...
        return None
    return _positive_int(getattr(embedding, "num_embeddings", None))


def model_vocab_size(module: Any) -> Optional[tuple[int, str]]:
    """``(vocabulary size, where it was found)`` for a LightningModule or model; ``None`` if unknown."""
    modules = list(module.modules()) if callable(getattr(module, "modules", None)) else [module]
    for m in modules:
        rows = _input_embedding_rows(m)
        if rows is not None:
            return rows, f"{type(m).__name__}.get_input_embeddings().num_embeddings"
    for m in modules:
        size = _positive_int(getattr(getattr(m, "config", None), "vocab_size", None))
        if size is not None:
            return size, f"{type(m).__name__}.config.vocab_size"
    for m in modules:
        size = _positive_int(getattr(m, "vocab_size", None))
        if size is not None:
            return size, f"{type(m).__name__}.vocab_size"
    return None


def check_data_vocab(data_vocab: int, data_says: str, model_vocab: int, model_where: str) -> None:
    """Refuse data whose vocabulary is larger than the model's (ids past the model's would be wrong).
    ``data_says``: e.g. "token file x.bin has vocab_size=512 (from its .bin.json)"."""
    if data_vocab > model_vocab:
        raise ValueError(
            f"{data_says}, but the model's vocabulary has {model_vocab} entries "
            f"({model_where}): token ids {model_vocab}..{data_vocab - 1} cannot be embedded. Use a model with "
            f"vocab_size >= {data_vocab}, or tokenize the data with the model's tokenizer."
        )
