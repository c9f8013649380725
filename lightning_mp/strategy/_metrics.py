"""torchmetrics ``Metric`` objects logged inside a pipelined step behave as under ``ddp``.

[Note: metrics in a pipelined step] Under ``ddp`` a user writes ``self.acc(preds, y); self.log("acc", self.acc)``:
the metric's state grows batch by batch on each rank, Lightning logs its batch value on step, and at epoch end
Lightning calls ``compute()`` (which syncs the state over the process group) and ``reset()``. Under ``smp`` only
the driver (pipeline rank 0 of a replica) runs the step, once per microbatch; so:

1. the driver's metric is updated once per microbatch (its state covers the whole batch, as on one device);
2. at the end of the step the driver sends, with the step's summary, each logged metric's state
   (:class:`MetricLog`) and every other stage loads it into its own copy of the metric (metrics hold no
   parameters, so every stage has one), so every rank computes the same value and ``ModelCheckpoint(monitor=)``,
   the progress bar and ``callback_metrics`` agree on all ranks;
3. the value logged on step is the mean of the metric's per-microbatch values (exact for equal-sized
   microbatches of a mean metric such as accuracy or MSE);
4. with more than one stage (or TP rank) per replica, every metric syncs over the data-parallel group instead of
   the world (:func:`sync_metrics_over`): its stages hold the same state, so a world-wide sync would count each
   replica once per stage.

A metric that is updated in a step but not passed to ``self.log`` (the user calls ``compute()`` in an epoch-end
hook, say) is sent too: its state after the step goes to every other stage with the summary (``unlogged_states``),
so ``self.acc.compute()`` gives the same value on every rank, synced over data parallel, as under ``ddp``. A metric
with list ("cat") states sends its whole state every step.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torchmetrics import Metric

__all__ = ["MetricCalls", "MetricLog", "load_metric_log", "metric_update_counts", "sync_metrics_over", "unlogged_states"]


@dataclass
class MetricLog:
    """A logged ``Metric`` as the driver sends it to every stage at the end of a step.

    Attributes:
        fqn: the metric's module name in the LightningModule.
        forward_value: the mean of its per-microbatch values this step (``None`` if only ``update`` was called).
        state: its states after the step (tensors, or lists of tensors for "cat" states), detached, on the CPU.
        update_count: its ``_update_count`` after the step.
    """

    fqn: str
    forward_value: Tensor | None
    state: dict[str, Any]
    update_count: int


class MetricCalls:
    """The ``Metric`` objects passed to ``self.log`` during one pipelined step, per logged name."""

    def __init__(self) -> None:
        self._metrics: dict[str, tuple[Metric, list[Tensor], tuple, dict]] = {}

    def record(self, name: str, metric: Metric, args: tuple, kwargs: dict) -> None:
        """One ``self.log(name, metric)`` call of one microbatch (call under the recorder's lock)."""
        _, values, _, _ = self._metrics.setdefault(name, (metric, [], args, kwargs))
        if metric._forward_cache is not None:
            values.append(metric._forward_cache.detach().cpu())

    def logged_ids(self) -> set[int]:
        """``id()`` of every metric object logged this step."""
        return {id(metric) for metric, _, _, _ in self._metrics.values()}

    def logs(self, module: nn.Module) -> list[tuple[str, MetricLog, tuple, dict]]:
        """``(name, MetricLog, args, kwargs)`` per logged metric, in first-call order.

        Raises:
            ValueError: if a logged metric is not a submodule of ``module`` (Lightning requires that too).
        """
        if not self._metrics:
            return []
        names = {id(m): fqn for fqn, m in module.named_modules() if isinstance(m, Metric)}
        out = []
        for name, (metric, values, args, kwargs) in self._metrics.items():
            if id(metric) not in names:
                raise ValueError(
                    f"self.log({name!r}, metric) got a torchmetrics Metric that is not an attribute of the"
                    " LightningModule; assign it in `__init__` (e.g. `self.acc = Accuracy(...)`) so every stage has it."
                )
            forward_value = None
            if values:
                forward_value = torch.stack([v.to(torch.float64) for v in values]).mean(0).to(values[0].dtype)
            state = {key: _detach_cpu(getattr(metric, key)) for key in metric._defaults}
            out.append((name, MetricLog(names[id(metric)], forward_value, state, metric._update_count), args, kwargs))
        return out


_METRICS: weakref.WeakKeyDictionary[nn.Module, list[tuple[str, Metric]]] = weakref.WeakKeyDictionary()


def _metrics_of(module: nn.Module) -> list[tuple[str, Metric]]:
    """``(fqn, metric)`` for every ``Metric`` of ``module`` (found once per module: metrics are made in ``__init__``)."""
    found = _METRICS.get(module)
    if found is None:
        found = _METRICS[module] = [(fqn, m) for fqn, m in module.named_modules() if isinstance(m, Metric)]
    return found


def metric_update_counts(module: nn.Module) -> dict[str, int]:
    """Each metric's ``_update_count`` (before a step, to see which ones the step updates)."""
    return {fqn: metric._update_count for fqn, metric in _metrics_of(module)}


def unlogged_states(module: nn.Module, before: dict[str, int], logged: set[int]) -> list[MetricLog]:
    """The state of every metric the step updated (its update count changed) whose ``id()`` is not in ``logged``."""
    return [
        MetricLog(fqn, None, {key: _detach_cpu(getattr(metric, key)) for key in metric._defaults}, metric._update_count)
        for fqn, metric in _metrics_of(module)
        if id(metric) not in logged and metric._update_count != before.get(fqn)
    ]


def load_metric_log(module: nn.Module, log: MetricLog) -> Metric:
    """This rank's copy of the logged metric, holding the driver's state (see the Note above)."""
    metric = module.get_submodule(log.fqn)
    assert isinstance(metric, Metric)
    device = metric.device
    for key, value in log.state.items():
        if isinstance(value, list):
            setattr(metric, key, [v.to(device) for v in value])
        else:
            setattr(metric, key, value.to(device))
    metric._update_count = log.update_count
    metric._computed = None
    metric._forward_cache = None if log.forward_value is None else log.forward_value.to(device)
    return metric


def sync_metrics_over(module: nn.Module, group: Any) -> None:
    """Make every ``Metric`` of ``module`` without its own ``process_group`` sync over ``group`` (data parallel)."""
    for child in module.modules():
        if isinstance(child, Metric) and child.process_group is None:
            child.process_group = group


def _detach_cpu(value: Any) -> Any:
    if isinstance(value, list):
        return [v.detach().cpu().clone() for v in value]
    return value.detach().cpu().clone()
