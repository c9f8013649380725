"""Checkpoints through ``torch.distributed.checkpoint`` (DCP), keyed by the original parameter FQNs.

Every rank holds its own stage's parameters under their original names (the engine never renames), so one DCP
save writes each parameter once, from the rank that owns it (replicas on other data-parallel ranks are
deduplicated by DCP's planner), and a load reads each rank's keys wherever they were saved from. A tensor-parallel
shard is saved as its piece of the full tensor, and so is the optimizer state of the shard (see [Note: shards in
checkpoints] in ``_shards.py``), so every layout reads its own slices: a checkpoint resumes at any (pp, tp, dp),
with or without ZeRO-1. A folder becomes visible only once every rank wrote it (see [Note: checkpoint commit]). A parameter with
several names (a tied weight, copied on several stages under ``tied_weights="replicate"``) is saved once, under its
original FQN, and a load fills every name and copy from it (see [Note: replicated tied weights] in ``_tied.py``). A checkpoint
is a folder: DCP's shards plus ``meta.pt`` with Lightning's non-tensor state (epoch, loops, callbacks), the same
layout as Lightning's ``ModelParallelStrategy`` with ``save_distributed_checkpoint=True``. With
``save_distributed_checkpoint=False`` a checkpoint is one full Lightning file instead (see
[Note: full checkpoint files]); a plain Lightning checkpoint file loads the same way.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import shutil
import uuid
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
)
from torch.optim import Optimizer

from lightning_mp.nn._base import TPModule, local_state_dicts
from lightning_mp.strategy._shards import full_shape, sharded_view
from lightning_mp.strategy._tied import rename_flat_key
from lightning_mp.tp._sharding import ShardSpec, shard, shard_spec, unshard

__all__ = [
    "CheckpointMismatchError",
    "consolidate_checkpoint",
    "is_complete_checkpoint",
    "full_param_groups",
    "gather_sharded_optimizer_states",
    "load_checkpoint",
    "load_full_checkpoint",
    "load_weights",
    "model_state_dict",
    "name_checkpoint_folders",
    "optimizer_state_dict",
    "param_groups_by_fqn",
    "remove_checkpoint",
    "save_checkpoint",
    "save_full_checkpoint",
]

METADATA_FILENAME = "meta.pt"


def model_state_dict(model: nn.Module) -> dict[str, Any]:
    """This rank's parameters and buffers under their original FQNs; a tensor-parallel parameter as this rank's
    shard (no collective; ``save_checkpoint`` records where the shard lies in the full tensor)."""
    with local_state_dicts():
        state = model.state_dict(keep_vars=True)
    return {key: value.detach() if isinstance(value, Tensor) else value for key, value in state.items()}


# Flattened: one key per (parameter FQN, state or hyper-parameter), e.g. "state.h.0.attn.weight.momentum_buffer"
# and "param_groups.h.0.attn.weight.lr". Nested param_groups lists would be one key shared by every stage,
# which DCP deduplicates to rank 0's copy.
_OPTIM_OPTIONS = StateDictOptions(cpu_offload=True, flatten_optimizer_state_dict=True)


def optimizer_state_dict(model: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """This rank's optimizer state, keyed by parameter FQN (not by index, so it survives a new layout); the state
    of a tensor-parallel shard is the shard's (``save_checkpoint`` records where it lies in the full tensor)."""
    with local_state_dicts():
        return get_optimizer_state_dict(model, optimizer, options=_OPTIM_OPTIONS)


@dataclass(frozen=True)
class _Sharding:
    spec: ShardSpec
    rank: int
    size: int
    group: dist.ProcessGroup | None


def _shardings(model: nn.Module) -> dict[str, _Sharding]:
    """``{parameter FQN (every name): how it is sharded}`` for this rank's tensor-parallel parameters."""
    found = {}
    for mod_fqn, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, TPModule) and module.tp.size > 1:
            for name, param in module.named_parameters(recurse=False):
                spec = shard_spec(param)
                if spec is not None:
                    found[f"{mod_fqn}.{name}" if mod_fqn else name] = _Sharding(
                        spec, module.tp.rank, module.tp.size, module.tp.group
                    )
    return found


def _local_shard(key: str, value: Any, shardings: Mapping[str, _Sharding], flat: bool) -> _Sharding | None:
    """The sharding of ``key`` when ``value`` is this rank's tp shard of it (a parameter, or optimizer state of its
    shape); ``flat``: ``key`` is an optimizer key (``state.<fqn>.<name>``)."""
    fqn = key
    if flat:
        section, _, rest = key.partition(".")
        fqn = rest.rpartition(".")[0] if section == "state" else ""
    sharding = shardings.get(fqn)
    if sharding is not None and isinstance(value, Tensor) and value.dim() > sharding.spec.dim and (
        value.size(sharding.spec.dim) == sharding.spec.local_size(sharding.size)
    ):
        return sharding
    return None


def _as_pieces(state: dict[str, Any], shardings: Mapping[str, _Sharding], flat: bool = False) -> dict[str, Any]:
    """``state`` with each tp shard (a parameter, or optimizer state of its shape) as a view of its piece of the
    full tensor (see [Note: shards in checkpoints] in ``_shards.py``); ``flat``: optimizer keys."""
    if not shardings:
        return state
    out = {}
    for key, value in state.items():
        sharding = _local_shard(key, value, shardings, flat)
        if sharding is not None:
            value = sharded_view(value, sharding.spec, sharding.rank, sharding.size, sharding.group)
        out[key] = value
    return out


@contextmanager
def _quiet_sharded_tensor() -> Iterator[None]:
    """DCP warns that ShardedTensor is deprecated on every access; it is still the one type that describes a
    piece made of several chunks (see [Note: shards in checkpoints])."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*ShardedTensor.*", category=FutureWarning)
        yield


def name_checkpoint_folders(callbacks: list[Any]) -> None:
    """Name DCP folders without the ``.ckpt`` file suffix (``last``, ``epoch=0-step=3``), once per callback.

    ``ModelCheckpoint`` names checkpoints ``*.ckpt``; a folder under that name looks like a file that
    ``Model.load_from_checkpoint`` could open (it raises ``IsADirectoryError``). Callbacks whose ``FILE_EXTENSION``
    the user changed are left alone.
    """
    from lightning.pytorch.callbacks import ModelCheckpoint

    for callback in callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.FILE_EXTENSION == ".ckpt":
            callback.FILE_EXTENSION = ""
            names = ["last"] if callback.save_last else []
            names += [] if callback.save_top_k == 0 else [callback.filename or "epoch=E-step=S"]
            where = callback.dirpath or "<log dir>/checkpoints"
            rank_zero_info(
                "lightning_mp: checkpoints are DCP folders (save_distributed_checkpoint=True), named without"
                f" '.ckpt': {' and '.join(f'{where}/{n}' for n in names) or 'none is saved'}. Pass"
                " `save_distributed_checkpoint=False` to the strategy for one Lightning .ckpt file instead."
            )


def _originals(state: dict[str, Any], names: Mapping[str, str], flat: bool = False) -> dict[str, Any]:
    """``state`` keyed by original FQNs: every other name of a shared parameter folds into its original one."""
    renamed: dict[str, Any] = {}
    for key, value in state.items():
        renamed.setdefault(rename_flat_key(key, names) if flat else names.get(key, key), value)
    return renamed


PARTIAL_SUFFIX = ".partial"


def _partial_path(path: Path) -> Path:
    """Where a checkpoint is written before it is committed under ``path`` (hidden, so no glob takes it)."""
    return path.parent / f".{path.name}{PARTIAL_SUFFIX}"


def is_complete_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a committed checkpoint folder: DCP's ``.metadata`` (written by the coordinator after
    every rank's shards) and ``meta.pt`` (written after that), under a name that is not a temporary one."""
    return (
        path.is_dir()
        and not path.name.endswith(PARTIAL_SUFFIX)
        and (path / METADATA_FILENAME).is_file()
        and (path / ".metadata").is_file()
    )


def _remove(path: Path) -> None:
    """Remove a file or folder so that its name is gone at once (renamed first, then deleted)."""
    if path.is_dir() and not path.is_symlink():
        trash = path.parent / f".{path.name}.removing-{uuid.uuid4().hex[:8]}"
        os.rename(path, trash)
        shutil.rmtree(trash, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


def remove_checkpoint(path: Path) -> None:
    """Delete a checkpoint (``save_top_k`` rotation) on one rank: its name disappears in one rename, so no rank
    or later resume sees a half-deleted folder."""
    _remove(path)


def save_checkpoint(
    checkpoint: dict[str, Any], path: Path, is_global_zero: bool, names: Mapping[str, str] | None = None,
    model: nn.Module | None = None,
) -> None:
    """Write ``checkpoint`` (Lightning's dict) as a DCP folder. Every rank must call this.

    [Note: checkpoint commit] Every rank writes into ``.<name>.partial`` next to ``path``; once DCP's
    coordinator has written ``.metadata`` (after every rank's shards were written) global rank 0 writes
    ``meta.pt`` and renames the folder to ``path`` (an earlier checkpoint there is first renamed away, then
    deleted), and every rank waits for that. A save that dies half-way (a rank killed) leaves the partial folder
    and the previous checkpoint at ``path`` intact; a folder without both marker files is never loaded.

    ``names``: other names of shared parameters -> original FQN; each is saved once, under the original.
    ``model``: this rank's model, whose tensor-parallel shards are saved as pieces of their full tensors
    (see [Note: shards in checkpoints] in ``_shards.py``).
    """
    names = names or {}
    shardings = _shardings(model) if model is not None else {}
    partial = _partial_path(path)
    if is_global_zero:
        if partial.exists():  # left by a save that died
            _remove(partial)
        partial.parent.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    tensors = {"state_dict": _as_pieces(_originals(checkpoint.pop("state_dict"), names), shardings)}
    for index, state in enumerate(checkpoint.pop("optimizer_states", [])):
        compact = _compact_groups(_originals(state, names, flat=True))
        tensors[f"optimizer_{index}"] = _as_pieces(compact, shardings, flat=True)
    with _quiet_sharded_tensor():
        dcp.save(tensors, checkpoint_id=partial)
    if is_global_zero:
        torch.save(checkpoint, partial / METADATA_FILENAME)
        if path.exists() or path.is_symlink():
            _remove(path)
        os.rename(partial, path)
    dist.barrier()


class CheckpointMismatchError(RuntimeError):
    """A checkpoint does not fit the model: missing or unexpected keys, or other shapes (``strict`` loading)."""


def _check_against(
    path: Path, prefix: str, request: dict[str, Any], saved: Mapping[str, Any], strict: bool, what: str,
    report_unexpected: bool,
) -> dict[str, Any]:
    """``request`` without the keys the checkpoint lacks or holds in another shape; with ``strict``, an error
    naming them instead (every rank raises the same one: the lists are gathered over the world)."""
    mine = {}
    for key, value in request.items():
        if isinstance(value, Tensor):
            mine[key] = tuple(value.size())
        else:
            mine[key] = None
    missing = sorted(k for k in mine if prefix + k not in saved)
    mismatched = []
    for key, shape in mine.items():
        md = saved.get(prefix + key)
        if shape is not None and isinstance(md, TensorStorageMetadata) and tuple(md.size) != shape:
            mismatched.append((key, tuple(md.size), shape))
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (sorted(mine), missing, mismatched))
    requested = {k for keys, _, _ in everyone for k in keys}
    all_missing = sorted({k for _, m, _ in everyone for k in m})
    all_mismatched = sorted({t for _, _, mm in everyone for t in mm})
    unexpected = (
        sorted(k[len(prefix) :] for k in saved if k.startswith(prefix) and k[len(prefix) :] not in requested)
        if report_unexpected
        else []
    )
    if all_missing or all_mismatched or unexpected:
        lines = []
        if all_missing:
            lines.append(f"missing keys ({len(all_missing)}): {all_missing[:10]}")
        if unexpected:
            lines.append(f"unexpected keys ({len(unexpected)}): {unexpected[:10]}")
        if all_mismatched:
            lines.append(
                "shape mismatches (key, saved, this model): "
                + ", ".join(f"{k}: {tuple(a)} vs {tuple(b)}" for k, a, b in all_mismatched[:10])
            )
        message = f"The checkpoint {path} does not fit this model's {what}: " + "; ".join(lines) + "."
        if strict:
            raise CheckpointMismatchError(
                message + " Pass a checkpoint of this model, or set `strict_loading = False` on the LightningModule"
                " to load only the matching entries."
            )
        rank_zero_warn(message + " Loading only the matching entries (strict_loading=False).")
    drop = set(missing) | {k for k, _, _ in mismatched}
    return {k: v for k, v in request.items() if k not in drop}


def load_checkpoint(
    path: Path, model: nn.Module, optimizers: list[Optimizer], *, strict: bool, weights_only: bool | None,
    names: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Load a folder written by :func:`save_checkpoint` into ``model`` and ``optimizers``; return the rest.

    Any layout reads any other's checkpoint: every rank asks DCP for its own keys in its own pieces (pipeline
    stages: its parameters; tp shards: its slice of the full tensor; ZeRO: its share of the optimizer state).
    Parameters are loaded in place.

    Raises:
        FileNotFoundError: if ``path`` is not a complete checkpoint folder (see [Note: checkpoint commit]).
        CheckpointMismatchError: with ``strict``, if the checkpoint lacks a key of this model, holds keys this
            model does not have, or holds a tensor in another shape; each is listed.
    """
    if not is_complete_checkpoint(path):
        raise FileNotFoundError(
            f"{path} is neither a complete lightning_mp checkpoint folder (with {METADATA_FILENAME} and DCP's"
            " .metadata) nor a checkpoint file. Pass the path of a folder written with"
            " save_distributed_checkpoint=True (a save that died half-way leaves only a hidden '.<name>.partial'"
            " folder) or of a Lightning .ckpt file."
        )
    names = names or {}
    shardings = _shardings(model)
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    with _quiet_sharded_tensor():
        request = _as_pieces(_originals(model_state_dict(model), names), shardings)
        request = _check_against(path, "state_dict.", request, saved, strict, "parameters and buffers", True)
        dcp.load({"state_dict": request}, checkpoint_id=path)  # in place, into the parameters and buffers
        for index, optimizer in enumerate(optimizers):
            key = f"optimizer_{index}"
            local_optim = optimizer_state_dict(model, optimizer)  # this model's names (a fresh state if unstepped)
            by_original = _originals(local_optim, names, flat=True)
            hyper, known = _saved_hyperparameters(path, key, by_original, saved)
            pieces = _as_pieces(by_original, shardings, flat=True)
            pieces = _check_against(path, key + ".", pieces, {**saved, **known}, strict, f"optimizer {index}", False)
            request = {k: v for k, v in pieces.items() if k not in hyper}
            dcp.load({key: request}, checkpoint_id=path)  # tensors in place (into by_original's), the rest here
            pieces = {**pieces, **request, **{k: v for k, v in hyper.items() if k in pieces}}
            # a parameter whose state is not all there (strict=False) starts afresh: Adam needs every entry
            partial = {_split_flat_key(k)[1] for k in by_original if k.startswith("state.") and k not in pieces}
            loaded = {}
            for k in local_optim:
                original = rename_flat_key(k, names)
                if original in pieces and _split_flat_key(original)[1] not in partial:
                    value = by_original[original]
                    loaded[k] = value if isinstance(value, Tensor) else pieces[original]
            set_flat_optimizer_state(model, optimizer, loaded)
    return torch.load(path / METADATA_FILENAME, weights_only=weights_only)


_GROUPS = "groups."


def _compact_groups(flat: dict[str, Any]) -> dict[str, Any]:
    """A flattened optimizer state with its per-parameter hyper-parameters (``param_groups.<fqn>.lr``, a dozen
    small entries per parameter, each a separate DCP item) folded into one record per distinct set of values:
    ``groups.<digest>`` = pickled ``{"params": [fqn, ...], "hps": {...}}``, keyed by a digest of the record: records
    of several stages or ZeRO shares get distinct keys (a tied weight's copy may come first on two stages), equal
    ones (data-parallel replicas, tp ranks) one key that DCP writes once."""
    out = {k: v for k, v in flat.items() if not k.startswith("param_groups.")}
    by_fqn: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        if key.startswith("param_groups."):
            _, fqn, name = _split_flat_key(key)
            by_fqn.setdefault(fqn, {})[name] = value
    records: dict[str, dict[str, Any]] = {}
    for fqn, hps in by_fqn.items():
        records.setdefault(repr(sorted(hps.items())), {"params": [], "hps": hps})["params"].append(fqn)
    for record in records.values():  # pickled: DCP would flatten a dict into one item per entry again
        blob = pickle.dumps(record)
        out[_GROUPS + hashlib.sha1(blob).hexdigest()[:16]] = blob  # equal records (replicas) share one key
    return out


def _saved_hyperparameters(
    path: Path, key: str, local: Mapping[str, Any], saved: Mapping[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The saved values of ``local``'s ``param_groups.<fqn>.<name>`` keys, read from the group records of
    :func:`_compact_groups` (every rank reads all records: one small collective load); and those keys as
    metadata entries, so that the key check counts them present. Nothing for a checkpoint without records."""
    prefix = f"{key}.{_GROUPS}"
    record_keys = sorted(k[len(key) + 1 :] for k in saved if k.startswith(prefix))
    if not record_keys:  # per-parameter keys (an earlier format) are read as they are
        return {}, {}
    records: dict[str, Any] = {k: 0 for k in record_keys}  # placeholders, replaced by the saved objects
    dcp.load({key: records}, checkpoint_id=path)
    unpickled = [pickle.loads(blob) for blob in records.values()]  # noqa: S301 (plain values we wrote)
    lookup = {fqn: record["hps"] for record in unpickled for fqn in record["params"]}
    hyper = {}
    for k in local:
        if k.startswith("param_groups."):
            _, fqn, name = _split_flat_key(k)
            if name in lookup.get(fqn, {}):
                hyper[k] = lookup[fqn][name]
    return hyper, {f"{key}.{k}": None for k in hyper}


def set_flat_optimizer_state(model: nn.Module, optimizer: Optimizer, flat: Mapping[str, Any]) -> None:
    """Load a flattened, FQN-keyed optimizer state (as :func:`optimizer_state_dict` gives) into ``optimizer``.

    ``set_optimizer_state_dict`` of torch does the same but fails with an ``IndexError`` when a param group is
    empty (a pipeline stage that holds none of a group's parameters, e.g. no weight-decayed ones); here an empty
    group keeps its hyper-parameters. Keys of this optimizer's parameters absent from ``flat`` leave their state
    empty (it is created at the first step).
    """
    state: dict[str, dict[str, Any]] = {}
    hyper: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        section, fqn, name = _split_flat_key(key)
        (state if section == "state" else hyper).setdefault(fqn, {})[name] = value
    fqn_of = {id(p): fqn for fqn, p in model.named_parameters()}
    native: dict[str, Any] = {"state": {}, "param_groups": []}
    index = 0
    for group in optimizer.param_groups:
        ids = []
        for p in group["params"]:
            fqn = fqn_of[id(p)]
            if fqn in state:
                native["state"][index] = state[fqn]
            ids.append(index)
            index += 1
        first = fqn_of[id(group["params"][0])] if group["params"] else None
        hps = hyper.get(first, {}) if first is not None else {}
        kept = {k: v for k, v in group.items() if k != "params"}
        native["param_groups"].append({**kept, **hps, "params": ids})
    optimizer.load_state_dict(native)


# ---- one full Lightning checkpoint file (save_distributed_checkpoint=False, and plain checkpoints) ------------
#
# [Note: full checkpoint files] A full file is what Lightning writes on one device: ``state_dict`` holds every
# parameter and buffer under its FQN, ``optimizer_states`` holds ``optimizer.state_dict()`` of the whole model
# (integer ids numbered over the param groups in order, each group's parameters in the model's
# ``named_parameters()`` order, as when ``configure_optimizers`` passes ``self.parameters()`` or groups of them).
# Writing one: each stage's FQN-keyed states are gathered to global rank 0 over the pipeline group of replica 0,
# group g of the full optimizer is the union of every stage's group g ordered by the model's parameter order,
# and rank 0 writes the file. Reading one: every rank reads the file, keeps its own keys, and maps the saved ids
# back to FQNs the same way.


def param_groups_by_fqn(
    model: nn.Module, optimizer: Optimizer, originals: Mapping[str, str] | None = None
) -> list[list[str]]:
    """This rank's optimizer groups as lists of parameter FQNs (in the group's order); with ``originals``, a copy of
    a replicated tied weight goes by its original FQN."""
    originals = originals or {}
    names = {id(p): originals.get(fqn, fqn) for fqn, p in model.named_parameters()}
    return [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]


def full_param_groups(local_groups: list[list[list[str]]], param_order: list[str]) -> list[list[str]]:
    """Group g of the whole model: every stage's group g, in ``param_order`` (see [Note: full checkpoint files]).

    Args:
        local_groups: per stage, per group, the FQNs that stage's optimizer holds.
        param_order: every parameter FQN of the whole model, in ``named_parameters()`` order.
    """
    position = {fqn: index for index, fqn in enumerate(param_order)}
    num_groups = max(len(groups) for groups in local_groups)
    full = []
    for g in range(num_groups):
        fqns = {fqn for groups in local_groups if g < len(groups) for fqn in groups[g]}
        full.append(sorted(fqns, key=lambda fqn: position.get(fqn, len(position))))
    return full


def _split_flat_key(key: str) -> tuple[str, str, str]:
    """``"state.h.0.weight.exp_avg"`` -> ``("state", "h.0.weight", "exp_avg")`` (optimizer keys hold no dots)."""
    section, rest = key.split(".", 1)
    fqn, name = rest.rsplit(".", 1)
    return section, fqn, name


def consolidate_checkpoint(
    checkpoint: dict[str, Any], local_groups: list[list[list[str]]], param_order: list[str],
    group: dist.ProcessGroup | None, dst: int, names: Mapping[str, str] | None = None,
) -> dict[str, Any] | None:
    """Gather every stage's part of ``checkpoint`` to global rank ``dst``; return the full checkpoint there.

    Every rank of ``group`` (the pipeline group of replica 0) must call this with its own ``checkpoint`` (FQN-keyed
    ``state_dict`` and flattened ``optimizer_states`` as :func:`optimizer_state_dict` gives them).
    ``local_groups[i]`` is :func:`param_groups_by_fqn` of optimizer ``i`` on this rank. Returns ``None`` elsewhere.
    The ``state_dict`` keeps every name of a tied weight, as on one device; optimizer states go by original FQNs
    (``names``: other name -> original FQN).
    """
    optimizer_states = [_originals(state, names or {}, flat=True) for state in checkpoint.get("optimizer_states", [])]
    part = {"state_dict": checkpoint["state_dict"], "optimizer_states": optimizer_states, "groups": local_groups}
    parts: list[Any] | None = [None] * dist.get_world_size(group) if dist.get_rank() == dst else None
    dist.gather_object(part, parts, dst=dst, group=group)
    if parts is None:
        return None
    full = {key: value for key, value in checkpoint.items() if key not in ("state_dict", "optimizer_states")}
    full["state_dict"] = {}
    for stage_part in parts:  # a replicated tied weight comes from every stage that holds it: keep the first
        for key, value in stage_part["state_dict"].items():
            full["state_dict"].setdefault(key, value)
    num_optimizers = len(part["optimizer_states"])
    full["optimizer_states"] = [
        _native_optimizer_state([p["optimizer_states"][i] for p in parts], [p["groups"][i] for p in parts], param_order)
        for i in range(num_optimizers)
    ]
    return full


def _native_optimizer_state(
    flat_states: list[dict[str, Any]], groups: list[list[list[str]]], param_order: list[str]
) -> dict[str, Any]:
    """``optimizer.state_dict()`` of the whole model from every stage's flattened, FQN-keyed state."""
    state: dict[str, dict[str, Any]] = {}
    hyper: dict[str, dict[str, Any]] = {}
    for flat in flat_states:
        for key, value in flat.items():
            section, fqn, name = _split_flat_key(key)
            (state if section == "state" else hyper).setdefault(fqn, {})[name] = value
    native: dict[str, Any] = {"state": {}, "param_groups": []}
    next_id = 0
    for fqns in full_param_groups(groups, param_order):
        ids = list(range(next_id, next_id + len(fqns)))
        next_id += len(fqns)
        for index, fqn in zip(ids, fqns):
            if fqn in state:
                native["state"][index] = state[fqn]
        hps = hyper.get(fqns[0], {}) if fqns else {}
        native["param_groups"].append({**hps, "params": ids})
    return native


def gather_sharded_optimizer_states(
    states: list[dict[str, Any]], group: dist.ProcessGroup, dst: int
) -> list[dict[str, Any]] | None:
    """Under ZeRO-1 (``shard_optimizer_state``): every dp rank of a stage holds the state of its own share of the
    stage's parameters, flattened and keyed by FQN (:func:`optimizer_state_dict`); merge them on global rank
    ``dst`` of the stage's data-parallel ``group`` (the keys of two shares never overlap). ``None`` elsewhere."""
    parts: list[Any] | None = [None] * dist.get_world_size(group) if dist.get_rank() == dst else None
    dist.gather_object(states, parts, dst=dst, group=group)
    if parts is None:
        return None
    return [{key: value for part in parts for key, value in part[i].items()} for i in range(len(states))]


def gather_tp_shards(state: dict[str, Any], model: nn.Module, flat: bool = False) -> dict[str, Any]:
    """``state`` with every tensor-parallel shard (a parameter, or optimizer state of its shape; ``flat``:
    optimizer keys) all-gathered over its tp group into the full tensor, as a full checkpoint file holds it.

    Every rank of each tp group must call this with the same keys (the ranks of a tp group hold the same FQNs).
    """
    shardings = _shardings(model)
    if not shardings:
        return state
    device = next(iter(model.parameters())).device
    out = {}
    for key in sorted(state):
        value = state[key]
        sharding = _local_shard(key, value, shardings, flat)
        if sharding is not None:
            local = value.detach().to(device).contiguous()
            pieces = [torch.empty_like(local) for _ in range(sharding.size)]
            dist.all_gather(pieces, local, group=sharding.group)
            value = unshard(pieces, sharding.spec).to(value.device)
        out[key] = value
    return out


def save_full_checkpoint(
    checkpoint: dict[str, Any], path: Path, model: nn.Module, optimizers: list[Optimizer], param_order: list[str],
    group: dist.ProcessGroup, checkpoint_io: Any | None, names: Mapping[str, str] | None = None,
) -> None:
    """Write one full Lightning checkpoint file from global rank 0 (``save_distributed_checkpoint=False``).

    Every rank of replica 0's pipeline ``group`` calls this; the rank given a ``checkpoint_io`` (global rank 0)
    writes, replacing a DCP folder of the same name.
    """
    groups = [param_groups_by_fqn(model, optimizer, names) for optimizer in optimizers]
    full = consolidate_checkpoint(checkpoint, groups, param_order, group, dst=0, names=names)
    if checkpoint_io is not None:
        assert full is not None
        if path.is_dir():
            shutil.rmtree(path)
        checkpoint_io.save_checkpoint(full, path)


def load_full_checkpoint(
    path: Path, model: nn.Module, optimizers: list[Optimizer], param_order: list[str], group: dist.ProcessGroup,
    *, strict: bool, weights_only: bool | None, local_optimizers: list[Optimizer] | None = None,
    names: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Load a full Lightning checkpoint file (one device's, or one written with ``save_distributed_checkpoint=False``).

    Each rank keeps the parameters, buffers and optimizer states of its own stage (see [Note: full checkpoint
    files]); every rank of the pipeline ``group`` must call this. Returns the rest (loops, callbacks, ...).
    ``optimizers`` give the stage's param groups; under ZeRO-1 ``local_optimizers`` (each rank's share) receive
    the states of their own parameters only.

    Raises:
        ValueError: if the file's optimizer groups do not have the sizes this model's optimizers have.
        RuntimeError: with ``strict``, if the file misses a parameter or buffer of this stage.
    """
    local_optimizers = optimizers if local_optimizers is None else local_optimizers
    stages: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(stages, [param_groups_by_fqn(model, o, names) for o in optimizers], group=group)
    full_groups = [full_param_groups([stage[i] for stage in stages], param_order) for i in range(len(optimizers))]
    checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)
    saved = checkpoint.pop("state_dict")
    local_keys = model.state_dict().keys()
    names = names or {}
    saved = {**{k: saved[o] for k, o in names.items() if k not in saved and o in saved}, **saved}  # tied: one name
    missing = sorted(k for k in local_keys if k not in saved)
    if missing and strict:
        raise RuntimeError(f"{path} has no entry for {missing[:5]} of this model; pass a checkpoint of this model.")
    model.load_state_dict({k: saved[k] for k in local_keys if k in saved}, strict=False)
    for index, (optimizer, fqn_groups) in enumerate(zip(local_optimizers, full_groups)):
        optimizer_states = checkpoint.get("optimizer_states", [])
        if index >= len(optimizer_states):
            break
        _load_native_optimizer_state(optimizer, model, optimizer_states[index], fqn_groups, path, names)
    checkpoint.pop("optimizer_states", None)
    return checkpoint


def _load_native_optimizer_state(
    optimizer: Optimizer, model: nn.Module, native: dict[str, Any], fqn_groups: list[list[str]], path: Path,
    originals: Mapping[str, str] | None = None,
) -> None:
    originals = originals or {}
    saved_groups = native["param_groups"]
    sizes, expected = [len(g["params"]) for g in saved_groups], [len(g) for g in fqn_groups]
    if sizes != expected:
        raise ValueError(
            f"The optimizer in {path} has param groups of sizes {sizes}, but this model's optimizer has {expected}."
            " Resume with the same `configure_optimizers`, or load only the weights (`Model.load_from_checkpoint`)."
        )
    id_of = {fqn: pid for group, fqns in zip(saved_groups, fqn_groups) for pid, fqn in zip(group["params"], fqns)}
    names = {id(p): originals.get(fqn, fqn) for fqn, p in model.named_parameters()}
    shardings = {id(p): _shardings(model).get(fqn) for fqn, p in model.named_parameters()}
    local: dict[str, Any] = {"state": {}, "param_groups": []}
    next_index = 0
    for group, saved_group in zip(optimizer.param_groups, saved_groups):
        indices = []
        for p in group["params"]:
            saved_id = id_of[names[id(p)]]
            if saved_id in native["state"]:
                local["state"][next_index] = _own_slices(native["state"][saved_id], p, shardings.get(id(p)))
            indices.append(next_index)
            next_index += 1
        local["param_groups"].append({**{k: v for k, v in saved_group.items() if k != "params"}, "params": indices})
    optimizer.load_state_dict(local)


def load_weights(path: str | Path, model: nn.Module, names: Mapping[str, str], *, strict: bool) -> None:
    """Initialise this rank's part of ``model`` from whole weights at ``path`` (see ``SMPStrategy(load_weights=)``):
    each tensor-parallel parameter keeps its slice of the full tensor (the distributed modules' load hook).

    Raises:
        CheckpointMismatchError: with ``strict``, if ``path`` lacks a parameter or buffer of this stage; the same
            error on every rank (the lists are gathered).
    """
    from lightning_mp.strategy._consolidate import hf_info, read_weights

    info = hf_info(model)
    saved = read_weights(path, info["prefix"] if info else "")
    for other, original in names.items():  # a shared parameter under either of its names
        if other not in saved and original in saved:
            saved[other] = saved[original]
        elif original not in saved and other in saved:
            saved[original] = saved[other]
    local = model_state_dict(model)
    shardings = _shardings(model)
    missing = sorted(k for k in local if k not in saved)
    mismatched = []
    for key, value in local.items():
        if key in saved and isinstance(value, Tensor):
            expected = full_shape(value.shape, shardings[key].spec) if key in shardings else value.shape
            if tuple(saved[key].shape) != tuple(expected):
                mismatched.append((key, tuple(saved[key].shape), tuple(expected)))
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (missing, mismatched))
    all_missing = sorted({k for m, _ in everyone for k in m})
    all_mismatched = sorted({t for _, mm in everyone for t in mm})
    if all_missing or all_mismatched:
        message = f"The weights at {path} do not fit this model: " + "; ".join(
            part
            for part in (
                f"missing keys ({len(all_missing)}): {all_missing[:10]}" if all_missing else "",
                "shape mismatches (key, saved, this model): "
                + ", ".join(f"{k}: {a} vs {b}" for k, a, b in all_mismatched[:10])
                if all_mismatched
                else "",
            )
            if part
        )
        if all_mismatched or strict:
            raise CheckpointMismatchError(
                message + ". Pass weights of this model (original module FQNs and full shapes), or set"
                " `strict_loading = False` on the LightningModule to skip missing keys."
            )
        rank_zero_warn(message + "; they keep their initial values (strict_loading=False).")
    with torch.no_grad():
        model.load_state_dict({k: saved[k] for k in local if k in saved}, strict=False)
    rank_zero_info(f"lightning_mp: initial weights loaded from {path}")


def _own_slices(param_state: dict[str, Any], param: Tensor, sharding: _Sharding | None) -> dict[str, Any]:
    """A full file's optimizer state of one parameter, each full-shape tensor cut to this rank's tp shard."""
    if sharding is None:
        return param_state
    spec = sharding.spec
    out = {}
    for name, value in param_state.items():
        if isinstance(value, Tensor) and value.shape != param.shape and value.dim() > spec.dim and (
            value.size(spec.dim) == spec.full_size
        ):
            value = shard(value, spec, sharding.rank, sharding.size)
        out[name] = value
    return out
