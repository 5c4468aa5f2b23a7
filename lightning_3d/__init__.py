"""lightning_3d: 3D parallelism (data x tensor x pipeline, ZeRO) as a PyTorch Lightning strategy.

Importing this package registers the strategy name ``"3d"``, so ``Trainer(strategy="3d")`` works.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_3d import precision_flag
from lightning_3d.checkpoint.consolidate import load_from_checkpoint
from lightning_3d.config import ParallelConfig
from lightning_3d.pretrained import from_pretrained, load_pretrained_
from lightning_3d.strategy import ThreeDParallelStrategy
from lightning_3d.topology import Coordinates, ParallelDims, Topology

__version__ = "0.1.0"

StrategyRegistry.register(
    ThreeDParallelStrategy.strategy_name,
    ThreeDParallelStrategy,
    description="lightning_3d: data x tensor x pipeline parallel with ZeRO",
    override=True,
)
precision_flag.install()  # Trainer(strategy="3d", precision=<unsupported>) is refused by name, not by ImportError

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
