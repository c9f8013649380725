"""Training steps/s of ``strategy="smp"`` (pp=1, dp=2) against ``strategy="ddp"`` on the same model, in one run.

    python benchmarks/smp_vs_ddp.py [--steps 300] [--warmup 10] [--rounds 3] [--dim 256] [--batch-size 64]

Both strategies run ``Trainer.fit`` on 2 CPU processes with the default (popen) launcher and the default
environment (no ``OMP_NUM_THREADS``), so each gets the thread policy its launcher applies. The rounds alternate
ddp, smp, ddp, smp, ... so that a machine shared with other work loads both alike; the table gives the median
over rounds of each strategy's steps/s (wall time from the end of the warm-up steps to the last step, rank 0),
and the ratio smp / ddp (the goal is >= 0.95: the pipeline engine at pp=1 must not cost a data-parallel user).
It also gives rank 0's CPU time per step (all its threads), which a loaded machine disturbs less than wall time
but which does not show what overlapping communication with compute gains.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def _worker(strategy_name: str, args: argparse.Namespace, out_file: str) -> None:
    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    sys.path.insert(0, ROOT)
    import lightning_mp

    class Timer(L.Callback):
        def __init__(self) -> None:
            self.start = 0.0

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == args.warmup:
                self.start, self.cpu_start = time.perf_counter(), time.process_time()
            if trainer.global_step == args.warmup + args.steps and trainer.global_rank == 0:
                with open(out_file, "w") as f:
                    json.dump({"steps_per_s": args.steps / (time.perf_counter() - self.start),
                               "cpu_ms_per_step": 1e3 * (time.process_time() - self.cpu_start) / args.steps,
                               "threads": torch.get_num_threads()}, f)

    class MLP(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            dim = args.dim
            blocks = [m for _ in range(4) for m in (nn.Linear(dim, dim), nn.GELU())]
            self.net = nn.Sequential(*blocks, nn.Linear(dim, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x).squeeze(-1), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def train_dataloader(self):
            n = 2 * args.batch_size * (args.warmup + args.steps + 1)
            g = torch.Generator().manual_seed(0)
            data = TensorDataset(torch.randn(n, args.dim, generator=g), torch.randn(n, generator=g))
            return DataLoader(data, batch_size=args.batch_size, drop_last=True)

    strategy = "ddp" if strategy_name == "ddp" else lightning_mp.SMPStrategy(pipeline_parallel_degree=1)
    torch.manual_seed(0)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=args.warmup + args.steps, logger=False,
        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
        callbacks=[Timer()],
    )
    trainer.fit(MLP())


def _run(strategy_name: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out_file = os.path.join(tmp, "result.json")
        command = [sys.executable, os.path.abspath(__file__), "--worker", strategy_name, "--out", out_file,
                   "--steps", str(args.steps), "--warmup", str(args.warmup), "--dim", str(args.dim),
                   "--batch-size", str(args.batch_size)]
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "LOCAL_RANK")}
        env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
        subprocess.run(command, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
        with open(out_file) as f:
            return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        _worker(args.worker, args, args.out)
        return
    results: dict[str, list[dict]] = {"ddp": [], "smp": []}
    for _ in range(args.rounds):
        for name in results:
            results[name].append(_run(name, args))
    print(f"MLP 4x{args.dim} + head, batch {args.batch_size} per process, 2 CPU processes, {os.cpu_count()} cores,"
          f" {args.steps} timed steps after {args.warmup}, {args.rounds} rounds")
    print(f"{'strategy':<18}{'steps/s (median)':>18}{'CPU ms/step':>13}{'threads':>9}  steps/s per round")
    medians, cpu = {}, {}
    for name, rounds in results.items():
        medians[name] = statistics.median(r["steps_per_s"] for r in rounds)
        cpu[name] = statistics.median(r["cpu_ms_per_step"] for r in rounds)
        label = "ddp" if name == "ddp" else "smp pp=1 dp=2"
        per_round = ", ".join(f"{r['steps_per_s']:.2f}" for r in rounds)
        print(f"{label:<18}{medians[name]:>18.2f}{cpu[name]:>13.2f}{rounds[0]['threads']:>9}  {per_round}")
    print(f"ratio smp / ddp: {medians['smp'] / medians['ddp']:.3f} steps/s (goal >= 0.95);"
          f" CPU time per step ddp / smp: {cpu['ddp'] / cpu['smp']:.3f}")


if __name__ == "__main__":
    main()
