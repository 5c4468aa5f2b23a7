"""Tools that make CPU ranks behave like a GPU cluster: the multi-rank test harness and strict
communication mode (NCCL's rules on gloo). Low in the layers because library code marks host
tensors for strict mode; the harness imports nothing above ``core``."""
