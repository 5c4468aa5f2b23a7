"""lightning_3d: 3D parallelism (data x tensor x pipeline, ZeRO) as a PyTorch Lightning strategy.

Importing this package registers the strategy name ``"3d"``, so ``Trainer(strategy="3d")`` works.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_3d.checkpoint.consolidate import load_from_checkpoint
from lightning_3d.checkpoint.pretrained import from_pretrained, load_pretrained_
from lightning_3d.core import __version__
from lightning_3d.core.config import ParallelConfig
from lightning_3d.core.topology import Coordinates, ParallelDims, Topology
from lightning_3d.plugins.precision import install_precision_check
from lightning_3d.plugins.strategy import ThreeDParallelStrategy


StrategyRegistry.register(
    ThreeDParallelStrategy.strategy_name,
    ThreeDParallelStrategy,
    description="lightning_3d: data x tensor x pipeline parallel with ZeRO",
    override=True,
)
install_precision_check()  # Trainer(strategy="3d", precision=<unsupported>) is refused by name, not by ImportError

__all__ = [
    "Coordinates",
    "ParallelConfig",
    "ParallelDims",
    "ThreeDParallelStrategy",
    "Topology",
    "__version__",
    "from_pretrained",
    "load_from_checkpoint",
    "load_pretrained_",
]
