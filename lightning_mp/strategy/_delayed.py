"""Strategy glue for delayed parameter initialisation: a meta trace, then each rank materialises its stage.

The torch-only machinery is :mod:`lightning_mp.init`. Here: the partitioning trace of a meta-built model runs
on a meta copy of the sample batch (so no parameter is ever allocated for tracing), and after the engine has
dropped every other stage's tensors, what is left on the rank (its stage, plus stateless modules' buffers,
which run everywhere) is materialised by replaying the record.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn

from lightning_mp.init import MaterializeReport, find_record, materialize_module

__all__ = ["is_delayed", "materialize_stage", "meta_trace_inputs"]


def is_delayed(model: nn.Module) -> bool:
    """Whether ``model`` was built under delayed init and is not materialised yet."""
    return find_record(model) is not None


def meta_trace_inputs(to_device: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``to_device`` followed by a move of every tensor to the meta device: the trace input of a meta model."""

    def to_meta(batch: Any) -> Any:
        return apply_to_collection(to_device(batch), torch.Tensor, lambda t: t.to("meta"))

    return to_meta


def materialize_stage(model: nn.Module, device: torch.device, stage: int) -> MaterializeReport:
    """Materialise every meta tensor ``model`` still holds (call after ``PipelineEngine.install``)."""
    report = materialize_module(model, device=device)
    rank_zero_info(
        f"lightning_mp: delayed init materialised stage {stage}: {report.num_tensors} tensors,"
        f" {report.kept_bytes / 2**20:.1f} MiB ({report.ops_run} init ops replayed, {report.ops_scratch} random ops"
        " of other stages drawn on scratch)"
    )
    return report
