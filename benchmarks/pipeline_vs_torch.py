"""lightning_mp's pipeline engine against torch.distributed.pipelining, same model, same split, one run.

    python benchmarks/pipeline_vs_torch.py [--rounds 3] [--steps 3] [--microbatches 4 8] [--malloc retain|glibc]

The model is a stack of pre-LayerNorm MLP blocks (``x + W2 gelu(W1 LN(x))``) in an ``nn.Sequential``, cut in
half: blocks ``0 .. L/2-1`` on stage 0, the rest on stage 1, on 2 CPU processes (gloo, 1 intra-op thread each).
Every method runs forward + backward of one batch (no optimizer step) with the MSE loss against a target:

- ``one process``: the whole model, full batch, 1 thread, on rank 0 while rank 1 waits (same processes, so it
  is measured under the same conditions and alternates with the others).
- ``lightning_mp simple`` / ``interleaved``: our module-server engine (``pipeline="simple"`` is GPipe with
  ``active_microbatches=M``, ``"interleaved"`` orders ready work as 1F1B would, with the default
  ``active_microbatches=pp+2``; ``interleaved a2`` caps it at ``pp``); the loss, recorded on the last block's output,
  runs on stage 1, and is fetched with its backward in one exchange per microbatch ([Note: the loss's fetch and
  backward in one exchange]).
- ``... loop``: the same blocks in an ``nn.ModuleList`` called from a Python loop (``for block in self.blocks:
  x = block(x)``, as Hugging Face models are written), each remote block its own call; ``interl. loop eager`` is
  that with ``remote_handles=False`` (every remote call waits for its outputs: one round trip per block, as
  before remote handles).
- ``lightning_mp zero_bubble`` (and ``... loop``): ``pipeline="zero_bubble"``, each backward split into its input
  pass and a deferred weight pass (ZB-H1's order on 1F1B's priorities, [Note: zero-bubble]).
- ``torch GPipe`` / ``torch 1F1B``: ``torch.distributed.pipelining.ScheduleGPipe`` / ``Schedule1F1B`` over
  ``PipelineStage``s of the same two halves, the loss on the last stage.

Methods alternate round by round (``--rounds`` rounds of ``--steps`` timed steps each, after one warm-up step
per method and microbatch count); the table shows the median step time of rank 0, the *ideal* pipelined time
``one-process time / stages x (M + stages - 1) / M`` (perfect overlap, only the fill/drain bubble), and the
peak activation memory per rank: the largest total size of tensors saved for backward (autograd's saved
tensors, parameters excluded, counted through ``torch.autograd.graph.saved_tensors_hooks`` around every block)
alive at once during a step, and each process's CPU time and context switches per step (``getrusage``, all its
threads; rank 1 idles in a barrier during "one process"; the voluntary ones are a thread blocking, i.e. the
hand-offs and waits; the rest are preemptions, which grow with the machine's load) and minor page faults per step (``ru_minflt``: memory
the allocator got fresh from the kernel, zeroed page by page). On a loaded machine the wall times of all methods
stretch; CPU time and context switches are the less load-sensitive measures of overhead. Both processes run
under ``SMPStrategy``'s malloc policy for pipelined ranks (every method alike; ``--malloc glibc``: glibc's default;
[Note: engine threads and glibc malloc] in ``lightning_mp/memory/_host.py``).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from lightning_mp.comm import Transport, make_data_plane  # noqa: E402
from lightning_mp.memory import retain_freed_memory  # noqa: E402
from lightning_mp.topology import build_pair_groups  # noqa: E402
from lightning_mp.callbacks import RankTimeline, gpipe_bubble, measure_bubble  # noqa: E402
from lightning_mp.pipeline import PipelineEngine, split_microbatches  # noqa: E402

STAGES = 2
METHODS = (
    "one process",
    "lightning_mp simple",
    "lightning_mp interleaved",
    "lightning_mp interleaved a2",
    "lightning_mp simple loop",
    "lightning_mp interleaved loop",
    "lightning_mp interl. loop eager",
    "lightning_mp zero_bubble",
    "lightning_mp zero_bubble loop",
    "torch GPipe",
    "torch 1F1B",
)


class MLPBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, D) -> (B, D)
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class BlockStack(nn.Module):
    def __init__(self, dim: int, num_blocks: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[MLPBlock(dim) for _ in range(num_blocks)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


class BlockLoop(nn.Module):
    """The same blocks called from a Python loop over an ``nn.ModuleList`` (as Hugging Face models do)."""

    def __init__(self, dim: int, num_blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([MLPBlock(dim) for _ in range(num_blocks)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class ActivationMeter:
    """Peak bytes of autograd-saved activations alive at once, from saved-tensor hooks entered around modules.

    The hooks are thread-local, so they are entered by forward pre-hooks and left by forward hooks on each block,
    in whichever thread runs the block (our engine runs microbatches and requests in several threads).
    """

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self._lock = threading.Lock()
        self._contexts = threading.local()

    def reset(self) -> None:
        with self._lock:
            self.peak = self.live

    def attach(self, modules: list[nn.Module]) -> None:
        for module in modules:
            module.register_forward_pre_hook(self._enter)
            module.register_forward_hook(self._exit)

    def _enter(self, module: nn.Module, args: tuple) -> None:
        ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        ctx.__enter__()
        self._stack().append(ctx)

    def _exit(self, module: nn.Module, args: tuple, output: object) -> None:
        self._stack().pop().__exit__(None, None, None)

    def _stack(self) -> list:
        if not hasattr(self._contexts, "stack"):
            self._contexts.stack = []
        return self._contexts.stack

    def _pack(self, tensor: torch.Tensor) -> object:
        if isinstance(tensor, nn.Parameter):
            return tensor
        return _Saved(self, tensor)

    @staticmethod
    def _unpack(saved: object) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.live += nbytes
            self.peak = max(self.peak, self.live)


class _Saved:
    def __init__(self, meter: ActivationMeter, tensor: torch.Tensor) -> None:
        self.meter, self.tensor = meter, tensor
        self.nbytes = tensor.numel() * tensor.element_size()
        meter.add(self.nbytes)

    def __del__(self) -> None:
        self.meter.add(-self.nbytes)


def _batch(batch_size: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(batch_size, dim, generator=generator), torch.randn(batch_size, dim, generator=generator)


def _ours_step(engine: PipelineEngine, model: nn.Module, parts: list) -> None:
    num = len(parts)
    with engine.session() as session:
        if engine.is_driver:
            session.drive(
                lambda mb, i: F.mse_loss(model(mb[0]), mb[1]), parts, loss_fn=lambda loss: loss / num, backward=True
            )
            session.finish(None)
        else:
            session.serve()


def _transport(plane: str) -> Transport:
    """The pipeline transport on ``plane``: ``gloo`` (default) or ``strict_mock`` (NCCL's rules on gloo)."""
    group = dist.new_group([0, 1])
    if plane == "gloo":
        return Transport(group, torch.device("cpu"))
    pairs = build_pair_groups([[0, 1]], "gloo")
    return Transport(group, torch.device("cpu"), make_data_plane(plane, group, torch.device("cpu"), pairs, 300.0))


def _rank(rank: int, init_file: str, out_dir: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    if args.malloc == "retain":
        assert retain_freed_memory()  # as SMPStrategy sets it in every pipelined rank (torch's schedules share it)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2, timeout=timedelta(minutes=5))
    try:
        torch.manual_seed(0)
        reference = BlockStack(args.dim, args.blocks)
        half = args.blocks // 2
        halves = [copy.deepcopy(reference.blocks[:half]), copy.deepcopy(reference.blocks[half:])]
        ours = copy.deepcopy(reference)
        stage_of = {"": 0, "blocks": 0}
        for fqn, _ in ours.blocks.named_modules():
            if fqn:
                stage_of[f"blocks.{fqn}"] = 0 if int(fqn.split(".")[0]) < half else 1
        transport = _transport(args.data_plane)
        engine = PipelineEngine(transport, STAGES, timeout_s=300, remote_handles=True)
        engine.install(ours, stage_of)
        looped = BlockLoop(args.dim, args.blocks)
        looped.blocks.load_state_dict(reference.blocks.state_dict())
        looped_eager = copy.deepcopy(looped)
        loop_engine = PipelineEngine(transport, STAGES, timeout_s=300, remote_handles=True)
        loop_engine.install(looped, stage_of)
        eager_engine = PipelineEngine(transport, STAGES, timeout_s=300, remote_handles=False)
        eager_engine.install(looped_eager, stage_of)
        meter = ActivationMeter()
        meter.attach(
            list(ours.blocks) + list(looped.blocks) + list(looped_eager.blocks) + list(halves[rank])
            + (list(reference.blocks) if rank == 0 else [])
        )
        x, y = _batch(args.batch_size, args.dim)

        runners: dict[tuple[str, int], Callable[[], None]] = {}
        for m in args.microbatches:
            parts = split_microbatches((x, y), m)
            for name, schedule, active in (
                ("lightning_mp simple", "simple", m),  # one wave: every forward, then every backward
                ("lightning_mp interleaved", "interleaved", STAGES + 2),  # the default cap, pp + 2
                ("lightning_mp interleaved a2", "interleaved", STAGES),  # active_microbatches = pp
                ("lightning_mp simple loop", "simple", m),
                ("lightning_mp interleaved loop", "interleaved", STAGES + 2),
                ("lightning_mp interl. loop eager", "interleaved", STAGES + 2),
                ("lightning_mp zero_bubble", "zero_bubble", STAGES + 2),  # input passes now, weight passes deferred
                ("lightning_mp zero_bubble loop", "zero_bubble", STAGES + 2),
            ):
                eng, model = {"loop": (loop_engine, looped), "eager": (eager_engine, looped_eager)}.get(
                    name.split()[-1], (engine, ours)
                )

                def run(schedule=schedule, active=active, parts=parts, eng=eng, model=model) -> None:
                    eng.schedule, eng.active_microbatches = schedule, active
                    _ours_step(eng, model, parts)

                runners[(name, m)] = run
            for name, cls in (("torch GPipe", ScheduleGPipe), ("torch 1F1B", Schedule1F1B)):
                stage = PipelineStage(halves[rank], rank, STAGES, torch.device("cpu"))
                sched = cls(stage, n_microbatches=m, loss_fn=F.mse_loss)

                def run(sched=sched) -> None:
                    if rank == 0:
                        sched.step(x)
                    else:
                        sched.step(target=y, losses=[])

                runners[(name, m)] = run

            def single() -> None:
                if rank == 0:
                    F.mse_loss(reference(x), y).backward()

            runners[("one process", m)] = single

        times: dict[tuple[str, int], list[float]] = {key: [] for key in runners}
        cpu: dict[tuple[str, int], list[float]] = {key: [] for key in runners}
        switches: dict[tuple[str, int], list[int]] = {key: [] for key in runners}
        faults: dict[tuple[str, int], list[int]] = {key: [] for key in runners}
        voluntary: dict[tuple[str, int], list[int]] = {key: [] for key in runners}
        peaks: dict[tuple[str, int], int] = {key: 0 for key in runners}
        roles: dict[tuple[str, int], list[dict[str, float]]] = {key: [] for key in runners}
        for round_index in range(args.rounds + 1):  # round 0 warms every method up
            for key, run in runners.items():
                for _ in range(1 if round_index == 0 else args.steps):
                    dist.barrier()
                    meter.reset()
                    threads = _thread_cpu() if args.threads else {}
                    usage = resource.getrusage(resource.RUSAGE_SELF)
                    start = time.perf_counter()
                    run()
                    elapsed = time.perf_counter() - start
                    after = resource.getrusage(resource.RUSAGE_SELF)
                    if args.threads and round_index:
                        process_s = after.ru_utime + after.ru_stime - usage.ru_utime - usage.ru_stime
                        roles[key].append(_by_role(threads, _thread_cpu(), process_s))
                    if round_index:
                        times[key].append(elapsed)
                        cpu[key].append(after.ru_utime + after.ru_stime - usage.ru_utime - usage.ru_stime)
                        switches[key].append(after.ru_nvcsw + after.ru_nivcsw - usage.ru_nvcsw - usage.ru_nivcsw)
                        faults[key].append(after.ru_minflt - usage.ru_minflt)
                        voluntary[key].append(after.ru_nvcsw - usage.ru_nvcsw)
                        peaks[key] = max(peaks[key], meter.peak)
        timelines = _record_timelines(rank, engine, runners, args) if args.bubbles else {}
        torch.save({"times": times, "peaks": peaks, "cpu": cpu, "switches": switches, "faults": faults, "voluntary": voluntary,
                    "timelines": timelines, "roles": roles}, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


BUBBLE_METHODS = ("lightning_mp interleaved", "lightning_mp zero_bubble")
THREAD_ROLES = ("main", "gloo", "engine", "other")


def _thread_cpu() -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) of every live thread of this process: ``{tid: (name, seconds)}``, from
    ``/proc/self/task/<tid>/stat`` (clock ticks, 10 ms on Linux's usual 100 Hz)."""
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / ticks)  # utime, stime: fields 14 and 15
    return out


def _by_role(before: dict, after: dict, process_s: float) -> dict[str, float]:
    """Split ``process_s`` of CPU between the main thread, gloo's threads (``gloo*``, named by gloo), the engine's
    threads (Python threads other than the main one, and threads that ended in between: the engine's per-step workers) and the rest."""
    roles = dict.fromkeys(THREAD_ROLES, 0.0)
    main = threading.get_native_id()
    seen = 0.0
    for tid, (name, seconds) in after.items():
        spent = seconds - before.get(tid, (name, 0.0))[1]
        seen += spent
        role = ("main" if tid == main else "gloo" if name.startswith("gloo") else
                "engine" if name.startswith(("smp", "python")) else "other")  # Python 3.11 names no OS thread
        roles[role] += spent
    roles["engine"] += max(0.0, process_s - seen)  # threads that ended before ``after``: the engine's workers
    return roles


def _record_timelines(rank: int, engine: PipelineEngine, runners: dict, args: argparse.Namespace) -> dict:
    """``--bubbles``: one more step of each of ``BUBBLE_METHODS`` per M with the engine's timeline on, as a
    ``RankTimeline`` on the clock of the barrier before it (what ``PipelineTimeline`` records through Lightning)."""
    recorded = {}
    for m in args.microbatches:
        for name in BUBBLE_METHODS:
            dist.barrier()
            origin = time.perf_counter()
            engine.timeline.start()
            runners[(name, m)]()
            events = [dataclasses.replace(e, start_s=e.start_s - origin, end_s=e.end_s - origin)
                      for e in engine.timeline.stop()]
            recorded[(name, m)] = RankTimeline(rank, rank, events, time.perf_counter() - origin)
    return recorded


def _print_bubbles(results: list[dict], args: argparse.Namespace) -> None:
    print("\nMeasured bubble (1 - compute / step span, per rank, PipelineTimeline's measure_bubble), one step each:")
    for m in args.microbatches:
        for name in BUBBLE_METHODS:
            report = measure_bubble([r["timelines"][(name, m)] for r in results])
            fractions = " / ".join(f"{100 * report.fractions[rank]:.0f}%" for rank in sorted(report.fractions))
            print(f"{m:>2} {name:<30} r0 / r1 {fractions:>11}   mean {100 * report.mean:.0f}%"
                  f"   (GPipe's (p-1)/(m+p-1): {100 * gpipe_bubble(STAGES, m):.0f}%)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--data-plane", choices=["gloo", "strict_mock"], default="gloo", help="lightning_mp's data plane")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per method per round")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument(
        "--malloc", choices=["retain", "glibc"], default="retain",
        help="the processes' malloc policy: SMPStrategy's (memory._host.retain_freed_memory) or glibc's default",
    )
    parser.add_argument("--bubbles", action="store_true", help="also measure the bubble of interleaved / zero_bubble")
    parser.add_argument("--threads", action="store_true",
                        help="also split each rank's CPU per step by thread role: main, gloo, engine, other")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(os.path.join(tmp, "rdv"), tmp, args), nprocs=STAGES, join=True)
        results = [torch.load(os.path.join(tmp, f"{r}.pt"), weights_only=False) for r in range(STAGES)]

    mib = 2**20
    print(
        f"\n{args.blocks} MLP blocks (dim {args.dim}, hidden {4 * args.dim}), batch {args.batch_size}, forward+backward,"
        f" {STAGES} stages on {STAGES} CPU processes (gloo, 1 thread each); median of {args.rounds * args.steps} steps"
    )
    header = (
        f"{'M':>2} {'method':<30} {'ms/step':>8} {'% of ideal':>10} {'ours / torch best':>17} {'peak act MiB r0 / r1':>21}"
        f" {'CPU ms/step r0 / r1':>20} {'ctx sw/step r0 / r1':>20} {'of them voluntary':>18} {'page faults/step r0 / r1':>25}"
    )
    print(header)
    print("-" * len(header))
    for m in args.microbatches:
        median = {name: 1000 * statistics.median(results[0]["times"][(name, m)]) for name in METHODS}
        ideal = median["one process"] / STAGES * (m + STAGES - 1) / m
        torch_best = min(median["torch GPipe"], median["torch 1F1B"])
        print(f"{m:>2} {'ideal (one process / 2 x (M+1)/M)':<30} {ideal:8.1f}")
        for name in METHODS:
            peaks = " / ".join(f"{r['peaks'][(name, m)] / mib:.1f}" for r in results)
            vs = f"{median[name] / torch_best:16.2f}x" if name != "one process" else ""
            cpu = " / ".join(f"{1000 * statistics.median(r['cpu'][(name, m)]):.0f}" for r in results)
            switches = " / ".join(f"{statistics.median(r['switches'][(name, m)]):.0f}" for r in results)
            faults = " / ".join(f"{statistics.median(r['faults'][(name, m)]):.0f}" for r in results)
            vol = " / ".join(f"{statistics.median(r['voluntary'][(name, m)]):.0f}" for r in results)
            print(
                f"{m:>2} {name:<30} {median[name]:8.1f} {100 * ideal / median[name]:9.0f}% {vs:>17} {peaks:>21}"
                f" {cpu:>20} {switches:>20} {vol:>18} {faults:>25}"
            )
        for schedule in ("simple", "interleaved", "zero_bubble"):
            ratio = median[f"lightning_mp {schedule} loop"] / median[f"lightning_mp {schedule}"]
            print(f"{m:>2} {schedule} ModuleList loop / Sequential: {ratio:.2f}x")
    if args.bubbles:
        _print_bubbles(results, args)
    if args.threads:
        _print_roles(results, args)


def _print_roles(results: list[dict], args: argparse.Namespace) -> None:
    print("\nCPU ms per step by thread, per rank (mean over the timed steps; /proc/self/task, 10 ms ticks): main thread,"
          " gloo's threads, other Python threads (the engine's, and its per-step workers that ended), the rest")
    print(f"{'M':>2} {'method':<30} " + " ".join(f"{role + ' r0 / r1':>16}" for role in THREAD_ROLES))
    for m in args.microbatches:
        for name in METHODS:
            if name == "one process":
                continue
            cells = []
            for role in THREAD_ROLES:
                per_rank = [1000 * statistics.mean(step[role] for step in r["roles"][(name, m)]) for r in results]
                cells.append(" / ".join(f"{v:.0f}" for v in per_rank))
            print(f"{m:>2} {name:<30} " + " ".join(f"{c:>16}" for c in cells))


if __name__ == "__main__":
    main()
