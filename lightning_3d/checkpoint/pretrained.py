"""Start from a Hugging Face checkpoint without any rank holding the dense model.

``from_pretrained(path)`` (called in ``LightningModule.configure_model()``) builds the causal-LM
model with its *parameters* on the meta device -- no memory, no initialization -- and remembers
where its weights are. The strategy then applies the layout (tensor-parallel plan, pipeline split,
precision, ZeRO-3 sharding) to the empty model, and :func:`load_pretrained_` gives each rank's
parameters memory and fills them from the safetensors files, reading only the rows and columns the
rank holds (:mod:`lightning_3d.checkpoint.safetensors_read`). A rank's memory therefore grows by
its own share of the model, never by the whole of it.

How a rank's local tensor relates to the dense tensor in the file:

* tensor parallel: ``get_spec(param)`` (:class:`~lightning_3d.tensor_parallel.spec.TPSpec`); the local
  tensor is ``shard_tensor(dense.t() if transposed else dense, dim, world, rank, num_blocks,
  padded_size)``, with zero rows for vocabulary padding;
* pipeline: layers of other stages are stubs without parameters; the remaining parameters keep
  their names, which are the checkpoint's keys (a tied LM head on the last stage reads the
  embedding when the file stores only that);
* ZeRO-3: FSDP2 shards each (tensor-parallel local) parameter along dim 0 like ``torch.chunk``
  over the data-parallel ranks; a rank fills only its chunk.

Buffers are built for real (the rotary ``inv_freq`` keeps its computed values); persistent ones are
read from the file too.

Tensors transformers merges when it loads (a mixture of experts' per-expert matrices stacked into
one ``experts.gate_up_proj`` / ``experts.down_proj``, its ``conversion_mapping``): the stack is built
from the file's per-expert tensors with the mapping's own operations (stack, then concatenate), then
cut like any dense tensor, one stack at a time. When the stack is along the experts (dim 0), a ZeRO-3
rank reads only the experts its rows hold; otherwise the rank reads the whole stack.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import Tensor, nn

from lightning_3d.checkpoint.safetensors_format import read_header, weight_files
from lightning_3d.checkpoint.safetensors_read import Index, SafetensorsFile
from lightning_3d.tensor_parallel.spec import TPSpec, get_spec, shard_tensor

SOURCE_ATTR = "_lightning_3d_pretrained"

@dataclass(frozen=True)
class PretrainedSource:
    """Where a model's weights are: the directory, and for every parameter/persistent-buffer name of
    the dense model (tied names included) the checkpoint key and the file holding it."""

    directory: Path
    keys: Mapping[str, str]
    files: Mapping[str, Path] = field(repr=False)
    merged: Mapping[str, "Merged"] = field(default_factory=dict, repr=False)  # names built from several keys

    def locate(self, name: str) -> tuple[Path, str]:
        """(file, checkpoint key) for a parameter or buffer name of the model."""
        key = self.keys.get(name)
        if key is None:
            raise KeyError(
                f"{name!r} is not a weight of the model loaded from {self.directory} (it was added after "
                f"from_pretrained(), or renamed); only the weights of the checkpoint's model can be loaded."
            )
        return self.files[key], key


@dataclass
class LoadReport:
    """What :func:`load_pretrained_` did on this rank."""

    models: list[str] = field(default_factory=list)
    tensors: int = 0
    bytes_read: int = 0
    seconds: float = 0.0


# -- building on the meta device --------------------------------------------------------------------
@contextmanager
def meta_parameters() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device; buffers stay real.

    Registering a parameter moves it to ``meta`` (attributes and ``requires_grad`` kept). A layer's
    constructor initializes its weight after registering it, so initialization runs on the meta
    tensor; the ``torch.empty`` it was created from is freed untouched (no resident memory). Buffers
    such as the rotary ``inv_freq`` are computed as usual: they are not in every checkpoint, and
    recomputing them would need each model's formula. The patch is process-wide while active.
    """
    original = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
        if param is not None and type(param) is nn.Parameter and not param.is_meta:
            moved = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
            moved.__dict__.update(param.__dict__)
            param = moved
        original(module, name, param)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


@contextmanager
def _default_dtype(dtype: Optional[torch.dtype]) -> Iterator[None]:
    if dtype is None:
        yield
        return
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _as_dtype(dtype: Union[torch.dtype, str, None]) -> Optional[torch.dtype]:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    names = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
             "fp16": torch.float16, "float16": torch.float16}
    if dtype not in names:
        raise ValueError(f"dtype={dtype!r} is not a floating dtype lightning_3d builds models in; use one of {sorted(names)}.")
    return names[dtype]


def from_pretrained(path: Union[str, Path], *, dtype: Union[torch.dtype, str, None] = None, **config_overrides: Any) -> nn.Module:
    """The causal-LM model of a Hugging Face directory, its parameters on the meta device.

    Call it in ``LightningModule.configure_model()``: the strategy lays the model out and then each
    rank loads only its own slices (:func:`load_pretrained_`). Nothing is read but ``config.json`` and
    the safetensors headers, which are checked against the model here -- every rank raises the same
    error before any collective.

    Args:
        path: a directory with ``config.json`` and ``model.safetensors`` (or sharded files with
            ``model.safetensors.index.json``), as ``save_pretrained`` writes it.
        dtype: the parameters' dtype before the precision plugin converts them (default float32).
        config_overrides: keyword arguments for ``AutoConfig.from_pretrained`` (e.g. dropout rates).
    """
    directory = Path(path)
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(
            f"{directory} has no config.json: from_pretrained() takes a Hugging Face model directory (what "
            f"save_pretrained() writes; download hub models first, e.g. with `huggingface-cli download`)."
        )
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from lightning_3d.models.adapters.registry import adapter_for_hf_config

    config = transformers.AutoConfig.from_pretrained(str(directory), **config_overrides)
    try:
        adapter_for_hf_config(config)  # any causal LM transformers knows; plans are needed only by the layouts that split it
    except ValueError as err:
        raise ValueError(f"{directory}: {err}") from None
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    files = weight_files(directory)
    with meta_parameters(), _default_dtype(_as_dtype(dtype)):
        model = model_class(config)
    setattr(model, SOURCE_ATTR, _resolve(model, directory, files))
    return model


def _persistent_buffers(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    for prefix, module in model.named_modules():
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                yield (f"{prefix}.{name}" if prefix else name), buf


def _tied_names(model: nn.Module) -> dict[str, list[str]]:
    """name -> every name of the same parameter (tied embedding and LM head)."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return {name: names for names in by_id.values() for name in names}


def _candidates(name: str, tied: list[str], base_prefix: str) -> list[str]:
    """Checkpoint keys that may hold ``name``: itself, its tied twins, and both without the base
    model's prefix (GPT-2 checkpoints on the hub store ``h.0...``, not ``transformer.h.0...``)."""
    out = [name, *(t for t in tied if t != name)]
    if base_prefix:
        out += [n[len(base_prefix) + 1 :] for n in list(out) if n.startswith(base_prefix + ".")]
    return out


@dataclass(frozen=True)
class Merged:
    """A tensor transformers builds from several checkpoint tensors: per source pattern the keys, in
    expert order, stacked along ``stack_dim``; the stacks then concatenated along ``concat_dim``."""

    keys: tuple[tuple[str, ...], ...]
    stack_dim: int
    concat_dim: Optional[int]
    piece_shapes: tuple[tuple[int, ...], ...] = ()  # per source pattern: each expert's tensor shape


def _merging_conversions(model: nn.Module) -> list[tuple[list[str], str, int, Optional[int]]]:
    """(source patterns, target suffix, stack dim, concat dim) of the conversions transformers applies
    to ``model``'s checkpoints that stack a module list (``MergeModulelist``), then optionally
    concatenate (``Concatenate``): the MoE families' expert weights. Other operations are left out
    (their tensors are then reported missing, by name)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:
        return []
    out = []
    for transform in get_model_conversion_mapping(model, add_legacy=False):
        ops = [(type(op).__name__, getattr(op, "dim", None)) for op in getattr(transform, "operations", ())]
        targets = getattr(transform, "target_patterns", ())
        if type(transform).__name__ != "WeightConverter" or len(targets) != 1 or getattr(transform, "scope_prefix", None):
            continue
        if ops and ops[0][0] == "MergeModulelist" and len(ops) <= 2 and (len(ops) == 1 or ops[1][0] == "Concatenate"):
            out.append((list(transform.source_patterns), targets[0], ops[0][1], ops[1][1] if len(ops) == 2 else None))
    return out


def _merged_source(name: str, renamed_keys: Mapping[str, str], conversions: list[tuple[list[str], str, int, Optional[int]]]) -> Optional[Merged]:
    """The checkpoint keys a merged parameter ``name`` is built from (``renamed_keys``: the file's keys
    under transformers' renamings -> the keys as stored), or None."""
    for sources, target, stack_dim, concat_dim in conversions:
        if not name.endswith(target):
            continue
        prefix = name[: len(name) - len(target)]
        lists = []
        for pattern in sources:
            regex = re.compile(re.escape(prefix + pattern).replace(r"\*", r"(\d+)") + "$")
            found = sorted((int(m.group(1)), stored) for new, stored in renamed_keys.items() if (m := regex.match(new)))
            if not found or [i for i, _ in found] != list(range(len(found))):
                break
            lists.append(tuple(stored for _, stored in found))
        else:
            if len({len(keys) for keys in lists}) == 1:
                return Merged(tuple(lists), stack_dim, concat_dim)  # (piece shapes: filled in by _resolve)
    return None


def _key_renames(model: nn.Module) -> list[tuple[str, str]]:
    """(pattern, replacement) pairs of the plain key renamings transformers applies when it loads a
    checkpoint of ``model``'s class (``conversion_mapping``); conversions that merge tensors are not
    renamings and are left out (their keys are then reported missing, by name)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:
        return []
    pairs = []
    for transform in get_model_conversion_mapping(model, add_legacy=False):
        sources, targets = getattr(transform, "source_patterns", ()), getattr(transform, "target_patterns", ())
        if type(transform).__name__ == "WeightRenaming" and len(sources) == len(targets) == 1 and not getattr(transform, "scope_prefix", None):
            pairs.append((sources[0], targets[0]))
    return pairs


def _renamed(key: str, renames: list[tuple[str, str]]) -> str:
    for pattern, replacement in renames:
        key = re.sub(pattern, replacement, key)
    return key


def _resolve(model: nn.Module, directory: Path, files: Mapping[str, Path]) -> PretrainedSource:
    """Match every parameter and persistent buffer of the (dense, meta) model to a checkpoint key, and
    check the shapes: one error naming everything missing or mismatched."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(set(files.values())):
        if not file.is_file():
            raise FileNotFoundError(f"{directory}: {file.name} is listed in the index but missing; the download is incomplete.")
        header, _ = read_header(file)
        shapes.update({k: tuple(v["shape"]) for k, v in header.items() if files.get(k) == file})
    absent = sorted(set(files) - set(shapes))
    if absent:
        raise ValueError(f"{directory}: the index lists {absent[:5]} in files that do not hold them; the checkpoint is damaged.")
    tied = _tied_names(model)
    base_prefix = getattr(model, "base_model_prefix", "") or ""
    tensors = [*model.named_parameters(remove_duplicate=False), *_persistent_buffers(model)]
    renames = _key_renames(model)
    renamed = {new: old for old in shapes if (new := _renamed(old, renames)) != old}
    conversions = _merging_conversions(model)
    stored_as = {**{k: k for k in shapes}, **renamed} if conversions else {}  # (the file's keys under transformers' names)
    keys: dict[str, str] = {}
    merged: dict[str, Merged] = {}
    missing: list[str] = []
    mismatched: list[str] = []
    for name, t in tensors:
        key = next((k for k in _candidates(name, tied.get(name, []), base_prefix) if k in shapes), None)
        if key is None:  # a key transformers renames when it loads (GPT-NeoX's embed_out -> lm_head)
            key = next((renamed[k] for k in _candidates(name, tied.get(name, []), base_prefix) if k in renamed), None)
        if key is None and conversions:  # a tensor transformers builds from several (stacked experts)
            found = next((m for c in _candidates(name, tied.get(name, []), base_prefix) if (m := _merged_source(c, stored_as, conversions))), None)
            if found is not None:
                per_source = [{shapes[k] for k in keys_} for keys_ in found.keys]
                if any(len(s) != 1 for s in per_source):
                    mismatched.append(f"{name}: the tensors it is built from ({found.keys[0][0]}, ...) differ in shape between experts")
                    continue
                found = replace(found, piece_shapes=tuple(next(iter(s)) for s in per_source))
                merged[name] = found
                shape = _merged_shape(found)
                if shape != tuple(t.shape):
                    mismatched.append(f"{name} (built from {found.keys[0][0]}, ...): shape {list(shape)}, model expects {list(t.shape)}")
                continue
        if key is None:
            missing.append(name)
            continue
        keys[name] = key
        if shapes[key] != tuple(t.shape):
            mismatched.append(f"{key}: file shape {list(shapes[key])}, model expects {list(t.shape)}")
    if missing:
        raise ValueError(
            f"{directory}: the checkpoint has no tensor for {len(missing)} weight(s) of the {type(model).__name__} that "
            f"its config.json describes: {missing[:8]}{' ...' if len(missing) > 8 else ''}. The files hold {len(shapes)} "
            f"tensors (e.g. {sorted(shapes)[:3]}); check that config.json and the weights belong together."
        )
    if mismatched:
        raise ValueError(
            f"{directory}: {len(mismatched)} tensor(s) of the checkpoint do not have the shape the model built from "
            f"config.json expects: {'; '.join(mismatched[:5])}{' ...' if len(mismatched) > 5 else ''}."
        )
    used = set(keys.values()) | {k for m in merged.values() for keys_ in m.keys for k in keys_}
    return PretrainedSource(directory=directory, keys=keys, files={k: files[k] for k in used}, merged=merged)


def _merged_shape(merged: Merged) -> tuple[int, ...]:
    """The shape of a merged tensor from its sources' shapes (without reading them)."""
    stacks = []
    for keys, piece in zip(merged.keys, merged.piece_shapes):
        shape = list(piece)
        shape.insert(merged.stack_dim, len(keys))
        stacks.append(shape)
    out = list(stacks[0])
    if merged.concat_dim is not None:
        out[merged.concat_dim] = sum(s[merged.concat_dim] for s in stacks)
    return tuple(out)


# -- which part of the dense tensor a rank holds ------------------------------------------------------------
def local_slice_index(
    file_shape: tuple[int, ...], spec: Optional[TPSpec] = None, rows: Optional[tuple[int, int]] = None
) -> tuple[list[Index], bool]:
    """(per-dimension indices into the dense tensor of the file, transposed) for a rank's local tensor.

    ``spec`` is the parameter's tensor-parallel spec; ``rows`` = (first, count): the rows of the
    tensor-parallel local tensor (in the layer's layout) that a ZeRO-3 rank holds. Reading the file
    tensor at these indices gives the local tensor, or its transpose when ``transposed`` (a Hugging
    Face ``Conv1D`` weight stored ``[in, out]`` held as ``[out, in]``). Padding entries are -1.

    The indices come from :func:`~lightning_3d.tensor_parallel.spec.shard_tensor` itself, applied to
    positions 1..n (its zero padding becomes -1), so they cannot disagree with how tensors are split.
    """
    transposed = spec is not None and spec.transposed
    if transposed and len(file_shape) != 2:
        raise ValueError(f"a transposed tensor-parallel spec needs a matrix; the file tensor has shape {list(file_shape)}.")
    layout = list(reversed(file_shape)) if transposed else list(file_shape)
    index: list[Index] = [None] * len(layout)
    if spec is not None and spec.is_sharded:
        assert spec.dim is not None
        dim = spec.dim % len(layout)
        positions = torch.arange(1, layout[dim] + 1)
        index[dim] = shard_tensor(positions, 0, spec.world, spec.rank, spec.num_blocks, spec.padded_size) - 1
    if rows is not None:
        first, count = rows
        if not layout:
            raise ValueError("a ZeRO-3 row chunk of a scalar is not defined.")
        all_rows = index[0] if index[0] is not None else torch.arange(layout[0])
        index[0] = all_rows[first : first + count]
    return (index[::-1] if transposed else index), transposed


def _selected_shape(file_shape: tuple[int, ...], index: list[Index]) -> tuple[int, ...]:
    return tuple(size if idx is None else idx.numel() for size, idx in zip(file_shape, index))


def _held(p: Tensor) -> tuple[Tensor, Optional[tuple[int, int]]]:
    """(the tensor this rank writes, the rows of the tp-local tensor it holds) -- a ZeRO-3 (FSDP2)
    DTensor holds a ``torch.chunk`` of dim 0 over its mesh; anything else holds all of it."""
    if not hasattr(p, "to_local"):
        return p, None
    from torch.distributed.tensor import Replicate, Shard

    local = p.to_local()
    placements = tuple(p.placements)
    if all(isinstance(pl, Replicate) for pl in placements):
        return local, None
    if len(placements) != 1 or placements[0] != Shard(0):
        raise NotImplementedError(f"loading into a DTensor placed {placements}: only FSDP2's Shard(0) over one mesh dimension is supported.")
    n = p.shape[0]
    per = -(-n // p.device_mesh.size())
    return local, (min(n, p.device_mesh.get_local_rank() * per), local.shape[0])


def _expected_dense_shape(p: Tensor, spec: Optional[TPSpec]) -> tuple[int, ...]:
    if spec is not None and spec.differs_from_dense:
        return tuple(spec.full_shape)
    return tuple(p.shape)


# -- allocation -------------------------------------------------------------------------------------------
def _allocate_(p: nn.Parameter, device: torch.device) -> None:
    """Give a meta parameter memory on ``device`` in place: the same Python object (pipeline runtimes,
    tied modules and optimizers may hold it), its attributes (its metadata record) and its gradient hooks
    (sequence-parallel sums) kept."""
    attributes = dict(p.__dict__)
    hooks = p._backward_hooks
    real = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad)
    torch.utils.swap_tensors(p, real)
    p.__dict__.clear()
    p.__dict__.update(attributes)
    if hooks:
        p._backward_hooks = hooks  # re-registers them on the new tensor


def _carriers(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost modules inside ``root`` built by :func:`from_pretrained`."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in root.named_modules():
        if getattr(module, SOURCE_ATTR, None) is None:
            continue
        if any(name == p or name.startswith(p + ".") or p == "" for p, _ in found):
            continue
        found.append((name, module))
    return found


def pretrained_models(root: nn.Module) -> list[nn.Module]:
    """The outermost models inside ``root`` built by :func:`from_pretrained`."""
    return [module for _, module in _carriers(root)]


def has_pretrained(root: nn.Module) -> bool:
    """Whether ``root`` contains a model from :func:`from_pretrained` (loaded or not)."""
    return bool(_carriers(root))


def load_pretrained_(root: nn.Module, device: Union[torch.device, str, None] = None) -> LoadReport:
    """Allocate and fill, on this rank, every model inside ``root`` that :func:`from_pretrained` built.

    Meta parameters get memory on ``device`` (default: the CPU); parameters that already have memory
    (ZeRO-3 shards after ``to_empty``) are filled where they are. Each parameter reads only what this
    rank holds of it: its tensor-parallel slice, its ZeRO-3 row chunk; other pipeline stages'
    layers are not in the module any more. Values are cast to the parameter's dtype (the precision
    plugin set it). Persistent buffers are read too; other buffers keep their computed values and
    move to ``device``.
    """
    start = time.perf_counter()
    device = torch.device(device) if device is not None else torch.device("cpu")  # a torch.device: not a host tag in strict mode
    report = LoadReport()
    with ExitStack() as stack:
        opened: dict[Path, SafetensorsFile] = {}

        def handle(path: Path) -> SafetensorsFile:
            if path not in opened:
                opened[path] = stack.enter_context(SafetensorsFile(path))
            return opened[path]

        for prefix, model in _carriers(root):
            source: PretrainedSource = getattr(model, SOURCE_ATTR)
            report.models.append(prefix or type(model).__name__)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if p.is_meta and not hasattr(p, "to_local"):
                        _allocate_(p, device)
                    elif hasattr(p, "to_local") and p.to_local().is_meta:
                        raise ValueError(
                            f"{name} is a ZeRO-3 shard still on the meta device: load_pretrained_ fills ZeRO-3 shards after "
                            f"materialize_meta() gave them memory (the strategy does this in set-up)."
                        )
                    _load_(p, name, source, handle)
                    report.tensors += 1
                report.tensors += _load_buffers_(model, source, handle, device)
        report.bytes_read = sum(f.bytes_read for f in opened.values())
    report.seconds = time.perf_counter() - start
    return report


def _on(t: Tensor, device: torch.device) -> bool:
    """Whether ``t`` is on ``device`` (``"cuda"`` without an index: any GPU counts)."""
    return t.device.type == device.type and (device.index is None or t.device.index == device.index)


def _load_buffers_(model: nn.Module, source: PretrainedSource, handle: Any, device: torch.device) -> int:
    """Persistent buffers are read (whole: they are replicated); the others keep their computed values
    and move to ``device``. Returns how many were read."""
    count = 0
    for module_name, module in model.named_modules():
        for buf_name, buf in list(module._buffers.items()):
            if buf is None:
                continue
            full_name = f"{module_name}.{buf_name}" if module_name else buf_name
            if buf_name in module._non_persistent_buffers_set:
                if buf.is_meta:
                    raise ValueError(f"{full_name} is a non-persistent buffer on the meta device: it is in no checkpoint; build it for real.")
                if not _on(buf, device):
                    module._buffers[buf_name] = buf.to(device)
                continue
            if buf.is_meta or not _on(buf, device):
                buf = module._buffers[buf_name] = torch.empty(buf.shape, dtype=buf.dtype, device=device)
            path, key = source.locate(full_name)
            _read_into(handle(path), key, buf, None, full_name, source.directory, tuple(buf.shape))
            count += 1
    return count


def _load_(p: Tensor, name: str, source: PretrainedSource, handle: Any) -> None:
    spec = get_spec(p)
    target, rows = _held(p)
    if name in source.merged:
        _read_merged_into(source, source.merged[name], handle, target, spec, rows)
        return
    path, key = source.locate(name)
    _read_into(handle(path), key, target, spec, name, source.directory, _expected_dense_shape(p, spec), rows)


def _read_merged_into(
    source: PretrainedSource, merged: Merged, handle: Any, target: Tensor, spec: Optional[TPSpec], rows: Optional[tuple[int, int]]
) -> None:
    """Build a merged tensor as transformers does (stack each source list, then concatenate), then
    keep this rank's part of it (its tensor-parallel or expert slice, its ZeRO-3 rows). When the
    stack is along dim 0 (the experts), only the experts this rank holds are read."""
    shape = _merged_shape(merged)
    index, transposed = local_slice_index(shape, spec, rows)
    keys = merged.keys
    if merged.stack_dim == 0 and index and index[0] is not None and bool((index[0] >= 0).all()):
        chosen = index[0].tolist()  # (a ZeRO-3 rank's experts: the others are never read)
        keys = tuple(tuple(per_expert[i] for i in chosen) for per_expert in keys)
        index = [None, *index[1:]]
    stacks = [torch.stack([handle(source.files[k]).read(k) for k in per_expert], dim=merged.stack_dim) for per_expert in keys]
    dense = torch.cat(stacks, dim=merged.concat_dim) if merged.concat_dim is not None else stacks[0]
    for dim, idx in enumerate(index):
        if idx is not None:
            dense = dense.index_select(dim, idx)
    out = target.t() if transposed else target
    if tuple(dense.shape) != tuple(out.shape):
        raise ValueError(
            f"{source.directory}: this rank's part of the tensor built from {merged.keys[0][0]}, ... has shape "
            f"{list(dense.shape)}, but the parameter holds {list(out.shape)}; its spec does not describe it."
        )
    out.copy_(dense)


def _read_into(
    f: SafetensorsFile,
    key: str,
    target: Tensor,
    spec: Optional[TPSpec],
    name: str,
    directory: Path,
    expected_dense: tuple[int, ...],
    rows: Optional[tuple[int, int]] = None,
) -> None:
    file_shape = f.shape(key)
    if file_shape != expected_dense:
        raise ValueError(
            f"{directory}: tensor {key!r} (for {name}) has file shape {list(file_shape)}, but the model expects the dense "
            f"shape {list(expected_dense)}; check that config.json and the weights belong together."
        )
    index, transposed = local_slice_index(file_shape, spec, rows)
    out = target.t() if transposed else target
    if _selected_shape(file_shape, index) != tuple(out.shape):
        raise ValueError(
            f"{directory}: {name}: this rank's slice of {key!r} has shape {list(_selected_shape(file_shape, index))}, but the "
            f"parameter holds {list(out.shape)}; its tensor-parallel spec does not describe it."
        )
    f.read(key, index, out=out)
