"""Is this checkpoint for this model? Asked once, before any tensor is loaded.

Without it, resuming a model whose size differs from the checkpoint's fails inside
``load_state_dict`` with a list of shard shapes on every rank, and nothing about *why* the shapes
differ. Every manifest records the model's class and configuration (its hyper-parameters, and the
configs of Hugging Face submodules, as plain scalars), and every piece its dense shape; loading
compares dense shapes first and, when they differ, names the configuration values that differ.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

from lightning_3d.tensor_parallel.spec import get_spec, spec_record

SCALARS = (bool, int, float, str, type(None))


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, Mapping):
        for key, item in value.items():
            _flatten(f"{prefix}{key}.", item, out)
    elif isinstance(value, SCALARS):
        out[prefix[:-1]] = value
    elif isinstance(value, (list, tuple)) and all(isinstance(v, SCALARS) for v in value):
        out[prefix[:-1]] = list(value)


def model_config(module: nn.Module) -> dict[str, Any]:
    """The module's configuration as ``{dotted key: scalar}``: Lightning hyper-parameters, plus the
    ``config`` of any direct submodule that has a ``to_dict()`` (Hugging Face models)."""
    out: dict[str, Any] = {}
    _flatten("", dict(getattr(module, "hparams", {}) or {}), out)
    for name, child in module.named_children():
        config = getattr(child, "config", None)
        if hasattr(config, "to_dict"):
            _flatten(f"{name}.config.", config.to_dict(), out)
    return out


DIMS = ("n_layer", "hidden", "n_head", "n_kv_head", "ffn")


def model_dims(module: nn.Module) -> dict[str, dict[str, Any]]:
    """The sizes of every known model inside ``module`` (the adapters' ``ModelDims``), by model name,
    with the names their users know them by: what a checkpoint of another architecture differs in
    even when its tensors happen to fit (another head count, fewer layers)."""
    from lightning_3d.models.adapters.registry import models_in

    out = {}
    for name, dims in models_in(module):
        labels = getattr(dims, "labels", {}) or {}
        out[name] = {key: [int(getattr(dims, key)), labels.get(key, key)] for key in DIMS}
    return out


def model_record(module: nn.Module) -> dict[str, Any]:
    """What a manifest says about the model that wrote it."""
    cls = type(module)
    return {"class": f"{cls.__module__}.{cls.__qualname__}", "config": model_config(module), "dims": model_dims(module)}


def dense_shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """Every state tensor's dense shape (tensor-parallel slices and ZeRO-3 shards seen whole)."""
    shapes = {}
    for name, value in module.state_dict(keep_vars=True).items():
        if isinstance(value, Tensor):
            shapes[name] = tuple(spec_record(get_spec(value), tuple(value.shape))["full_shape"])
    return shapes


def stored_shapes(source: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Dense shapes in a checkpoint's state dict without reading its tensors (sharded: the manifest)."""
    reader = getattr(source, "checkpoint", None)
    if reader is not None:
        shapes = {}
        for record in reader.manifest["pieces"]:
            if record["kind"] == "model":
                shapes[record["name"]] = tuple(record["tp"]["full_shape"])
        for alias, group in reader.ties.items():
            stored = next((shapes[n] for n in group if n in shapes), None)
            if stored is not None:
                shapes.setdefault(alias, stored)
        return shapes
    return {k: tuple(v.shape) for k, v in source.items() if isinstance(v, Tensor)}


def _holds_every_layer(module: nn.Module) -> bool:
    """False on a pipeline stage (other stages' layers are stubs): its keys are a subset by design."""
    return not any(type(m).__name__ == "PipelineStub" for m in module.modules())


def _architecture_refusal(
    module: nn.Module, reader: Any, ours: dict[str, tuple[int, ...]], theirs: dict[str, tuple[int, ...]], strict: bool
) -> str:
    """Why the checkpoint is of another architecture although no tensor shape tells (or ""); ``ours`` /
    ``theirs``: the dense shapes of the model and of the checkpoint."""
    reasons = []
    saved = (reader.manifest.get("model") or {}).get("dims") if reader is not None else None
    if saved and strict:  # (strict_loading=False: a subset on purpose; shapes are still checked)
        here = model_dims(module)
        for name in sorted(set(saved) & set(here)):
            for key in DIMS:
                (old, label), (new, _) = saved[name][key], here[name][key]
                if old != new:
                    reasons.append(f"{label}={old} in the checkpoint, {new} here" + (f" (model {name!r})" if name else ""))
    if strict:
        missing = sorted(n for n in ours if n not in theirs)
        unexpected = sorted(n for n in theirs if n not in ours) if _holds_every_layer(module) else []
        for what, names in (("missing from the checkpoint", missing), ("in the checkpoint but not in the model", unexpected)):
            if names:
                shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
                reasons.append(f"{len(names)} tensor(s) {what}: {shown}")
    if not reasons:
        return ""
    return (
        (f"checkpoint {reader.path}" if reader is not None else "the checkpoint")
        + " was saved from a different model: " + "; ".join(reasons) + ". Build the model with the checkpoint's "
        "configuration, or start from a checkpoint of this model (to load a subset on purpose, set the "
        "LightningModule's strict_loading = False)."
    )


def check_compatible(module: nn.Module, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
    """Refuse, in one message, a checkpoint that is not of ``module``'s architecture: tensors that do
    not fit (naming the configuration values that differ: sharded, the manifest's model record;
    consolidated, the saved hyper-parameters), other model sizes recorded in the manifest (another
    head count whose tensors happen to fit), and -- with ``strict`` -- tensors the model has and
    the checkpoint lacks or the reverse (fewer layers)."""
    source = checkpoint["state_dict"]
    reader = getattr(source, "checkpoint", None)
    ours, theirs = dense_shapes(module), stored_shapes(source)
    wrong = [(n, theirs[n], ours[n]) for n in ours if n in theirs and theirs[n] != ours[n]]
    if not wrong:
        refusal = _architecture_refusal(module, reader, ours, theirs, strict)
        if refusal:
            raise ValueError(refusal)
        return
    saved = (reader.manifest.get("model") or {}) if reader is not None else {"config": checkpoint.get("hyper_parameters") or {}}
    there: dict[str, Any] = {}
    _flatten("", dict(saved.get("config") or {}), there)
    here = model_config(module)
    differs = [f"{k}={there[k]!r} in the checkpoint, {here[k]!r} here" for k in sorted(here) if k in there and here[k] != there[k]]
    cls, mine = saved.get("class"), f"{type(module).__module__}.{type(module).__qualname__}"
    name, old, new = wrong[0]
    raise ValueError(
        (f"checkpoint {reader.path}" if reader is not None else "the checkpoint")
        + " was saved from a different model"
        + (f" ({cls}; this is {mine})" if cls and cls != mine else "")
        + ": "
        + (f"its configuration differs: {'; '.join(differs)}. " if differs else "")
        + f"{len(wrong)} tensor(s) differ in shape, e.g. {name!r}: {list(old)} in the checkpoint, {list(new)} here. "
        f"Build the model with the checkpoint's configuration, or start from a checkpoint of this model."
    )
