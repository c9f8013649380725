"""Tensor-parallel shards as pieces of their full logical tensor, for ``torch.distributed.checkpoint``.

[Note: shards in checkpoints] A checkpoint stores every parameter under its original FQN with its full logical
shape; each tp rank writes only the piece it holds, described by DCP's chunk metadata (offsets and sizes in the
full tensor). Any other layout then reads exactly the pieces it needs: a tp=1 rank asks for the whole tensor
(DCP stitches the saved chunks), a tp=4 rank asks for its quarter (DCP reads the overlapping parts of the saved
chunks). A rank's piece is not always one chunk: a fused projection (``ShardSpec.parts = k``, e.g. ``[W_q; W_k;
W_v]``) holds ``k`` separate blocks of the full tensor, and a padded vocabulary shard holds rows past the end that
belong to no one. So a piece is wrapped as a ``ShardedTensor`` with one local shard per block (views of the
local tensor, no copy, no communication); DCP saves and loads those natively (its planner reads the local
shards' offsets), and its load copies into the views, i.e. into the parameter itself. A ``DTensor`` view
(``DTensor.from_local(..., [Shard(d)])``) describes a single chunk per rank, so it cannot express fused blocks;
torchtitan and Megatron's DCP path face the same and split fused weights into separate keys instead, which
would change the FQNs. Optimizer state of a shard (Adam's moments, of the parameter's shape) is wrapped alike.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.api import ShardedTensorBase
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

from lightning_mp.tp._sharding import ShardSpec

__all__ = ["full_shape", "piece_chunks", "sharded_view"]


def full_shape(local_shape: torch.Size | tuple[int, ...], spec: ShardSpec) -> torch.Size:
    """The logical (unsharded) shape of a tensor whose dim ``spec.dim`` is sharded by ``spec``."""
    shape = list(local_shape)
    shape[spec.dim] = spec.full_size
    return torch.Size(shape)


def piece_chunks(spec: ShardSpec, rank: int, tp_size: int) -> list[tuple[int, int, int]]:
    """Where rank ``rank``'s piece lies along ``spec.dim``: ``(local offset, full offset, length)`` per block.

    The inverse of :func:`lightning_mp.tp.shard`: blocks of length 0 (padding only) are left out.
    """
    if spec.padded:
        local = spec.local_size(tp_size)
        start = rank * local
        length = max(0, min(local, spec.full_size - start))
        return [(0, start, length)] if length else []
    block = spec.full_size // spec.parts
    width = block // tp_size
    return [(p * width, p * block + rank * width, width) for p in range(spec.parts)]


def sharded_view(
    local: Tensor, spec: ShardSpec, rank: int, tp_size: int, group: dist.ProcessGroup | None = None
) -> ShardedTensor:
    """``local`` (rank ``rank``'s shard, of ``spec.local_size`` along ``spec.dim``) as a ``ShardedTensor`` of the
    full logical shape whose local shards are views of ``local`` (see [Note: shards in checkpoints]).

    No communication: every rank computes every rank's chunk metadata from ``spec``. ``group``: the tp group
    (``None``: the default group), recorded on the view only.

    Raises:
        ValueError: if ``local`` does not have the shard's size along ``spec.dim``.
    """
    if local.size(spec.dim) != spec.local_size(tp_size):
        raise ValueError(
            f"A tp shard of size {local.size(spec.dim)} along dim {spec.dim} does not match its spec {spec} at"
            f" tensor_parallel_degree={tp_size} (expected {spec.local_size(tp_size)})."
        )
    shape = full_shape(local.shape, spec)
    device = local.device

    def metadata(r: int) -> list[ShardMetadata]:
        shards = []
        for _, full_offset, length in piece_chunks(spec, r, tp_size):
            offsets, sizes = [0] * local.dim(), list(shape)
            offsets[spec.dim], sizes[spec.dim] = full_offset, length
            shards.append(ShardMetadata(offsets, sizes, placement=f"rank:{r}/{device}"))
        return shards

    own = metadata(rank)
    local_shards = [
        Shard(local.narrow(spec.dim, local_offset, length), md)
        for (local_offset, _, length), md in zip(piece_chunks(spec, rank, tp_size), own)
    ]
    global_md = ShardedTensorMetadata(
        shards_metadata=[md for r in range(tp_size) for md in metadata(r)],
        size=shape,
        tensor_properties=TensorProperties(dtype=local.dtype, layout=torch.strided, requires_grad=False),
    )
    view = ShardedTensorBase._init_from_local_shards_and_global_metadata(local_shards, global_md)
    view._process_group = group  # read by the few ops DCP calls on it (``size()``); nothing is communicated
    view._init_rrefs = False
    return view
