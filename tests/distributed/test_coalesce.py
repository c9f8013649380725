"""Coalesced one-way calls ([Note: coalesced one-way calls] in pipeline/_core.py): the driver holds its one-way calls
and sends them with its next message to that stage, as one transport message.

Every test trains on 2 or 3 gloo processes and compares losses, first-step gradients and updated parameters with one
process; the transport messages are counted where they leave (a wrapper around ``Transport.send``, per message: the
destination and how many messages it carries) and with ``transport_messages(engine.messages_sent)``.
"""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mp.pipeline import PipelineEngine, split_microbatches, transport_messages
from tests._dist import make_transport, run_distributed
from tests.distributed.test_remote_handles import DIM, LR, Block, _assert_matches, _batch, _reference
from tests.models import expand_placement

MICROBATCHES = 4


class Loop(nn.Module):
    """Blocks in an ``nn.ModuleList`` called in a Python loop (Hugging Face style), a local layer and a head."""

    def __init__(self, blocks: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList([Block() for _ in range(blocks)])
        self.local = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, 1)


class Outer(nn.Module):
    """Lives on stage 1 and calls ``inner``, which lives on stage 0: a nested call."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)
        self.inner = Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(torch.tanh(self.fc(x)))


class Nesting(Loop):
    def __init__(self) -> None:
        super().__init__()
        self.outer = Outer()


class Boom(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("boom in a coalesced call")


class Failing(Loop):
    def __init__(self) -> None:
        super().__init__()
        self.boom = Boom()


def _loop_step(model: Loop, batch, log) -> torch.Tensor:
    x, y = batch
    h = model.inp(x)
    for block in model.blocks:
        h = block(h)
    return F.mse_loss(model.head(h).squeeze(-1), y)  # recorded on the head's handle: computed on its stage


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(DIM, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))


def _mlp_step(model, batch, log) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x).squeeze(-1), y)


WIDE = 24


def _wide() -> nn.Module:
    return nn.Sequential(nn.Linear(DIM, 16), nn.Tanh(), nn.Linear(16, WIDE))


def _wide_batch(seed: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, DIM, generator=g), torch.randint(0, WIDE, (n,), generator=g)


def _metadata_step(model, batch, log) -> torch.Tensor:
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y)  # ``size(-1)``: a GET of metadata


def _local_after_step(model: Loop, batch, log) -> torch.Tensor:
    x, y = batch
    a = model.blocks[0](model.inp(x))  # remote, held
    g = model.local(x)  # local with parameters: the held call goes first
    b = model.blocks[1](a)
    return F.mse_loss(model.head(b).squeeze(-1), y) + 0.01 * g.pow(2).mean()  # fetches the head's output


def _three_stage_step(model: Loop, batch, log) -> torch.Tensor:
    x, y = batch
    h = model.inp(x)
    h = model.blocks[0](h)  # stage 1
    h = model.blocks[1](h)  # stage 2: a reference to stage 1's output
    h = model.blocks[2](h)  # stage 1 again
    h = model.blocks[3](h)  # stage 2 again
    return F.mse_loss(model.head(h).squeeze(-1), y)


def _nested_step(model: Nesting, batch, log) -> torch.Tensor:
    x, y = batch
    a = model.blocks[0](model.inp(x))  # one-way to stage 1, held
    b = model.outer(a)  # calls stage 0 from stage 1: waits for its output, and takes the held call along
    return F.mse_loss(model.head(model.blocks[1](b)).squeeze(-1), y)


def _failing_step(model: Failing, batch, log) -> torch.Tensor:
    x, y = batch
    h = model.inp(x)
    h = model.blocks[0](h)
    if log == 0:  # the first step (``_run`` passes the step's index)
        model.boom(h)  # one-way, raises on stage 1, its output never touched
    h = model.blocks[1](h)
    return F.mse_loss(model.head(h).squeeze(-1), y)


def _wire_log(transport, log: list) -> None:
    """Record every transport message this rank sends: (destination, how many messages it carries)."""
    send = transport.send

    def logged(message, dst):
        loaded = pickle.loads(message.payload)
        log.append((dst, len(loaded[1]) if loaded[0] == "bundle" else 1))
        return send(message, dst)

    transport.send = logged


def _run(rank: int, world: int, step, make_model, placement: dict, schedule: str = "interleaved",
         active: int = 2, batch_fn=_batch, steps: int = 2, watch: str | None = None) -> dict:
    torch.manual_seed(0)
    model = make_model()
    transport = make_transport(list(range(world)))
    wire: list = []
    _wire_log(transport, wire)
    engine = PipelineEngine(transport, world, schedule=schedule, active_microbatches=active, timeout_s=60)
    engine.install(model, expand_placement(model, placement))
    held_at_local: list = []
    if watch is not None and rank == 0:
        def before_local(module, args):
            counted = sum(n for kind, n in engine.messages_sent.items() if kind not in ("bundle", "bundled"))
            held_at_local.append(counted - sum(n for _, n in wire))  # messages counted but not yet on the wire

        model.get_submodule(watch).register_forward_pre_hook(before_local)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads, kinds, wires, outcome = [], {}, [], [], []
    for index in range(steps):
        optimizer.zero_grad()
        before, first = dict(engine.messages_sent), len(wire)
        try:
            with engine.session() as session:
                if engine.is_driver:
                    parts = split_microbatches(batch_fn(index), MICROBATCHES)
                    outputs = session.drive(lambda mb, i: step(model, mb, index), parts,
                                            loss_fn=lambda l: l / MICROBATCHES, backward=True)
                    loss = sum(o.detach() / MICROBATCHES for o in outputs)
                    session.finish(loss)
                else:
                    loss = session.serve()
        except Exception as err:  # noqa: BLE001 - the outcome is the result
            outcome.append(f"{type(err).__name__}: {err}")
            continue
        outcome.append("ok")
        kinds.append({k: v - before.get(k, 0) for k, v in engine.messages_sent.items() if v - before.get(k, 0)})
        wires.append(wire[first:])
        if index == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
        losses.append(float(loss))
    return {
        "losses": losses, "grads": grads, "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "kinds": kinds, "wires": wires, "outcome": outcome, "held_at_local": held_at_local,
    }


def _per_step(result: dict) -> list[int]:
    return [len(wire) for wire in result["wires"]]


def test_a_sequential_cut_in_two_sends_three_messages_per_microbatch():
    """The one-way call goes at the forward's end (nothing follows it in the forward), then the loss's exchange."""
    results = run_distributed(_run, 2, _mlp_step, _mlp, {"3": 1, "4": 1})
    _assert_matches(results, _reference(_mlp_step, _mlp, MICROBATCHES))
    driver, owner = results
    assert _per_step(driver) == [2 * MICROBATCHES + 2] * 2, driver["wires"]  # call, getbwd; "end", "close"
    assert _per_step(owner) == [MICROBATCHES + 1] * 2, owner["wires"]  # the reply; "close"
    for kinds in driver["kinds"]:
        assert transport_messages(kinds) == 2 * MICROBATCHES + 2 and "bundle" not in kinds, kinds


@pytest.mark.parametrize("schedule", ["interleaved", "simple", "zero_bubble"])
def test_a_loop_over_remote_blocks_sends_its_calls_as_one_message(schedule):
    """4 blocks and the head on stage 1 in a loop: per microbatch one message with the 5 calls, the loss's exchange
    and its reply (was 5 calls, the exchange and the reply: 7)."""
    placement = {"blocks": 1, "head": 1}
    results = run_distributed(_run, 2, _loop_step, Loop, placement, schedule)
    _assert_matches(results, _reference(_loop_step, Loop, MICROBATCHES))
    driver, owner = results
    for kinds, wire in zip(driver["kinds"], driver["wires"]):
        assert kinds == {"call": 5 * MICROBATCHES, "getbwd": MICROBATCHES, "end": 1, "close": 1,
                         "bundle": MICROBATCHES, "bundled": 5 * MICROBATCHES}, kinds
        assert sorted(n for _, n in wire) == [1] * (MICROBATCHES + 2) + [5] * MICROBATCHES, wire
        assert transport_messages(kinds) == len(wire) == 2 * MICROBATCHES + 2
    assert _per_step(owner) == [MICROBATCHES + 1] * 2, owner["wires"]


def test_a_metadata_fetch_takes_the_calls_before_it_along():
    """``logits.size(-1)`` in the loss: the call and the GET of the logits' shape go as one message."""
    results = run_distributed(_run, 2, _metadata_step, _wide, {"2": 1}, "interleaved", 2, _wide_batch)
    _assert_matches(results, _reference(_metadata_step, _wide, MICROBATCHES, _wide_batch))
    driver, owner = results
    for kinds, wire in zip(driver["kinds"], driver["wires"]):
        assert kinds == {"call": MICROBATCHES, "get": MICROBATCHES, "getbwd": MICROBATCHES, "end": 1, "close": 1,
                         "bundle": MICROBATCHES, "bundled": 2 * MICROBATCHES}, kinds
        assert transport_messages(kinds) == len(wire) == 2 * MICROBATCHES + 2, wire
    assert _per_step(owner) == [2 * MICROBATCHES + 1] * 2, owner["wires"]  # the shape, the loss's exchange


def test_a_held_call_goes_before_a_local_module_with_parameters_computes():
    results = run_distributed(_run, 2, _local_after_step, Loop, {"blocks": 1, "head": 1}, "interleaved", 1, _batch,
                              2, "local")
    _assert_matches(results, _reference(_local_after_step, Loop, MICROBATCHES))
    assert results[0]["held_at_local"] == [0] * 2 * MICROBATCHES, "nothing held when `local` starts"


def test_calls_to_two_stages_keep_their_order():
    """Blocks alternate between stages 1 and 2, each taking the previous one's output (fetched by the driver, as a
    handle goes to its owner only): a call held for one stage goes before one to the other is held, or with the fetch
    of its output."""
    placement = {"blocks.0": 1, "blocks.1": 2, "blocks.2": 1, "blocks.3": 2, "head": 2}
    for schedule in ("interleaved", "simple"):
        results = run_distributed(_run, 3, _three_stage_step, Loop, placement, schedule)
        _assert_matches(results, _reference(_three_stage_step, Loop, MICROBATCHES))
        for kinds, wire in zip(results[0]["kinds"], results[0]["wires"]):
            assert kinds == {"call": 5 * MICROBATCHES, "get": 3 * MICROBATCHES, "gbwd": 3 * MICROBATCHES,
                             "getbwd": MICROBATCHES, "end": 2, "close": 2, "bundle": 4 * MICROBATCHES,
                             "bundled": 8 * MICROBATCHES}, kinds
            # per microbatch: blocks.0 + the fetch of its output (to 1), blocks.1 + fetch (2), blocks.2 + fetch (1),
            # blocks.3 + head at the forward's end (2); then the loss's exchange (2) and 3 fetch backwards
            assert sorted(wire) == sorted([(1, 2)] * 8 + [(2, 2)] * 8 + [(1, 1)] * 10 + [(2, 1)] * 10), wire


def test_a_held_call_goes_with_a_call_that_calls_back():
    """stage 0 -> 1 (outer) -> 0 (inner): the one-way call held before ``outer`` goes with its request and runs first
    on stage 1 (its output is ``outer``'s input), and ``inner`` is served on stage 0 meanwhile."""
    placement = {"blocks": 1, "head": 1, "outer": 1, "outer.inner": 0}
    results = run_distributed(_run, 2, _nested_step, Nesting, placement)
    _assert_matches(results, _reference(_nested_step, Nesting, MICROBATCHES))
    for kinds, wire in zip(results[0]["kinds"], results[0]["wires"]):
        assert kinds["bundle"] == 2 * MICROBATCHES and kinds["fwd"] == MICROBATCHES, kinds  # call + fwd; 2 calls
        assert transport_messages(kinds) == len(wire), (kinds, wire)


def test_an_error_in_a_coalesced_call_fails_the_step_and_the_next_one_runs():
    results = run_distributed(_run, 2, _failing_step, Failing, {"blocks": 1, "head": 1, "boom": 1})
    for result in results:
        assert result["outcome"][0].startswith("PipelineError"), result["outcome"]
        assert "boom in a coalesced call" in result["outcome"][0], result["outcome"]
        assert result["outcome"][1] == "ok", result["outcome"]


def _reused_buffer_step(model: Loop, batch, log) -> torch.Tensor:
    """A local buffer reused across calls and changed in place after each (as a loop filling one input buffer): a
    held call must send what the buffer held at the call (found by review: the bytes were read at the flush)."""
    x, y = batch
    h = model.inp(x)
    buffer = torch.zeros_like(x)
    outs = []
    for i in range(2):
        buffer.copy_(h.detach() * (i + 1))
        with torch.no_grad():
            outs.append(model.blocks[i](buffer))  # held; the next copy_ changes ``buffer`` before it goes
    loss = F.mse_loss(h.sum(-1), y)
    for out in outs:
        loss = loss + F.mse_loss(model.head(out).squeeze(-1), y)
    return loss


def test_a_held_call_sends_its_arguments_as_they_were_at_the_call():
    from tests.distributed.test_remote_handles import _pipelined

    results = run_distributed(_pipelined, 2, _reused_buffer_step, Loop, {"blocks": 1, "head": 1}, MICROBATCHES, 2)
    _assert_matches(results, _reference(_reused_buffer_step, Loop, MICROBATCHES))


def _unreadable_part(rank: int, world: int) -> dict:
    import time

    from lightning_mp.comm import _wire

    torch.manual_seed(0)
    model = Loop()
    engine = PipelineEngine(make_transport([0, 1]), world, active_microbatches=1, timeout_s=20)
    engine.install(model, expand_placement(model, {"blocks": 1, "head": 1}))
    if rank == 1:  # every part of a bundle fails to unpack here (a plain message is unpacked by the transport)
        def unreadable(*args, **kwargs):
            raise RuntimeError("simulated: out of memory unpacking a part")

        _wire._unpack = unreadable  # Bundle.messages looks it up at each part; the transport imported its own
    start, outcome = time.monotonic(), None
    try:
        with engine.session() as session:
            if engine.is_driver:
                parts = split_microbatches(_batch(0), 2)
                session.drive(lambda mb, i: _loop_step(model, mb, None), parts, loss_fn=lambda loss: loss / 2,
                              backward=True)
                session.finish(None)
            else:
                session.serve()
    except Exception as err:
        outcome = f"{type(err).__name__}: {err}"
    return {"outcome": outcome, "seconds": time.monotonic() - start}


def test_a_bundle_part_that_cannot_be_read_fails_the_step_on_every_rank_at_once():
    """Found by review: the listener died on it and both ranks waited for the whole timeout, the cause lost."""
    driver, owner = run_distributed(_unreadable_part, 2)
    assert owner["outcome"] is not None and "simulated: out of memory unpacking a part" in owner["outcome"], owner
    assert driver["outcome"] is not None, driver
    for result in (driver, owner):
        assert result["seconds"] < 10, result  # the timeout is 20 s
