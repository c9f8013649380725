"""Sharding maths (pure, no communication) and how a parameter records its placement.

A tensor-parallel parameter carries a :class:`ShardSpec` (``param._lmp_shard``): the tensor dim it is split
along, the full size of that dim, how many fused blocks it holds (``parts``: 3 for a fused q/k/v projection,
each block split separately), and whether the dim is padded to a multiple of the tp degree (vocabularies).
With it, :func:`shard` cuts this rank's piece out of the original full tensor (loading the user's weights) and
:func:`unshard` joins every rank's pieces back (saving under the original keys and full shapes).
Parameters without a spec are replicated on every tp rank.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = [
    "ShardSpec",
    "TPGroup",
    "TPDivisibilityError",
    "check_divisible",
    "grad_allreduce",
    "parameter_creation_scope",
    "reduce_replicated_grads",
    "shard",
    "shard_spec",
    "unshard",
]

_SPEC_ATTR = "_lmp_shard"
_GRAD_ALLREDUCE_ATTR = "_lmp_tp_grad_allreduce"


class TPDivisibilityError(ValueError):
    """A size does not divide by the tensor-parallel degree (raised before any collective)."""


@dataclass(frozen=True)
class TPGroup:
    """The tensor-parallel group a distributed module works in: its handle, this rank's index and the degree.

    ``group`` may be ``None`` only to build modules and load shards without communicating (sharding maths in
    one process); their forward needs a real group.
    """

    group: dist.ProcessGroup | None
    rank: int
    size: int

    @classmethod
    def of(cls, group: dist.ProcessGroup) -> TPGroup:
        """The :class:`TPGroup` of an initialised process group."""
        return cls(group, dist.get_rank(group), dist.get_world_size(group))


def check_divisible(what: str, value: int, tp_size: int) -> int:
    """``value // tp_size``.

    Raises:
        TPDivisibilityError: if ``value`` is not a multiple of ``tp_size``, naming both and the fix.
    """
    if value % tp_size:
        lower, upper = (value // tp_size) * tp_size, -(-value // tp_size) * tp_size
        raise TPDivisibilityError(
            f"{what}={value} is not divisible by tensor_parallel_degree={tp_size}. Use a {what} that is a multiple"
            f" of {tp_size} (e.g. {upper}{f' or {lower}' if lower else ''}), or a tensor_parallel_degree that divides"
            f" {value}."
        )
    return value // tp_size


@dataclass(frozen=True)
class ShardSpec:
    """How a parameter is split over the tp group.

    Attributes:
        dim: tensor dim that is split.
        full_size: size of ``dim`` in the original (unsharded) tensor.
        parts: fused blocks along ``dim`` (each ``full_size / parts`` wide), each split over the ranks; e.g. 3 for
            ``[W_q; W_k; W_v]`` so that rank ``r`` holds ``[W_q^r; W_k^r; W_v^r]``.
        padded: if True, ``dim`` is zero-padded to a multiple of the degree (uneven vocabularies); the padding is
            dropped again by :func:`unshard`.
    """

    dim: int
    full_size: int
    parts: int = 1
    padded: bool = False

    def local_size(self, tp_size: int) -> int:
        """Size of ``dim`` on each rank."""
        if self.padded:
            return math.ceil(self.full_size / tp_size)
        return check_divisible("size", self.full_size // self.parts, tp_size) * self.parts


def shard(full: Tensor, spec: ShardSpec, rank: int, tp_size: int) -> Tensor:
    """Rank ``rank``'s piece of ``full`` (a copy), of size ``spec.local_size(tp_size)`` along ``spec.dim``."""
    if full.size(spec.dim) != spec.full_size:
        raise ValueError(f"Expected size {spec.full_size} along dim {spec.dim}, got shape {tuple(full.shape)}.")
    if spec.padded:
        local = spec.local_size(tp_size)
        pad = local * tp_size - spec.full_size
        if pad:
            shape = list(full.shape)
            shape[spec.dim] = pad
            full = torch.cat([full, full.new_zeros(shape)], dim=spec.dim)
        return full.narrow(spec.dim, rank * local, local).clone()
    blocks = full.chunk(spec.parts, dim=spec.dim)
    return torch.cat([b.chunk(tp_size, dim=spec.dim)[rank] for b in blocks], dim=spec.dim).clone()


def unshard(pieces: list[Tensor], spec: ShardSpec) -> Tensor:
    """The full tensor from every rank's piece, in rank order (inverse of :func:`shard`)."""
    if spec.padded:
        return torch.cat(pieces, dim=spec.dim).narrow(spec.dim, 0, spec.full_size).clone()
    blocks = [p.chunk(spec.parts, dim=spec.dim) for p in pieces]
    return torch.cat([torch.cat([b[i] for b in blocks], dim=spec.dim) for i in range(spec.parts)], dim=spec.dim)


def shard_spec(param: Tensor) -> ShardSpec | None:
    """The spec a parameter was created with (``None``: replicated over the tp group)."""
    return getattr(param, _SPEC_ATTR, None)


def grad_allreduce(param: Tensor) -> str | None:
    """How a replicated parameter's gradient is reduced over the tp group after backward: ``"mean"``, ``"sum"``
    (partial gradients, e.g. LayerNorms under sequence parallelism) or ``None`` (equal already)."""
    return getattr(param, _GRAD_ALLREDUCE_ATTR, None)


def mark(param: nn.Parameter, spec: ShardSpec | None = None, *, allreduce_grad: str | None = None) -> nn.Parameter:
    """Record ``spec`` (and the gradient rule, ``"mean"`` or ``"sum"``) on ``param``; returns it."""
    if allreduce_grad not in (None, "mean", "sum"):
        raise ValueError(f"`allreduce_grad` must be None, 'mean' or 'sum', got {allreduce_grad!r}.")
    if spec is not None:
        setattr(param, _SPEC_ATTR, spec)
    if allreduce_grad is not None:
        setattr(param, _GRAD_ALLREDUCE_ATTR, allreduce_grad)
    return param


def reduce_replicated_grads(params: list[nn.Parameter], group: dist.ProcessGroup) -> None:
    """Reduce, over the tp ``group``, the gradients of parameters marked with ``allreduce_grad`` (one bucket).

    Every rank of the group must pass the same parameters in the same order.
    """
    flagged = [p for p in params if p.grad is not None and grad_allreduce(p) is not None]
    if not flagged:
        return
    size = dist.get_world_size(group)
    flat = torch.cat([p.grad.reshape(-1) for p in flagged])
    dist.all_reduce(flat, group=group)
    offset = 0
    for p in flagged:
        reduced = flat[offset : offset + p.numel()].view_as(p.grad)
        p.grad.copy_(reduced / size if grad_allreduce(p) == "mean" else reduced)
        offset += p.numel()


@contextlib.contextmanager
def parameter_creation_scope(
    spec: ShardSpec | None = None, *, allreduce_grad: str | None = None
) -> Iterator[None]:
    """Parameters registered on any module inside get ``spec`` and the gradient rule (SMP's scope of that name).

    For writing new distributed modules::

        with parameter_creation_scope(ShardSpec(dim=0, full_size=out_features)):
            self.weight = nn.Parameter(torch.empty(out_features // tp.size, in_features))

    The strategy then reads the spec to load shards from the original weights, to save full tensors, and to
    count each logical parameter once in the gradient norm; ``allreduce_grad="mean"`` averages a replicated
    parameter's gradient over the tp group after backward, ``"sum"`` adds partial gradients (a replicated
    parameter applied to different tokens on each rank, as under sequence parallelism).
    """

    def hook(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None:
            mark(param, spec, allreduce_grad=allreduce_grad)

    handle = nn.modules.module.register_module_parameter_registration_hook(hook)
    try:
        yield
    finally:
        handle.remove()
