"""Logging in a pipelined step: ``self.log`` calls recorded per microbatch, reduced, and replayed on every rank.

[Note: logging in a pipelined step] ``self.log`` calls made once per microbatch are recorded by
:class:`LogRecorder`, reduced over microbatches on the driver, sent to every stage with the step's summary
(:class:`StepSummary`), and replayed once per step on every rank (:func:`replay_logs`), so logs, the progress bar
and ``ModelCheckpoint(monitor=)`` agree on all ranks as with DDP. Metrics objects: see [Note: metrics in a
pipelined step] in ``_metrics.py``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torchmetrics import Metric

from lightning_mp.pipeline import RemoteValue, materialize
from lightning_mp.strategy._metrics import (
    MetricCalls,
    MetricLog,
    load_metric_log,
    metric_update_counts,
    unlogged_states,
)

__all__ = ["LogRecorder", "StepSummary", "replay_logs"]

_REDUCERS = {"mean": torch.mean, "sum": torch.sum, "max": torch.max, "min": torch.min}


@dataclass
class _LogCall:
    name: str
    values: list[tuple[int, Any]]  # (microbatch index, value)
    args: tuple
    kwargs: dict


@dataclass
class StepSummary:
    """What the driver sends to every stage at the end of a step.

    Attributes:
        output: the merged, detached step output.
        logs: the logged values, reduced over microbatches.
        num_tokens: with token-weighted losses (see [Note: token-weighted losses] in ``_runner.py``), the sum of
            the microbatches' ``num_tokens``; every stage divides its gradients of the step by it. ``None``
            otherwise.
        metric_states: the states of metrics the step updated but did not log (see [Note: metrics in a
            pipelined step]); the other stages load them.
    """

    output: Any
    logs: list[tuple[str, Any, tuple, dict]] = field(default_factory=list)
    num_tokens: float | None = None
    metric_states: list[MetricLog] = field(default_factory=list)


class LogRecorder:
    """Capture ``LightningModule.log`` calls during a pipelined step (see [Note: logging in a pipelined step]).

    While active, ``module.log`` (and so ``log_dict``) records instead of logging. :meth:`reduced` gives one
    value per name: the mean over microbatches (or the ``reduce_fx`` the call asked for: sum, max, min), reduced
    in microbatch order whatever order the microbatches ran in.
    """

    def __init__(self, module: nn.Module) -> None:
        self._module = module
        self._lock = threading.Lock()
        self._calls: dict[str, _LogCall] = {}
        self._local = threading.local()
        self._metrics = MetricCalls()  # torchmetrics objects, see [Note: metrics in a pipelined step]

    def __enter__(self) -> LogRecorder:
        self._module.log = self._record  # instance attribute shadows the method
        self._counts_before = metric_update_counts(self._module)
        return self

    def __exit__(self, *exc: Any) -> None:
        del self._module.log

    @contextmanager
    def microbatch(self, index: int) -> Iterator[None]:
        """Values logged by this thread in the body belong to microbatch ``index``."""
        self._local.index = index
        try:
            yield
        finally:
            self._local.index = None

    def _record(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        index = getattr(self._local, "index", None)
        keep = index is not None and _unfetched(value)  # ``isinstance`` would fetch it
        if not keep and isinstance(value, Metric):
            with self._lock:
                self._metrics.record(name, value, args, kwargs)
            return
        if not keep:
            value = _loggable_value(value)
        with self._lock:
            call = self._calls.setdefault(name, _LogCall(name, [], args, kwargs))
            call.values.append((len(call.values) if index is None else index, value))

    def fetch_microbatch(self, index: int) -> None:
        """Fetch the handles microbatch ``index`` logged (free where its backward fetched them); run as it finishes,
        while its stages still hold its outputs."""
        with self._lock:
            kept = [(call, k) for call in self._calls.values() for k, (i, v) in enumerate(call.values)
                    if i == index and type(v) is RemoteValue]
        for call, k in kept:
            value = _loggable_value(call.values[k][1])
            with self._lock:
                call.values[k] = (index, value)

    def reduced(self, weights: list[float] | None = None) -> list[tuple[str, Any, tuple, dict]]:
        """``(name, value, args, kwargs)`` per logged name, in first-call order, values reduced over microbatches.

        Args:
            weights: per-microbatch weights of mean-reduced values (token weighting: ``num_tokens`` of each
                microbatch); ``None``: a plain mean. Weights are normalised over the microbatches that logged a name.
        """
        logs = []
        for call in self._calls.values():
            reduce_fx = call.kwargs.get("reduce_fx", "mean")
            name = reduce_fx if isinstance(reduce_fx, str) else getattr(reduce_fx, "__name__", "")
            reducer = _REDUCERS.get(name, torch.mean)
            ordered = sorted(call.values, key=lambda item: item[0])  # stable: a microbatch's own calls keep order
            stacked = torch.stack([torch.as_tensor(v, dtype=torch.float64) for _, v in ordered])
            if reducer is torch.mean and weights is not None:
                w = torch.tensor([weights[i] for i, _ in ordered], dtype=torch.float64)
                w = w.reshape(-1, *([1] * (stacked.dim() - 1)))
                # A microbatch of weight 0 (no tokens) counts for nothing, also when its value is NaN (0 x NaN).
                weighted = torch.where(w > 0, stacked * w, torch.zeros_like(stacked))
                value = weighted.sum(0) / w.sum() if w.sum() > 0 else stacked.mean(0)
            else:
                value = reducer(stacked, 0) if reducer is not torch.mean else stacked.mean(0)
            if isinstance(value, tuple):  # torch.max/min over a dim return (values, indices)
                value = value[0]
            logs.append((call.name, value.to(torch.float32), call.args, call.kwargs))
        return logs + self._metrics.logs(self._module)

    def unlogged_metric_states(self) -> list[MetricLog]:
        """After the step: the states of the module's metrics it updated without logging them."""
        return unlogged_states(self._module, self._counts_before, self._metrics.logged_ids())


def _unfetched(value: Any) -> bool:
    return type(value) is RemoteValue and not value._rv_fetched


def _loggable_value(value: Any) -> Any:
    """A tensor or number for one microbatch (``Metric`` objects are recorded apart, see ``_metrics``)."""
    value = materialize(value)  # the output of a remote call, still on its stage: fetch it
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, (int, float, bool)):
        return float(value)
    if isinstance(value, dict):
        raise TypeError("self.log() got a dict; use self.log_dict() for several values.")
    raise TypeError(f"self.log() got a value of type {type(value).__name__}; log a tensor or a number.")


def replay_logs(module: Any, logs: list[tuple[str, Any, tuple, dict]], dp_group: Any | None) -> None:
    """Call ``module.log`` once per recorded name (on every rank, same order).

    A torchmetrics ``Metric`` is logged as the object (Lightning computes, syncs and resets it), holding the
    driver's state (see [Note: metrics in a pipelined step]). ``sync_dist=True`` reduces over the data-parallel
    group (``dp_group``), not the world: every stage of a replica logs the same value, so a world-wide sum would
    count it once per stage.
    """
    for name, value, args, kwargs in logs:
        if isinstance(value, MetricLog):  # the driver's metric state, loaded into this rank's copy
            value = load_metric_log(module, value)
        if kwargs.get("sync_dist") and kwargs.get("sync_dist_group") is None and dp_group is not None:
            kwargs = {**kwargs, "sync_dist_group": dp_group}
        module.log(name, value, *args, **kwargs)
