"""GPU check of the two-plane transport, delayed init and offloading: one file, under 5 minutes on one GPU, a JSON.

    python scripts/gpu_check.py [--out gpu_check.json] [--cpu]

Checks (each recorded as "pass", "fail" with the error, or "skipped" with the reason):

- ``autograd_calling_thread``: on CUDA autograd runs a custom Function's backward on its device thread;
  ``torch.autograd.set_multithreading_enabled(False)`` runs it on the calling thread (what the engine relies on).
- ``two_stage_nested_<plane>`` / ``two_stage_gpt_<plane>``: 2 pipeline stages as 2 processes sharing the one GPU
  (the gloo data plane: headers over gloo, tensors staged through pinned host memory), two SGD steps of a model
  whose stage 1 calls back into stage 0 (A -> B -> A in forward and backward) and of the example GPT, against the
  same model in one process: losses, first-step gradients, updated parameters; and every backward of the probe
  layers ran on an engine thread with multithreaded backward off.
- ``nccl_loop_back``: the NCCL data plane's code (packing into one aligned buffer, sequence numbers, the one
  communication thread, events before the send, receive after the header, unpacking) through NCCL loop-back in
  one process (this rank sends to itself), bitwise, with in-place writes to the sources after sending.
- ``delayed_init_on_device``: the example GPT built under ``torch.device(<device>)`` with delayed parameter
  initialisation, materialised one pipeline stage at a time (2 stages, the real planner on a meta trace): each
  stage's tensors bitwise those of the eager build under the same device and seed (other stages' random ops draw
  on scratch on that device, so its generator advances as in the eager build).
- ``offloading_on_device``: activation offloading (``ActivationOffloader``, horizon 2) of 6 checkpointed residual
  blocks with dropout, two microbatches whose backwards run in the other order: on CUDA the saved inputs go to
  pinned host memory on a side stream and come back ahead of their backward; gradients bitwise those of the same
  checkpointed model without offloading, every saved input offloaded once and loaded once.
- ``staging_per_mb`` / ``loop_back_per_mb``: ms per MB of pinned staging (device -> pinned host -> device) and of
  the NCCL loop-back, for a few message sizes.

``--cpu`` (also taken when no GPU is visible) runs every part that can run on CPU: the 2-stage checks on CPU with
the gloo plane and with the strict mock of NCCL's rules, the autograd check on CPU, and the loop-back harness with
a copy in place of NCCL; the CUDA-only parts are recorded as skipped. The exit status is 1 if any check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from contextlib import nullcontext
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from lightning_mp.comm import PairDataPlane, PairGroups, Transport, make_data_plane, pack  # noqa: E402
from lightning_mp.topology import build_pair_groups  # noqa: E402
from lightning_mp.comm._pair import _check_thread, _NcclBackend  # noqa: E402
from lightning_mp.comm._wire import _unpack  # noqa: E402
from lightning_mp.pipeline import PipelineEngine, split_microbatches  # noqa: E402

_MB = 1 << 20

# ---- models ----------------------------------------------------------------------------------------------------

_SEEN: list[tuple[str, bool]] = []  # (thread name, multithreaded backward on) of every probe backward


class _RecordBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        _SEEN.append((threading.current_thread().name, torch.autograd.is_multithreading_enabled()))
        return grad


class _Probe(nn.Linear):
    def forward(self, x):
        return _RecordBackward.apply(super().forward(x))


class _Nested(nn.Module):
    """encoder, block and out on stage 0; block's parent on stage 1 calls its child back on stage 0."""

    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.encoder = _Probe(dim, dim)
        self.block = nn.Sequential(_Probe(dim, dim), nn.GELU(), nn.Linear(dim, dim))
        self.out = _Probe(dim, 1)

    def forward(self, x):
        h = torch.tanh(self.encoder(x))
        h = self.block(h)
        if h.mean() > -1:  # a data-dependent second call
            h = self.block(h)
        return self.out(h).squeeze(-1)


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "nested":
        return _Nested()
    from examples.gpt import GPT

    return GPT(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)


def _batch(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    if name == "nested":
        return torch.randn(16, 64, generator=g), torch.randn(16, generator=g)
    data = torch.randint(0, 256, (8, 65), generator=g)
    return data[:, :-1], data[:, 1:]


def _loss(name: str, model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    out = model(x)
    if name == "nested":
        return F.mse_loss(out, y)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _placement(name: str, model: nn.Module) -> dict[str, int]:
    if name == "nested":
        stage_of = {fqn: 0 for fqn, _ in model.named_modules()}
        stage_of.update({"block": 1, "block.2": 1})
        return stage_of
    from lightning_mp.partition import plan, trace

    device = next(model.parameters()).device
    sample = tuple(t.to(device) for t in _batch(name))
    return plan(trace(model, lambda: _loss(name, model, sample)), 2).stage_of


_STEPS, _LR, _MICROBATCHES = 2, 0.05, 4


def _train(name: str, model: nn.Module, device: torch.device, step_fn: Callable) -> dict:
    optimizer = torch.optim.SGD([p for p in model.parameters() if p is not None], lr=_LR)
    losses, grads = [], {}
    for step in range(_STEPS):
        optimizer.zero_grad()
        losses.append(step_fn())
        if step == 0:
            grads = {n: p.grad.detach().cpu() for n, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
    params = {n: p.detach().cpu() for n, p in model.named_parameters() if p is not None}
    return {"losses": losses, "grads": grads, "params": params}


def _one_process(name: str, device: torch.device) -> dict:
    model = _model(name).to(device)
    batch = tuple(t.to(device) for t in _batch(name))

    def step() -> float:
        loss = _loss(name, model, batch)
        loss.backward()
        return loss.item()

    return _train(name, model, device, step)


def _stage(rank: int, init_file: str, out_dir: str, name: str, device_type: str, plane: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2, timeout=timedelta(minutes=2))
    try:
        device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        _SEEN.clear()
        model = _model(name).to(device)
        stage_of = _placement(name, model)
        group = dist.new_group([0, 1], backend="gloo")
        pairs = build_pair_groups([[0, 1]], "gloo") if plane == "strict_mock" else None
        transport = Transport(group, device, make_data_plane(plane, group, device, pairs, 60.0))
        engine = PipelineEngine(transport, 2, timeout_s=120)
        engine.install(model, stage_of)
        parts = split_microbatches(tuple(t.to(device) for t in _batch(name)), _MICROBATCHES)

        def step() -> float:
            with engine.session() as session:
                if engine.is_driver:
                    outputs = session.drive(
                        lambda mb, i: _loss(name, model, mb), parts, loss_fn=lambda l: l / _MICROBATCHES, backward=True
                    )
                    loss = torch.stack([o.detach() for o in outputs]).mean().item()
                    session.finish(loss)
                    return loss
                return session.serve()

        result = _train(name, model, device, step)
        result["seen"] = list(_SEEN)
        transport.close()
        torch.save(result, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def two_stage(name: str, device: torch.device, plane: str) -> dict:
    """2 stages as 2 processes on ``device`` (both on GPU 0 for CUDA) against one process."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _stage, args=(os.path.join(tmp, "rdv"), tmp, name, device.type, plane), nprocs=2, join=True, start_method="spawn"
        )
        results = [torch.load(os.path.join(tmp, f"{r}.pt"), weights_only=False) for r in range(2)]
    _SEEN.clear()
    reference = _one_process(name, device)
    rtol, atol = (1e-4, 1e-5) if device.type == "cuda" else (1e-5, 1e-6)
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    for result in results:
        torch.testing.assert_close(result["losses"], reference["losses"], rtol=rtol, atol=atol)
        worst["loss"] = max(worst["loss"], max(abs(a - b) for a, b in zip(result["losses"], reference["losses"])))
        for kind, key in (("grad", "grads"), ("param", "params")):
            for fqn, value in result[key].items():
                torch.testing.assert_close(value, reference[key][fqn], rtol=rtol, atol=atol, msg=fqn)
                worst[kind] = max(worst[kind], (value - reference[key][fqn]).abs().max().item())
    owned = sorted(n for r in results for n in r["params"])
    if owned != sorted(reference["params"]):
        raise AssertionError("the stages do not own every parameter exactly once")
    seen = [entry for r in results for entry in r["seen"]]
    if name == "nested":
        bad = [entry for entry in seen if not entry[0].startswith("smp-") or entry[1]]
        if not seen or bad:
            raise AssertionError(f"probe backwards off engine threads or with multithreading on: {bad or 'none ran'}")
    return {
        "losses": results[0]["losses"],
        "reference_losses": reference["losses"],
        "max_abs_diff": worst,
        "probe_backward_threads": sorted({n for n, _ in seen}),
    }


# ---- autograd's calling thread ----------------------------------------------------------------------------------


def autograd_calling_thread(device: torch.device) -> dict:
    def backward_thread() -> str:
        _SEEN.clear()
        x = torch.ones(8, device=device, requires_grad=True)
        _RecordBackward.apply(x * 2).sum().backward()
        return _SEEN[0][0]

    caller = threading.current_thread().name
    default = backward_thread()
    with torch.autograd.set_multithreading_enabled(False):
        disabled = backward_thread()
    # In a fresh thread too (the setting is thread-local: the engine sets it in each of its threads).
    box: list[str] = []

    def in_thread() -> None:
        torch.autograd.set_multithreading_enabled(False)
        box.append(backward_thread())

    worker = threading.Thread(target=in_thread, name="smp-probe")
    worker.start()
    worker.join()
    if disabled != caller or box != ["smp-probe"]:
        raise AssertionError(f"backward with multithreading off ran on {disabled!r} / {box}, not the calling thread")
    return {"calling_thread": caller, "default_backward_thread": default, "disabled_backward_thread": disabled,
            "default_on_calling_thread": default == caller}


# ---- NCCL data plane through loop-back --------------------------------------------------------------------------


class _Deferred:
    """A send's work, known once its receive is issued (the loop-back pairs them in one NCCL group call)."""

    work: Any = None

    def is_completed(self) -> bool:
        return self.work is not None and self.work.is_completed()


class _Done:
    def is_completed(self) -> bool:
        return True

    def wait(self, *args: Any) -> bool:
        return True


class _LoopBack(_NcclBackend):
    """The NCCL backend with this rank as both ends of one ordered pair.

    NCCL needs a send to self and its receive in one group call, so ``isend`` keeps the buffer and ``irecv`` issues
    both with ``batch_isend_irecv`` (on the communication thread, as every call). With ``nccl=False`` (CPU) the
    transfer is a copy, so the rest of the plane's code runs without NCCL.
    """

    name = "nccl_loop_back"

    def __init__(self, pairs: PairGroups, nccl: bool) -> None:
        super().__init__(pairs)
        self.nccl = nccl
        self._sends: deque = deque()

    def warm_up(self, device: torch.device) -> None:
        pass

    def isend(self, buffer: torch.Tensor, dst: int, seq: int) -> Any:
        _check_thread(self.issuer, f"the send of message {seq}")
        deferred = _Deferred()
        self._sends.append((buffer, seq, deferred))
        return deferred

    def irecv(self, buffer: torch.Tensor, src: int, seq: int) -> Any:
        _check_thread(self.issuer, f"the receive of message {seq}")
        sent, sent_seq, deferred = self._sends.popleft()
        if sent_seq != seq or sent.numel() != buffer.numel():
            raise AssertionError(f"receive {seq} of {buffer.numel()} B met send {sent_seq} of {sent.numel()} B")
        if not self.nccl:
            buffer.copy_(sent)
            deferred.work = _Done()
            return _Done()
        group = self.pairs.groups[(0, 1)]
        # The send joins the receive here, on the receive stream: it must also wait for what the send stream waited
        # on (the sender's packing, rule 5).
        torch.cuda.current_stream().wait_stream(self.comm.send_stream)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, sent, 0, group), dist.P2POp(dist.irecv, buffer, 0, group)])
        deferred.work = works[0]
        return works[-1]


def _loop_back_plane(device: torch.device) -> PairDataPlane:
    world = dist.group.WORLD
    pairs = PairGroups(stage=0, global_ranks=[0, 0], groups={(0, 1): world, (1, 0): world}, backend="nccl")
    return PairDataPlane(_LoopBack(pairs, nccl=device.type == "cuda"), device, 60.0)


def _exchange(plane: PairDataPlane, messages: list[Any], device: torch.device, mutate: bool) -> list[Any]:
    """Send every message (as Transport.send does: gather, then the data after the header), then receive all."""
    sent = []
    for seq, message in enumerate(messages):
        packed = pack(message)
        plane.send(plane.gather(packed), 1, seq)
        sent.append((seq, packed))
        if mutate:  # the sources change on the current stream right after the send: the wire must not see it
            for tensor in packed.tensors:
                if tensor.is_floating_point():
                    tensor.add_(1.0)
    received = []
    for seq, packed in sent:
        plane.header_read(1, seq, packed.data_nbytes)
        data = plane.recv(packed.data_nbytes, 1, seq)
        received.append(_unpack(packed.payload, data, device).obj)
    return received


def _with_world(fn: Callable[[], dict], backend: str) -> dict:
    if dist.is_initialized():
        return fn()
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(backend, init_method=f"file://{os.path.join(tmp, 'rdv')}", rank=0, world_size=1)
        try:
            return fn()
        finally:
            dist.destroy_process_group()


def nccl_loop_back(sizes_mb: list[int] = (1, 16, 64), device: torch.device | None = None) -> dict:
    """Bitwise round trips through the NCCL plane's code in one process, and its cost per MB."""
    device = device or torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda":
        torch.cuda.set_device(device)

    def run() -> dict:
        plane = _loop_back_plane(device)
        try:
            torch.manual_seed(0)
            cpu_part = torch.arange(5, dtype=torch.int32)
            messages = [
                {
                    "x": torch.randn(3, 7, device=device, dtype=dtype),
                    "strided": torch.randn(6, 4, device=device).t(),  # not contiguous
                    "empty": torch.empty(0, 3, device=device),
                    "ids": torch.randint(0, 9, (11,), device=device),
                    "host": cpu_part,  # a CPU tensor in a CUDA message arrives on the device
                    "n": i,
                }
                for i, dtype in enumerate([torch.float32, torch.bfloat16, torch.float16, torch.float64])
            ]
            expected = [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in m.items()} for m in messages]
            received = _exchange(plane, messages, device, mutate=True)
            for got, want in zip(received, expected):
                for key, value in want.items():
                    if isinstance(value, torch.Tensor):
                        if got[key].device != device or got[key].dtype != value.dtype:
                            raise AssertionError(f"{key}: arrived as {got[key].dtype} on {got[key].device}")
                        torch.testing.assert_close(got[key].cpu(), value.cpu(), rtol=0, atol=0, msg=key)
                    elif got[key] != value:
                        raise AssertionError(f"{key}: {got[key]!r} != {value!r}")
            per_mb = {}
            for size in sizes_mb:
                payload = [torch.randn(size * _MB // 4, device=device)]
                _exchange(plane, payload, device, mutate=False)  # warm-up
                times = []
                for _ in range(5):
                    _sync(device)
                    start = time.perf_counter()
                    _exchange(plane, payload, device, mutate=False)
                    _sync(device)
                    times.append(time.perf_counter() - start)
                per_mb[f"{size} MB"] = 1000 * statistics.median(times) / size
            return {"status": "pass", "messages": len(messages), "ms_per_mb": per_mb,
                    "transfer": "NCCL loop-back" if device.type == "cuda" else "copy (CPU: no NCCL)"}
        finally:
            plane.close()

    return _with_world(run, "nccl" if device.type == "cuda" else "gloo")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def staging_per_mb(device: torch.device, sizes_mb: list[int] = (1, 16, 64)) -> dict:
    """ms per MB of the gloo plane's staging: pack into pinned host memory (device -> host), unpack on the device."""
    from lightning_mp.comm import GlooDataPlane

    plane = GlooDataPlane(None, device)
    per_mb = {}
    for size in sizes_mb:
        packed = pack([torch.randn(size * _MB // 4, device=device)])
        times = []
        for _ in range(6):
            _sync(device)
            start = time.perf_counter()
            wire = plane.gather(packed)
            (out,) = _unpack(packed.payload, wire, device).obj
            _sync(device)
            times.append(time.perf_counter() - start)
        torch.testing.assert_close(out, packed.tensors[0], rtol=0, atol=0)
        per_mb[f"{size} MB"] = 1000 * statistics.median(times[1:]) / size
    return {"ms_per_mb": per_mb, "pinned": wire.is_pinned()}


# ---- driver -----------------------------------------------------------------------------------------------------


def delayed_init_on_device(device: torch.device) -> dict:
    from lightning_mp.init import delay_param_initialization, materialize_module
    from lightning_mp.partition import plan, trace

    def build(delayed: bool) -> nn.Module:
        torch.manual_seed(0)
        if device.type == "cuda":
            torch.cuda.manual_seed(0)
        with torch.device(device), (delay_param_initialization() if delayed else nullcontext()):
            return _model("gpt")

    tensors = lambda m: {**dict(m.named_parameters(remove_duplicate=False)), **dict(m.named_buffers())}  # noqa: E731
    eager = {k: v.detach().cpu() for k, v in tensors(build(False)).items()}
    covered, compared = set(), 0
    for stage in range(2):
        model = build(True)
        sample = tuple(t.to("meta") for t in _batch("gpt"))
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            stage_of = plan(trace(model, lambda: _loss("gpt", model, sample)), 2).stage_of
        for fqn, module in model.named_modules(remove_duplicate=False):  # what PipelineEngine.install drops
            if next(module.parameters(), None) is not None and stage_of[fqn] != stage:
                for kind in ("_parameters", "_buffers"):
                    for key in getattr(module, kind):
                        getattr(module, kind)[key] = None
        materialize_module(model)
        for name, value in tensors(model).items():
            if value is None:
                continue
            if value.device.type != device.type or not torch.equal(value.detach().cpu(), eager[name]):
                raise AssertionError(f"stage {stage}: {name} differs from the eager build on {device}")
            covered.add(name)
            compared += 1
    if covered != set(eager):
        raise AssertionError(f"tensors no stage holds: {sorted(set(eager) - covered)[:5]}")
    return {"tensors_compared": compared}


class _Residual(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc, self.drop = nn.Linear(dim, dim), nn.Dropout(0.2)

    def forward(self, x):
        return x + self.drop(torch.tanh(self.fc(x)))


def offloading_on_device(device: torch.device, depth: int = 6, dim: int = 256) -> dict:
    import copy

    from lightning_mp.memory import ActivationOffloader, set_activation_checkpointing

    torch.manual_seed(0)
    reference = nn.Sequential(*[_Residual(dim) for _ in range(depth)]).to(device)
    model = copy.deepcopy(reference)
    set_activation_checkpointing(reference, strategy="each")
    set_activation_checkpointing(model, strategy="each")
    current = {"mb": 0}
    offloader = ActivationOffloader(horizon=2, microbatch_fn=lambda: current["mb"])
    for block in model:
        block.__dict__["_lightning_mp_offloader"] = offloader
    xs = [torch.randn(64, dim, device=device) for _ in range(2)]
    for net in (model, reference):
        losses = []
        for mb, x in enumerate(xs):
            current["mb"] = mb
            torch.manual_seed(10 + mb)
            if device.type == "cuda":
                torch.cuda.manual_seed(10 + mb)
            losses.append(net(x).pow(2).mean())
        for mb in (1, 0):
            current["mb"] = mb
            losses[mb].backward()
    _sync(device)
    stats = offloader.stats
    if stats.packs != 2 * depth or stats.unpacks != 2 * depth or stats.host_bytes != 0:
        raise AssertionError(f"packs {stats.packs}, unpacks {stats.unpacks}, host bytes left {stats.host_bytes}")
    for (name, a), (_, b) in zip(model.named_parameters(), reference.named_parameters()):
        if not torch.equal(a.grad, b.grad):
            raise AssertionError(f"{name}: gradient differs from no offloading by {(a.grad - b.grad).abs().max():.3g}")
    return {"packs": stats.packs, "prefetches": stats.prefetches, "max_host_mb": round(stats.max_host_bytes / _MB, 2)}


def _record(results: dict, name: str, fn: Callable[[], dict]) -> None:
    start = time.perf_counter()
    try:
        outcome = fn()
        outcome.setdefault("status", "pass")
    except Exception as err:  # noqa: BLE001 - recorded in the JSON, the run goes on
        outcome = {"status": "fail", "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
    outcome["seconds"] = round(time.perf_counter() - start, 1)
    results["checks"][name] = outcome
    print(f"{name:<32} {outcome['status']:<8} {outcome['seconds']:6.1f} s  {outcome.get('error', outcome.get('reason', ''))}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu_check.json")
    parser.add_argument("--cpu", action="store_true", help="run the CPU parts only (taken when no GPU is visible)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    results: dict[str, Any] = {
        "mode": "cuda" if cuda else "cpu",
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        "checks": {},
    }
    skip = lambda reason: (lambda: {"status": "skipped", "reason": reason})  # noqa: E731
    _record(results, "autograd_calling_thread", lambda: autograd_calling_thread(device))
    planes = ["gloo"] if cuda else ["gloo", "strict_mock"]
    for name in ("nested", "gpt"):
        for plane in planes:
            _record(results, f"two_stage_{name}_{plane}", lambda: two_stage(name, device, plane))
    _record(results, "nccl_loop_back", lambda: nccl_loop_back(device=device))
    _record(results, "delayed_init_on_device", lambda: delayed_init_on_device(device))
    _record(results, "offloading_on_device", lambda: offloading_on_device(device))
    if cuda:
        _record(results, "staging_per_mb", lambda: staging_per_mb(device))
    else:
        _record(results, "staging_per_mb", skip("needs CUDA (pinned host memory)"))
        results["checks"]["nccl_loop_back"]["note"] = "CPU: the plane's code with a copy in place of NCCL"
        _record(results, "nccl_transfer", skip("needs CUDA and NCCL"))
    with open(args.out, "w") as file:
        json.dump(results, file, indent=2, default=str)
    print(f"wrote {args.out}")
    return int(any(c["status"] == "fail" for c in results["checks"].values()))


if __name__ == "__main__":
    sys.exit(main())
