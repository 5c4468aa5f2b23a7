"""Compose the package's Hydra configs (``lightning_3d/conf/``) the way ``recipes/train.py`` would.

Low in the layers because the planner's published runs and every entry point read model and cluster
configs through it; a composition error becomes one sentence that names the override and the fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from omegaconf import DictConfig, OmegaConf

# The Hydra configs ship inside the package (package data), so an installed wheel finds them too;
# ``--config-dir`` (recipes, ``lightning-3d plan``) still points elsewhere.
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def compose_config(overrides: list[str], config_dir: Optional[Path] = None) -> DictConfig:
    """The config ``recipes/train.py`` would run with these overrides, without running it."""
    from hydra import compose, initialize_config_dir

    directory = Path(config_dir or CONF_DIR).resolve()
    if not (directory / "config.yaml").is_file():
        raise FileNotFoundError(
            f"no Hydra config at {directory}/config.yaml; --config-dir takes a directory holding config.yaml "
            f"(the one shipped with the package is {CONF_DIR})."
        )
    from hydra.errors import HydraException

    with initialize_config_dir(config_dir=str(directory), version_base="1.3"):
        try:
            return compose("config", overrides=list(overrides))
        except HydraException as err:  # one line naming the override and the fix, not Hydra's traceback
            raise ValueError(_override_error(err, list(overrides), directory)) from None


def _override_error(err: Exception, overrides: list[str], directory: Path) -> str:
    """Hydra's composition error as one sentence: which override, what exists, the likely fix."""
    import difflib
    import re

    from hydra import compose

    text = str(err)
    missing = re.search(r"Could not find '([^/']+)/([^']+)'", text)
    if missing:
        group, option = missing.groups()
        options = sorted(p.stem for p in (directory / group).glob("*.yaml"))
        close = difflib.get_close_matches(option, options, n=1)
        hint = f"Did you mean {group}={close[0]}? " if close else ""
        return f"{group}={option}: there is no such {group} config; {hint}choose one of {', '.join(options)}."
    unknown = re.search(r"Could not override '([^']+)'", text)
    if unknown:
        key = unknown.group(1)
        parent, _, leaf = key.rpartition(".")
        try:
            with_known = compose("config", overrides=[o for o in overrides if not o.split("=")[0].lstrip("+~").startswith(key)])
            node = OmegaConf.select(with_known, parent) if parent else with_known
            keys = sorted(node.keys()) if isinstance(node, DictConfig) else []
        except Exception:  # noqa: BLE001 - the hint is best effort; the message stands without it
            keys = []
        close = difflib.get_close_matches(leaf, keys, n=1)
        hint = f"Did you mean {parent + '.' if parent else ''}{close[0]}? " if close else ""
        known = f" ({parent or 'the config'} has: {', '.join(keys)})" if keys else ""
        return (
            f"{key}: the config has no such key{known}. {hint}To add a new key on purpose, write +{key}=...; a typo "
            f"would then be trained on in silence."
        )
    first = text.strip().splitlines()[0] if text.strip() else type(err).__name__
    return f"{first} (overrides: {' '.join(overrides)})."
