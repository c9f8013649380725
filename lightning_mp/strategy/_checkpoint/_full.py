"""One full Lightning checkpoint file (``save_distributed_checkpoint=False``, and plain checkpoints)."""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from lightning_mp.strategy._checkpoint._dtensors import like_local
from lightning_mp.strategy._checkpoint._sharding import _own_slices, _shardings
from lightning_mp.strategy._checkpoint._state import _originals, _split_flat_key

__all__ = [
    "consolidate_checkpoint",
    "full_param_groups",
    "gather_sharded_optimizer_states",
    "load_full_checkpoint",
    "param_groups_by_fqn",
    "save_full_checkpoint",
]

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
    local = model.state_dict()
    names = names or {}
    saved = {**{k: saved[o] for k, o in names.items() if k not in saved and o in saved}, **saved}  # tied: one name
    missing = sorted(k for k in local if k not in saved)
    if missing and strict:
        raise RuntimeError(f"{path} has no entry for {missing[:5]} of this model; pass a checkpoint of this model.")
    model.load_state_dict({k: like_local(saved[k], v) for k, v in local.items() if k in saved}, strict=False)
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
                own = _own_slices(native["state"][saved_id], p, shardings.get(id(p)))
                local["state"][next_index] = {k: like_local(v, p) for k, v in own.items()}  # sdp: this rank's rows
            indices.append(next_index)
            next_index += 1
        local["param_groups"].append({**{k: v for k, v in saved_group.items() if k != "params"}, "params": indices})
    optimizer.load_state_dict(local)
