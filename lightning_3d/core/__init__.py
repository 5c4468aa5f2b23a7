"""The bottom layer: parallel degrees and topology, the validated configuration, the layout rules
and small helpers. Imports torch and nothing else of lightning_3d (docs/architecture.md, "Layers")."""

__version__ = "0.1.0"  # the package's version (re-exported as lightning_3d.__version__)
STRATEGY_NAME = "3d"  # Trainer(strategy="3d"): registered by plugins/registration.py, ThreeDParallelStrategy.strategy_name
