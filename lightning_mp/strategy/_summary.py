"""Lightning's model summary of the whole model, wherever its parameters live.

With ``pipeline_parallel_degree > 1`` each rank holds one stage's parameters, so Lightning's ``ModelSummary``
(printed on global rank 0) would count stage 0 only. At setup the strategy gathers every module's own parameter
counts over the pipeline group (:func:`gather_parameter_counts`) and has each ``ModelSummary`` callback build a
:class:`WholeModelSummary` from them: per-layer "Params", total, trainable and non-trainable counts and the model
size are then those of the whole model, as under ``ddp``. Under tensor parallelism a rank holds a shard of each
split parameter; it is counted at its full logical size (:func:`logical_numel`), so the summary counts the model
the user wrote at every layout.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from functools import partial
from typing import Any

import torch.distributed as dist
from lightning.pytorch.callbacks import ModelSummary as ModelSummaryCallback
from lightning.pytorch.utilities.model_summary import ModelSummary
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from torch import Tensor, nn
from typing_extensions import override

from lightning_mp.tp._sharding import shard_spec

__all__ = [
    "WholeModelSummary",
    "gather_parameter_counts",
    "logical_numel",
    "silence_single_replica_sync_advice",
    "summarize_whole_model",
]

Counts = dict[str, dict[str, tuple[int, bool]]]
"""Module FQN -> {original FQN of each parameter it holds itself: (logical elements, trainable)}."""


def logical_numel(param: Tensor) -> int:
    """Elements of ``param``'s full logical tensor: a tensor-parallel shard counts as the tensor it is a piece of
    (its ``ShardSpec``'s full size along the sharded dim, padding excluded)."""
    spec = shard_spec(param)
    if spec is None or param.dim() <= spec.dim or param.size(spec.dim) == 0:
        return param.numel()
    return param.numel() // param.size(spec.dim) * spec.full_size


def _local_counts(module: nn.Module, names: Mapping[str, str]) -> Counts:
    counts: Counts = {}
    for fqn, child in module.named_modules(remove_duplicate=False):
        own = counts.setdefault(fqn, {})
        for name, param in child.named_parameters(recurse=False, remove_duplicate=False):
            full_name = f"{fqn}.{name}" if fqn else name
            own[names.get(full_name, full_name)] = (logical_numel(param), param.requires_grad)
    return counts


def gather_parameter_counts(module: nn.Module, group: dist.ProcessGroup, names: Mapping[str, str] | None = None) -> Counts:
    """Every module's own parameters over the stages of ``group``. Every rank of ``group`` must call this.

    ``names``: other names of shared parameters -> original FQN; a shared parameter then counts once in a total
    (and in each layer that holds it), as Lightning counts it on one device."""
    stages: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(stages, _local_counts(module, names or {}), group=group)
    merged: Counts = {}
    for counts in stages:
        for fqn, own in counts.items():
            merged.setdefault(fqn, {}).update(own)
    return merged


class WholeModelSummary(ModelSummary):
    """Lightning's ``ModelSummary`` with parameter counts of the whole model (see the module docstring)."""

    def __init__(self, model: Any, counts: Counts, max_depth: int = 1) -> None:
        self._counts = counts
        super().__init__(model, max_depth=max_depth)

    def _unique(self, prefix: str | None = None) -> dict[str, tuple[int, bool]]:
        """The parameters (each once) held by the module ``prefix`` and its children; all of them for ``None``."""
        found: dict[str, tuple[int, bool]] = {}
        for fqn, own in self._counts.items():
            if prefix is None or fqn == prefix or fqn.startswith(prefix + "."):
                found.update(own)
        return found

    @property
    @override
    def param_nums(self) -> list[int]:
        return [sum(n for n, _ in self._unique(fqn).values()) for fqn in self._layer_summary]

    @property
    @override
    def total_parameters(self) -> int:
        return sum(n for n, _ in self._unique().values())

    @property
    @override
    def trainable_parameters(self) -> int:
        return sum(n for n, trainable in self._unique().values() if trainable)


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


def whole_model_views(trainer: Any, module: nn.Module, topology: Any, mesh: Any, names: Mapping[str, str]) -> Any:
    """Logged values and summaries over the whole model, at setup: under model parallelism metrics sync over the
    replicas of this rank and the model summary counts every stage's parameters at full size; with one replica
    Lightning's advice to sync logged values is silenced (there is nothing to sync).

    Returns:
        The group over which ``sync_dist=True`` reduces logged values (this rank's replicas, under model
        parallelism), or ``None`` for Lightning's default.
    """
    from lightning_mp.strategy._metrics import sync_metrics_over
    from lightning_mp.topology import MeshAxis

    model_parallel = topology.pipeline_parallel_degree * topology.tensor_parallel_degree > 1
    dp_group = mesh.get_group(MeshAxis.DP.value) if model_parallel else None
    if model_parallel:
        sync_metrics_over(module, dp_group)
        counts = gather_parameter_counts(module, mesh.get_group(MeshAxis.PP.value), names=names)  # full sizes
        summarize_whole_model(trainer.callbacks, counts)
    if topology.data_parallel_degree == 1:
        silence_single_replica_sync_advice()
    return dp_group
