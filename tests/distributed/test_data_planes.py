"""The two-plane transport: the strict mock's rules fire, messages cross every plane intact, backward runs on the
calling thread through a nested A -> B -> A call, and (marked ``cuda``, skipped without a GPU) the CUDA planes."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_mp.comm import Transport, make_data_plane, pack
from lightning_mp.topology import build_pair_groups
from lightning_mp.pipeline import PipelineEngine, split_microbatches
from tests._dist import PLANES, make_transport, run_distributed
from tests.models import Branchy, expand_placement

_CPU = torch.device("cpu")


def _mock_plane(rank: int, watchdog_s: float = 30.0):
    group = dist.new_group([0, 1])
    return make_data_plane("strict_mock", group, _CPU, build_pair_groups([[0, 1]], "gloo"), watchdog_s)


def _wire(plane, nbytes: int):
    return plane.gather(pack(torch.arange(nbytes, dtype=torch.uint8)))


def _expect(fn) -> str:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the test reads the message
        return f"{type(err).__name__}: {err}"
    return "no error"


def _rules(rank: int, world_size: int) -> dict[str, str]:
    """Each scenario on its own mock plane (a broken rule leaves a plane failed, as NCCL would)."""
    found = {}
    # 1. A receive posted before its header was read.
    plane = _mock_plane(rank)
    if rank == 1:
        found["speculative"] = _expect(lambda: plane.recv(16, 0, 0))
    # 2. Receives out of sequence: message 1's posted while message 0's header was read first.
    plane = _mock_plane(rank)
    if rank == 1:
        plane.header_read(0, 0, 16)
        plane.header_read(0, 1, 16)
        found["out_of_order"] = _expect(lambda: plane.recv(16, 0, 1))
    # 3. A receive posted for another byte count than its header's, and a send of another size than the receive.
    plane = _mock_plane(rank)
    if rank == 1:
        plane.header_read(0, 0, 16)
        found["posted_count"] = _expect(lambda: plane.recv(32, 0, 0))
    plane = _mock_plane(rank)
    if rank == 0:
        plane.send(_wire(plane, 32), 1, 0)
    else:
        plane.header_read(0, 0, 16)
        found["sent_count"] = _expect(lambda: plane.recv(16, 0, 0))
    # 4. A call issued from a thread other than the communication thread.
    plane = _mock_plane(rank)
    if rank == 0:
        found["second_thread"] = _expect(lambda: plane.backend.isend(torch.zeros(4, dtype=torch.uint8), 1, 0))
    # 5. A send whose receive is never posted: the watchdog fails the plane; the next send says why.
    plane = _mock_plane(rank, watchdog_s=1.0)
    if rank == 0:
        plane.send(_wire(plane, 16), 1, 0)
        threading.Event().wait(2.5)
        found["watchdog"] = _expect(lambda: plane.send(_wire(plane, 16), 1, 1))
    dist.barrier()
    return found


def test_each_rule_of_the_strict_mock_fires():
    sender, receiver = run_distributed(_rules, 2, start_method="fork")
    assert "No speculative receives" in receiver["speculative"]
    assert "FIFO per ordered pair" in receiver["out_of_order"]
    assert "Exact byte counts" in receiver["posted_count"] and "header says 16" in receiver["posted_count"]
    assert "Exact byte counts" in receiver["sent_count"] and "32 bytes" in receiver["sent_count"]
    assert "One issuing thread" in sender["second_thread"]
    assert "Watchdog" in sender["watchdog"] and "message 0 to stage 1" in sender["watchdog"]


def _round_trip(rank: int, world_size: int, plane: str) -> list:
    """Many threads send mixed messages at once; each arrives intact, in per-sender order."""
    transport = make_transport([0, 1], plane)
    torch.manual_seed(0)  # the same messages on both ranks
    messages = [
        {"i": i, "x": (10 * torch.randn(3, i + 1)).to(dtype), "empty": torch.empty(0, 2), "tag": "t" * (5000 * (i % 3 == 0))}
        for i, dtype in enumerate([torch.float32, torch.float16, torch.int64, torch.bfloat16] * 3)
    ]
    if rank == 0:
        def send_all(t: int) -> None:
            for m in messages:
                transport.send((t, m), 1)

        threads = [threading.Thread(target=send_all, args=(t,)) for t in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        transport.close()  # sends are asynchronous on the pair planes: wait for them before tearing down
        return []
    got = [transport.recv(0).obj for _ in range(3 * len(messages))]
    return [got, messages]


@pytest.mark.parametrize("plane", PLANES)
def test_messages_cross_every_cpu_plane_intact_and_in_order(plane):
    got, sent = run_distributed(_round_trip, 2, plane, start_method="fork")[1]
    for thread in range(3):
        from_thread = [m for t, m in got if t == thread]
        assert [m["i"] for m in from_thread] == list(range(len(sent)))
        for received in from_thread:
            expected = sent[received["i"]]
            assert received["tag"] == expected["tag"] and received["empty"].shape == (0, 2)
            torch.testing.assert_close(received["x"], expected["x"], rtol=0, atol=0)


def _frame_layouts(rank: int, world_size: int, plane: str) -> list:
    """One message of each wire layout ([Note: one frame per message]), sent twice in a row."""
    from lightning_mp.comm._transport import _HEADER_NBYTES

    transport = make_transport([0, 1], plane)
    torch.manual_seed(0)
    messages = [
        ("no tensor", "x" * 100),
        ("data in the header", torch.randn(1024)),
        ("data over the header", torch.randn(_HEADER_NBYTES // 4 + 1)),  # one float more than the header holds
        ("pickle over the header", ("p" * _HEADER_NBYTES, torch.randn(8))),
        ("empty tensor", torch.empty(0, 3)),
    ]
    if rank == 0:
        for _ in range(2):
            for message in messages:
                transport.send(message, 1)
        transport.close()
        return []
    return [[transport.recv(0).obj for _ in range(2 * len(messages))], messages]


@pytest.mark.parametrize("plane", PLANES)
def test_every_frame_layout_crosses_intact_and_in_order(plane):
    got, sent = run_distributed(_frame_layouts, 2, plane, start_method="fork")[1]
    assert [name for name, _ in got] == [name for name, _ in sent] * 2
    for (name, received), (_, expected) in zip(got, sent * 2):
        if isinstance(expected, tuple):
            assert received[0] == expected[0], name
            received, expected = received[1], expected[1]
        if isinstance(expected, torch.Tensor):
            torch.testing.assert_close(received, expected, rtol=0, atol=0, msg=name)
        else:
            assert received == expected, name


# ---- backward on the calling thread, through A -> B -> A --------------------------------------------------------

_SEEN: list[tuple[str, bool]] = []


class _RecordBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        _SEEN.append((threading.current_thread().name, torch.autograd.is_multithreading_enabled()))
        return grad


class _Probe(nn.Linear):
    """A linear layer whose backward records the thread it ran on and whether multithreaded backward was on."""

    def forward(self, x):
        return _RecordBackward.apply(super().forward(x))


class _NestedProbe(Branchy):
    def __init__(self, dim: int = 12) -> None:
        super().__init__(dim)
        self.block = nn.Sequential(_Probe(dim, dim), nn.GELU())
        self.out = _Probe(dim, 1)


# block on stage 1 calls its child block.0 back on stage 0: backward goes 0 -> 1 -> 0 inside one backward.
_NESTED = {"block": 1, "block.0": 0, "gate": 1}


def _nested_backward(rank: int, world_size: int, plane: str) -> dict:
    _SEEN.clear()  # a forked child inherits the parent's list
    torch.manual_seed(0)
    model = _NestedProbe()
    engine = PipelineEngine(make_transport([0, 1], plane), 2, timeout_s=60)
    engine.install(model, expand_placement(model, _NESTED))
    with engine.session() as session:
        if engine.is_driver:
            parts = split_microbatches(Branchy.batch(seed=0), 2)
            session.drive(lambda mb, i: Branchy.loss(model, mb) / 2, parts, loss_fn=lambda l: l, backward=True)
            session.finish(None)
        else:
            session.serve()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"seen": list(_SEEN), "grads": grads}


@pytest.mark.parametrize("plane", PLANES)
def test_nested_call_in_backward_runs_on_engine_threads_with_multithreading_off(plane):
    results = run_distributed(_nested_backward, 2, plane, start_method="fork")
    torch.manual_seed(0)
    reference = _NestedProbe()
    Branchy.loss(reference, Branchy.batch(seed=0)).backward()
    expected = {n: p.grad for n, p in reference.named_parameters()}
    assert sorted(n for r in results for n in r["grads"]) == sorted(expected)
    for result in results:
        for name, grad in result["grads"].items():
            torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-6, msg=name)
    driver_seen = results[0]["seen"]
    # block.0 (stage 0) runs twice per microbatch where the branch is taken, out (stage 0) once: both recorded.
    assert len(driver_seen) >= 2 * 2, driver_seen
    for name, multithreaded in driver_seen:
        assert name.startswith("smp-") and not multithreaded, driver_seen
    # block.0's backward was served (smp-recv-1: a request from stage 1 in stage 1's backward), not only driven.
    assert any(name == "smp-recv-1" for name, _ in driver_seen), driver_seen


# ---- CUDA (skipped without a GPU; scripts/gpu_check.py runs the same checks with timings) ----------------------

_needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _cuda_two_stage(rank: int, world_size: int) -> dict:
    _SEEN.clear()
    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    model = _NestedProbe().to(device)
    transport = Transport(dist.new_group([0, 1]), device)  # gloo plane, staged through pinned memory
    engine = PipelineEngine(transport, 2, timeout_s=120)
    engine.install(model, expand_placement(model, _NESTED))
    with engine.session() as session:
        if engine.is_driver:
            x, y = Branchy.batch(seed=0)
            parts = split_microbatches((x.to(device), y.to(device)), 2)
            session.drive(lambda mb, i: Branchy.loss(model, mb) / 2, parts, loss_fn=lambda l: l, backward=True)
            session.finish(None)
        else:
            session.serve()
    return {
        "grads": {n: p.grad.cpu() for n, p in model.named_parameters() if p.grad is not None},
        "seen": list(_SEEN),
    }


@pytest.mark.cuda
@_needs_gpu
def test_cuda_two_stages_on_one_gpu_over_the_gloo_plane_match_one_process():
    results = run_distributed(_cuda_two_stage, 2)
    torch.manual_seed(0)
    reference = _NestedProbe()
    Branchy.loss(reference, Branchy.batch(seed=0)).backward()
    for result in results:
        for name, grad in result["grads"].items():
            torch.testing.assert_close(grad, reference.get_parameter(name).grad, rtol=1e-4, atol=1e-5, msg=name)
        assert all(name.startswith("smp-") and not multi for name, multi in result["seen"]), result["seen"]


@pytest.mark.cuda
@_needs_gpu
def test_cuda_nccl_plane_packs_and_sequences_through_loop_back():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    result = gpu_check.nccl_loop_back(sizes_mb=[1])
    assert result["status"] == "pass", result
