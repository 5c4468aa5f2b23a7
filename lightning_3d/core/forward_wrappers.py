"""Every forward a lightning_3d transform puts on a module, recorded once, with its undo.

``parallelize`` changes what a module's ``forward`` does without touching the module's code: the
tensor-parallel RNG regions and shared entries, the context-parallel input split, activation
checkpointing, the pipeline runtime and the token-global loss normalisation each replace the
instance's ``forward`` by a wrapper around the one before. Each is recorded here under its kind,
with what it keeps (its ``state``: the pipeline runtime, the context-parallel group, ...) and the
forward it replaced, so that

* applying a kind twice (set-up again for ``validate`` after ``fit``) is one wrapper, not two;
* what a module carries can be asked by kind (:func:`wrapper`), not read from ad-hoc attributes;
* the outermost wrapper can be undone (:func:`unwrap_forward`), restoring the forward it replaced.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

from torch import nn

_ATTR = "_lightning_3d_forward_wrappers"


@dataclass(frozen=True)
class ForwardWrapper:
    kind: str
    state: Any  # what the wrapper works with (a runtime, a group, ...), for whoever asks by kind
    previous: Any  # the instance forward it replaced; None: the class's own


def wrappers(module: nn.Module) -> tuple[ForwardWrapper, ...]:
    """The wrappers on ``module``'s forward, innermost first."""
    return module.__dict__.get(_ATTR, ())


def wrapper(module: nn.Module, kind: str) -> Optional[ForwardWrapper]:
    return next((w for w in wrappers(module) if w.kind == kind), None)


def wrap_forward(module: nn.Module, kind: str, make: Callable[[Callable[..., Any]], Callable[..., Any]], state: Any = None) -> bool:
    """Replace ``module.forward`` by ``make(current forward)``, recorded under ``kind``; ``False`` (and
    nothing done) when a wrapper of that kind is already there."""
    if wrapper(module, kind) is not None:
        return False
    previous = module.__dict__.get("forward")
    module.forward = make(module.forward)  # type: ignore[method-assign]
    module.__dict__[_ATTR] = (*wrappers(module), ForwardWrapper(kind, state, previous))
    return True


def unwrap_forward(module: nn.Module, kind: str) -> bool:
    """Undo ``module``'s ``kind`` wrapper (``False`` if there is none). Only the outermost can go:
    undoing an inner one would silently drop every wrapper applied after it."""
    stack = wrappers(module)
    if all(w.kind != kind for w in stack):
        return False
    if stack[-1].kind != kind:
        later = [w.kind for w in stack[[w.kind for w in stack].index(kind) + 1 :]]
        raise RuntimeError(f"the {kind!r} wrapper of {type(module).__name__}.forward is under {later}: undo those first.")
    if stack[-1].previous is None:
        del module.__dict__["forward"]
    else:
        module.forward = stack[-1].previous  # type: ignore[method-assign]
    module.__dict__[_ATTR] = stack[:-1]
    return True
