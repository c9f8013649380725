"""Failures that must not wait for the timeout or go unnamed: a data-parallel gradient all-reduce whose peer died
fails naming the peer's global rank (gloo names only an address), in both places it runs: after backward
(``all_reduce_gradients``) and bucketed during backward (``GradientReducer.finish``); a failed order leader closes
its step without waiting for a follower that stopped receiving."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_mp.comm import Transport
from lightning_mp.pipeline import PipelineEngine
from lightning_mp.strategy._gradients import all_reduce_gradients
from lightning_mp.strategy._reducer import GradientReducer
from tests._dist import run_distributed


def _peer_dies(rank: int, world: int, bucketed: bool) -> str:
    """Rank 1 leaves after the rendezvous (its process ends); rank 0 all-reduces a gradient with it and returns the
    error it got."""
    net = nn.Linear(4, 4)
    params = list(net.parameters())
    reducer = GradientReducer(params, dist.group.WORLD, world, previous=lambda p: None) if bucketed else None
    dist.barrier()
    if rank == 1:
        return "left"
    net(torch.ones(2, 4)).sum().backward()
    try:
        if reducer is not None:
            reducer.arm(1)
            reducer.flush()
            reducer.finish()
        else:
            all_reduce_gradients(params, dist.group.WORLD, world)
    except RuntimeError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize("bucketed", [False, True], ids=["after-backward", "bucketed"])
def test_a_dead_peer_is_named(bucketed):
    error = run_distributed(_peer_dies, 2, bucketed, start_method="fork")[0]
    assert "data-parallel gradient all-reduce over global ranks [0, 1] failed on global rank 0" in error, error
    assert "global rank 1 died or stopped answering" in error, error


def _leader_fails_while_follower_is_deaf(rank: int, world: int) -> float:
    """Two one-stage replicas sharing an order; the follower takes the leader's first grant, then stops receiving
    (as a follower whose own step failed does); the leader's step fails. Returns how long the leader's failed step
    took to close (rank 0), after which the follower drains the leader's notice."""
    order = Transport(dist.new_group([0, 1]), torch.device("cpu"))
    own = [dist.new_group([r]) for r in range(world)][rank]
    if rank == 1:
        order.recv(0)  # the grant of microbatch 0
        dist.barrier()  # until the leader's step closed
        while order.recv(0).obj[0] != "error":  # drain up to its notice, sent from the notice thread
            pass
        return 0.0
    engine = PipelineEngine(Transport(own, torch.device("cpu")), 1, timeout_s=60, order_transport=order)
    model = nn.Linear(4, 1)
    engine.install(model, {"": 0})

    def step_fn(part, i):
        raise ValueError("bad batch on the leader")

    start = time.monotonic()
    with pytest.raises(Exception, match="bad batch on the leader"):
        with engine.session() as session:
            session.drive(step_fn, list(torch.randn(1, 2, 4)), loss_fn=lambda loss: loss, backward=True)
    elapsed = time.monotonic() - start
    dist.barrier()
    return elapsed


def test_a_failed_leader_does_not_wait_for_a_follower_that_stopped_receiving():
    """gloo's send waits for the receiver: the failed leader's notice must not hold it for the timeout (60 s)."""
    elapsed = run_distributed(_leader_fails_while_follower_is_deaf, 2, start_method="fork")[0]
    assert elapsed < 20, f"the failed step took {elapsed:.1f} s to close (timeout 60 s): it waited for the follower"
