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
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard as LocalShard
from torch.distributed._shard.sharded_tensor import ShardedTensor, ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.api import ShardedTensorBase
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor import Shard as ShardPlacement

from lightning_mp.nn import TPModule
from lightning_mp.strategy._shards import full_shape, piece_chunks, sharded_view
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
        if isinstance(value, DTensor) and sharding is not None:  # a tp shard sharded again over dp (FSDP2)
            value = _dp_sharded_view(value, sharding)
        elif sharding is not None:
            value = sharded_view(value, sharding.spec, sharding.rank, sharding.size, sharding.group)
        out[key] = value
    return out


def _chunk_rows(size: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, length)`` of chunk ``index`` of ``size`` rows cut in ``parts`` as ``torch.chunk`` does (and FSDP2
    and ``Shard(0)``): ceil-sized chunks, the last ones shorter or empty."""
    step = -(-size // parts)
    start = min(index * step, size)
    return start, min(step, size - start)


def _dp_sharded_view(value: DTensor, sharding: _Sharding) -> ShardedTensor:
    """A tp shard that FSDP2 sharded again (rows of dim 0 over the data-parallel shard mesh, replicated over an HSDP
    replicate dim) as a ``ShardedTensor`` of the full logical tensor: each local shard is where one tp block meets
    this rank's rows (see [Note: sharded data parallelism in checkpoints] in ``_dtensors.py``). No communication.

    Raises:
        ValueError: for a ``DTensor`` sharded otherwise than on dim 0 over one mesh dim.
    """
    shard_dims = [i for i, p in enumerate(value.placements) if isinstance(p, ShardPlacement)]
    others = [p for p in value.placements if not isinstance(p, (ShardPlacement, Replicate))]
    if len(shard_dims) != 1 or value.placements[shard_dims[0]].dim != 0 or others:
        raise ValueError(
            f"A tensor-parallel shard under sharded data parallelism must be sharded on dim 0 over one mesh dim"
            f" (FSDP2's default), got placements {value.placements}; checkpoints cannot describe it."
        )
    spec, tp_rank, tp_size = sharding.spec, sharding.rank, sharding.size
    parts = value.device_mesh.size(shard_dims[0])
    mine = value.device_mesh.get_local_rank(shard_dims[0])
    local = value.to_local()
    shape = full_shape(value.shape, spec)

    def chunks(dp_index: int, tp_index: int) -> list[tuple[int, ShardMetadata]]:
        """(offset of the chunk's first row in that rank's rows, or column offset in its tp shard; metadata)."""
        start, rows = _chunk_rows(value.size(0), parts, dp_index)
        found = []
        for local_offset, full_offset, length in piece_chunks(spec, tp_index, tp_size):
            offsets, sizes = [0] * value.dim(), list(shape)
            if spec.dim == 0:  # the tp block's rows that fall in this dp chunk
                first, last = max(local_offset, start), min(local_offset + length, start + rows)
                if last <= first:
                    continue
                offsets[0], sizes[0], at = full_offset + first - local_offset, last - first, first - start
            else:
                if rows == 0:
                    continue
                offsets[0], sizes[0] = start, rows
                offsets[spec.dim], sizes[spec.dim], at = full_offset, length, local_offset
            placement = f"rank:{dp_index * tp_size + tp_index}/{local.device}"
            found.append((at, ShardMetadata(offsets, sizes, placement=placement)))
        return found

    local_shards = []
    for at, md in chunks(mine, tp_rank):
        along = 0 if spec.dim == 0 else spec.dim
        local_shards.append(LocalShard(local.narrow(along, at, md.shard_sizes[along]), md))
    global_md = ShardedTensorMetadata(
        shards_metadata=[md for d in range(parts) for t in range(tp_size) for _, md in chunks(d, t)],
        size=shape,
        tensor_properties=TensorProperties(dtype=local.dtype, layout=torch.strided, requires_grad=False),
    )
    view = ShardedTensorBase._init_from_local_shards_and_global_metadata(local_shards, global_md)
    view._process_group = sharding.group  # as in sharded_view: read by DCP's size() calls only
    view._init_rrefs = False
    return view


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
