"""Deterministic execution order across ranks that enter collectives together (DESIGN.md invariant).

Four ranks: 2 data-parallel replicas x 2 pipeline stages. The module on stage 1 runs an all-gather over the
stage's data-parallel group in its forward *and* its backward, carrying the microbatch index, and fails if the
two replicas are not at the same microbatch (what a TP or SyncBatchNorm collective would silently mix up or
hang on). Every received message is delayed at random, differently on each rank, so arrival order differs
between replicas; with a shared order (``order_transport``) both replicas still run the same tasks in the same
order, and losses and gradients match a one-process reference of each replica."""

from __future__ import annotations

import random
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_mp.comm import Transport
from lightning_mp.pipeline import PipelineEngine, PipelineError, split_microbatches
from tests._dist import run_distributed

MICROBATCHES = 4


class _CheckedIdentity(torch.autograd.Function):
    """Forward and backward each all-gather ``(microbatch, phase)`` over ``group`` and require one value."""

    @staticmethod
    def forward(ctx, x, microbatch, group, log):
        ctx.microbatch, ctx.group, ctx.log = microbatch, group, log
        _agree(microbatch, 1, group, log)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        _agree(ctx.microbatch, 0, ctx.group, ctx.log)
        return grad, None, None, None


def _agree(microbatch: int, phase: int, group, log: list) -> None:
    mine = torch.tensor([microbatch, phase])
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    log.append((microbatch, phase))
    if any(not torch.equal(g, mine) for g in gathered):
        raise RuntimeError(f"replicas out of order: this rank at {mine.tolist()}, group at {[g.tolist() for g in gathered]}")


class Synced(nn.Module):
    """A layer whose collectives need every replica at the same microbatch (like a TP or SyncBatchNorm layer)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        self.group = None
        self.log: list[tuple[int, int]] = []

    def forward(self, x: torch.Tensor, microbatch: int) -> torch.Tensor:
        x = torch.tanh(self.linear(x))
        if self.group is not None:
            x = _CheckedIdentity.apply(x, microbatch, self.group, self.log)
        return x


class TwoStage(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.first = nn.Linear(dim, dim)
        self.synced = Synced(dim)
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor, microbatch: int) -> torch.Tensor:
        return self.head(self.synced(torch.relu(self.first(x)), microbatch)).pow(2).mean()


PLACEMENT = {"": 0, "first": 0, "synced": 1, "synced.linear": 1, "head": 0}


def _batch(replica: int, step: int) -> torch.Tensor:
    return torch.randn(16, 8, generator=torch.Generator().manual_seed(100 * replica + step))


def _reference(replica: int, steps: int) -> list[dict]:
    torch.manual_seed(0)
    model = TwoStage()
    results = []
    for step in range(steps):
        model.zero_grad()
        parts = split_microbatches(_batch(replica, step), MICROBATCHES)
        loss = sum(model(part, i) / MICROBATCHES for i, part in enumerate(parts))
        loss.backward()
        results.append({"loss": loss.item(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()}})
    return results


def _delayed_recv(recv, rng: random.Random):
    def recv_with_delay(self, src):
        message = recv(self, src)
        time.sleep(rng.uniform(0.0, 0.02))
        return message

    return recv_with_delay


def _run(rank: int, world_size: int, schedule: str, ordered: bool, steps: int, diverge: bool = False) -> dict:
    replica, stage = divmod(rank, 2)
    pipe_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    stage_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    Transport.recv = _delayed_recv(Transport.recv, random.Random(rank))
    torch.manual_seed(0)
    model = TwoStage()
    model.synced.group = None if diverge else stage_groups[1]  # a diverged collective would hang in C++
    engine = PipelineEngine(
        Transport(pipe_groups[replica], torch.device("cpu")),
        2,
        schedule=schedule,
        active_microbatches=MICROBATCHES,
        timeout_s=10,
        order_transport=Transport(stage_groups[stage], torch.device("cpu")) if ordered else None,
    )
    stage_of = {fqn: PLACEMENT[fqn] for fqn, _ in model.named_modules()}
    engine.install(model, stage_of)
    results = []
    for step in range(steps):
        model.zero_grad()
        with engine.session() as session:
            if engine.is_driver:
                parts = split_microbatches(_batch(replica, step), MICROBATCHES)

                def step_fn(part, i):
                    out = model(part, i)
                    if diverge and replica == 1 and i == 0:
                        out = out + model.synced(part, i).sum() * 0  # one more call than replica 0 makes
                    return out

                outputs = session.drive(step_fn, parts, loss_fn=lambda l: l / MICROBATCHES, backward=True)
                loss = torch.stack([o.detach() for o in outputs]).mean()
                session.finish(loss)
            else:
                loss = session.serve()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append({"loss": float(loss), "grads": grads})
    return {"steps": results, "log": model.synced.log}


@pytest.mark.parametrize("schedule", ["interleaved", "simple"])
def test_replicas_run_stage_tasks_in_one_order_despite_random_delays(schedule: str) -> None:
    steps = 2
    results = run_distributed(_run, 4, schedule, True, steps)
    # The collective in both directions saw every replica at the same microbatch (else the step would fail),
    # and the stage-1 ranks ran their forward/backward calls in one order, including that order.
    assert results[1]["log"] == results[3]["log"]
    assert len(results[1]["log"]) == steps * MICROBATCHES * 2
    for replica in (0, 1):
        reference = _reference(replica, steps)
        driver, server = results[2 * replica], results[2 * replica + 1]
        for step in range(steps):
            assert driver["steps"][step]["loss"] == pytest.approx(reference[step]["loss"], rel=1e-5)
            grads = {**driver["steps"][step]["grads"], **server["steps"][step]["grads"]}
            assert set(grads) == set(reference[step]["grads"])
            for name, grad in grads.items():
                torch.testing.assert_close(grad, reference[step]["grads"][name], rtol=1e-5, atol=1e-6)


def _expect_failure(rank: int, world_size: int, *args) -> str:
    try:
        _run(rank, world_size, *args)
    except PipelineError as err:
        return str(err)
    except RuntimeError as err:  # a collective torn down under a failing rank
        return f"RuntimeError: {err}"
    return ""


def test_diverging_replicas_raise_instead_of_hanging() -> None:
    """Replica 1 makes one call more than replica 0: the ranks cannot share an order, and say so (every rank
    returns an error instead of waiting; no wall-clock bound here, the shared CI cores make one meaningless)."""
    messages = run_distributed(_expect_failure, 4, "interleaved", True, 1, True)
    assert any("order leader" in m for m in messages), messages
    assert all(messages[r] for r in (2, 3)), messages


def _leader_fails(rank: int, world_size: int) -> str:
    """Two one-stage replicas sharing an order; the leader's step raises at microbatch 1."""
    own = [dist.new_group([r]) for r in range(world_size)][rank]
    engine = PipelineEngine(
        Transport(own, torch.device("cpu")), 1, timeout_s=10, order_transport=Transport(dist.new_group([0, 1]), torch.device("cpu"))
    )
    model = nn.Linear(4, 1)
    engine.install(model, {"": 0})

    def step_fn(part, i):
        if rank == 0 and i == 1:
            raise ValueError("bad batch on the leader")
        return model(part).sum()

    try:
        with engine.session() as session:
            session.drive(step_fn, list(torch.randn(3, 2, 4)), loss_fn=lambda l: l, backward=True)
    except Exception as err:  # noqa: BLE001 - the test inspects the message
        return f"{type(err).__name__}: {err}"
    return ""


def test_a_failing_leader_is_reported_as_a_failure_not_as_diverged_calls() -> None:
    messages = run_distributed(_leader_fails, 2)
    assert "bad batch on the leader" in messages[0], messages
    assert "order leader" in messages[1] and "failed" in messages[1], messages
    assert "must make the same module calls" not in messages[1], messages
