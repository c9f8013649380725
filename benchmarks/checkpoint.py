"""Checkpoint save and load time and size: ``smp`` (pp=1 x dp=2, pp=2, tp=2) against Lightning's
``ModelParallelStrategy`` (FSDP2 over 2 ranks, DCP folder) and ``ddp`` (one file from rank 0), in one run.

    python benchmarks/checkpoint.py [--rounds 3] [--n-layer 12] [--n-embd 768] [--vocab 50304]

Every configuration runs ``Trainer.fit`` for one AdamW step of the example GPT (``examples.gpt_tp.TPGPT``,
~124 M parameters at the defaults) on 2 CPU processes (gloo, fork), then times ``trainer.save_checkpoint`` (model
and Adam state; wall time on rank 0 from a barrier before to a barrier after) and the strategy's
``load_checkpoint`` of that checkpoint, and measures its size on disk. Rounds alternate the configurations
(smp-pp1, smp-pp2, smp-tp2, model-parallel, ddp, smp-pp1, ...) so a shared machine loads all alike; the table
gives the median over rounds and each time's ratio to ``ModelParallelStrategy`` at the same world size (the
goal: smp save within 1.2x).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

CONFIGS = ("smp-pp1-dp2", "smp-pp2", "smp-tp2", "model-parallel-fsdp2", "ddp-file")


def _size(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _run(config: str, args: argparse.Namespace, workdir: str) -> None:
    import lightning as L
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_mp
    from examples.gpt_tp import TPGPT
    from benchmarks._fsdp_peer import fully_shard_like_torchtitan

    torch.set_num_threads(1)  # before forking
    T = 64

    class GPT(TPGPT):
        def __init__(self) -> None:
            super().__init__(vocab_size=args.vocab, block_size=T, n_layer=args.n_layer, n_head=12, n_embd=args.n_embd)

        def configure_model(self) -> None:
            fully_shard_like_torchtitan(self, self.h)

        def train_dataloader(self):
            data = torch.randint(0, args.vocab, (8, T + 1), generator=torch.Generator().manual_seed(0))
            return DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=2)

    result: dict = {}
    if config.startswith("smp"):
        import warnings

        warnings.filterwarnings("ignore")

    class Measure(L.Callback):
        def on_train_end(self, trainer, pl_module) -> None:
            path = os.path.join(workdir, config)
            if not config.startswith("smp"):
                path += ".ckpt"
            dist.barrier()
            start = time.perf_counter()
            trainer.save_checkpoint(path)
            dist.barrier()
            save_s = time.perf_counter() - start
            start = time.perf_counter()
            trainer.strategy.load_checkpoint(path)
            dist.barrier()
            load_s = time.perf_counter() - start
            if trainer.global_rank == 0:
                result.update(save_s=save_s, load_s=load_s, bytes=_size(path))
                torch.save(result, os.path.join(workdir, f"{config}.result"))
            dist.barrier()

    if config.startswith("smp"):
        pp, tp = {"smp-pp1-dp2": (1, 1), "smp-pp2": (2, 1), "smp-tp2": (1, 2)}[config]
        strategy = lightning_mp.SMPStrategy(
            pipeline_parallel_degree=pp, tensor_parallel_degree=tp, microbatches=2, start_method="fork"
        )
    elif config.startswith("model-parallel"):
        strategy = L.pytorch.strategies.ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    else:
        strategy = L.pytorch.strategies.DDPStrategy(start_method="fork")
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[Measure()],
    )
    trainer.fit(GPT())


def _run_in_subprocess(config: str, args: argparse.Namespace, workdir: str) -> dict:
    """One configuration in a fresh interpreter (its own rendezvous port, no state left by the others)."""
    import torch

    command = [
        sys.executable, "-W", "ignore", os.path.abspath(__file__), "--one", config, "--workdir", workdir,
        "--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd), "--vocab", str(args.vocab),
    ]
    subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": ROOT})
    for name in os.listdir(workdir):
        if name.startswith(config) and not name.endswith(".result"):
            target = os.path.join(workdir, name)
            shutil.rmtree(target) if os.path.isdir(target) else os.remove(target)
    return torch.load(os.path.join(workdir, f"{config}.result"), weights_only=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--n-layer", type=int, default=12)
    parser.add_argument("--n-embd", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        _run(args.one, args, args.workdir)
        return
    configs = args.configs.split(",")
    times: dict[str, list[dict]] = {c: [] for c in configs}
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as workdir:
        for _ in range(args.rounds):
            for config in configs:
                times[config].append(_run_in_subprocess(config, args, workdir))
    base = "model-parallel-fsdp2"
    median = {c: {k: statistics.median(r[k] for r in rs) for k in ("save_s", "load_s", "bytes")} for c, rs in times.items()}
    print(f"GPT n_layer={args.n_layer} n_embd={args.n_embd} vocab={args.vocab}, 2 CPU ranks, gloo; "
          f"medians over {args.rounds} alternating rounds (model + AdamW state)")
    print(f"| {'configuration':<22} | save s | load s | size MiB | save / MP | load / MP |")
    print(f"|{'-' * 24}|--------|--------|----------|-----------|-----------|")
    for config, m in median.items():
        ref = median.get(base)
        ratio_s = f"{m['save_s'] / ref['save_s']:.2f}" if ref else "-"
        ratio_l = f"{m['load_s'] / ref['load_s']:.2f}" if ref else "-"
        print(f"| {config:<22} | {m['save_s']:6.2f} | {m['load_s']:6.2f} | {m['bytes'] / 2**20:8.0f} | {ratio_s:>9} |"
              f" {ratio_l:>9} |")


if __name__ == "__main__":
    main()
