"""``PipelineTimeline`` in a real 2-stage ``Trainer.fit``: files, events of every rank, one clock; without a
pipeline it warns once and records nothing."""

from __future__ import annotations

import json
import os

import lightning as L
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

import lightning_mp
from lightning_mp.callbacks import PipelineTimeline
from tests.trainer.test_strategy import STEPS, _fit

RECORDED_STEP, MICROBATCHES = 1, 4


class RecorderProbe(L.Callback):
    """Runs after ``PipelineTimeline``: is the engine's recorder on, at the start and at the end of each batch?"""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.on_at_start: list[bool] = []
        self.on_at_end: list[bool] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.on_at_start.append(trainer.strategy.pipeline_engine.timeline.enabled)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.on_at_end.append(trainer.strategy.pipeline_engine.timeline.enabled)

    def on_train_end(self, trainer, pl_module):
        timeline = next(c for c in trainer.callbacks if isinstance(c, lightning_mp.PipelineTimeline))
        probe = {"start": self.on_at_start, "end": self.on_at_end, "recorded": timeline.recorded_steps}
        torch.save(probe, os.path.join(self.out_dir, f"probe{trainer.global_rank}.pt"))


def test_timeline_of_a_two_stage_fit(tmp_path, capfd):
    out_dir, log_dir = tmp_path / "out", tmp_path / "logs"
    os.makedirs(out_dir)
    strategy = lightning_mp.SMPStrategy(pipeline_parallel_degree=2, microbatches=MICROBATCHES, start_method="spawn")
    timeline = lightning_mp.PipelineTimeline(steps=[RECORDED_STEP])
    _fit("mlp", str(out_dir), strategy, devices=2, callbacks_extra=[timeline, RecorderProbe(str(out_dir))],
         default_root_dir=str(log_dir))

    assert sorted(p.name for p in log_dir.iterdir()) == [
        f"pipeline_timeline_step{RECORDED_STEP}.json", f"pipeline_timeline_step{RECORDED_STEP}.png"
    ], "only the chosen step is written"
    assert (log_dir / f"pipeline_timeline_step{RECORDED_STEP}.png").stat().st_size > 1000
    trace = json.loads((log_dir / f"pipeline_timeline_step{RECORDED_STEP}.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1}

    def microbatches(pid: int, category: str, name: str | None = None) -> set[int]:
        return {
            e["args"]["microbatch"] for e in spans
            if e["pid"] == pid and e["cat"] == category and name in (None, e["name"])
        }

    every = set(range(MICROBATCHES))
    assert microbatches(0, "forward", "step") == every, "the driver ran the user's step for every microbatch"
    assert microbatches(0, "backward") == every
    assert microbatches(1, "forward") == every and microbatches(1, "backward") == every
    assert {(e["pid"], e["cat"]) for e in spans} >= {(0, "send"), (0, "recv"), (1, "send"), (1, "recv")}

    other = trace["otherData"]
    start_us, end_us = other["span_us"]
    for event in spans:  # every event lies inside its rank's recording window, on the shared clock
        assert 0 <= event["ts"] and event["ts"] + event["dur"] <= other["window_us"][str(event["pid"])] + 1e-3
        assert start_us <= event["ts"] and event["ts"] + event["dur"] <= end_us + 1e-3
    assert sorted(other["bubble"]) == ["0", "1"]
    assert all(0 <= b < 1 for b in other["bubble"].values())

    for rank in range(2):
        probe = torch.load(out_dir / f"probe{rank}.pt")
        assert probe["recorded"] == [RECORDED_STEP]
        assert probe["start"] == [step == RECORDED_STEP for step in range(STEPS)], "on only around the chosen step"
        assert probe["end"] == [False] * STEPS, "off again once the step's batch ends"
    output = capfd.readouterr()
    assert "lightning_mp pipeline timeline, training step 1" in output.out + output.err
    assert "mean bubble" in output.out + output.err


def test_timeline_without_a_pipeline_warns_once_and_records_nothing(tmp_path):
    model = BoringModel()
    timeline = PipelineTimeline(steps=[0, 1])
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[timeline], default_root_dir=str(tmp_path), limit_val_batches=0,
    )
    with pytest.warns(UserWarning, match="no pipeline to record") as record:
        trainer.fit(model)
    assert sum("no pipeline to record" in str(w.message) for w in record) == 1
    assert timeline.recorded_steps == [] and not list(tmp_path.rglob("pipeline_timeline*"))
