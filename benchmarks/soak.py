"""Soak: a long pp2 x dp2 fit of the example GPT; per window of steps, resident memory, threads, open files, step time.

Run (CPU, 4 processes; about half an hour on a busy 2-core machine)::

    python benchmarks/soak.py [--steps 2000] [--every 100] [--checkpoint-every 200] [--out DIR]

``lightning-mp fit`` runs a small ``examples.gpt.GPT`` (2 layers, width 64, sequences of 64 bytes, batch 8 per
replica in 2 microbatches) on 4 processes: 2 pipeline stages x 2 data-parallel replicas, with validation (5 batches)
and a DCP checkpoint (``ModelCheckpoint(every_n_train_steps=...)``, the latest kept, plus ``last``) every
``--checkpoint-every`` steps. Every ``--every`` steps, each rank appends one record to ``DIR/probe_rank<R>.jsonl``
(the :class:`SoakProbe` callback): its resident set (``VmRSS``), threads and open file descriptors from ``/proc/self``,
the mean wall and CPU time (``time.process_time``: every thread of the process) of its training steps in the window
(``on_train_batch_start`` to ``on_train_batch_end``: the pipelined step and the optimizer; validation and
checkpoints are outside it) and the machine's load average. On a shared machine the wall time follows the load; the
CPU time per step much less.

Prints one row per window (resident memory summed over the 4 ranks; the most threads and open files of any rank;
global rank 0's mean step wall and CPU time, the load average), then each curve's growth after warm-up: ``max(later windows) / base - 1``, with
``base`` the window at step ``--warmup`` (default 300: after the first validation and checkpoint). It ends with the
run's exit status, its wall time and the processes the run left behind (goal 0). Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import yaml

ROOT = Path(__file__).resolve().parents[1]
_CURVES = ("rss_mib", "threads", "fds", "step_ms", "step_cpu_ms")


def process_counts() -> dict[str, float]:
    """This process's resident set (MiB), threads and open file descriptors, from ``/proc/self`` (Linux)."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {
        "rss_mib": int(fields["VmRSS"].split()[0]) / 1024,
        "threads": int(fields["Threads"]),
        "fds": len(os.listdir("/proc/self/fd")),
    }


class SoakProbe(L.Callback):
    """Every ``every`` training steps, append this rank's :func:`process_counts` and mean step time to
    ``{out_dir}/probe_rank{global_rank}.jsonl`` (one JSON object per line)."""

    def __init__(self, out_dir: str, every: int = 100) -> None:
        self.out_dir, self.every = out_dir, every
        self._started = (0.0, 0.0)
        self._step_s: list[tuple[float, float]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._started = (time.perf_counter(), time.process_time())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._step_s.append((time.perf_counter() - self._started[0], time.process_time() - self._started[1]))
        if trainer.global_step % self.every:
            return
        wall, cpu = (sum(column) / len(self._step_s) for column in zip(*self._step_s))
        record = {"step": trainer.global_step, **process_counts(), "step_ms": 1000 * wall, "step_cpu_ms": 1000 * cpu,
                  "load": os.getloadavg()[0]}
        self._step_s.clear()
        with open(os.path.join(self.out_dir, f"probe_rank{trainer.global_rank}.jsonl"), "a") as out:
            out.write(json.dumps(record) + "\n")


def soak_config(out: Path, steps: int, every: int, checkpoint_every: int) -> dict:
    """The ``lightning-mp fit`` config of the soak (see the module docstring)."""
    return {
        "seed_everything": 0,
        "model": {"class_path": "examples.gpt.GPT", "init_args": {
            "block_size": 64, "n_layer": 2, "n_head": 2, "n_embd": 64, "warmup_steps": 20}},
        "data": {"class_path": "examples.text_data.ByteTextDataModule", "init_args": {
            "block_size": 64, "batch_size": 8, "max_bytes": 4_000_000}},
        "trainer": {
            "accelerator": "cpu", "devices": 4, "max_steps": steps, "val_check_interval": checkpoint_every,
            "check_val_every_n_epoch": None, "limit_val_batches": 5, "log_every_n_steps": 50,
            "enable_progress_bar": False, "default_root_dir": str(out / "logs"),
            "strategy": {"class_path": "lightning_mp.SMPStrategy", "init_args": {
                "pipeline_parallel_degree": 2, "microbatches": 2}},
            "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(out)}},
            "callbacks": [
                {"class_path": "benchmarks.soak.SoakProbe", "init_args": {"out_dir": str(out), "every": every}},
                {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {
                    "dirpath": str(out / "checkpoints"), "every_n_train_steps": checkpoint_every, "save_last": True}},
            ],
        },
    }


def _read_probes(out: Path) -> dict[int, dict[int, dict]]:
    """``{step: {rank: record}}`` from every rank's probe file."""
    windows: dict[int, dict[int, dict]] = {}
    for path in sorted(out.glob("probe_rank*.jsonl")):
        rank = int(path.stem.removeprefix("probe_rank"))
        for line in path.read_text().splitlines():
            record = json.loads(line)
            windows.setdefault(record["step"], {})[rank] = record
    return windows


def _row(by_rank: dict[int, dict]) -> dict[str, float]:
    return {
        "rss_mib": sum(r["rss_mib"] for r in by_rank.values()),
        "threads": max(r["threads"] for r in by_rank.values()),
        "fds": max(r["fds"] for r in by_rank.values()),
        "step_ms": by_rank[0]["step_ms"] if 0 in by_rank else float("nan"),
        "step_cpu_ms": by_rank[0]["step_cpu_ms"] if 0 in by_rank else float("nan"),
        "load": by_rank[0]["load"] if 0 in by_rank else float("nan"),
    }


def _left_behind(session: int) -> list[str]:
    """Processes still in the run's session (it was started with its own), as ``pid command`` lines."""
    left = []
    for status in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = status.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == session:  # stat field 6, the session id
            command = (status.parent / "cmdline").read_bytes().replace(bytes(1), b" ")[:80]
            left.append(f"{status.parent.name} {command.decode(errors='replace')}")
    return left


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--checkpoint-every", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=300, help="the window that is the base of the growth figures")
    parser.add_argument("--timeout", type=float, default=4 * 3600)
    parser.add_argument("--out", default=None, help="run folder (default: a new temporary folder)")
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="soak_")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    config = out / "soak.yaml"
    config.write_text(yaml.safe_dump(soak_config(out, args.steps, args.every, args.checkpoint_every)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    started = time.perf_counter()
    with open(out / "run.log", "w") as log:
        run = subprocess.Popen([sys.executable, "-m", "lightning_mp.cli", "fit", "--config", str(config)], cwd=ROOT,
                               env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            status = run.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            status = "hung (killed at --timeout)"
            os.killpg(run.pid, 9)
            run.wait()
    wall_s = time.perf_counter() - started
    time.sleep(1.0)  # a rank that outlives the launcher would still be there
    left = _left_behind(run.pid)
    windows = {step: _row(by_rank) for step, by_rank in sorted(_read_probes(out).items())}
    print(f"soak: {args.steps} steps, pp2 x dp2, validation and checkpoint every {args.checkpoint_every}; {out}")
    print("step | RSS MiB (sum of 4 ranks) | threads (max rank) | open fds (max rank) | step ms (rank 0) | step CPU ms"
          " (rank 0) | load average")
    for step, row in windows.items():
        print(f"{step} | {row['rss_mib']:.1f} | {row['threads']} | {row['fds']} | {row['step_ms']:.1f}"
              f" | {row['step_cpu_ms']:.1f} | {row['load']:.1f}")
    if args.warmup in windows:
        base = windows[args.warmup]
        later = [row for step, row in windows.items() if step > args.warmup]
        if later:
            growth = {c: max(row[c] for row in later) / base[c] - 1 for c in _CURVES}
            last = {c: later[-1][c] / base[c] - 1 for c in _CURVES}
            print(f"growth after step {args.warmup} (max of later windows / base - 1): "
                  + ", ".join(f"{c} {100 * g:+.1f}%" for c, g in growth.items()))
            print("last window / base - 1: " + ", ".join(f"{c} {100 * g:+.1f}%" for c, g in last.items()))
    print(f"exit status {status}, wall {wall_s / 60:.1f} min, processes left behind: {len(left)}")
    for line in left:
        print(f"  left: {line}")
    if status != 0:
        print((out / "run.log").read_text()[-3000:])


if __name__ == "__main__":
    main()
