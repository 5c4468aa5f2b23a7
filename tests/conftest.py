"""Every multi-rank test runs under NCCL's rules (lightning_3d/testing/strict_comm.py): the harness's worlds,
and ranks that Lightning or torchrun launch (they inherit the variable and the strategy reads it)."""

import os

os.environ.setdefault("LIGHTNING_3D_STRICT_COMM", "1")
