"""Turning a dense model into this rank's part of a layout: :func:`parallelize` (the one ordered
place) and :func:`setup_parallel` (the set-up the strategy and the dry run share)."""
