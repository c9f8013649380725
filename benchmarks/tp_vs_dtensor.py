"""lightning_mp's tensor-parallel layers against torch's DTensor ``parallelize_module``, same model, same split.

    python benchmarks/tp_vs_dtensor.py [--rounds 5] [--steps 5] [--layers 4] [--width 64]

The model is a stack of pre-LayerNorm transformer blocks with separate ``q, k, v, o`` projections and a GELU
MLP (``fc``, ``proj``), the layout of Llama and of transformers' TP plans. Both methods split it the same way
(Megatron's): ``q, k, v, fc`` column-parallel, ``o, proj`` row-parallel, heads and MLP features over 2 CPU
processes (gloo, 1 intra-op thread each); LayerNorms replicated.

- ``ours``: the blocks' ``nn.Linear``\\ s swapped for ``lightning_mp.nn.DistributedLinear`` (plain
  ``torch.distributed`` collectives in autograd functions).
- ``DTensor``: ``torch.distributed.tensor.parallel.parallelize_module`` with ``ColwiseParallel`` /
  ``RowwiseParallel`` on the same modules.

One step is forward + backward of a batch (``loss = mean(y^2)``, no optimizer). Methods alternate round by
round (``--rounds`` x ``--steps`` timed steps, after warm-up), in two modes: every step in the same thread,
and every step in a fresh thread (as our pipeline engine runs microbatches: DTensor's sharding-propagation
cache is per thread). The table shows the median step time of rank 0 and the ratio ours / DTensor, and the
parameter bytes per rank against one process. The first rows check that both give the one-process loss.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from lightning_mp.nn import DistributedLinear  # noqa: E402
from lightning_mp.tp import TPGroup  # noqa: E402
from lightning_mp.tp._swap import load_from  # noqa: E402

COLUMN, ROW = ("q", "k", "v", "fc"), ("o", "proj")


class Block(nn.Module):
    """``x + o(attn(q, k, v)(ln1 x))``, then ``x + proj(gelu(fc(ln2 x)))``; heads read from the shapes."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.head_size = width // heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))
        self.fc, self.proj = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape  # (B, T, C)
        h = self.ln1(x)
        q, k, v = (m(h).view(B, T, -1, self.head_size).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, local heads, T, hs)
        x = x + self.o(y.transpose(1, 2).reshape(B, T, -1))
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


def _ours(model: nn.Sequential, group: dist.ProcessGroup) -> nn.Sequential:
    tp = TPGroup.of(group)
    model = copy.deepcopy(model)
    for block in model:
        for name in COLUMN + ROW:
            old = getattr(block, name)
            new = DistributedLinear(old.in_features, old.out_features, tp=tp, parallel="column" if name in COLUMN else "row")
            load_from(new, old)
            setattr(block, name, new)
    return model


def _dtensor(model: nn.Sequential, world: int) -> nn.Sequential:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    model = copy.deepcopy(model)
    plan = {name: ColwiseParallel() for name in COLUMN} | {name: RowwiseParallel() for name in ROW}
    for block in model:
        parallelize_module(block, mesh, plan)
    return model


def _step(model: nn.Module, x: torch.Tensor) -> float:
    loss = model(x).pow(2).mean()
    loss.backward()
    return float(loss.detach())


def _timed(model: nn.Module, x: torch.Tensor, fresh_thread: bool) -> float:
    dist.barrier()
    start = time.perf_counter()
    if fresh_thread:
        thread = threading.Thread(target=_step, args=(model, x))
        thread.start()
        thread.join()
    else:
        _step(model, x)
    return time.perf_counter() - start


def _param_bytes(model: nn.Module) -> int:
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def _worker(rank: int, world: int, init_file: str, out: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(minutes=5))
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(args.width, args.heads) for _ in range(args.layers)])
    x = torch.randn(args.batch, args.seq, args.width)
    methods = {"ours": _ours(model, dist.group.WORLD), "DTensor": _dtensor(model, world)}
    losses = {"one process": _step(copy.deepcopy(model), x)} | {name: _step(m, x) for name, m in methods.items()}
    times: dict[tuple[str, bool], list[float]] = {}
    for fresh in (False, True):
        for name, m in methods.items():  # warm-up
            _timed(m, x, fresh)
        for _ in range(args.rounds):
            for name, m in methods.items():
                for _ in range(args.steps):
                    times.setdefault((name, fresh), []).append(_timed(m, x, fresh))
    if rank == 0:
        bytes_one = _param_bytes(model)
        result = {"losses": losses, "times": times, "bytes": {n: _param_bytes(m) / bytes_one for n, m in methods.items()}}
        torch.save(result, out)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.pt")
        mp.start_processes(_worker, args=(2, os.path.join(tmp, "rdv"), out, args), nprocs=2, start_method="spawn")
        result = torch.load(out)
    print(f"tp=2 on 2 CPU processes (gloo), {args.layers} blocks, width {args.width}, {args.heads} heads,"
          f" batch {args.batch} x seq {args.seq}; median of {args.rounds} x {args.steps} steps, fwd+bwd\n")
    print("| check | loss |\n|---|---|")
    for name, loss in result["losses"].items():
        print(f"| {name} | {loss:.6f} |")
    print("\n| mode | ours (ms) | DTensor (ms) | ours / DTensor | goal |\n|---|---|---|---|---|")
    for fresh, goal in ((False, "<= 0.67"), (True, "<= 0.2")):
        ours = statistics.median(result["times"][("ours", fresh)]) * 1e3
        theirs = statistics.median(result["times"][("DTensor", fresh)]) * 1e3
        mode = "fresh thread per step" if fresh else "one thread"
        print(f"| {mode} | {ours:.2f} | {theirs:.2f} | {ours / theirs:.2f} | {goal} |")
    print("\n| method | parameter bytes per rank / one process | goal |\n|---|---|---|")
    for name, ratio in result["bytes"].items():
        print(f"| {name} | {ratio:.3f} | <= 0.55 |")


if __name__ == "__main__":
    main()
