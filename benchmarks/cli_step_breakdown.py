"""Where a training step's time goes: ``lightning-mp fit`` of ``configs/gpt_pp2.yaml`` against ``gpt_single.yaml``.

Run (CPU, a few minutes)::

    python benchmarks/cli_step_breakdown.py [--steps 40] [--rounds 2]

Each round runs, in an order that rotates from round to round, ``gpt_single.yaml`` (one process), ``gpt_pp2.yaml``
as shipped and ``gpt_pp2.yaml`` with ``tied_weights: replicate`` (the head, and so the loss, on stage 1), with no
validation, checkpoint, logger or progress bar. The :class:`StepBreakdown` callback splits every training step
after the first ``--warmup`` on every rank into: the training step (Lightning's closure: for ``smp`` the pipelined
step, ``engine.session`` in it; for one process forward and backward), the optimizer step (from
``on_before_optimizer_step`` to ``on_train_batch_end``) and the time outside the step (from one
``on_train_batch_end`` to the next ``on_train_batch_start``: the loop, the batch, logging); and, from the engine's own
timeline (``engine.timeline``), the rank's compute (union of its forward, backward and weight spans), its sends
and receives, and the rest of the session (waiting for the other stage: the bubble and replies). Per step also the
process CPU seconds (all threads, ``time.process_time``), context switches (``getrusage``) and the engine's
messages. Prints per-round steps/s (global rank 0's step plus outside time) with each run's ratio to
``gpt_single`` of the same round, and the breakdown of the last round (means per step; only ratios within one run
mean anything on a shared machine).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections import Counter
from contextlib import contextmanager
from typing import Any

import lightning as L
import torch

from lightning_mp.callbacks import RankTimeline, measure_bubble

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


class StepBreakdown(L.Callback):
    """Per rank, the mean split of the training steps after ``warmup`` (see the module docstring), written as JSON to
    ``{out_dir}/{global_rank}.json`` at the end of ``fit``."""

    def __init__(self, out_dir: str, warmup: int = 10) -> None:
        self.out_dir, self.warmup = out_dir, warmup
        self.totals: Counter = Counter()
        self.messages: Counter = Counter()
        self.steps = 0
        self._marks: dict[str, float] = {}
        self._session_s = 0.0
        self._engine: Any = None

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        engine = getattr(trainer.strategy, "pipeline_engine", None)
        if engine is not None and engine.num_stages > 1:
            self._engine = engine
            original = engine.session

            @contextmanager
            def timed_session(*args: Any, **kwargs: Any) -> Any:
                start = time.perf_counter()
                with original(*args, **kwargs) as session:
                    yield session
                self._session_s += time.perf_counter() - start

            engine.session = timed_session

    def _timed(self, trainer: L.Trainer) -> bool:
        return trainer.global_step >= self.warmup

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        now = time.perf_counter()
        if self._timed(trainer) and "end" in self._marks:
            self.totals["outside_s"] += now - self._marks["end"]
        usage = resource.getrusage(resource.RUSAGE_SELF)
        self._marks.update(start=now, cpu=time.process_time(), csw=usage.ru_nvcsw + usage.ru_nivcsw)
        self._session_s = 0.0
        if self._engine is not None:
            self._messages_before = Counter(self._engine.messages_sent)
            self._engine.timeline.start()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self._marks["closure_end"] = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        now = time.perf_counter()
        events = self._engine.timeline.stop() if self._engine is not None else []
        self._marks["end"] = now
        if not self._timed(trainer) or "closure_end" not in self._marks:
            return
        usage = resource.getrusage(resource.RUSAGE_SELF)
        self.steps += 1
        totals, marks = self.totals, self._marks
        totals["step_s"] += now - marks["start"]
        totals["training_step_s"] += marks["closure_end"] - marks["start"]
        totals["optimizer_s"] += now - marks["closure_end"]
        totals["cpu_s"] += time.process_time() - marks["cpu"]
        totals["context_switches"] += usage.ru_nvcsw + usage.ru_nivcsw - marks["csw"]
        if self._engine is not None:
            compute = measure_bubble([RankTimeline(0, 0, events, 0.0)]).busy_s[0] if events else 0.0
            totals["session_s"] += self._session_s
            totals["compute_s"] += compute
            for category in ("forward", "backward", "weight", "send", "recv"):
                totals[f"{category}_s"] += sum(e.duration_s for e in events if e.category == category)
            totals["waiting_s"] += self._session_s - compute
            self.messages.update(Counter(self._engine.messages_sent) - self._messages_before)

    def on_train_end(self, trainer, pl_module):
        os.makedirs(self.out_dir, exist_ok=True)
        record = {key: value / max(1, self.steps) for key, value in self.totals.items()}
        record["messages"] = {kind: count / max(1, self.steps) for kind, count in self.messages.items()}
        record.update(steps=self.steps, threads=torch.get_num_threads())
        with open(os.path.join(self.out_dir, f"{trainer.global_rank}.json"), "w") as f:
            json.dump(record, f)


def _run(config: str, extra: list[str], steps: int, warmup: int) -> list[dict]:
    out_dir = tempfile.mkdtemp(prefix="breakdown_")
    callback = {"class_path": "benchmarks.cli_step_breakdown.StepBreakdown",
                "init_args": {"out_dir": out_dir, "warmup": warmup}}
    command = [
        sys.executable, "-m", "lightning_mp.cli", "fit", "--config", f"configs/{config}",
        "--trainer.max_steps", str(steps), "--trainer.limit_val_batches", "0", "--trainer.enable_checkpointing",
        "false", "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false", "--trainer.callbacks", json.dumps([callback]), *extra,
    ]
    env = {**os.environ, "PYTHONPATH": ROOT}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    files = sorted(f for f in os.listdir(out_dir) if f.endswith(".json"))
    if done.returncode != 0 or not files:
        tail = f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        raise RuntimeError(f"{config} {extra} failed ({done.returncode}):\n{tail}")
    records = []
    for name in files:
        with open(os.path.join(out_dir, name)) as f:
            records.append(json.load(f))
    return records


_ROWS = [
    ("step (batch start to batch end)", "step_s"),
    ("  training step (closure)", "training_step_s"),
    ("    engine session", "session_s"),
    ("      compute (union of spans)", "compute_s"),
    ("        forward", "forward_s"),
    ("        backward", "backward_s"),
    ("      waiting (session - compute)", "waiting_s"),
    ("        sending / receiving (inside waiting)", None),
    ("  optimizer step", "optimizer_s"),
    ("outside the step (loop, batch, logging)", "outside_s"),
    ("process CPU s per step (all threads)", "cpu_s"),
    ("context switches per step", "context_switches"),
]


def _table(runs: dict[str, list[dict]]) -> str:
    columns = [(name, rank, record) for name, records in runs.items() for rank, record in enumerate(records)]
    single = runs["gpt_single"][0]
    lines = ["| | " + " | ".join(f"{name} rank {rank}" for name, rank, _ in columns) + " |",
             "|---" * (len(columns) + 1) + "|"]
    for label, key in _ROWS:
        cells = []
        for _, _, record in columns:
            if key is None:
                value = record.get("send_s", 0.0) + record.get("recv_s", 0.0)
                cells.append(f"{1e3 * value:.1f} ms" if "session_s" in record else "")
            elif key not in record:
                cells.append("")
            elif key == "context_switches":
                cells.append(f"{record[key]:.0f}")
            else:
                ratio = record[key] / single[key] if single.get(key) else None
                cells.append(f"{1e3 * record[key]:.1f} ms" + (f" ({ratio:.2f}x)" if ratio is not None else ""))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("| messages sent per step | " + " | ".join(
        ", ".join(f"{k} {v:g}" for k, v in sorted(r.get("messages", {}).items())) for _, _, r in columns) + " |")
    lines.append("| intra-op threads | " + " | ".join(str(r["threads"]) for _, _, r in columns) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    runs = {
        "gpt_single": ("gpt_single.yaml", []),
        "gpt_pp2": ("gpt_pp2.yaml", []),
        "gpt_pp2 replicate": ("gpt_pp2.yaml", ["--trainer.strategy.init_args.tied_weights", "replicate"]),
    }
    names = list(runs)
    for round_index in range(args.rounds):
        shift = round_index % len(names)
        results = {}
        for name in names[shift:] + names[:shift]:
            results[name] = _run(*runs[name], args.steps, args.warmup)
        rate = {name: 1 / (records[0]["step_s"] + records[0]["outside_s"]) for name, records in results.items()}
        print(f"round {round_index}: " + ", ".join(
            f"{name} {rate[name]:.3f} steps/s ({rate[name] / rate['gpt_single']:.3f}x)" for name in names), flush=True)
    print(f"\nround {args.rounds - 1}, means per step over steps {args.warmup}..{args.steps - 1}"
          " (ratios: to gpt_single's)\n")
    print(_table({name: results[name] for name in names}))


if __name__ == "__main__":
    main()
