"""Named process groups of the (dp, pp, tp) grid and SMP's helpers over them.

SMP v1 offered ``smp.tp_rank()``, ``smp.allgather(obj, smp.TP_GROUP)`` and so on over hidden global state. Here
the groups are one explicit object, :class:`ParallelGroups`, that the strategy builds from its topology
(``SMPStrategy.groups``) and hands to whoever needs it; the helpers take it as their first argument, so no code
ever falls back to the default group silently.

Group meanings (SMP's names, kept for SMP's helpers): ``TP`` the tensor-parallel group; ``PP`` the pipeline of
one replica; ``RDP`` the replicas of one (stage, tp rank), over which gradients are averaged; ``DP`` SMP's
data-parallel group, the ranks of one stage over every replica and tp rank (``RDP x TP``); ``WORLD`` every rank.
The rest of the package names these by its own axes (see [Note: axis vocabulary] in ``lightning_mp/topology.py``):
SMP's ``RDP`` is the ``dp`` axis (``SMPStrategy.dp_rank`` is ``rdp_rank(groups)``) and SMP's ``DP`` is ``dp_tp``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "CommGroup",
    "ParallelGroups",
    "allgather",
    "allreduce",
    "barrier",
    "broadcast",
    "dp_rank",
    "dp_size",
    "pp_rank",
    "pp_size",
    "rdp_rank",
    "rdp_size",
    "tp_rank",
    "tp_size",
]


class CommGroup(str, Enum):
    """Names of the groups of :class:`ParallelGroups` (SMP's ``CommGroup``)."""

    WORLD = "world"
    TP = "tp"
    PP = "pp"
    DP = "dp"
    RDP = "rdp"


@dataclass(frozen=True)
class ParallelGroups:
    """Process-group handles of one rank, by :class:`CommGroup` name.

    Attributes:
        world: every rank.
        tp: this rank's tensor-parallel group.
        pp: this rank's pipeline (one replica, one tp rank).
        dp: this stage's ranks over every replica and tp rank (SMP's DP group; the package's ``dp_tp``).
        rdp: this (stage, tp rank)'s replicas (SMP's "reduced" DP group, the package's ``dp`` axis; gradients are
            averaged here).
    """

    world: dist.ProcessGroup
    tp: dist.ProcessGroup
    pp: dist.ProcessGroup
    dp: dist.ProcessGroup
    rdp: dist.ProcessGroup

    def get(self, name: CommGroup | str) -> dist.ProcessGroup:
        """The handle of ``name`` (a :class:`CommGroup` or its value, e.g. ``"tp"``).

        Raises:
            ValueError: for an unknown name.
        """
        try:
            return getattr(self, CommGroup(name).value)
        except ValueError:
            raise ValueError(f"Unknown group {name!r}; use one of {[g.value for g in CommGroup]}.") from None


def _rank(groups: ParallelGroups, name: CommGroup) -> int:
    return dist.get_rank(groups.get(name))


def _size(groups: ParallelGroups, name: CommGroup) -> int:
    return dist.get_world_size(groups.get(name))


def tp_rank(groups: ParallelGroups) -> int:
    """This rank's index in its tensor-parallel group."""
    return _rank(groups, CommGroup.TP)


def tp_size(groups: ParallelGroups) -> int:
    """The tensor-parallel degree."""
    return _size(groups, CommGroup.TP)


def pp_rank(groups: ParallelGroups) -> int:
    """This rank's pipeline stage."""
    return _rank(groups, CommGroup.PP)


def pp_size(groups: ParallelGroups) -> int:
    """The pipeline-parallel degree."""
    return _size(groups, CommGroup.PP)


def dp_rank(groups: ParallelGroups) -> int:
    """This rank's index in SMP's DP group (replicas x tp ranks of its stage); ``SMPStrategy.dp_rank`` is
    :func:`rdp_rank` instead."""
    return _rank(groups, CommGroup.DP)


def dp_size(groups: ParallelGroups) -> int:
    """Size of SMP's DP group: ``world / pp``."""
    return _size(groups, CommGroup.DP)


def rdp_rank(groups: ParallelGroups) -> int:
    """This rank's replica index (the data-parallel rank of the strategy's sampler)."""
    return _rank(groups, CommGroup.RDP)


def rdp_size(groups: ParallelGroups) -> int:
    """Number of replicas: ``world / (pp * tp)``."""
    return _size(groups, CommGroup.RDP)


def allgather(groups: ParallelGroups, obj: Any, group: CommGroup | str) -> list[Any]:
    """Every rank's picklable ``obj`` in ``group``, in group-rank order (SMP's ``smp.allgather``)."""
    handle = groups.get(group)
    out: list[Any] = [None] * dist.get_world_size(handle)
    dist.all_gather_object(out, obj, group=handle)
    return out


def allreduce(
    groups: ParallelGroups, tensor: torch.Tensor, group: CommGroup | str, op: dist.ReduceOp = dist.ReduceOp.SUM
) -> torch.Tensor:
    """All-reduce ``tensor`` in place over ``group`` (no autograd; see ``lightning_mp.tp`` for autograd ops)."""
    dist.all_reduce(tensor, op=op, group=groups.get(group))
    return tensor


def broadcast(groups: ParallelGroups, obj: Any, group: CommGroup | str, src: int = 0) -> Any:
    """``obj`` of the group's rank ``src`` (an index *within* the group), on every rank of ``group``."""
    handle = groups.get(group)
    payload = [obj]
    dist.broadcast_object_list(payload, src=dist.get_global_rank(handle, src), group=handle)
    return payload[0]


def barrier(groups: ParallelGroups, group: CommGroup | str) -> None:
    """Wait until every rank of ``group`` got here."""
    dist.barrier(group=groups.get(group))
