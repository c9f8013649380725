"""Checkpoint pieces without a Trainer on gloo processes: tp shards as pieces of their full tensors (plain, fused
q/k/v blocks, padded vocabulary, column split) saved at one tp degree and read at another (1, 2, 4) and whole on one
process; an optimizer with an empty param group round-trips (torch's ``set_optimizer_state_dict`` raises IndexError)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from lightning_mp.strategy._checkpoint import optimizer_state_dict, set_flat_optimizer_state
from lightning_mp.strategy._checkpoint._sharding import _quiet_sharded_tensor
from lightning_mp.strategy._shards import piece_chunks, sharded_view
from lightning_mp.tp import ShardSpec, shard
from tests._dist import run_distributed

SPECS = {
    "plain": (ShardSpec(0, 8), (8, 3)),
    "fused": (ShardSpec(0, 24, parts=3), (24, 3)),
    "padded": (ShardSpec(0, 7, padded=True), (7, 3)),
    "column": (ShardSpec(1, 8), (2, 8)),
}


def _full(name: str) -> torch.Tensor:
    return torch.randn(SPECS[name][1], generator=torch.Generator().manual_seed(len(name)))


def _tp_group(world: int, tp: int):
    """Groups of ``tp`` consecutive ranks; this rank's group and rank in it."""
    mine = None
    for start in range(0, world, tp):
        group = dist.new_group(list(range(start, start + tp)))
        if start <= dist.get_rank() < start + tp:
            mine = group
    return mine, dist.get_rank() % tp


def _save(rank: int, world: int, path: str, tp: int) -> bool:
    group, tp_rank = _tp_group(world, tp)
    state = {}
    for name, (spec, _) in SPECS.items():
        local = shard(_full(name), spec, tp_rank, tp)
        state[name] = local if tp == 1 else sharded_view(local, spec, tp_rank, tp, group)
    with _quiet_sharded_tensor():
        dcp.save({"m": state}, checkpoint_id=path)
    return True


def _load(rank: int, world: int, path: str, tp: int) -> dict[str, bool]:
    group, tp_rank = _tp_group(world, tp)
    locals_ = {n: torch.zeros_like(shard(_full(n), s, tp_rank, tp)) for n, (s, _) in SPECS.items()}
    state = {n: sharded_view(locals_[n], s, tp_rank, tp, group) if tp > 1 else locals_[n] for n, (s, _) in SPECS.items()}
    with _quiet_sharded_tensor():
        dcp.load({"m": state}, checkpoint_id=path)
    ok = {}
    for name, (spec, _) in SPECS.items():
        expected = shard(_full(name), spec, tp_rank, tp)
        if spec.padded:  # rows past the vocabulary belong to no one and stay as they were (zero)
            length = sum(n for _, _, n in piece_chunks(spec, tp_rank, tp))
            expected.narrow(spec.dim, length, expected.size(spec.dim) - length).zero_()
        ok[name] = torch.equal(locals_[name], expected)
    return ok


@pytest.mark.parametrize(("saved_tp", "loaded_tp"), [(2, 1), (2, 4), (1, 2), (4, 2)])
def test_shards_move_between_tp_degrees(saved_tp, loaded_tp):
    with tempfile.TemporaryDirectory() as path:
        run_distributed(_save, max(saved_tp, 1), path, saved_tp, start_method="fork")
        results = run_distributed(_load, loaded_tp, path, loaded_tp, start_method="fork")
        assert all(all(r.values()) for r in results), results
        whole = {n: torch.zeros(shape) for n, (_, shape) in SPECS.items()}
        dcp.load({"m": whole}, checkpoint_id=path, no_dist=True)
        assert all(torch.equal(whole[n], _full(n)) for n in SPECS)


def _empty_group_round_trip(rank: int, world: int, path: str) -> bool:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    groups = [{"params": [], "weight_decay": 0.1}, {"params": list(model.parameters()), "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=0.1)
    model(torch.randn(2, 3)).sum().backward()
    optimizer.step()
    dcp.save({"o": optimizer_state_dict(model, optimizer)}, checkpoint_id=path)
    model.zero_grad(set_to_none=True)  # as on resume: torch initialises a fresh optimizer's state only then
    fresh = torch.optim.AdamW(
        [{"params": [], "weight_decay": 0.1}, {"params": list(model.parameters()), "weight_decay": 0.0}], lr=0.5
    )
    request = optimizer_state_dict(model, fresh)
    dcp.load({"o": request}, checkpoint_id=path)
    set_flat_optimizer_state(model, fresh, request)
    a, b = optimizer.state_dict(), fresh.state_dict()
    assert [g["lr"] for g in b["param_groups"]] == [0.5, 0.1], "the empty group keeps its own; the other is loaded"
    return all(torch.equal(a["state"][i][k], b["state"][i][k]) for i in a["state"] for k in a["state"][i])


def test_optimizer_with_an_empty_param_group_round_trips(tmp_path):
    assert run_distributed(_empty_group_round_trip, 1, str(Path(tmp_path) / "ckpt"), start_method="fork") == [True]
