"""A data-parallel gradient all-reduce whose peer died fails naming the peer's global rank (gloo names only an
address), in both places it runs: after backward (``all_reduce_gradients``) and bucketed during backward
(``GradientReducer.finish``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

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
