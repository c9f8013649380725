"""User-facing views and switches: the partition summary (more come with later features)."""

from lightning_mp.callbacks._partition_summary import PartitionSummary, StageSummary, summarize_stages

__all__ = ["PartitionSummary", "StageSummary", "summarize_stages"]
