"""User-facing views and switches: the partition summary, the pipeline timeline, and the memory savers."""

from lightning_mp.callbacks._memory import ActivationCheckpointing, ActivationOffloading, DelayedParameterInit
from lightning_mp.callbacks._partition_summary import PartitionSummary, StageSummary, summarize_stages
from lightning_mp.callbacks._pipeline_timeline import (
    BubbleReport,
    PipelineTimeline,
    RankTimeline,
    chrome_trace,
    gpipe_bubble,
    measure_bubble,
)

__all__ = [
    "ActivationCheckpointing",
    "ActivationOffloading",
    "BubbleReport",
    "DelayedParameterInit",
    "PartitionSummary",
    "PipelineTimeline",
    "RankTimeline",
    "StageSummary",
    "chrome_trace",
    "gpipe_bubble",
    "measure_bubble",
    "summarize_stages",
]
