"""Entry points people run: the ``lightning-3d`` CLI, the Hydra recipe runner, the dry run, the
planner's command and plots."""
