"""Tied weights replicated across pipeline stages: a replicated parameter missing on one stage fails on every rank
at once."""

from __future__ import annotations

from datetime import timedelta

from torch import nn

from lightning_mp.partition import PartitionPlan


def _tie_missing_on_stage_1(rank: int, world_size: int) -> str:
    """Stage 1's model lacks the replicated parameter (a plan for another model): every rank raises, none waits."""
    from lightning_mp.strategy._tied import build_tied_weights
    from lightning_mp.topology import Topology

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    if rank == 1:
        model[0]._parameters["weight"] = None  # what the engine leaves of another stage's module
    stages = PartitionPlan(2, {"": 0, "0": 0, "1": 1}, (0.5, 0.5), replicated={"0.weight": (0, 1)})
    topology = Topology(world_size=2, rank=rank, pipeline_parallel_degree=2)
    try:
        build_tied_weights(model, stages, {}, topology, timeout=timedelta(seconds=20))
    except ValueError as err:
        return str(err)
    return "no error"


def test_a_replicated_parameter_missing_on_one_stage_fails_on_every_rank_at_once():
    from tests._dist import run_distributed

    messages = run_distributed(_tie_missing_on_stage_1, 2, start_method="fork")
    assert all("'0.weight' (on stages [0, 1]), but stage 1 holds no such parameter" in m for m in messages), messages
