"""Context parallelism: attention over a sequence sharded across ranks (load-balanced causal chunks).

``layout`` says which tokens a cp rank holds; ``ring_attention`` and ``all_to_all_attention``
are the two exact attention kernels over that layout (ring: K/V blocks passed around the group;
all-to-all: DeepSpeed-Ulysses head sharding).
"""

from lightning_3d.context_parallel.layout import local_positions, shard_sequence, unshard_sequence
from lightning_3d.context_parallel.ring import ring_attention
from lightning_3d.context_parallel.ulysses import all_to_all_attention

__all__ = ["all_to_all_attention", "local_positions", "ring_attention", "shard_sequence", "unshard_sequence"]
