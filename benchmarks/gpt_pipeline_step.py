"""Step time of the example GPT: one process against lightning_mp's 2-stage pipeline, in one run.

Measures forward+backward of one batch (no optimizer, no Lightning) so the table shows the engine itself:

    python benchmarks/gpt_pipeline_step.py [--model gpt|hf-gpt2] [--steps 20] [--microbatches 4] [--batch-size 32]
        [--malloc retain|glibc] [--schedules interleaved simple] [--tied-weights colocate|replicate]

Rows: one process with 1 and 2 intra-op threads (the peer: plain PyTorch), and the pipeline on 2 processes with
1 thread each, for both schedules, each with remote handles and "eager" (``remote_handles=False``: every remote
call waits for its outputs, as before remote handles); the two variants of a schedule alternate step by step in
the same pair of processes. "ideal" is the one-thread time / 2 stages x (M + 1) / M (a perfect 2-stage
pipeline with its fill/drain bubble). Also printed: per-stage busy time (forward/backward spans of the engine's
timeline), the number of remote calls per step, the driver's round trips per microbatch forward / backward
(fetches or waiting calls / their backwards; one-way calls are not round trips) and the context switches per step
and minor page faults per step of each process (``getrusage``, all threads). "M=4 in turn" is the peer of the
engine's compute: the same microbatches one after the other (forward, backward) in one thread of rank 0's
process while rank 1 waits, alternating step by step with the pipeline; the last lines give the engine's compute
(busy s0 + s1; in wall and in thread CPU time: ``TokenCPU``) and CPU time (both processes) per step against it.
The KiB column is what each process sends per microbatch (pickles and tensor bytes, ``PipelineEngine.bytes_sent``),
the messages column how many transport messages (``transport_messages(PipelineEngine.messages_sent)``: one-way
calls sent together count once, [Note: coalesced one-way calls]; the step's "end" and "close" included);
``--tied-weights replicate`` plans the tied embedding/head apart (the head and the loss on stage 1), the default
co-locates them on stage 0. The ranks run under ``SMPStrategy``'s malloc policy (``--malloc glibc``: glibc's default; [Note: engine threads and glibc malloc] in
``lightning_mp/memory/_host.py``); the one-process rows in the launching process under glibc's default (plain
PyTorch). Runs on CPU with gloo; ``gpt`` is configs/gpt_single.yaml's model,
``hf-gpt2`` Hugging Face's unmodified ``GPT2LMHeadModel`` (a ``for block in self.h`` loop over a ModuleList) of
the same size.
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
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from examples.gpt import GPT  # noqa: E402
from lightning_mp.comm import Transport, make_data_plane  # noqa: E402
from lightning_mp.memory import retain_freed_memory  # noqa: E402
from lightning_mp.topology import build_pair_groups  # noqa: E402
from lightning_mp.partition import plan, trace  # noqa: E402
from lightning_mp.pipeline import PipelineEngine, split_microbatches, transport_messages  # noqa: E402
from lightning_mp.pipeline._scheduler import ComputeToken  # noqa: E402


MODEL = "gpt"
TIED_WEIGHTS = "colocate"


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    if MODEL == "hf-gpt2":
        import transformers

        config = transformers.GPT2Config(
            vocab_size=256, n_positions=128, n_layer=4, n_head=4, n_embd=128, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, use_cache=False,
        )
        return transformers.GPT2LMHeadModel(config)
    return GPT(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=128)


def _batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.randint(0, 256, (batch_size, 129), generator=torch.Generator().manual_seed(0))
    return data[:, :-1], data[:, 1:]


def _loss(model: GPT, batch) -> torch.Tensor:
    x, y = batch
    logits = model(input_ids=x, use_cache=False).logits if MODEL == "hf-gpt2" else model(x)  # (B, T, V)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def one_process(threads: int, steps: int, batch_size: int) -> list[float]:
    torch.set_num_threads(threads)
    model, batch = _model(), _batch(batch_size)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        _loss(model, batch).backward()
        times.append(time.perf_counter() - start)
    return times


def _microbatches_in_one_thread(model: torch.nn.Module, parts: list) -> None:
    """The step's microbatches one after the other in this thread, each forward then backward (the same compute
    as the pipeline's stages together)."""
    for part in parts:
        (_loss(model, part) / len(parts)).backward()


def _transport(plane: str) -> Transport:
    """The pipeline transport on ``plane``: ``gloo`` (default) or ``strict_mock`` (NCCL's rules on gloo)."""
    group = dist.new_group([0, 1])
    if plane == "gloo":
        return Transport(group, torch.device("cpu"))
    pairs = build_pair_groups([[0, 1]], "gloo")
    return Transport(group, torch.device("cpu"), make_data_plane(plane, group, torch.device("cpu"), pairs, 300.0))


def _cpu_s(usage: resource.struct_rusage) -> float:
    return usage.ru_utime + usage.ru_stime


class TokenCPU:
    """Thread CPU time spent holding the engine's compute token, summed over this process's threads: the compute
    spans' CPU, which a loaded machine's preemptions do not stretch (their wall time it does)."""

    def __init__(self) -> None:
        self.total_s = 0.0
        self._local = threading.local()
        # ``_release`` gives the token up; ``release`` also sends the held one-way calls, after it
        acquire, release = ComputeToken.acquire, ComputeToken._release

        def timed_acquire(token: ComputeToken, *args, **kwargs) -> None:
            acquire(token, *args, **kwargs)
            self._local.since = time.thread_time()

        def timed_release(token: ComputeToken) -> bool:
            released = release(token)
            since = getattr(self._local, "since", None)
            if released and since is not None:
                self.total_s += time.thread_time() - since  # one holder at a time: no race on the sum
                self._local.since = None
            return released

        ComputeToken.acquire, ComputeToken._release = timed_acquire, timed_release


def _copy_ties_apart(model: torch.nn.Module, stage_of: dict[str, int]) -> None:
    """A module holding a tied parameter on another stage than its first holder gets its own copy, as
    ``SMPStrategy(tied_weights="replicate")`` gives it (the copies' gradient all-reduce is outside the step here)."""
    first_stage: dict[int, int] = {}
    for fqn, module in model.named_modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if first_stage.setdefault(id(param), stage_of[fqn]) != stage_of[fqn]:
                setattr(module, name, torch.nn.Parameter(param.detach().clone()))


def _pipeline_rank(
    rank: int, init_file: str, out_dir: str, steps: int, microbatches: int, schedule: str, batch_size: int, plane: str,
    model_name: str, malloc: str, tied_weights: str,
) -> None:
    """Both variants (remote handles on, off) in the same two processes, alternating step by step."""
    global MODEL
    MODEL = model_name
    torch.set_num_threads(1)
    if malloc == "retain":
        assert retain_freed_memory()  # as SMPStrategy sets it in every pipelined rank
    token_cpu = TokenCPU()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2, timeout=timedelta(minutes=5))
    try:
        batch = _batch(batch_size)
        parts = split_microbatches(batch, microbatches)
        transport = _transport(plane)
        variants = {}
        for handles in (True, False):
            model = _model()
            model_trace = trace(model, lambda model=model: _loss(model, parts[0]))
            stage_of = plan(model_trace, 2, tied_weights=tied_weights).stage_of
            _copy_ties_apart(model, stage_of)
            engine = PipelineEngine(transport, 2, schedule=schedule, remote_handles=handles)
            engine.install(model, stage_of)
            variants[handles] = (model, engine, {"times": [], "busy": [], "switches": [], "faults": [], "cpu": [], "busy_cpu": []})
        reference_model = _model()
        reference = {"times": [], "switches": [], "faults": [], "cpu": []}
        for _ in range(steps):
            dist.barrier()  # rank 0 computes alone, rank 1 waits: the one-process peer of the engine's compute
            usage = resource.getrusage(resource.RUSAGE_SELF)
            start = time.perf_counter()
            if rank == 0:
                _microbatches_in_one_thread(reference_model, parts)
            reference["times"].append(time.perf_counter() - start)
            after = resource.getrusage(resource.RUSAGE_SELF)
            reference["switches"].append(after.ru_nvcsw + after.ru_nivcsw - usage.ru_nvcsw - usage.ru_nivcsw)
            reference["faults"].append(after.ru_minflt - usage.ru_minflt)
            reference["cpu"].append(_cpu_s(after) - _cpu_s(usage))
            for handles, (model, engine, result) in variants.items():
                dist.barrier()
                usage = resource.getrusage(resource.RUSAGE_SELF)
                start = time.perf_counter()
                engine.timeline.start()
                token_cpu.total_s = 0.0
                with engine.session() as session:
                    if engine.is_driver:
                        session.drive(
                            lambda mb, i, model=model: _loss(model, mb), parts, loss_fn=lambda l: l / microbatches,
                            backward=True,
                        )
                        session.finish(None)
                    else:
                        session.serve()
                result["times"].append(time.perf_counter() - start)
                result["busy_cpu"].append(token_cpu.total_s)
                after = resource.getrusage(resource.RUSAGE_SELF)
                result["switches"].append(after.ru_nvcsw + after.ru_nivcsw - usage.ru_nvcsw - usage.ru_nivcsw)
                result["faults"].append(after.ru_minflt - usage.ru_minflt)
                result["cpu"].append(_cpu_s(after) - _cpu_s(usage))
                events = engine.timeline.stop()
                result["busy"].append(sum(e.duration_s for e in events if e.category in ("forward", "backward")))
        out = {}
        for handles, (model, engine, result) in variants.items():
            sent = engine.messages_sent
            backward_trips = sent["gbwd"] + sent["bwd"] + sent["getbwd"]  # a loss's fetch rides with its backward
            trips = ((sent["get"] + sent["fwd"]) / steps / microbatches, backward_trips / steps / microbatches)
            kib = sum(engine.bytes_sent.values()) / 1024 / steps / microbatches
            messages = transport_messages(sent) / steps / microbatches
            calls = (sent["call"] + sent["fwd"]) / steps  # one-way calls and calls that wait for their outputs
            out[handles] = {**result, "calls": calls, "trips": trips, "kib": kib, "messages": messages}
        out["reference"] = reference
        torch.save(out, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def pipeline(
    steps: int, microbatches: int, schedule: str, batch_size: int, plane: str = "gloo", malloc: str = "retain"
) -> list[dict]:
    """Per rank: {remote_handles: result, "reference": the one-thread run}, measured in one pair of processes."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(
            _pipeline_rank,
            args=(os.path.join(tmp, "rdv"), tmp, steps, microbatches, schedule, batch_size, plane, MODEL, malloc, TIED_WEIGHTS),
            nprocs=2,
            join=True,
        )
        return [torch.load(os.path.join(tmp, f"{r}.pt")) for r in range(2)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--data-plane", choices=["gloo", "strict_mock"], default="gloo", help="lightning_mp's data plane")
    parser.add_argument("--model", choices=["gpt", "hf-gpt2"], default="gpt")
    parser.add_argument("--schedules", nargs="+", choices=["interleaved", "simple"], default=["interleaved", "simple"])
    parser.add_argument(
        "--malloc", choices=["retain", "glibc"], default="retain",
        help="the ranks' malloc policy: SMPStrategy's (memory._host.retain_freed_memory) or glibc's default",
    )
    parser.add_argument("--tied-weights", choices=["colocate", "replicate"], default="colocate",
                        help="the planner's tied_weights (replicate: the head and the loss on stage 1)")
    args = parser.parse_args()
    global MODEL, TIED_WEIGHTS
    MODEL, TIED_WEIGHTS = args.model, args.tied_weights
    warmup = max(2, args.steps // 5)

    def median_ms(values: list[float]) -> float:
        return 1000 * statistics.median(values[warmup:])

    rows = []
    single = {t: median_ms(one_process(t, args.steps, args.batch_size)) for t in (1, 2)}
    rows += [(f"one process, {t} thread{'s' if t > 1 else ''}", single[t], "", "", "", "", "", "", "") for t in (1, 2)]
    m = args.microbatches
    ideal = single[1] / 2 * (m + 1) / m
    rows.append((f"ideal 2-stage pipeline, M={m}", ideal, "", "", "", "", "", "", ""))
    compute = []  # (schedule, handles, engine compute / one-process compute of the same microbatches)
    for schedule in args.schedules:
        both = pipeline(args.steps, m, schedule, args.batch_size, args.data_plane, args.malloc)
        reference = both[0]["reference"]
        faults = f"{statistics.median(reference['faults'][warmup:]):.0f} / -"
        name = f"one process, 1 thread, M={m} in turn ({schedule} run)"
        rows.append((name, median_ms(reference["times"]), "", "", "", "", faults, "", ""))
        for handles in (True, False):
            results = [r[handles] for r in both]
            busy = " / ".join(f"{median_ms(r['busy']):.0f}" for r in results)
            trips = " / ".join(f"{t:.0f}" for t in results[0]["trips"])
            switches = " / ".join(f"{statistics.median(r['switches'][warmup:]):.0f}" for r in results)
            faults = " / ".join(f"{statistics.median(r['faults'][warmup:]):.0f}" for r in results)
            name = f"lightning_mp pp=2 {schedule}{'' if handles else ' eager'}, M={m}"
            kib = " / ".join(f"{r['kib']:.0f}" for r in results)
            messages = " / ".join(f"{r['messages']:.1f}" for r in results)
            calls = f"{results[0]['calls']:.0f}"
            rows.append((name, median_ms(results[0]["times"]), busy, calls, trips, switches, faults, kib, messages))
            busy_sum = sum(median_ms(r["busy"]) for r in results)
            busy_cpu_sum = sum(median_ms(r["busy_cpu"]) for r in results)
            cpu_sum = sum(median_ms(r["cpu"]) for r in results)
            reference_ms, reference_cpu = median_ms(reference["times"]), median_ms(reference["cpu"])
            compute.append((name, busy_sum, busy_cpu_sum, cpu_sum, reference_ms, reference_cpu))

    what = "HF GPT2LMHeadModel" if MODEL == "hf-gpt2" else "GPT"
    print(f"\n{what} (4 x 128, batch {args.batch_size}, seq 128), forward+backward, median of {args.steps - warmup} steps")
    print(
        f"{'setup':<48} {'ms/step':>8} {'vs 2-thread':>11} {'% of ideal':>10} {'busy ms s0/s1':>14} {'remote calls':>12}"
        f" {'round trips/mb f/b':>18} {'ctx sw/step r0/r1':>18} {'minflt/step r0/r1':>18} {'KiB sent/mb r0/r1':>18}"
        f" {'messages/mb r0/r1':>18}"
    )
    for name, ms, busy, calls, trips, switches, faults, kib, messages in rows:
        print(
            f"{name:<48} {ms:8.1f} {single[2] / ms:10.2f}x {100 * ideal / ms:9.0f}% {busy:>14} {calls:>12} {trips:>18}"
            f" {switches:>18} {faults:>18} {kib:>18} {messages:>18}"
        )
    print(
        "\nthe engine against the same microbatches in one thread of rank 0's process (same run): compute spans (busy"
        " s0 + s1, wall) / that run's wall time; the spans' thread CPU time / that run's CPU time; CPU time per step"
        " of both processes (all threads) / that run's"
    )
    for name, busy_sum, busy_cpu_sum, cpu_sum, reference_ms, reference_cpu in compute:
        print(
            f"{name:<48} compute {busy_sum:6.0f} / {reference_ms:6.0f} ms = {busy_sum / reference_ms:.2f}"
            f"   compute CPU {busy_cpu_sum:6.0f} / {reference_cpu:6.0f} ms = {busy_cpu_sum / reference_cpu:.2f}"
            f"   process CPU {cpu_sum:6.0f} / {reference_cpu:6.0f} ms = {cpu_sum / reference_cpu:.2f}"
        )

if __name__ == "__main__":
    main()
