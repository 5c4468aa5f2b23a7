"""Register ``strategy="3d"`` with Lightning as soon as Lightning is loaded, without loading it.

``import lightning_3d`` has registered the name since the first release. Doing that eagerly cost
every process that imports the package Lightning's import (about 5 s on two cores), also the
command line's ``plan``, ``--version`` and ``export``, which never build a Trainer. So the package
root is lazy (PEP 562) and the registration waits for Lightning: at once when it is already
imported, else right after its import finishes, through a one-shot import hook. ``Trainer`` cannot
be built before that, so ``Trainer(strategy="3d")`` finds the name in either import order.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Any, Optional, Sequence

from lightning_3d.core import STRATEGY_NAME

_TRIGGER = "lightning"  # the package whose import ends with lightning.pytorch fully loaded
_registered = False


def _strategy(**kwargs: Any) -> Any:
    """What ``StrategyRegistry.get("3d")`` calls: the class loads here, when a Trainer asks."""
    from lightning_3d.plugins.strategy import ThreeDParallelStrategy

    return ThreeDParallelStrategy(**kwargs)


def register_with_lightning() -> None:
    """Register the strategy name and the precision check (idempotent). Imports only Lightning
    (it may run in the middle of an import of ours that triggered Lightning's)."""
    global _registered
    if _registered:
        return
    from lightning.pytorch.strategies import StrategyRegistry

    StrategyRegistry.register(
        STRATEGY_NAME, _strategy, description="lightning_3d: data x tensor x pipeline parallel with ZeRO", override=True
    )
    install_precision_check()
    _registered = True


def install_precision_check() -> None:
    """Refuse ``Trainer(precision=...)`` values the strategy cannot run before Lightning builds them
    (idempotent). Lightning turns the precision string into a plugin before the strategy sees it; for
    ``"transformer-engine"`` that means an ``ImportError`` asking the user to install a package the
    strategy would then refuse anyway. Wrapping that one connector step lets the strategy answer
    first, with the values it does support: a strategy that declares ``supported_precision`` (ours
    declares lightning_3d.plugins.precision.MODES) is checked, any other is left alone."""
    import functools

    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    original = _AcceleratorConnector._check_and_init_precision
    if getattr(original, "_lightning_3d", False):
        return

    @functools.wraps(original)
    def check_then_init(self: Any) -> Any:
        supported = getattr(self.strategy, "supported_precision", None)
        flag = getattr(self, "_precision_flag", None)
        if supported is not None and getattr(self, "_precision_plugin_flag", None) is None:
            if isinstance(flag, str) and flag not in supported:
                from lightning_3d.plugins.precision import unsupported_precision

                raise unsupported_precision(flag)
        return original(self)

    check_then_init._lightning_3d = True  # type: ignore[attr-defined]
    _AcceleratorConnector._check_and_init_precision = check_then_init  # type: ignore[method-assign]


class _Loader(importlib.abc.Loader):
    """The trigger package's own loader, followed by the registration."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[ModuleType]:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _remove_hook()
        try:
            register_with_lightning()
        except Exception as err:  # noqa: BLE001 - never break `import lightning` for processes that do not use "3d"
            warnings.warn(f"lightning_3d could not register strategy='3d' with Lightning ({err!r}); "
                          f"pass ThreeDParallelStrategy(...) to the Trainer instead.", stacklevel=2)

    def __getattr__(self, name: str) -> Any:  # get_resource_reader, is_package, ...
        return getattr(self._loader, name)


class _AfterLightningImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when the trigger is looked up for an import, hands back the real spec
    with its loader wrapped. It stays installed until that loader has run, so a lookup that imports
    nothing (``importlib.util.find_spec("lightning")``, an availability check) does not use it up."""

    def __init__(self) -> None:
        self._searching = False

    def find_spec(self, fullname: str, path: Optional[Sequence[str]], target: Optional[ModuleType] = None) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname != _TRIGGER or self._searching or fullname in sys.modules:
            return None
        self._searching = True  # the search below asks the finders again, this one included
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._searching = False
        if spec is not None and spec.loader is not None and not isinstance(spec.loader, _Loader):
            spec.loader = _Loader(spec.loader)
        return spec


_hook = _AfterLightningImport()


def _remove_hook() -> None:
    try:
        sys.meta_path.remove(_hook)
    except ValueError:
        pass


def register_when_lightning_loads() -> None:
    """Called by ``lightning_3d/__init__.py`` at import and at each name it resolves (a safety net
    for a Lightning that was half imported when the hook went in)."""
    if _TRIGGER in sys.modules and getattr(sys.modules[_TRIGGER], "pytorch", None) is not None:
        _remove_hook()
        register_with_lightning()
    elif _hook not in sys.meta_path:
        sys.meta_path.insert(0, _hook)
