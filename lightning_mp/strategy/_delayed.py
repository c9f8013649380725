"""Strategy glue for delayed parameter initialisation: a meta trace, then each rank materialises its stage.

The torch-only machinery is :mod:`lightning_mp.init`. Here: the partitioning trace of a meta-built model runs
on a meta copy of the sample batch (so no parameter is ever allocated for tracing); a model whose step reads a
value (``if x[0, 0].item() > 0``) cannot run on meta and is traced again on the real sample with each module's
weights made real during its own call only (see [Note: per-call materialisation] in ``init/_per_call.py``).
After the engine has dropped every other stage's tensors, what is left on the rank (its stage, plus stateless
modules' buffers, which run everywhere) is materialised by replaying the record; under sharded data parallelism
straight into the FSDP shards (see [Note: sharded stages] in ``_fsdp.py``).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn

from lightning_mp.init import MaterializeReport, find_record, materialize_module, materialize_per_call

T = TypeVar("T")

__all__ = [
    "MetaInputs",
    "holds_meta_tensors",
    "is_delayed",
    "kept_on_meta",
    "materialize_stage",
    "meta_trace_inputs",
    "needs_real_values",
    "trace_per_call",
]


def is_delayed(model: nn.Module) -> bool:
    """Whether ``model`` was built under delayed init and is not materialised yet."""
    return find_record(model) is not None


def holds_meta_tensors(model: nn.Module) -> bool:
    """Whether a parameter or buffer of ``model`` is on the meta device (a delayed-init model not materialised;
    unlike :func:`is_delayed`, never raises for a model whose record is unusable)."""
    return any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))


@contextmanager
def kept_on_meta(model: nn.Module | None) -> Iterator[None]:
    """In the body, ``model.cpu()`` is a no-op when ``model`` still holds meta tensors (a setup that failed before
    materialisation): Lightning's teardown would raise "Cannot copy out of meta tensor" over the error that stopped
    the setup, and there is nothing to move."""
    if model is None or not holds_meta_tensors(model):
        yield
        return
    model.cpu = lambda: model
    try:
        yield
    finally:
        del model.cpu


class MetaInputs:
    """``real`` (the loop's move to the device) followed by a move of every tensor to meta: the trace input of a
    meta model. ``real`` is kept for a trace that needs values (:func:`trace_per_call`)."""

    def __init__(self, real: Callable[[Any], Any]) -> None:
        self.real = real

    def __call__(self, batch: Any) -> Any:
        return apply_to_collection(self.real(batch), torch.Tensor, lambda t: t.to("meta"))


def meta_trace_inputs(to_device: Callable[[Any], Any]) -> MetaInputs:
    """``to_device`` followed by a move of every tensor to the meta device: the trace input of a meta model."""
    return MetaInputs(to_device)


# "meta" as a word of its own, any case: torch's "cannot be called on meta tensors", "with Meta tensors" (bincount,
# unique), "meta device type tensor" (.numpy()), "register_meta function" (nonzero); not "metadata".
_META_WORD = re.compile(r"(?<![a-z])meta(?![a-z])", re.IGNORECASE)


def needs_real_values(inputs: Callable[[Any], Any], err: BaseException) -> bool:
    """Whether a meta trace failed because the step needs tensor values (``.item()``, ``if tensor:``, ``.numpy()``,
    data-dependent ops such as ``bincount``, ``unique``, ``nonzero``): torch's error, of any type, names meta
    tensors. A failure whose message does not (``repeat_interleave`` checking sizes against meta values) is not
    retried."""
    cause = err.__cause__ or err
    return isinstance(inputs, MetaInputs) and _META_WORD.search(f"{err} {cause}") is not None


def trace_per_call(
    model: nn.Module,
    run: Callable[[Callable[[Any], Any]], T],
    inputs: MetaInputs,
    first: Exception,
    device: torch.device,
) -> T:
    """Run ``run(inputs.real)`` (a trace on the real sample) with each module's weights real during its call only,
    on ``device`` (where ``inputs.real`` puts the sample).

    Raises:
        RuntimeError: naming the module that was running, the failing op and the way out, if that trace fails too
            (a module that uses another module's parameters outside that module's call, code outside any module
            that uses parameters).
    """
    with materialize_per_call(model, device) as report:
        try:
            result = run(inputs.real)
        except RuntimeError as err:
            where = report.failed_in or "<the step, outside any module>"
            reason = first.__cause__ or first
            raise RuntimeError(
                f"The step reads tensor values, which the meta trace of a delayed-init model cannot ({reason});"
                f" traced again with each module's weights real during its own call, it failed in module"
                f" {where!r}: {err.__cause__ or err}. Parameters used outside their own module's call cannot be made"
                " real this way. Give the partition yourself with `partition_plan=` (a plan for every module, e.g."
                " the partition.json that PartitionSummary writes from an eager run), or build the model eagerly"
            ) from err
    rank_zero_info(
        f"lightning_mp: the step reads tensor values, so the partitioning trace ran on the real sample with each"
        f" module's weights made real during its own call: {report.calls} calls, at most"
        f" {report.peak_bytes / 2**10:,.1f} KiB of weights at once (the model: {report.total_bytes / 2**10:,.1f} KiB)"
    )
    return result


def materialize_stage(model: nn.Module, device: torch.device, stage: int) -> MaterializeReport:
    """Materialise every meta tensor ``model`` still holds (call after ``PipelineEngine.install``)."""
    report = materialize_module(model, device=device)
    rank_zero_info(
        f"lightning_mp: delayed init materialised stage {stage}: {report.num_tensors} tensors,"
        f" {report.kept_bytes / 2**20:.1f} MiB ({report.ops_run} init ops replayed, {report.ops_scratch} random ops"
        " of other stages drawn on scratch)"
    )
    return report
