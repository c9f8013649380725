"""Memory of the partitioning trace of a delayed-init model whose step reads a value, on the tracing rank.

    python benchmarks/delayed_trace_memory.py [--depth 16] [--width 1024] [--batch 8]

The model: ``depth`` residual blocks ``h + tanh(Linear(width, width)(h))``, then a gate on an activation's value
(``if h[0, 0].item() > 0``) in front of a last Linear. Built under ``delay_param_initialization`` (nothing
allocated), it cannot be traced on meta. Each method runs in a fresh process (spawn, one thread) and traces one
forward with autograd on, as the strategy's trace does (``lightning_mp.partition.trace``):

- ``per_call``: :func:`lightning_mp.init.materialize_per_call`, each module's weights real during its own call
  (what rank 0 does under ``delayed_parameter_initialization`` since issue 21);
- ``whole``: :func:`lightning_mp.init.materialize_module` first (the whole model real), then the trace.

The table gives the trace's resident-memory peak above the resident memory before it (``VmHWM`` after a reset
through ``/proc/self/clear_refs``; Linux only), the most bytes of weights held at once, and the model's bytes.
By default glibc's mmap threshold is fixed at 128 KiB as ``SMPStrategy(release_host_memory=True)`` does
(``--host-memory default``: glibc's dynamic threshold, under which freed weights stay in malloc's heap).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


class GatedStack(nn.Module):
    def __init__(self, depth: int, width: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, width)
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        if x[0, 0].item() > 0:
            x = self.head(x)
        return x


def _kib(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field))


def _worker(rank: int, method: str, args: argparse.Namespace, out: str) -> None:
    from lightning_mp.init import delay_param_initialization, materialize_module, materialize_per_call
    from lightning_mp.memory._host import fix_mmap_threshold
    from lightning_mp.partition import trace

    if args.host_memory == "fixed":
        fix_mmap_threshold()  # freed weights go back to the OS (SMPStrategy(release_host_memory=True) does this)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    with delay_param_initialization():
        model = GatedStack(args.depth, args.width)
    x = torch.randn(args.batch, args.width)
    run = lambda: model(x)  # noqa: E731
    trace(nn.Linear(4, 4), lambda: nn.Linear(4, 4)(torch.randn(2, 4)), grad_enabled=True)  # warm torch up
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # VmHWM := VmRSS
    before = _kib("VmRSS")
    if method == "per_call":
        with materialize_per_call(model) as report:
            trace(model, run, grad_enabled=True)
        weights, total = report.peak_bytes, report.total_bytes
    else:
        materialize_module(model)
        trace(model, run, grad_enabled=True)
        weights = total = sum(p.numel() * p.element_size() for p in model.parameters())
    torch.save({"peak_kib": _kib("VmHWM") - before, "weights": weights, "total": total}, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=16)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--host-memory", choices=("fixed", "default"), default="fixed")
    args = parser.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for method in ("per_call", "whole"):
            out = os.path.join(tmp, f"{method}.pt")
            mp.start_processes(_worker, args=(method, args, out), nprocs=1, start_method="spawn")
            rows[method] = torch.load(out)
    mib = 2**20
    print(
        f"GatedStack depth={args.depth} width={args.width} batch={args.batch}, delayed init, one traced forward,"
        f" glibc mmap threshold {args.host_memory}"
    )
    print("| method | trace peak above start (MiB) | weights held at once (MiB) | model weights (MiB) |")
    print("|---|---|---|---|")
    for method, row in rows.items():
        print(f"| {method} | {row['peak_kib'] / 1024:.1f} | {row['weights'] / mib:.1f} | {row['total'] / mib:.1f} |")


if __name__ == "__main__":
    main()
