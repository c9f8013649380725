"""``PipelineTimeline``: what every pipeline rank did during chosen training steps, and the measured bubble.

[Note: bubble] GPipe (Huang et al., 2019, arXiv 1811.06965, section 2.3) calls the time a stage waits for its
neighbours the pipeline *bubble*: with ``p`` equal stages and ``m`` microbatches it is ``(p - 1) / (m + p - 1)`` of
the step, whatever the order of forwards and backwards (GPipe's all-forwards-then-all-backwards, or the 1F1B-like
``pipeline="interleaved"`` of SMP, Karakus et al., 2021, arXiv 2111.05972, section 3.2). We measure it instead of
deriving it: for each rank, ``bubble = 1 - busy / span``, where ``busy`` is the length of the union of the rank's
forward, backward and weight-pass compute spans (``"weight"``: the deferred weight gradients of
``pipeline="zero_bubble"``, which fill the bubble) and ``span`` is the step's wall time, from the earliest event start
to the latest event end over all ranks. Message sends and receives are not busy time: they are what a bubble waits on.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_mp.pipeline import TimelineEvent

if TYPE_CHECKING:
    from lightning_mp.pipeline import PipelineEngine

__all__ = [
    "BubbleReport",
    "PipelineTimeline",
    "RankTimeline",
    "chrome_trace",
    "gantt_chart",
    "gpipe_bubble",
    "measure_bubble",
]

_COMPUTE = ("forward", "backward", "weight")


@dataclass(frozen=True)
class RankTimeline:
    """One rank's events of one recorded step, on the clock shared by all ranks.

    Attributes:
        rank: global rank.
        stage: pipeline stage of that rank.
        events: what it did; ``start_s`` / ``end_s`` in seconds since the barrier that began the step on every rank.
        window_s: seconds from that barrier to the end of recording on this rank (every event lies inside it).
    """

    rank: int
    stage: int
    events: list[TimelineEvent]
    window_s: float


@dataclass(frozen=True)
class BubbleReport:
    """The measured bubble of one step (see [Note: bubble] in this module).

    Attributes:
        start_s: earliest event start over all ranks, seconds on the shared clock.
        end_s: latest event end over all ranks.
        busy_s: global rank -> seconds it computed (union of its forward, backward and weight spans).
        fractions: global rank -> ``1 - busy_s / (end_s - start_s)``, in [0, 1].
    """

    start_s: float
    end_s: float
    busy_s: dict[int, float]
    fractions: dict[int, float]

    @property
    def span_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def mean(self) -> float:
        """Mean bubble fraction over ranks."""
        return sum(self.fractions.values()) / len(self.fractions)


def gpipe_bubble(num_stages: int, num_microbatches: int) -> float:
    """GPipe's bubble fraction ``(p - 1) / (m + p - 1)`` for ``p`` equal stages and ``m`` microbatches."""
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


def measure_bubble(timelines: Sequence[RankTimeline]) -> BubbleReport:
    """The bubble fraction of every rank of one step (see [Note: bubble] in this module).

    Raises:
        ValueError: if no rank recorded any event (the span is undefined).
    """
    events = [e for t in timelines for e in t.events]
    if not events:
        raise ValueError("No timeline events were recorded on any rank; the step's span is undefined.")
    start = min(e.start_s for e in events)
    end = max(e.end_s for e in events)
    busy = {
        t.rank: _union_length([(e.start_s, e.end_s) for e in t.events if e.category in _COMPUTE]) for t in timelines
    }
    span = end - start
    fractions = {rank: (1.0 - b / span if span > 0 else 0.0) for rank, b in busy.items()}
    return BubbleReport(start, end, busy, fractions)


def _union_length(spans: list[tuple[float, float]]) -> float:
    """Total length covered by ``spans`` (overlaps counted once)."""
    total, covered_to = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > covered_to:
            total += end - max(start, covered_to)
            covered_to = end
    return total


def chrome_trace(timelines: Sequence[RankTimeline], step: int | None = None) -> dict:
    """A Chrome / Perfetto trace (JSON object format) of one step: open it at https://ui.perfetto.dev.

    One process per rank (``pid`` = global rank, named ``"rank r (stage s)"``), one track per engine thread
    (``tid`` numbered per rank, named by ``thread_name`` metadata), one ``"X"`` complete event per span with
    ``cat`` = its category, ``ts`` / ``dur`` in microseconds on the shared clock and ``args.microbatch``.
    ``otherData`` holds the step, each rank's recording window and the measured bubble.
    """
    trace_events: list[dict] = []
    for timeline in sorted(timelines, key=lambda t: t.rank):
        trace_events += _process_events(timeline)
    other: dict = {"step": step, "window_us": {str(t.rank): t.window_s * 1e6 for t in timelines}}
    if any(t.events for t in timelines):
        report = measure_bubble(timelines)
        other["span_us"] = [report.start_s * 1e6, report.end_s * 1e6]
        other["bubble"] = {str(rank): fraction for rank, fraction in report.fractions.items()}
        other["mean_bubble"] = report.mean
    return {"traceEvents": trace_events, "displayTimeUnit": "ms", "otherData": other}


def _process_events(timeline: RankTimeline) -> list[dict]:
    pid = timeline.rank
    process_name = f"rank {pid} (stage {timeline.stage})"
    out: list[dict] = [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": process_name}},
        {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}},
    ]
    tids: dict[str, int] = {}
    for event in timeline.events:
        if event.thread not in tids:
            tids[event.thread] = len(tids)
            name = {"name": event.thread}
            out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tids[event.thread], "args": name})
        out.append(
            {
                "ph": "X",
                "name": event.name,
                "cat": event.category,
                "pid": pid,
                "tid": tids[event.thread],
                "ts": event.start_s * 1e6,
                "dur": event.duration_s * 1e6,
                "args": {"microbatch": event.microbatch},
            }
        )
    return out


def _format_bubble(report: BubbleReport, timelines: Sequence[RankTimeline], step: int) -> str:
    """A per-rank table of busy time and bubble fraction, the mean, and GPipe's figure for the same p and m."""
    stages = {t.rank: t.stage for t in timelines}
    rows = [
        (str(rank), str(stages[rank]), f"{1e3 * report.busy_s[rank]:.2f}", f"{100 * report.fractions[rank]:.1f}%")
        for rank in sorted(report.fractions)
    ]
    header = ("rank", "stage", "busy ms", "bubble")
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    lines = [" | ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in (header, *rows)]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    num_stages = len(set(stages.values()))
    num_microbatches = len({e.microbatch for t in timelines for e in t.events if e.category == "forward"})
    ideal = gpipe_bubble(num_stages, num_microbatches) if num_microbatches else float("nan")
    lines.append(
        f"mean bubble {100 * report.mean:.1f}% (GPipe's (p-1)/(m+p-1) = {100 * ideal:.1f}% for p={num_stages},"
        f" m={num_microbatches})"
    )
    title = f"lightning_mp pipeline timeline, training step {step} (span {1e3 * report.span_s:.2f} ms):"
    return "\n".join([title, *lines])


class PipelineTimeline(Callback):
    """Record what every pipeline rank did during chosen training steps; write a trace, a chart and the bubble.

    On each chosen step, every rank enters a barrier over the world, takes ``time.perf_counter()`` as its origin
    (so the ranks share one clock, to the barrier's skew) and switches its engine's recorder on around the
    pipelined step. Global rank 0 gathers every rank's events and writes, to ``dirpath`` (default: the logger's
    directory, ``trainer.log_dir``, else ``default_root_dir``):

    - ``{filename}_step{N}.json``: a Chrome / Perfetto trace (see :func:`chrome_trace`); open it at
      https://ui.perfetto.dev or ``chrome://tracing``.
    - ``{filename}_step{N}.png``: a Gantt chart, one row per rank: forward, backward and weight-pass spans
      labelled with their microbatch, sends and receives as thin marks.

    It also prints, on rank 0, each rank's measured bubble fraction and the mean: ``1 - busy / span``, where busy
    is the union of the rank's forward, backward and weight spans and span is the step's wall time over all ranks
    (GPipe's bubble, measured; see [Note: bubble] in ``_pipeline_timeline.py``). The reports stay in
    :attr:`reports` (step -> :class:`BubbleReport`) on rank 0.

    Without the ``"smp"`` strategy or with ``pipeline_parallel_degree=1`` there is no pipeline: it warns once
    and records nothing.

    Args:
        steps: the global steps (``trainer.global_step`` when the batch starts, 0-based) to record. The default
            skips the first steps, which include warm-up (allocator, thread pools). With gradient accumulation
            the first batch of the step is recorded.
        filename: stem of the written files.
        dirpath: folder for the files; ``None`` = the logger's directory.
        chart: write the PNG (needs matplotlib).

    Raises:
        ValueError: if ``steps`` is not a non-empty sequence of non-negative integers.
    """

    def __init__(
        self,
        steps: Sequence[int] = (3,),
        filename: str = "pipeline_timeline",
        dirpath: str | None = None,
        chart: bool = True,
    ) -> None:
        self.steps = _validate_steps(steps)
        self.filename = filename
        self.dirpath = dirpath
        self.chart = chart
        self.reports: dict[int, BubbleReport] = {}
        self.recorded_steps: list[int] = []
        self._recording: int | None = None
        self._origin = 0.0
        self._warned = False

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._engine(trainer)  # warns now if there is no pipeline to record

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: object, batch_idx: int) -> None:
        step = trainer.global_step
        if step not in self.steps or step in self.recorded_steps or self._recording is not None:
            return
        engine = self._engine(trainer)
        if engine is None:
            return
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
        self._origin = time.perf_counter()
        engine.timeline.start()
        self._recording = step

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: object, batch: object, batch_idx: int
    ) -> None:
        if self._recording is None:
            return
        step, self._recording = self._recording, None
        engine = self._engine(trainer)
        assert engine is not None
        events = engine.timeline.stop()
        window = time.perf_counter() - self._origin
        self.recorded_steps.append(step)
        shifted = [
            dataclasses.replace(e, start_s=e.start_s - self._origin, end_s=e.end_s - self._origin) for e in events
        ]
        timelines = _gather(RankTimeline(trainer.global_rank, engine.stage, shifted, window))
        out_dir = self.dirpath or trainer.log_dir or trainer.default_root_dir  # every rank: `log_dir` is a collective
        if timelines is not None:
            self._write(timelines, step, out_dir)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if self._recording is not None:
            self._recording = None
            engine = self._engine(trainer)
            if engine is not None:
                engine.timeline.stop()

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        missed = sorted(set(self.steps) - set(self.recorded_steps))
        if missed and self._engine(trainer) is not None:
            rank_zero_warn(
                f"PipelineTimeline did not record steps {missed}: training ended at global step {trainer.global_step}."
                " Choose steps below `max_steps`."
            )

    def _engine(self, trainer: Trainer) -> PipelineEngine | None:
        """This rank's engine when there is a pipeline; else ``None``, after one warning on rank 0."""
        engine = getattr(trainer.strategy, "pipeline_engine", None)
        if engine is not None and engine.num_stages > 1:
            return engine
        if not self._warned:
            self._warned = True
            rank_zero_warn(
                "PipelineTimeline has no pipeline to record: it needs the 'smp' strategy with"
                " pipeline_parallel_degree > 1. It records nothing."
            )
        return None

    def _write(self, timelines: list[RankTimeline], step: int, out_dir: str) -> None:
        if not any(t.events for t in timelines):
            rank_zero_warn(f"PipelineTimeline recorded no events on step {step}; nothing written.")
            return
        report = measure_bubble(timelines)
        self.reports[step] = report
        rank_zero_info(_format_bubble(report, timelines, step))
        os.makedirs(out_dir, exist_ok=True)
        stem = os.path.join(out_dir, f"{self.filename}_step{step}")
        with open(f"{stem}.json", "w") as file:
            json.dump(chrome_trace(timelines, step), file)
        written = [f"{stem}.json (open in https://ui.perfetto.dev)"]
        if self.chart:
            gantt_chart(timelines, report, step, f"{stem}.png")
            written.append(f"{stem}.png")
        rank_zero_info(f"PipelineTimeline wrote {' and '.join(written)}")


def _validate_steps(steps: Sequence[int]) -> frozenset[int]:
    if isinstance(steps, (str, bytes)) or not isinstance(steps, Sequence) or not steps:
        raise ValueError(
            f"PipelineTimeline(steps=...) takes a non-empty sequence of global steps, e.g. (3,); got {steps!r}."
        )
    bad = [s for s in steps if isinstance(s, bool) or not isinstance(s, int) or s < 0]
    if bad:
        raise ValueError(
            f"PipelineTimeline(steps=...) takes non-negative integer global steps; got {list(steps)!r}, bad: {bad!r}."
        )
    return frozenset(steps)


def _gather(timeline: RankTimeline) -> list[RankTimeline] | None:
    """Every rank's timeline on global rank 0 (``None`` elsewhere); a collective over the default group."""
    if not (dist.is_available() and dist.is_initialized()):
        return [timeline]
    rank = dist.get_rank()
    gathered: list | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(timeline, gathered, dst=0)
    return gathered


def gantt_chart(timelines: Sequence[RankTimeline], report: BubbleReport, step: int, path: str) -> None:
    """Draw one row per rank: forward, backward and weight spans labelled with their microbatch, messages as thin
    marks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    colors = {"forward": "#4878a8", "backward": "#dd8452", "weight": "#8172b3", "send": "#55a868", "recv": "#c44e52"}
    ordered = sorted(timelines, key=lambda t: t.rank)
    span_ms = max(1e3 * report.span_s, 1e-6)
    figure, axes = plt.subplots(figsize=(11, 1.0 + 0.9 * len(ordered)))
    for row, timeline in enumerate(ordered):
        y = len(ordered) - 1 - row  # rank 0 on top
        for event in timeline.events:
            start, width = 1e3 * event.start_s, 1e3 * event.duration_s
            color = colors[event.category]
            if event.category in _COMPUTE:
                axes.broken_barh([(start, width)], (y - 0.3, 0.6), facecolors=color, edgecolor="white", linewidth=0.3)
                if width > 0.02 * span_ms:
                    axes.text(start + width / 2, y, str(event.microbatch), ha="center", va="center", fontsize=7,
                              color="white")
            else:  # thin marks above (send) and below (recv) the compute bar; a zero-length one stays visible
                offset = 0.34 if event.category == "send" else -0.42
                axes.broken_barh([(start, max(width, 0.002 * span_ms))], (y + offset, 0.08), facecolors=color)
    labels = [f"rank {t.rank}\nstage {t.stage}\nbubble {100 * report.fractions[t.rank]:.0f}%" for t in ordered]
    axes.set_yticks(range(len(ordered)), labels[::-1], fontsize=8)
    axes.set_xlim(1e3 * report.start_s, 1e3 * report.end_s)
    axes.set_ylim(-0.6, len(ordered) - 0.4 + 0.4)  # room for the legend above the top row
    axes.set_xlabel("time since the step's barrier (ms)")
    axes.set_title(f"Pipeline timeline, training step {step}: mean bubble {100 * report.mean:.1f}%")
    axes.legend(handles=[Patch(color=c, label=k) for k, c in colors.items()], loc="upper right", fontsize=7, ncol=4)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
