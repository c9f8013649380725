"""SMP's group helpers: ``lightning_mp.smp.tp_rank(groups)``, ``allgather(groups, obj, "tp")``, ...

SMP v1 offered ``smp.tp_rank()``, ``smp.allgather(obj, smp.TP_GROUP)`` and so on over hidden global state. Here
they take the strategy's named groups (``SMPStrategy.groups``, a :class:`ParallelGroups`) as their first
argument; group meanings are in :mod:`lightning_mp.tp` (``_groups.py``). Before this namespace existed they were
top-level names of ``lightning_mp``; those still import, with a ``DeprecationWarning``.

Example::

    from lightning_mp import smp

    if smp.tp_rank(trainer.strategy.groups) == 0:
        ...
"""

from lightning_mp.tp import (
    CommGroup,
    ParallelGroups,
    allgather,
    allreduce,
    barrier,
    broadcast,
    dp_rank,
    dp_size,
    pp_rank,
    pp_size,
    rdp_rank,
    rdp_size,
    tp_rank,
    tp_size,
)

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
