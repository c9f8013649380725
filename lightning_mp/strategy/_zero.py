"""Optimizer-state sharding over the data-parallel group (ZeRO stage 1, SMP's ``shard_optimizer_state``).

[Note: sharded optimizer state]
Each optimizer from ``configure_optimizers`` (already over this stage's parameters only) is rebuilt as a
:class:`torch.distributed.optim.ZeroRedundancyOptimizer` over the data-parallel group of the stage: every dp
rank keeps the state of a 1/dp share of the parameters and steps only those; then each updated share is
broadcast from its owner. Gradients are all-reduced over dp before the step as without sharding. ZeRO's
partition is greedy over whole parameters (largest first to the least-loaded rank); for transformer stages
(many equal blocks) that is within a few percent of even, so we use it rather than a partitioner of our own
(``benchmarks/memory.py`` prints the per-rank bytes). Checkpoints save each rank's *local* optimizer through DCP,
keyed by parameter FQN, so nothing is consolidated on one rank and a resume can use another dp size.
"""

from __future__ import annotations

import inspect
import weakref
from functools import wraps
from typing import Any

import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.optim import Optimizer

__all__ = [
    "local_optimizer",
    "shard_optimizer",
    "shard_optimizers",
    "sync_hyperparameters_from_local",
    "track_step_for_schedulers",
]


def shard_optimizers(
    optimizers: list[Optimizer], scheduler_configs: list[Any], group: dist.ProcessGroup, dp_size: int
) -> list[Any]:
    """Every optimizer sharded over this stage's data-parallel ``group`` of ``dp_size`` ranks, its schedulers
    following it (a warning and the optimizers unchanged with one replica: nothing to shard over)."""
    if dp_size == 1:
        rank_zero_warn(
            "shard_optimizer_state=True has no effect with one data-parallel replica (world size = pipeline x"
            " tensor parallel degree); use more devices to shard the optimizer state."
        )
        return optimizers
    sharded = {id(o): shard_optimizer(o, group) for o in optimizers}
    for config in scheduler_configs:
        if id(config.scheduler.optimizer) in sharded:
            config.scheduler.optimizer = sharded[id(config.scheduler.optimizer)]
            track_step_for_schedulers(config.scheduler.optimizer)
    return list(sharded.values())


def shard_optimizer(optimizer: Optimizer, group: dist.ProcessGroup) -> ZeroRedundancyOptimizer:
    """``optimizer`` (its class, param groups and hyper-parameters) as a ZeRO-1 optimizer over ``group``.

    Raises:
        ValueError: if ``optimizer`` already holds state (it must be fresh from ``configure_optimizers``).
    """
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer
    if optimizer.state:
        raise ValueError(
            f"shard_optimizer_state=True needs fresh optimizers, but {type(optimizer).__name__} already has state"
            f" for {len(optimizer.state)} parameters. Do not step optimizers inside `configure_optimizers`."
        )
    groups = [dict(g) for g in optimizer.param_groups]
    # only what the constructor takes: `defaults` may hold derived keys (AdamW's `decoupled_weight_decay`); the
    # param groups carry every key to the local optimizer anyway
    accepted = inspect.signature(type(optimizer).__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    return ZeroRedundancyOptimizer(groups, optimizer_class=type(optimizer), process_group=group, **defaults)


def local_optimizer(optimizer: Any) -> Optimizer:
    """The optimizer that holds this rank's state: the local shard's optimizer under ZeRO, else itself."""
    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


def sync_hyperparameters_from_local(optimizer: Any) -> None:
    """After loading the local shard's state, copy its hyper-parameters (lr, ...) to ZeRO's full groups.

    ZeRO copies its full groups onto the local ones before every step, so without this a resumed run would
    step with the learning rates the optimizer was built with instead of the saved ones.
    """
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        ZeroRedundancyOptimizer._sync_param_groups(optimizer.optim.param_groups, optimizer.param_groups)


def track_step_for_schedulers(optimizer: Optimizer) -> None:
    """Mark ``optimizer.step`` as an LR scheduler's constructor marks its optimizer's (torch's
    ``patch_track_step_called``), for schedulers moved onto ``optimizer`` after they were built.

    Without it, the first ``scheduler.step()`` warns that ``optimizer.step()`` "has been overridden after learning
    rate scheduler initialization", though the schedule applies (the sharded optimizer is simply another object).
    """
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    step = type(optimizer).step
    owner = weakref.ref(optimizer)

    @wraps(step)
    def tracked(*args: Any, **kwargs: Any) -> Any:
        opt = owner()
        opt._opt_called = True  # type: ignore[union-attr]
        return step(opt, *args, **kwargs)

    tracked._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = tracked  # type: ignore[method-assign]
