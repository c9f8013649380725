"""The partition summary's per-stage numbers add up to the traced model; the pipeline timeline's trace
and bubble from hand-made events, and its argument checks."""

from __future__ import annotations

import json

import pytest

from lightning_mp.callbacks import PipelineTimeline, RankTimeline, chrome_trace, gpipe_bubble, measure_bubble
from lightning_mp.callbacks import StageSummary, summarize_stages
from lightning_mp.callbacks._partition_summary import _bar_chart, _table, common_prefix, compact_names
from lightning_mp.callbacks._pipeline_timeline import gantt_chart
from lightning_mp.pipeline import TimelineEvent
from lightning_mp.partition import plan, trace
from tests.models import TinyLM


def test_stage_summaries_add_up_to_the_model():
    model = TinyLM()  # blocks is a ModuleList: a container that is never called itself
    batch = TinyLM.batch()
    model_trace = trace(model, lambda: TinyLM.loss(model, batch))
    stages = summarize_stages(plan(model_trace, 2), model_trace)
    assert sum(s.flops for s in stages) == model_trace.total_flops
    assert sum(s.num_params for s in stages) == sum(p.numel() for p in model.parameters())
    leaves = [r for r in model_trace.modules.values() if not r.children]
    assert sum(s.activation_bytes for s in stages) == sum(r.activation_bytes for r in leaves)
    assert all(s.flops > 0 for s in stages), "each stage holds transformer blocks"
    assert abs(sum(s.cost_share for s in stages) - 1) < 1e-9


def test_summary_of_a_32_layer_hf_model_names_modules_short_and_draws_every_quantity(tmp_path):
    """Four stages of a GPT-2-like tree: the shared ``model.transformer.`` prefix is left out, runs of blocks are
    folded, a module outside the prefix keeps its whole name; the chart draws parameters, compute, activations."""
    prefix = "model.transformer."
    blocks = [f"{prefix}h.{i}" for i in range(32)]
    modules = [[f"{prefix}wte", f"{prefix}wpe", *blocks[:8]], blocks[8:16], blocks[16:24],
               [*blocks[24:], f"{prefix}ln_f", "model.lm_head"]]
    stages = [StageSummary(k, names, 1000 * (k + 1), 2e9 * (k + 1), 2**20 * (k + 1), (k + 1) / 10)
              for k, names in enumerate(modules)]
    table = _table(stages)
    assert common_prefix([m for names in modules for m in names]) == prefix
    rows = table.splitlines()[2:]
    assert [row.split("|")[1].strip() for row in rows] == [
        "wte, wpe, h.0-7", "h.8-15", "h.16-23", "h.24-31, ln_f, model.lm_head"
    ]
    assert f"({prefix} omitted)" in table.splitlines()[0]
    assert [row.split("|")[2].strip() for row in rows] == ["1,000", "2,000", "3,000", "4,000"]
    assert compact_names(["a.0", "a.1", "b", "a.2", "a.4"]) == ["a.0-1", "b", "a.2", "a.4"]
    _bar_chart(stages, str(tmp_path / "partition.png"))
    assert (tmp_path / "partition.png").stat().st_size > 10_000


# ---- PipelineTimeline: the pure parts, on hand-made events -------------------------------------------------------


def _event(category: str, microbatch: int, start: float, end: float, name: str = "step", thread: str = "MainThread"):
    return TimelineEvent(category, name, microbatch, start, end, thread)


def _gpipe_layout(num_stages: int, num_microbatches: int, fwd: float, bwd: float) -> list[RankTimeline]:
    """GPipe's schedule with equal stages: forward of microbatch i on stage s at (s + i) * fwd; after the last
    forward, backwards run from the last stage to the first. Sends are zero-length marks (never busy time)."""
    forwards_end = (num_microbatches + num_stages - 1) * fwd
    timelines = []
    for stage in range(num_stages):
        events = []
        for i in range(num_microbatches):
            start = (stage + i) * fwd
            events.append(_event("forward", i, start, start + fwd))
            events.append(_event("send", i, start + fwd, start + fwd, name=f"to stage {stage + 1}"))
            back = forwards_end + (i + num_stages - 1 - stage) * bwd
            events.append(_event("backward", i, back, back + bwd, thread="smp-worker"))
        timelines.append(RankTimeline(rank=stage, stage=stage, events=events, window_s=forwards_end + 10 * bwd))
    return timelines


@pytest.mark.parametrize(("num_stages", "num_microbatches"), [(2, 4), (4, 8), (3, 1)])
def test_bubble_of_the_gpipe_layout_is_gpipes_formula(num_stages, num_microbatches):
    fwd, bwd = 0.25, 0.5
    report = measure_bubble(_gpipe_layout(num_stages, num_microbatches, fwd, bwd))
    # every stage computes m * (f + b) within a span of (m + p - 1) * (f + b)
    expected = (num_stages - 1) / (num_microbatches + num_stages - 1)
    assert report.span_s == pytest.approx((num_microbatches + num_stages - 1) * (fwd + bwd))
    for rank in range(num_stages):
        assert report.busy_s[rank] == pytest.approx(num_microbatches * (fwd + bwd))
        assert report.fractions[rank] == pytest.approx(expected)
    assert report.mean == pytest.approx(gpipe_bubble(num_stages, num_microbatches))


def test_bubble_counts_overlapping_compute_once_and_messages_never():
    rank0 = [_event("forward", 0, 0.0, 1.0), _event("forward", 1, 0.5, 1.5), _event("backward", 0, 2.0, 3.0)]
    rank1 = [_event("forward", 0, 1.0, 2.5), _event("recv", 0, 2.5, 4.0, name="from stage 0")]
    report = measure_bubble([RankTimeline(0, 0, rank0, 5.0), RankTimeline(1, 1, rank1, 5.0)])
    # span: earliest start 0.0 to latest end 4.0 (the recv) over both ranks
    assert (report.start_s, report.end_s) == (0.0, 4.0)
    assert report.busy_s == {0: pytest.approx(2.5), 1: pytest.approx(1.5)}  # [0, 1.5] + [2, 3]; [1, 2.5]
    assert report.fractions == {0: pytest.approx(1 - 2.5 / 4), 1: pytest.approx(1 - 1.5 / 4)}
    with pytest.raises(ValueError, match="No timeline events"):
        measure_bubble([RankTimeline(0, 0, [], 1.0)])


def test_chrome_trace_fields():
    timelines = _gpipe_layout(2, 2, fwd=0.001, bwd=0.002)
    trace = json.loads(json.dumps(chrome_trace(timelines, step=7)))
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == sum(len(t.events) for t in timelines)
    first = timelines[1].events[0]  # stage 1's forward of microbatch 0 starts at 1 ms
    match = next(e for e in spans if e["pid"] == 1 and e["cat"] == "forward" and e["args"]["microbatch"] == 0)
    assert match["name"] == first.name and match["ts"] == pytest.approx(1e3) and match["dur"] == pytest.approx(1e3)
    meta = {(e["pid"], e["name"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"] if "name" in e["args"]}
    assert meta[(0, "process_name", 0)] == "rank 0 (stage 0)" and meta[(1, "process_name", 0)] == "rank 1 (stage 1)"
    threads = {meta[(e["pid"], "thread_name", e["tid"])] for e in spans}
    assert threads == {"MainThread", "smp-worker"}, "every span's tid is named by thread_name metadata"
    assert {e["cat"] for e in spans} == {"forward", "backward", "send"}
    assert trace["otherData"]["step"] == 7
    assert trace["otherData"]["mean_bubble"] == pytest.approx(gpipe_bubble(2, 2))


def test_gantt_chart_writes_a_png(tmp_path):
    timelines = _gpipe_layout(3, 4, fwd=0.001, bwd=0.002)
    path = tmp_path / "timeline.png"
    gantt_chart(timelines, measure_bubble(timelines), 3, str(path))
    assert path.stat().st_size > 1000


@pytest.mark.parametrize("steps", [(), [-1], "3", 3, [1.5], [True], None])
def test_timeline_rejects_bad_steps(steps):
    with pytest.raises(ValueError, match=r"PipelineTimeline\(steps=...\)"):
        PipelineTimeline(steps=steps)
