"""Tensor-parallel collectives as autograd pairs over an explicit process group (Megatron's mappings).

Every op takes the tensor-parallel ``group`` explicitly (no default group) and is the identity when the group
has one rank. Each pair states its forward and its backward communication; they are built on plain
``torch.distributed`` collectives, not DTensor (see [Note: plain collectives, not DTensor]).

[Note: plain collectives, not DTensor] On gloo, a DTensor ``parallelize_module`` plan of a small MLP took 1.6x
the step time of these functions in one thread and about 12x when each step ran in a fresh thread (DTensor's
sharding-propagation cache is per thread; our pipeline engine runs every microbatch in its own thread).
``benchmarks/tp_vs_dtensor.py`` re-measures it.

Shapes: ``x`` is any tensor; ``dim`` is the tensor dim that is split or joined. ``tp`` is the group size,
``r`` this rank's index in it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "all_gather_along",
    "all_to_all",
    "copy_to_tp",
    "gather_from_tp",
    "reduce_from_tp",
    "reduce_scatter_along",
    "scatter_to_tp",
]


def _size(group: dist.ProcessGroup) -> int:
    return dist.get_world_size(group)


def _split(x: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
    size = _size(group)
    if x.size(dim) % size:
        raise ValueError(
            f"Cannot split dim {dim} of size {x.size(dim)} evenly over {size} tensor-parallel ranks; make it a"
            f" multiple of {size}."
        )
    return x.chunk(size, dim=dim)[dist.get_rank(group)].contiguous()


def _gather(x: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
    parts = [torch.empty_like(x) for _ in range(_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _all_reduce(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    return x


def _reduce_scatter(x: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
    # gloo has no reduce_scatter: all-reduce, then keep this rank's chunk (same result, tp x the bytes).
    return _split(_all_reduce(x, group), dim, group)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup, dim: int) -> Tensor:
        ctx.group, ctx.dim = group, dim
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        return _gather(grad, ctx.dim, ctx.group), None, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup, dim: int) -> Tensor:
        ctx.group, ctx.dim = group, dim
        return _gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        return _split(grad, ctx.dim, ctx.group), None, None


class _ReduceScatterAlong(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup, dim: int) -> Tensor:
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        return _gather(grad, ctx.dim, ctx.group), None, None


class _AllGatherAlong(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup, dim: int) -> Tensor:
        ctx.group, ctx.dim = group, dim
        return _gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        return _reduce_scatter(grad, ctx.dim, ctx.group), None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad.contiguous(), group=ctx.group)
        return out, None


def copy_to_tp(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Enter a tensor-parallel region with a replicated input (Megatron's ``f``).

    Forward: identity (every rank holds the same ``x``). Backward: all-reduce (sum) of the gradient over
    ``group``, since each rank's shard of the following layer contributes a partial gradient of ``x``.
    """
    return x if _size(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Leave a tensor-parallel region by summing partial results (Megatron's ``g``).

    Forward: all-reduce (sum) over ``group``. Backward: identity (the output is replicated, so is its gradient).
    """
    return x if _size(group) == 1 else _ReduceFromTP.apply(x, group)


def scatter_to_tp(x: Tensor, group: dist.ProcessGroup, dim: int = -1) -> Tensor:
    """Keep this rank's chunk ``r`` of a replicated ``x`` along ``dim``.

    Forward: split along ``dim`` (no communication), ``(..., D, ...) -> (..., D / tp, ...)``. Backward:
    all-gather of the gradient along ``dim``.

    Raises:
        ValueError: if ``x.size(dim)`` does not divide by the group size.
    """
    return x if _size(group) == 1 else _ScatterToTP.apply(x, group, dim)


def gather_from_tp(x: Tensor, group: dist.ProcessGroup, dim: int = -1) -> Tensor:
    """Concatenate every rank's chunk along ``dim``: ``(..., D / tp, ...) -> (..., D, ...)``.

    Forward: all-gather along ``dim``. Backward: split of the gradient along ``dim`` (keep chunk ``r``).
    Every rank's chunk must have the same shape.
    """
    return x if _size(group) == 1 else _GatherFromTP.apply(x, group, dim)


def reduce_scatter_along(x: Tensor, group: dist.ProcessGroup, dim: int) -> Tensor:
    """Sum partial results over ``group`` and keep chunk ``r`` along ``dim`` (sequence parallelism).

    Forward: reduce-scatter along ``dim``, ``(..., D, ...) -> (..., D / tp, ...)``. Backward: all-gather of the
    gradient along ``dim``. On gloo (no native reduce-scatter) it runs as an all-reduce and a local split.
    """
    return x if _size(group) == 1 else _ReduceScatterAlong.apply(x, group, dim)


def all_gather_along(x: Tensor, group: dist.ProcessGroup, dim: int) -> Tensor:
    """Concatenate chunks along ``dim`` where the consumer's gradient is partial (sequence parallelism).

    Forward: all-gather along ``dim``. Backward: reduce-scatter of the gradient along ``dim`` (each rank's
    consumer produced a partial gradient of the whole gathered tensor).
    """
    return x if _size(group) == 1 else _AllGatherAlong.apply(x, group, dim)


def all_to_all(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Exchange equal chunks of dim 0: chunk ``j`` of rank ``i`` becomes chunk ``i`` of rank ``j`` (MoE dispatch).

    Forward: ``all_to_all_single`` with equal splits of dim 0 (``x.size(0)`` must divide by ``tp``). Backward:
    the same all-to-all of the gradient (the exchange is its own inverse).
    """
    return x if _size(group) == 1 else _AllToAll.apply(x, group)
