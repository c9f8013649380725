"""Failures that must not wait for the timeout or go unnamed: a data-parallel gradient all-reduce whose peer died
fails naming the peer's global rank (gloo names only an address), in both places it runs: after backward
(``all_reduce_gradients``) and bucketed during backward (``GradientReducer.finish``); a failed order leader closes
its step without waiting for a follower that stopped receiving; with a roll call through a ``TCPStore`` (see
``_roll_call.py``), only the rank that does not answer is named, and a store that does not answer names its host."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_mp.comm import Transport
from lightning_mp.pipeline import PipelineEngine
from lightning_mp.strategy._gradients import all_reduce_gradients
from lightning_mp.strategy._reducer import GradientReducer, naming_peers
from lightning_mp.strategy._roll_call import RankFailedError, answer_roll_calls, naming_failed_ranks
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
        time.sleep(1.0)  # the leader's engine closes meanwhile: it must wait for the notice
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
    engine.close()  # at exit, before the groups are destroyed: the notice thread is joined first
    assert not [t for t in threading.enumerate() if t.name == "smp-order-error"], "the notice outlived close()"
    return elapsed


def test_a_failed_leader_does_not_wait_for_a_follower_that_stopped_receiving():
    """gloo's send waits for the receiver: the failed leader's notice must not hold it for the timeout (60 s)."""
    elapsed = run_distributed(_leader_fails_while_follower_is_deaf, 2, start_method="fork")[0]
    assert elapsed < 20, f"the failed step took {elapsed:.1f} s to close (timeout 60 s): it waited for the follower"


def _job_store(rank: int) -> dist.TCPStore:
    """A ``TCPStore`` hosted by rank 0 (the tests' default store is a file): its port goes through the default
    store."""
    default = dist.distributed_c10d._get_default_store()
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        default.set("roll_call_port", str(store.port))
        return store
    return dist.TCPStore("127.0.0.1", int(default.get("roll_call_port")), is_master=False)


def _one_rank_does_not_answer(rank: int, world: int) -> str:
    """Ranks 0 and 1 answer roll calls, rank 2 never does (as a dead process) and leaves after the rendezvous;
    ranks 0 and 1 all-reduce with it. Returns the error each got."""
    store = _job_store(rank)
    if rank != 2:
        answer_roll_calls(store)
    dist.barrier()
    if rank == 2:
        return "left"
    error = "no RankFailedError was raised"
    try:
        with naming_peers("the data-parallel gradient all-reduce", dist.group.WORLD):
            dist.all_reduce(torch.ones(4))
    except RankFailedError as err:
        error = str(err)
    if rank == 1:
        store.set("done", b"1")
    else:
        store.wait(["done"])  # rank 0 hosts the store until rank 1's roll call is over too
    return error


def test_the_rank_that_does_not_answer_a_roll_call_is_named():
    """Before the roll call, both survivors said "one of global ranks [1, 2]" (rank 0) and "[0, 2]" (rank 1)."""
    errors = run_distributed(_one_rank_does_not_answer, 3, start_method="fork")[:2]
    for me, error in enumerate(errors):
        assert f"over global ranks [0, 1, 2] failed on global rank {me}: global rank 2 died or stopped answering" in error
        assert "no answer to a roll call through the job's store" in error, error


def _the_store_host_dies(rank: int, world: int) -> str:
    """Rank 0 hosts the store and leaves after the rendezvous (its store first); rank 1 all-reduces with it."""
    store = _job_store(rank)
    answer_roll_calls(store)
    dist.barrier()
    if rank == 0:
        del store  # the store's server stops with its last reference
        return "left"
    start = time.monotonic()
    try:
        with naming_failed_ranks("an all-reduce"):
            dist.all_reduce(torch.ones(4))
    except RankFailedError as err:
        return f"{time.monotonic() - start:.1f} {err}"
    return "no error"


def test_a_dead_store_host_is_named():
    took, error = run_distributed(_the_store_host_dies, 2, start_method="fork")[1].split(" ", 1)
    assert "an all-reduce over global ranks [0, 1] failed on global rank 1: the job's store at 127.0.0.1" in error
    assert "did not answer" in error and "its host, global rank 0's process" in error, error
    assert float(took) < 30, f"{took} s: the roll call must be bounded by its connection timeout"
