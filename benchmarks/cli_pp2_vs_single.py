"""Steps/s of ``lightning-mp fit --config configs/gpt_pp2.yaml`` against ``configs/gpt_single.yaml``, one session.

Run (CPU, a few minutes)::

    python benchmarks/cli_pp2_vs_single.py [--steps 80] [--rounds 2] [--baseline-tree PATH]

Each round runs, in an order that rotates from round to round: ``gpt_single.yaml`` (one process), ``gpt_pp2.yaml``
(2 stages, remote handles on, the default) and ``gpt_pp2.yaml`` with remote handles off (every remote call
waits for its outputs: the strategy :class:`WithoutHandles` below, the engine's ``SMPConfig._remote_handles``); with ``--baseline-tree`` also ``gpt_pp2.yaml`` from another checkout of this repository
(e.g. an earlier commit: the "before" of a change), run with that tree on ``PYTHONPATH``. No validation, no
checkpoint, no logger; the steps after the first 10 are timed on global rank 0 (``StepClock`` of
``benchmarks/tied_weights_pp2.py``). Prints per-round steps/s and each run's ratio to ``gpt_single`` of the same
round (only ratios mean anything on a shared machine).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from typing import Any

import lightning_mp

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


class WithoutHandles(lightning_mp.SMPStrategy):
    """``SMPStrategy`` with the pipeline engine's remote handles off (an engine switch, not a user knob)."""

    def __init__(self, **fields: Any) -> None:
        super().__init__(_remote_handles=False, **fields)


def _run(config: str, steps: int, tree: str, extra: list[str]) -> float:
    command = [
        sys.executable, "-m", "lightning_mp.cli", "fit", "--config", f"configs/{config}",
        "--trainer.max_steps", str(steps), "--trainer.limit_val_batches", "0", "--trainer.enable_checkpointing",
        "false", "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
        # the clock replaces the configs' callbacks (their ModelCheckpoint would contradict enable_checkpointing)
        "--trainer.callbacks", '[{"class_path": "benchmarks.tied_weights_pp2.StepClock"}]', *extra,
    ]
    # the clock comes from this tree; the model, configs and lightning_mp from ``tree``
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tree, ROOT])}
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=3600)
    found = re.findall(r"steps/s ([0-9.]+)", done.stdout)
    if done.returncode != 0 or not found:
        raise RuntimeError(f"{config} {extra} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return float(found[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--baseline-tree", default=None, help="another checkout whose gpt_pp2.yaml run is 'before'")
    args = parser.parse_args()
    # the clock module must be importable from the baseline tree's working directory too
    runs = {
        "gpt_single": ("gpt_single.yaml", ROOT, []),
        "gpt_pp2": ("gpt_pp2.yaml", ROOT, []),
        "gpt_pp2 handles off": ("gpt_pp2.yaml", ROOT, ["--trainer.strategy.class_path", "benchmarks.cli_pp2_vs_single.WithoutHandles"]),
    }
    if args.baseline_tree:
        runs["gpt_pp2 baseline tree"] = ("gpt_pp2.yaml", os.path.abspath(args.baseline_tree), [])
    names = list(runs)
    results: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(args.rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            config, tree, extra = runs[name]
            results[name].append(_run(config, args.steps, tree, extra))
            print(f"round {round_index}: {name} {results[name][-1]:.3f} steps/s", flush=True)
    print(f"\n{args.steps} steps per run (timed after 10), {args.rounds} rounds")
    print("run | steps/s per round | / gpt_single per round | median ratio")
    for name in names:
        ratios = [r / s for r, s in zip(results[name], results["gpt_single"])]
        print(f"{name} | {', '.join(f'{v:.3f}' for v in results[name])} | {', '.join(f'{v:.3f}' for v in ratios)}"
              f" | {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
