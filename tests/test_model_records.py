"""The two records parallelize keeps on a model: forward wrappers by kind (with their undo) and one
metadata record per parameter (docs/architecture.md, "One configuration, one set-up path")."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_3d.core.forward_wrappers import unwrap_forward, wrap_forward, wrapper, wrappers
from lightning_3d.core.param_meta import EMPTY, is_pipeline_duplicate, meta_of, update_meta
from lightning_3d.tensor_parallel.spec import TPSpec, get_spec, set_spec


def _times(k: float):
    def make(original):
        return lambda x: original(x) * k

    return make


def test_wrappers_are_recorded_once_by_kind_and_undone_outermost_first():
    m = nn.Identity()
    x = torch.ones(2)
    assert wrap_forward(m, "double", _times(2.0), state="two")
    assert not wrap_forward(m, "double", _times(2.0))  # set-up again: still one wrapper
    assert wrap_forward(m, "triple", _times(3.0))
    assert torch.equal(m(x), x * 6) and [w.kind for w in wrappers(m)] == ["double", "triple"]
    assert wrapper(m, "double").state == "two" and wrapper(m, "absent") is None
    with pytest.raises(RuntimeError, match=r"'double' wrapper of Identity.forward is under \['triple'\]"):
        unwrap_forward(m, "double")
    assert unwrap_forward(m, "triple") and torch.equal(m(x), x * 2)
    assert unwrap_forward(m, "double") and torch.equal(m(x), x) and "forward" not in m.__dict__
    assert not unwrap_forward(m, "double") and wrappers(m) == ()


def test_a_parameter_record_is_replaced_not_shared():
    a = nn.Parameter(torch.zeros(4))
    assert meta_of(a) is EMPTY and get_spec(a) is None
    spec = TPSpec(dim=0, world=2, rank=1, full_shape=(8,))
    set_spec(a, spec)
    b = nn.Parameter(torch.zeros(4))
    b.__dict__.update(a.__dict__)  # a copied __dict__ shares the record (pretrained allocation does this)
    update_meta(b, pipeline_duplicate=True)
    assert is_pipeline_duplicate(b) and not is_pipeline_duplicate(a)  # marking one never marks the other
    assert get_spec(a) is spec and get_spec(b) is spec
