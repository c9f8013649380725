"""Transport A/B in one pair of processes: another checkout's ``Transport`` against this one's data planes.

    python benchmarks/transport_ab.py --base /path/to/other/checkout [--rounds 12] [--iters 100] [--shape 128x256]

Engine-like ping-pong on 2 CPU processes (gloo): rank 0 sends a request envelope holding one float32 tensor of
``--shape``, rank 1 replies with one of the same shape. The transports alternate in short rounds inside the same
processes, so machine load hits them alike (the engine benchmarks cannot resolve a few percent on a loaded
machine). Prints, per data plane of this checkout (gloo, strict_mock), the median over rounds of its time per
round trip divided by the other checkout's (``lightning_mp/comm/_transport.py`` and its ``_wire.py``, loaded from
``--base``).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from lightning_mp.comm import Transport, make_data_plane  # noqa: E402
from lightning_mp.topology import build_pair_groups  # noqa: E402

_PLANES = ("gloo", "strict_mock")


def _load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _load_base(base: str):
    """The other checkout's ``_transport.py`` with its own wire format (``_wire.py``, where the checkout has one)."""
    transport = os.path.join(base, "lightning_mp/comm/_transport.py")
    wire = os.path.join(base, "lightning_mp/comm/_wire.py")
    if not os.path.exists(wire):  # a checkout whose wire format is still inside _transport.py
        return _load("base_transport", transport)
    ours = sys.modules["lightning_mp.comm._wire"]
    sys.modules["lightning_mp.comm._wire"] = _load("base_wire", wire)  # what the base's `from ... import` finds
    try:
        return _load("base_transport", transport)
    finally:
        sys.modules["lightning_mp.comm._wire"] = ours


def _rank(rank: int, init_file: str, out: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2, timeout=timedelta(minutes=5))
    cpu = torch.device("cpu")
    transports = {"base": _load_base(args.base).Transport(dist.new_group([0, 1]), cpu)}
    transports["gloo"] = Transport(dist.new_group([0, 1]), cpu)
    group = dist.new_group([0, 1])
    pairs = build_pair_groups([[0, 1]], "gloo")
    transports["strict_mock"] = Transport(group, cpu, make_data_plane("strict_mock", group, cpu, pairs, 120.0))
    x = torch.randn(*(int(s) for s in args.shape.split("x")))
    times: dict[str, list[float]] = {name: [] for name in transports}
    for round_index in range(args.rounds + 1):  # round 0 warms up
        for name, transport in transports.items():
            dist.barrier()
            start = time.perf_counter()
            for i in range(args.iters):
                if rank == 0:
                    transport.send(("fwd", "step#0", (0, i), ("layers.3", (x,), {}, True, None), 0), 1)
                    transport.recv(1)
                else:
                    request = transport.recv(0)
                    transport.send(("reply", "step#0", (0, i), request.obj[3][1][0] * 2, 0), 0)
            if round_index:
                times[name].append((time.perf_counter() - start) / args.iters)
    transports["strict_mock"].close()
    if rank == 0:
        torch.save(times, out)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="another checkout of lightning_mp (e.g. `git worktree add`)")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--iters", type=int, default=100, help="round trips per round")
    parser.add_argument("--shape", default="128x256")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.pt")
        mp.spawn(_rank, args=(os.path.join(tmp, "rdv"), out, args), nprocs=2, join=True)
        times = torch.load(out)
    print(f"\nping-pong of a ({args.shape}) float32 request and reply, {args.rounds} alternating rounds x {args.iters}")
    print(f"{'data plane':<14} {'time / base (median)':>21}  per round")
    for name in _PLANES:
        ratios = [ours / base for ours, base in zip(times[name], times["base"])]
        print(f"{name:<14} {statistics.median(ratios):20.2f}x  {' '.join(f'{r:.2f}' for r in ratios)}")


if __name__ == "__main__":
    main()
