"""A checkpoint folder: DCP's shards plus ``meta.pt``, written under a temporary name and committed by one rename
([Note: checkpoint commit]), loaded by any layout with its keys checked against the model."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.optim import Optimizer

from lightning_mp.strategy._checkpoint._sharding import _as_pieces, _quiet_sharded_tensor, _shardings
from lightning_mp.strategy._checkpoint._state import (
    _compact_groups,
    _originals,
    _saved_hyperparameters,
    _split_flat_key,
    model_state_dict,
    optimizer_state_dict,
    set_flat_optimizer_state,
)
from lightning_mp.strategy._roll_call import naming_failed_ranks
from lightning_mp.strategy._tied import rename_flat_key

__all__ = [
    "METADATA_FILENAME",
    "PARTIAL_SUFFIX",
    "CheckpointMismatchError",
    "is_complete_checkpoint",
    "load_checkpoint",
    "name_checkpoint_folders",
    "remove_checkpoint",
    "save_checkpoint",
]

METADATA_FILENAME = "meta.pt"

def name_checkpoint_folders(callbacks: list[Any], announce: bool = True) -> None:
    """Name DCP folders without the ``.ckpt`` file suffix (``last``, ``epoch=0-step=3``), once per callback.

    ``ModelCheckpoint`` names checkpoints ``*.ckpt``; a folder under that name looks like a file that
    ``Model.load_from_checkpoint`` could open (it raises ``IsADirectoryError``). Callbacks whose ``FILE_EXTENSION``
    the user changed are left alone. ``announce=False`` (at launch, before ``ckpt_path="last"`` is resolved and
    before the log folder is known) renames silently; the first call with ``announce=True`` (at setup) says where
    the folders land.
    """
    from lightning.pytorch.callbacks import ModelCheckpoint

    for callback in callbacks:
        if not isinstance(callback, ModelCheckpoint):
            continue
        if callback.FILE_EXTENSION == ".ckpt":
            callback.FILE_EXTENSION = ""
            callback._lightning_mp_folders = True
        if announce and getattr(callback, "_lightning_mp_folders", False):
            del callback._lightning_mp_folders  # said once
            names = ["last"] if callback.save_last else []
            names += [] if callback.save_top_k == 0 else [callback.filename or "epoch=E-step=S"]
            where = callback.dirpath or "<log dir>/checkpoints"
            rank_zero_info(
                "lightning_mp: checkpoints are DCP folders (save_distributed_checkpoint=True), named without"
                f" '.ckpt': {' and '.join(f'{where}/{n}' for n in names) or 'none is saved'}. Pass"
                " `save_distributed_checkpoint=False` to the strategy for one Lightning .ckpt file instead."
            )


PARTIAL_SUFFIX = ".partial"


def _hidden(path: Path, suffix: str) -> Path:
    """A temporary name next to ``path``: hidden (no glob takes it), and without ``ckpt_``, since Lightning's
    SLURM requeue reads a version number out of every name in the folder that has ``ckpt_`` (``hpc_ckpt_N``):
    a ``.hpc_ckpt_2.ckpt.partial`` left by a killed save would make the requeued job resume from a missing
    ``hpc_ckpt_2.ckpt``."""
    return path.parent / f".{path.name.replace('ckpt_', 'ckpt-')}{suffix}"


def _partial_path(path: Path) -> Path:
    """Where a checkpoint is written before it is committed under ``path`` (see :func:`_hidden`)."""
    return _hidden(path, PARTIAL_SUFFIX)


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
        trash = _hidden(path, f".removing-{uuid.uuid4().hex[:8]}")
        os.rename(path, trash)
        shutil.rmtree(trash, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


def remove_checkpoint(path: Path) -> None:
    """Delete a checkpoint (``save_top_k`` rotation) on one rank: its name disappears in one rename, so no rank
    or later resume sees a half-deleted folder."""
    _remove(path)


@naming_failed_ranks("a checkpoint save")  # a rank lost inside DCP's collectives is named: see _roll_call.py
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


@naming_failed_ranks("a checkpoint load")
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
