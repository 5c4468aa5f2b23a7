"""Reference models, written without any parallelism."""

from lightning_3d.models.gpt import GPT, GPTConfig, GPTModule

__all__ = ["GPT", "GPTConfig", "GPTModule"]
