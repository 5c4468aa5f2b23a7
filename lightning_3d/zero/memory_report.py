"""What a rank holds for training, measured from the live tensors, next to the ZeRO formula.

The formula (Rajbhandari et al. 2020) for ``psi`` local parameters on ``N`` data-parallel ranks,
with ``c`` bytes per compute-dtype element, ``m`` per separate master element (0 when the
optimizer updates the parameters themselves) and ``o`` per optimizer-state element (Adam: two
moments in the master dtype):

* stage 0: (2c + m + o) psi;  stage 1: 2c psi + (m + o) psi / N;
* stage 2: c psi + (c + m + o) psi / N;  stage 3: (m' + g' + o) psi / N,
  where FSDP2's sharded parameters and gradients are in the master dtype (``m' = g' = 4`` mixed).

bf16-mixed Adam gives the paper's 16 psi, 4 psi + 12 psi / N, 2 psi + 14 psi / N, 16 psi / N.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lightning_3d.core.topology import Topology


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _storage_bytes(tensors: list[Tensor], seen: set[int]) -> int:
    total = 0
    for t in tensors:
        t = _local(t)
        storage = t.untyped_storage()
        # meta tensors (a dry run, lightning_3d.apps.dry_run) all read data pointer 0: tell their storages apart
        key = storage._cdata if t.is_meta else storage.data_ptr()
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def _optimizer_state_elements_per_param(optimizer: Any) -> int:
    """Per-element state tensors of known optimizers (Adam: 2, +1 with amsgrad; SGD momentum: 1)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
        return 3 if any(g.get("amsgrad") for g in inner.param_groups) else 2
    if isinstance(inner, torch.optim.SGD):
        return 1 if any(g.get("momentum", 0) for g in inner.param_groups) else 0
    return 0


def memory_report(module: nn.Module, optimizers: list[Any], zero: Any, topology: Topology) -> dict[str, Any]:
    seen: set[int] = set()
    params = list({id(p): p for p in module.parameters()}.values())
    report: dict[str, Any] = {"params": _storage_bytes(params, seen)}
    grads = [p.grad for p in params if p.grad is not None]
    masters, states = [], []
    on_disk = 0
    for opt in optimizers:
        inner = getattr(opt, "inner", opt)
        for bucket in getattr(opt, "buckets", []):
            grads += [t for t in (bucket.grad_buf, bucket.grad_shard, bucket.host_grad) if t is not None]
            masters.append(bucket.master)
        store = getattr(opt, "store", None)
        if store is not None:  # NVMe: masters and moments live in the file
            on_disk += sum(r.numel * 4 for regions in store.regions for r in regions.values())
        if inner is not None:
            for state in inner.state.values():
                states += [v for v in state.values() if isinstance(v, Tensor)]
    report["grads"] = _storage_bytes(grads, seen)
    report["master"] = _storage_bytes(masters, seen)
    report["optimizer_state"] = _storage_bytes(states, seen)
    report["total"] = sum(report[k] for k in ("params", "grads", "master", "optimizer_state"))
    report["nvme"] = on_disk

    psi = sum(p.numel() for p in params if p.requires_grad)  # DTensor.numel() is the dp-unsharded size
    n, stage = topology.dp_size, zero.stage
    c = torch.finfo(zero.compute_dtype).bits // 8
    mixed = zero.compute_dtype != zero.master_dtype
    m_bytes = torch.finfo(zero.master_dtype).bits // 8
    m = m_bytes if mixed else 0
    o = m_bytes * max((_optimizer_state_elements_per_param(opt) for opt in optimizers), default=0)
    per_element = {
        0: (2 * c + m + o, 0),
        1: (2 * c, m + o),
        2: (c, c + m + o),
        3: (0, (m_bytes if mixed else c) * 2 + o),
    }[stage]
    expected = per_element[0] * psi + per_element[1] * psi / n
    report["formula"] = {
        "stage": stage,
        "psi": psi,
        "N": n,
        "expression": f"{per_element[0]} psi + {per_element[1]} psi / N",
        "bytes": expected,
    }
    return report
