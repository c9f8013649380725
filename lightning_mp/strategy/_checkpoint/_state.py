"""This rank's state under original FQNs: the model's, and the optimizer's flattened (one key per parameter and
entry), with its per-parameter hyper-parameters folded into group records for DCP."""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.optim import Optimizer

from lightning_mp.nn import local_state_dicts
from lightning_mp.strategy._tied import rename_flat_key

__all__ = ["model_state_dict", "optimizer_state_dict", "set_flat_optimizer_state"]

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

def _originals(state: dict[str, Any], names: Mapping[str, str], flat: bool = False) -> dict[str, Any]:
    """``state`` keyed by original FQNs: every other name of a shared parameter folds into its original one."""
    renamed: dict[str, Any] = {}
    for key, value in state.items():
        renamed.setdefault(rename_flat_key(key, names) if flat else names.get(key, key), value)
    return renamed

def _split_flat_key(key: str) -> tuple[str, str, str]:
    """``"state.h.0.weight.exp_avg"`` -> ``("state", "h.0.weight", "exp_avg")`` (optimizer keys hold no dots)."""
    section, rest = key.split(".", 1)
    fqn, name = rest.rsplit(".", 1)
    return section, fqn, name

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
