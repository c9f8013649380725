"""Per-message latency of the pipeline engine: a 4 KiB request to the other stage, idle and while both ranks compute.

    python benchmarks/engine_latency.py [--rounds 5] [--calls 200] [--kib 4]

Two CPU processes (gloo, 1 intra-op thread each). Stage 1 owns ``echo``, a module that returns its input times a
scalar parameter; the driver (stage 0) calls it on a ``(kib * 256,)`` float32 tensor (4 KiB by default) under
``no_grad``, ``--calls`` times in a row inside one pipelined step (one microbatch), and reads the value back:

- ``handles``: ``remote_handles=True``, the default: a one-way ``"call"`` then a ``"get"`` round trip that fetches
  the value (touching the handle); two messages to stage 1, one back.
- ``eager``: ``remote_handles=False``: one ``"fwd"`` round trip per call.

Each is measured idle and *under load*: a plain Python thread on each rank runs 256 x 256 matmuls without a pause
for the whole measurement (torch releases the GIL in them), so every engine thread that has to wake up competes
for a core, as when both stages compute. Rows alternate round by round in the same processes; the table shows
the median and 90th percentile microseconds per call over every call of every round (rank 0's clock), the step's
CPU time and context switches per call on each rank (``getrusage``, all threads, the background thread included
under load: compare rows of one load only), and how many of those were voluntary (a thread blocked: hand-offs and
waits; the others are preemptions, which grow with the machine's load). Only ratios between rows of one run mean anything.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from lightning_mp.comm import Transport  # noqa: E402
from lightning_mp.pipeline import PipelineEngine  # noqa: E402
from lightning_mp.pipeline import materialize  # noqa: E402

ROWS = ("handles idle", "eager idle", "handles loaded", "eager loaded")


class Echo(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N,) -> (N,)
        return x * self.scale


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.echo = Echo()


class Background:
    """A thread that multiplies 256 x 256 matrices until stopped (CPU load on this rank)."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Background:
        def spin() -> None:
            torch.set_num_threads(1)
            a = torch.randn(256, 256)
            while not self._stop.is_set():
                a = torch.tanh(a @ a)

        self._thread = threading.Thread(target=spin, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _rank(rank: int, init_file: str, out_dir: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2, timeout=timedelta(minutes=5))
    try:
        transport = Transport(dist.new_group([0, 1]), torch.device("cpu"))
        engines = {}
        for mode in ("handles", "eager"):
            model = Model()
            engine = PipelineEngine(transport, 2, timeout_s=300, remote_handles=mode == "handles")
            engine.install(model, {"": 0, "echo": 1})
            engines[mode] = (engine, model)
        x = torch.randn(args.kib * 256)
        per_call: dict[str, list[float]] = {row: [] for row in args.rows}
        cpu: dict[str, list[float]] = {row: [] for row in args.rows}
        switches: dict[str, list[float]] = {row: [] for row in args.rows}
        voluntary: dict[str, list[float]] = {row: [] for row in args.rows}

        def step(engine: PipelineEngine, model: Model, calls: int, times: list[float]) -> None:
            def run(mb: torch.Tensor, index: int) -> None:
                for _ in range(calls):
                    start = time.perf_counter()
                    out = materialize(model.echo(mb))
                    times.append(time.perf_counter() - start)
                    assert out.shape == mb.shape

            with engine.session() as session, torch.no_grad():
                if engine.is_driver:
                    session.drive(run, [x], loss_fn=lambda _: None, backward=False)
                    session.finish(None)
                else:
                    session.serve()

        for round_index in range(args.rounds + 1):  # round 0 warms up
            for row in args.rows:
                mode, load = row.split()
                engine, model = engines[mode]
                times: list[float] = []
                dist.barrier()
                with Background() if load == "loaded" else _Nothing():
                    dist.barrier()
                    usage = resource.getrusage(resource.RUSAGE_SELF)
                    step(engine, model, args.calls if round_index else 5, times)
                    after = resource.getrusage(resource.RUSAGE_SELF)
                    dist.barrier()
                if round_index:
                    per_call[row].extend(times)
                    calls = args.calls
                    cpu[row].append((after.ru_utime + after.ru_stime - usage.ru_utime - usage.ru_stime) / calls)
                    switches[row].append((after.ru_nvcsw + after.ru_nivcsw - usage.ru_nvcsw - usage.ru_nivcsw) / calls)
                    voluntary[row].append((after.ru_nvcsw - usage.ru_nvcsw) / calls)
        torch.save({"per_call": per_call, "cpu": cpu, "switches": switches, "voluntary": voluntary}, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=200, help="remote calls per round and row")
    parser.add_argument("--kib", type=int, default=4, help="request size in KiB (float32)")
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS, metavar="ROW", help=f"of {ROWS}")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(os.path.join(tmp, "rdv"), tmp, args), nprocs=2, join=True)
        results = [torch.load(os.path.join(tmp, f"{r}.pt")) for r in range(2)]
    print(
        f"\nA {args.kib} KiB request from stage 0 to stage 1 and its value back, {args.calls} calls x {args.rounds}"
        f" rounds per row, 2 CPU processes (gloo, 1 thread each); load: a matmul thread on each rank"
    )
    header = f"{'row':<16} {'median us/call':>14} {'p90 us/call':>12} {'CPU us/call r0 / r1':>20} {'ctx sw/call r0 / r1':>20} {'of them voluntary':>18}"
    print(header)
    print("-" * len(header))
    for row in args.rows:
        times = sorted(results[0]["per_call"][row])
        median = 1e6 * statistics.median(times)
        p90 = 1e6 * times[int(0.9 * (len(times) - 1))]
        cpu = " / ".join(f"{1e6 * statistics.median(r['cpu'][row]):.0f}" for r in results)
        sw = " / ".join(f"{statistics.median(r['switches'][row]):.1f}" for r in results)
        vol = " / ".join(f"{statistics.median(r['voluntary'][row]):.1f}" for r in results)
        print(f"{row:<16} {median:14.0f} {p90:12.0f} {cpu:>20} {sw:>20} {vol:>18}")


if __name__ == "__main__":
    main()
