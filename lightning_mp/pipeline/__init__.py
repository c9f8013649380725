"""Module-server pipeline engine, schedules and microbatch split/merge. Torch only, no Lightning."""

from lightning_mp.pipeline._engine import PipelineEngine, PipelineError, PipelineSession
from lightning_mp.pipeline._handles import RemoteValue
from lightning_mp.pipeline._microbatch import (
    MicrobatchSplit,
    MicrobatchSplitError,
    merge_microbatches,
    split_batch,
    split_microbatches,
)

__all__ = [
    "MicrobatchSplit",
    "MicrobatchSplitError",
    "PipelineEngine",
    "PipelineError",
    "PipelineSession",
    "RemoteValue",
    "merge_microbatches",
    "split_batch",
    "split_microbatches",
]
