"""User-facing views and switches: the partition summary and the pipeline timeline (more come with later features)."""

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
    "BubbleReport",
    "PartitionSummary",
    "PipelineTimeline",
    "RankTimeline",
    "StageSummary",
    "chrome_trace",
    "gpipe_bubble",
    "measure_bubble",
    "summarize_stages",
]
