"""Tensor-parallel shards in checkpoints: each saved as its piece of the full tensor ([Note: shards in checkpoints]
in ``strategy/_shards.py``), gathered whole for a full file, cut to this rank's slice from one."""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_mp.nn import TPModule
from lightning_mp.strategy._shards import sharded_view
from lightning_mp.tp import ShardSpec, shard, shard_spec, unshard

__all__ = ["gather_tp_shards"]

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
