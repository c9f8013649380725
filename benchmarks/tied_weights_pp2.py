"""Steps/s of the example GPT at 2 pipeline stages with its tied embedding/head replicated against co-located.

Run (CPU, 2 processes per run, a few minutes)::

    python benchmarks/tied_weights_pp2.py [--steps 60] [--rounds 2]

Each round runs ``lightning-mp fit --config configs/gpt_pp2.yaml`` once with ``tied_weights: colocate`` and once
with ``tied_weights: replicate`` (alternating, in one session; the first of each pair alternates too), no
validation and no checkpoint, and times the steps after the first 10 on global rank 0 (:class:`StepClock`, in place of
the config's callbacks). Under ``colocate`` the head runs on stage 0 with the embedding: each microbatch's hidden
state ``(B, T, C)`` goes 0 -> 1 -> 0. Under ``replicate`` the head runs on stage 1 with a copy of the weight, and so
does the loss (``F.cross_entropy`` on the head's output runs where it is: [Note: the loss where the logits are] in
``pipeline/_recorded.py``), so only the scalar loss comes back: the hidden state goes 0 -> 1 only, at the price of a
metadata round trip (``logits.size(-1)``) per microbatch and an all-reduce of the copy's gradient per step. (Before
the loss moved, the logits ``(B, T, V)``, V = 256 = 2C, came back to stage 0.)
Prints a table of per-round steps/s and the ratio replicate / colocate (only the ratio means anything: the machine
may be shared). Measured on 2 shared CPU cores, 4 rounds: 0.854, 0.975, 0.930, 0.879 (median 0.90).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time

import lightning as L

ROOT = os.path.join(os.path.dirname(__file__), "..")
WARMUP = 10


class StepClock(L.Callback):
    """Prints ``steps/s <value>`` on global rank 0 for the training steps after the first ``warmup``."""

    def __init__(self, warmup: int = WARMUP) -> None:
        self.warmup = warmup
        self.start: float | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.warmup:
            self.start = time.perf_counter()

    def on_train_end(self, trainer, pl_module):
        if trainer.is_global_zero and self.start is not None:
            steps = trainer.global_step - self.warmup
            print(f"steps/s {steps / (time.perf_counter() - self.start):.4f}", flush=True)


def _run(mode: str, steps: int) -> float:
    command = [
        sys.executable, "-m", "lightning_mp.cli", "fit", "--config", "configs/gpt_pp2.yaml",
        "--trainer.max_steps", str(steps), "--trainer.limit_val_batches", "0", "--trainer.enable_checkpointing",
        "false", "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
        "--trainer.strategy.init_args.tied_weights", mode,
        "--trainer.callbacks=benchmarks.tied_weights_pp2.StepClock",  # replaces the config's (a ModelCheckpoint)
    ]
    env = {**os.environ, "PYTHONPATH": os.path.abspath(ROOT)}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    found = re.findall(r"steps/s ([0-9.]+)", done.stdout)
    if done.returncode != 0 or not found:
        raise RuntimeError(f"{mode} run failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return float(found[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    results: dict[str, list[float]] = {"colocate": [], "replicate": []}
    for round_index in range(args.rounds):
        order = ("colocate", "replicate") if round_index % 2 == 0 else ("replicate", "colocate")
        for mode in order:
            results[mode].append(_run(mode, args.steps))
            print(f"round {round_index}: {mode} {results[mode][-1]:.3f} steps/s", flush=True)
    print(f"\nconfigs/gpt_pp2.yaml, {args.steps} steps (timed after {WARMUP}), {args.rounds} alternating rounds")
    print("round | colocate steps/s | replicate steps/s | replicate / colocate")
    for i, (c, r) in enumerate(zip(results["colocate"], results["replicate"])):
        print(f"{i:5} | {c:16.3f} | {r:17.3f} | {r / c:20.3f}")
    ratio = statistics.median(r / c for c, r in zip(results["colocate"], results["replicate"]))
    print(f"median ratio replicate / colocate: {ratio:.3f}")


if __name__ == "__main__":
    main()
