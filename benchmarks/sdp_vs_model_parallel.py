"""Sharded data parallelism against its peers, in one run: ``smp`` with ``sharded_data_parallel_degree=dp`` at
pp=1 against Lightning's ``ModelParallelStrategy`` (FSDP2, ``fully_shard`` in ``configure_model``, each block a
unit and the root last) and against the unsharded layout (``smp`` pp=1 x dp); and pp=2 x sdp=2 against pp=2 x
dp=2 with ZeRO-1 (``shard_optimizer_state``); and sdp=2 at pp=1 with 4 microbatches under both
``reshard_after_forward`` settings (per unit, the pp=1 default, against once per step).

    python benchmarks/sdp_vs_model_parallel.py [--section dp|reshard|pp2|all] [--rounds 3] [--steps 10] [--warmup 3]
        [--n-layer 4] [--n-embd 256] [--vocab 4096]

Every configuration trains the example GPT (``examples.gpt.GPT``, AdamW, global batch ``--batch`` of 64
tokens) with ``Trainer.fit`` on CPU processes (gloo; one intra-op thread per rank), each in a fresh interpreter;
rounds alternate the configurations so a shared machine loads all alike. Per configuration:

- step time: rank 0's wall time per step after ``--warmup`` steps, median over rounds; and its ratio to the peer
  (``ModelParallelStrategy`` at the same dp; for pp=2, ZeRO-1 at the same microbatches) in each round, the two
  having run one after the other: the median of those ratios and their range;
- per-rank parameter + gradient + optimizer bytes after the first step (between steps: the local shards of
  ``DTensor`` parameters, their gradients and Adam moments; under ZeRO-1 the rank's own optimizer share), the
  largest over ranks, and its ratio to the unsharded layout's (the goal at pp=1: <= 1.05 / dp);
- collectives per step on rank 0 during the timed steps, counted by wrapping ``torch.distributed``'s functions
  (all-gathers, reduce-scatters, all-reduces, broadcasts: calls and MiB), at 2 and 4 microbatches for pp=2
  (FSDP's gathers and reduce-scatters per step must not grow with the microbatches). At pp=2 both layouts keep
  the tied embedding and head on one stage (``tied_weights="colocate"``, which sharding requires).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

T = 64
COLLECTIVES = {
    "all_gather": ("all_gather_single", "all_gather_into_tensor", "all_gather", "_all_gather_base"),
    "reduce_scatter": ("reduce_scatter_single", "reduce_scatter_tensor", "reduce_scatter", "_reduce_scatter_base"),
    "all_reduce": ("all_reduce",),
    "broadcast": ("broadcast",),
}


def _configs(section: str) -> dict[str, dict]:
    """Name -> layout: strategy (``mp`` = ModelParallelStrategy, ``smp``), world, pp, sdp, zero1, microbatches."""
    configs = {}
    if section in ("dp", "all"):
        for dp in (2, 4):
            configs[f"model-parallel-dp{dp}"] = {"strategy": "mp", "world": dp}
            configs[f"smp-sdp{dp}"] = {"strategy": "smp", "world": dp, "sdp": dp}
            configs[f"smp-dp{dp}-unsharded"] = {"strategy": "smp", "world": dp}
    if section in ("reshard", "all"):  # reshard_after_forward at pp=1: per unit (the default) or once per step
        for setting in ("always", "never"):
            configs[f"sdp2-m4-{setting}"] = {"strategy": "smp", "world": 2, "sdp": 2, "microbatches": 4,
                                             "reshard": setting}
    if section in ("pp2", "all"):
        for m in (2, 4):
            configs[f"pp2-sdp2-m{m}"] = {"strategy": "smp", "world": 4, "pp": 2, "sdp": 2, "microbatches": m}
            configs[f"pp2-dp2-zero1-m{m}"] = {"strategy": "smp", "world": 4, "pp": 2, "zero1": True, "microbatches": m}
    return configs


def _count_collectives(counts: dict[str, list[float]]) -> None:
    """Wrap ``torch.distributed``'s collectives so each call adds 1 call and its tensor MiB to ``counts[kind]``
    while ``counts["on"]`` is true."""
    import torch
    import torch.distributed as dist

    def tensor_mib(args, kwargs) -> float:
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        lists = [t for a in (*args, *kwargs.values()) if isinstance(a, (list, tuple)) for t in a]
        tensors += [t for t in lists if isinstance(t, torch.Tensor)]
        return max((t.numel() * t.element_size() for t in tensors), default=0) / 2**20

    for kind, names in COLLECTIVES.items():
        for name in names:
            original = getattr(dist, name, None)
            if original is None:
                continue

            @functools.wraps(original)
            def counted(*args, __original=original, __kind=kind, **kwargs):
                if counts["on"][0]:
                    counts[__kind][0] += 1
                    counts[__kind][1] += tensor_mib(args, kwargs)
                return __original(*args, **kwargs)

            setattr(dist, name, counted)


def _local_bytes(pl_module, optimizers) -> int:
    """This rank's parameter + gradient + optimizer-state bytes (a DTensor counts its local shard)."""
    import torch
    from torch.distributed.tensor import DTensor

    from lightning_mp.strategy._zero import local_optimizer

    def nbytes(t) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    total = 0
    for p in pl_module.parameters():
        total += nbytes(p) + (nbytes(p.grad) if p.grad is not None else 0)
    for optimizer in optimizers:
        optimizer = local_optimizer(getattr(optimizer, "_optimizer", optimizer))
        for state in optimizer.state.values():
            total += sum(nbytes(v) for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return total


def _run(name: str, layout: dict, args: argparse.Namespace, out_dir: str) -> None:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_mp
    from examples.gpt import GPT
    from benchmarks._fsdp_peer import fully_shard_like_torchtitan

    torch.set_num_threads(1)  # before forking
    counts = {"on": [False], **{kind: [0, 0.0] for kind in COLLECTIVES}}
    _count_collectives(counts)

    class BenchGPT(GPT):
        def __init__(self) -> None:
            super().__init__(vocab_size=args.vocab, block_size=T, n_layer=args.n_layer, n_head=8, n_embd=args.n_embd)

        def configure_model(self) -> None:
            fully_shard_like_torchtitan(self, self.h)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

        def train_dataloader(self):
            replicas = self.trainer.strategy.distributed_sampler_kwargs["num_replicas"]
            g = torch.Generator().manual_seed(0)
            data = torch.randint(0, args.vocab, ((args.steps + args.warmup) * args.batch, T + 1), generator=g)
            return DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=args.batch // replicas)

    class Measure(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            step = trainer.global_step
            if step == 1:
                self.bytes = _local_bytes(pl_module, trainer.optimizers)
            if step == args.warmup:
                counts["on"][0] = True
                self.start = time.perf_counter()
            if step == args.warmup + args.steps:
                counts["on"][0] = False
                result = {
                    "step_s": (time.perf_counter() - self.start) / args.steps,
                    "bytes": self.bytes,
                    **{kind: [v / args.steps for v in counts[kind]] for kind in COLLECTIVES},
                }
                with open(os.path.join(out_dir, f"{name}.{trainer.global_rank}.json"), "w") as f:
                    json.dump(result, f)

    if layout["strategy"] == "mp":
        world = layout["world"]
        strategy = L.pytorch.strategies.ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    else:
        options = {"sharded_data_parallel_degree": layout["sdp"]} if layout.get("sdp", 1) > 1 else {}
        if "reshard" in layout:
            options["reshard_after_forward"] = layout["reshard"]
        if layout.get("zero1"):
            options["shard_optimizer_state"] = True
        if layout.get("pp", 1) > 1:  # the tied embedding and head on one stage, as sharding requires: same plans
            options["tied_weights"] = "colocate"
        strategy = lightning_mp.SMPStrategy(
            pipeline_parallel_degree=layout.get("pp", 1), microbatches=layout.get("microbatches", 1),
            start_method="fork", **options,
        )
    trainer = L.Trainer(
        accelerator="cpu", devices=layout["world"], strategy=strategy, max_steps=args.warmup + args.steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[Measure()],
    )
    trainer.fit(BenchGPT())


def _run_in_subprocess(name: str, args: argparse.Namespace, out_dir: str) -> list[dict]:
    """One configuration in a fresh interpreter; each rank's measurements."""
    command = [sys.executable, "-W", "ignore", os.path.abspath(__file__), "--one", name, "--out-dir", out_dir]
    command += [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("one", "out_dir")]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        print(f"{name} failed:\n{done.stderr[-3000:]}", file=sys.stderr)
        return []
    world = _configs(args.section)[name]["world"]
    return [json.load(open(os.path.join(out_dir, f"{name}.{rank}.json"))) for rank in range(world)]


def _table(configs: dict, results: dict[str, list[list[dict]]], args: argparse.Namespace) -> None:
    def median(name: str, key) -> float:
        values = [key(rounds) for rounds in results[name] if rounds]
        return statistics.median(values) if values else float("nan")

    step = {n: median(n, lambda ranks: ranks[0]["step_s"]) for n in configs}
    mem = {n: median(n, lambda ranks: max(r["bytes"] for r in ranks)) for n in configs}

    def peer(name: str) -> tuple[str, str]:
        if name.startswith("pp2-sdp2"):
            return name.replace("sdp2", "dp2-zero1"), name.replace("sdp2", "dp2-zero1")
        if name.startswith("pp2-"):
            return name, name
        if name.startswith("sdp2-m4-"):  # per unit against once per step
            return "sdp2-m4-never", "sdp2-m4-never"
        dp = configs[name]["world"]
        return f"model-parallel-dp{dp}", f"smp-dp{dp}-unsharded"

    def round_ratios(name: str, other: str) -> str:
        """Each round's step time over the peer's in the same round (they ran one after the other)."""
        pairs = [(a, b) for a, b in zip(results[name], results.get(other, [])) if a and b]
        ratios = sorted(a[0]["step_s"] / b[0]["step_s"] for a, b in pairs)
        if not ratios:
            return "-"
        return f"{statistics.median(ratios):.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f})"

    print(f"\nexample GPT n_layer={args.n_layer} n_embd={args.n_embd} vocab={args.vocab} T={T}, global batch"
          f" {args.batch}, AdamW; medians over {args.rounds} alternating rounds of {args.steps} steps; step / peer:"
          " the peer is ModelParallelStrategy at the same dp (pp=1) or ZeRO-1 (pp=2), per round: median (range)")
    print("| configuration | ranks | step (ms) | step / peer | param+grad+optim MiB per rank (max) | / unsharded"
          " | all-gathers/step | reduce-scatters/step | all-reduces/step | broadcasts/step"
          " | MiB gathered+scattered/step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, layout in configs.items():
        time_peer, mem_peer = peer(name)
        counts = [r[0] for r in results[name] if r]
        if not counts:
            print(f"| {name} | {layout['world']} | failed | | | | | | | | |")
            continue
        calls = {kind: statistics.median(c[kind][0] for c in counts) for kind in COLLECTIVES}
        moved = statistics.median(c["all_gather"][1] + c["reduce_scatter"][1] for c in counts)
        print(
            f"| {name} | {layout['world']} | {1e3 * step[name]:.0f} | {round_ratios(name, time_peer)} |"
            f" {mem[name] / 2**20:.1f} | {mem[name] / mem[mem_peer] if mem_peer in mem else float('nan'):.3f} |"
            f" {calls['all_gather']:g} |"
            f" {calls['reduce_scatter']:g} | {calls['all_reduce']:g} | {calls['broadcast']:g} | {moved:.1f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--section", choices=("dp", "reshard", "pp2", "all"), default="all")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--only", default="", help="comma-separated configuration names (default: the section's)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--out-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    configs = _configs(args.section)
    if args.only:
        configs = {n: configs[n] for n in args.only.split(",")}
    if args.one:
        _run(args.one, configs[args.one], args, args.out_dir)
        return
    results: dict[str, list[list[dict]]] = {name: [] for name in configs}
    with tempfile.TemporaryDirectory() as out_dir:
        for _ in range(args.rounds):
            for name in configs:
                results[name].append(_run_in_subprocess(name, args, out_dir))
    _table(configs, results, args)


if __name__ == "__main__":
    main()
