"""Model transforms that are not a parallel degree: activation checkpointing (recompute) and the
token-global loss normalisation. Same layer as the degrees (tensor_parallel, pipeline, ...)."""
