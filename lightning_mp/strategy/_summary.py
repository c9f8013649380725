"""Lightning's model summary of the whole model, wherever its parameters live.

With ``pipeline_parallel_degree > 1`` each rank holds one stage's parameters, so Lightning's ``ModelSummary``
(printed on global rank 0) would count stage 0 only. At setup the strategy gathers every module's own parameter
counts over the pipeline group (:func:`gather_parameter_counts`) and has each ``ModelSummary`` callback build a
:class:`WholeModelSummary` from them: per-layer "Params", total, trainable and non-trainable counts and the model
size are then those of the whole model, as under ``ddp``.
"""

from __future__ import annotations

import warnings
from functools import partial
from typing import Any

import torch.distributed as dist
from lightning.pytorch.callbacks import ModelSummary as ModelSummaryCallback
from lightning.pytorch.utilities.model_summary import ModelSummary
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from torch import nn
from typing_extensions import override

__all__ = [
    "WholeModelSummary",
    "gather_parameter_counts",
    "silence_single_replica_sync_advice",
    "summarize_whole_model",
]

Counts = dict[str, tuple[int, int]]  # module FQN -> (parameter elements it holds itself, of which trainable)


def _local_counts(module: nn.Module, skip: set[str]) -> Counts:
    seen: set[int] = set()
    counts: Counts = {}
    for fqn, child in module.named_modules():
        own = [
            p for name, p in child.named_parameters(recurse=False)
            if id(p) not in seen and (f"{fqn}.{name}" if fqn else name) not in skip
        ]
        seen.update(id(p) for p in own)
        counts[fqn] = (sum(p.numel() for p in own), sum(p.numel() for p in own if p.requires_grad))
    return counts


def gather_parameter_counts(module: nn.Module, group: dist.ProcessGroup, skip: set[str] | None = None) -> Counts:
    """Every module's own parameter counts over the stages of ``group``. Every rank of ``group`` must call this.

    ``skip``: parameter FQNs not to count (the other names of shared parameters): a replicated tied weight then
    counts once, at its first owner, as on one device."""
    stages: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(stages, _local_counts(module, skip or set()), group=group)
    merged: Counts = {}
    for counts in stages:
        for fqn, (total, trainable) in counts.items():
            previous = merged.get(fqn, (0, 0))
            merged[fqn] = (max(previous[0], total), max(previous[1], trainable))
    return merged


class WholeModelSummary(ModelSummary):
    """Lightning's ``ModelSummary`` with parameter counts of the whole model (see the module docstring)."""

    def __init__(self, model: Any, counts: Counts, max_depth: int = 1) -> None:
        self._counts = counts
        super().__init__(model, max_depth=max_depth)

    def _subtree(self, fqn: str) -> tuple[int, int]:
        prefix = fqn + "."
        rows = [c for name, c in self._counts.items() if name == fqn or name.startswith(prefix)]
        return sum(r[0] for r in rows), sum(r[1] for r in rows)

    @property
    @override
    def param_nums(self) -> list[int]:
        return [self._subtree(fqn)[0] for fqn in self._layer_summary]

    @property
    @override
    def total_parameters(self) -> int:
        return sum(total for total, _ in self._counts.values())

    @property
    @override
    def trainable_parameters(self) -> int:
        return sum(trainable for _, trainable in self._counts.values())


def summarize_whole_model(callbacks: list[Any], counts: Counts) -> None:
    """Make every ``ModelSummary`` callback (and ``RichModelSummary``) summarize with ``counts``."""
    for callback in callbacks:
        if isinstance(callback, ModelSummaryCallback):
            callback._summary = partial(_whole_model_summary, counts=counts, max_depth=callback._max_depth)


def _whole_model_summary(trainer: Any, pl_module: Any, *, counts: Counts, max_depth: int) -> WholeModelSummary:
    return WholeModelSummary(pl_module, counts, max_depth=max_depth)


def silence_single_replica_sync_advice() -> None:
    """Drop Lightning's "use ``sync_dist=True``" advice, which is noise with one data-parallel replica.

    Lightning gives it whenever a process group exists; with ``dp == 1`` every stage of the only replica logs the
    same value, so there is nothing to sync (with ``dp > 1`` the advice stands, as under ``ddp``).
    """
    warnings.filterwarnings(
        "ignore", message=r"It is recommended to use `self\.log\(.*sync_dist=True\)", category=PossibleUserWarning
    )
