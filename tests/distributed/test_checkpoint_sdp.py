"""Checkpoints of modules sharded over data-parallel ranks with FSDP2 (``fully_shard``: ``DTensor`` parameters and
Adam moments), without a Trainer on gloo processes, through the strategy's checkpoint functions: a DCP folder saved
at sdp=2 (and HSDP, 2 x 2) resumes on one process and consolidates to the saved parameters, one saved on one
process resumes at sdp=2, a full file written from sdp=2 is one device's file and resumes at sdp=2, whole weights
(``load_weights``) land in the shards, and tp shards sharded again over dp (tp=2 x sdp=2) are read from and saved
as pieces of their full tensors. Every resumed run's losses and final parameters are those of the uninterrupted
one-process run (AdamW, float32)."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.fabric.plugins import TorchCheckpointIO
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor import Shard as ShardPlacement

from lightning_mp.strategy._checkpoint import (
    full_tensors,
    load_checkpoint,
    load_full_checkpoint,
    load_weights,
    model_state_dict,
    optimizer_state_dict,
    save_checkpoint,
    save_full_checkpoint,
)
from lightning_mp.strategy._checkpoint._sharding import _as_pieces, _chunk_rows, _quiet_sharded_tensor, _Sharding
from lightning_mp.strategy._consolidate import consolidate
from lightning_mp.strategy._shards import piece_chunks
from lightning_mp.tp import shard
from tests._dist import run_distributed
from tests.distributed.test_checkpoint_pieces import SPECS, _full

STEPS, BATCH, WIDTH = 2, 8, 6


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH + 1)  # odd rows: the shards are uneven at 2 ranks
        self.out = nn.Linear(WIDTH + 1, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(torch.tanh(self.fc(self.norm(x))))


def _model(mesh_shape: tuple[int, ...] | None) -> nn.Module:
    """Two blocks and a head; with ``mesh_shape``, each block an FSDP unit and the root last (1-D: sdp, 2-D: HSDP)."""
    torch.manual_seed(0)
    model = nn.Sequential(_Block(), _Block(), nn.Linear(WIDTH, 3))
    if mesh_shape is not None:
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard")[-len(mesh_shape) :])
        for block in model[:2]:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> list[float]:
    """The given steps of the global batch, this rank's rows of it (gradients averaged over ranks by FSDP)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    losses = []
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, 3, generator=g)
        loss = (model(x.chunk(world)[rank]) - y.chunk(world)[rank]).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        part = loss.detach().clone()
        dist.all_reduce(part)
        losses.append(part.item() / world)
    return losses


def _full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in state.items()}


def _run(rank: int, world: int, path: str, mesh_shape, action: str) -> dict:
    """``save``: steps 0-1, then a DCP folder; ``load``: the folder, then steps 2-3; ``whole``: steps 0-3."""
    model = _model(mesh_shape)
    optimizer = _optimizer(model)
    if action == "load":
        load_checkpoint(Path(path), model, [optimizer], strict=True, weights_only=False)
    steps = {"save": range(STEPS), "load": range(STEPS, 2 * STEPS), "whole": range(2 * STEPS)}[action]
    losses = _train(model, optimizer, steps)
    if action == "save":
        optimizer_states = [optimizer_state_dict(model, optimizer)]
        checkpoint = {"state_dict": model_state_dict(model), "optimizer_states": optimizer_states}
        save_checkpoint(checkpoint, Path(path), rank == 0)
    return {"losses": losses, "state": _full_state(model)}


def _check(result: dict, reference: dict, what: str) -> None:
    torch.testing.assert_close(
        result["losses"], reference["losses"][STEPS:], rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}"
    )
    assert result["state"].keys() == reference["state"].keys()
    for key, value in reference["state"].items():
        torch.testing.assert_close(
            result["state"][key], value, rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{what} {k}: {m}"
        )


@pytest.fixture(scope="module")
def reference() -> dict:
    return run_distributed(_run, 1, "", None, "whole", start_method="fork")[0]


@pytest.mark.parametrize(
    ("saved", "loaded"),
    [((2,), None), (None, (2,)), ((2, 2), (2,))],
    ids=["sdp2->1", "1->sdp2", "hsdp2x2->sdp2"],
)
def test_folder_moves_between_sharded_and_unsharded(reference, saved, loaded):
    """... and ``consolidate`` writes the saved run's whole parameters from the folder, as from any other."""
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "ckpt")
        for mesh_shape, action in ((saved, "save"), (loaded, "load")):
            world = 1 if mesh_shape is None else math.prod(mesh_shape)
            results = run_distributed(_run, world, path, mesh_shape, action, start_method="fork")
            if action == "save":
                saved_state = results[0]["state"]
        whole = torch.load(consolidate(path, Path(tmp) / "model.pt"), weights_only=True)
    assert whole.keys() == saved_state.keys()
    for key, value in saved_state.items():
        assert torch.equal(whole[key], value), key
    for rank, result in enumerate(results):
        _check(result, reference, f"{saved}->{loaded} r{rank}")


def _save_file(rank: int, world: int, path: str) -> bool:
    """Steps 0-1 at sdp=2, then one full file: every rank gathers its shards, rank 0 writes."""
    model = _model((world,))
    optimizer = _optimizer(model)
    _train(model, optimizer, range(STEPS))
    checkpoint = {
        "state_dict": full_tensors(model_state_dict(model)),
        "optimizer_states": [full_tensors(optimizer_state_dict(model, optimizer))],
    }
    alone = [dist.new_group([r]) for r in range(world)][rank]  # the pipeline group of one stage
    if rank == 0:
        order = [name for name, _ in _model(None).named_parameters()]
        save_full_checkpoint(checkpoint, Path(path), model, [optimizer], order, alone, TorchCheckpointIO())
    dist.barrier()
    return True


def _load_file(rank: int, world: int, path: str) -> dict:
    model = _model((world,))
    optimizer = _optimizer(model)
    order = [name for name, _ in _model(None).named_parameters()]
    alone = [dist.new_group([r]) for r in range(world)][rank]
    load_full_checkpoint(Path(path), model, [optimizer], order, alone, strict=True, weights_only=False)
    return {"losses": _train(model, optimizer, range(STEPS, 2 * STEPS)), "state": _full_state(model)}


def _one_device_file(rank: int, world: int, path: str) -> dict:
    model = _model(None)
    optimizer = _optimizer(model)
    _train(model, optimizer, range(STEPS))
    return {"state_dict": model.state_dict(), "optimizer": optimizer.state_dict()}


def test_full_file_from_sdp2_is_one_devices_file_and_resumes(reference):
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "last.ckpt")
        run_distributed(_save_file, 2, path, start_method="fork")
        got = torch.load(path, weights_only=False)
        expected = run_distributed(_one_device_file, 1, "", start_method="fork")[0]
        for key, value in expected["state_dict"].items():
            assert type(got["state_dict"][key]) is torch.Tensor, key
            torch.testing.assert_close(got["state_dict"][key], value, rtol=1e-5, atol=1e-6, msg=key)
        (saved_optim,) = got["optimizer_states"]
        assert saved_optim["param_groups"] == expected["optimizer"]["param_groups"]
        for index, state in expected["optimizer"]["state"].items():
            for name, value in state.items():
                torch.testing.assert_close(saved_optim["state"][index][name], value, rtol=1e-5, atol=1e-6)
        results = run_distributed(_load_file, 2, path, start_method="fork")
    for rank, result in enumerate(results):
        _check(result, reference, f"file sdp2->sdp2 r{rank}")


def _weights(rank: int, world: int, path: str) -> dict:
    model = _model((world,))
    load_weights(path, model, {}, strict=True)
    return {"state": _full_state(model), "local": {k: v.to_local().clone() for k, v in model.state_dict().items()}}


def test_load_weights_lands_in_the_shards():
    torch.manual_seed(1)
    whole = {k: torch.randn_like(v) for k, v in _model(None).state_dict().items()}
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "model.pt")
        torch.save(whole, path)
        results = run_distributed(_weights, 2, path, start_method="fork")
    for rank, result in enumerate(results):
        for key, value in whole.items():
            assert torch.equal(result["state"][key], value), key
            assert torch.equal(result["local"][key], value.chunk(2)[rank]), key  # this rank's rows only


def _tp_sdp(rank: int, world: int, whole_path: str, path: str) -> dict[str, bool]:
    """tp=2 x sdp=2 (ranks as the topology places them: tp inner): each spec's tp shard sharded over dp as FSDP2
    does, read from the whole tensors' folder (each rank its rows of its tp piece), then saved as pieces."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp_rank = mesh.get_local_rank("tp")
    state, expected = {}, {}
    for name, (spec, _) in SPECS.items():
        tp_local = shard(_full(name), spec, tp_rank, 2)
        sharding = _Sharding(spec, tp_rank, 2, mesh.get_group("tp"))
        value = distribute_tensor(torch.zeros_like(tp_local), mesh["dp"], [ShardPlacement(0)], src_data_rank=None)
        state[name] = _as_pieces({name: value}, {name: sharding})[name]
        expected[name] = (value, distribute_tensor(tp_local, mesh["dp"], [ShardPlacement(0)], src_data_rank=None))
    with _quiet_sharded_tensor():
        dcp.load({"m": state}, checkpoint_id=whole_path)
        ok = {}
        for name, (spec, _) in SPECS.items():
            got, want = (t.to_local() for t in expected[name])
            if spec.padded:  # rows past the vocabulary belong to no one and stay as they were (zero)
                want = want.clone()
                start, rows = _chunk_rows(shard(_full(name), spec, tp_rank, 2).size(0), 2, mesh.get_local_rank("dp"))
                length = sum(n for _, _, n in piece_chunks(spec, tp_rank, 2))
                want[max(0, length - start) :] = 0
            ok[name] = torch.equal(got, want)
        dcp.save({"m": state}, checkpoint_id=path)
    return ok


def test_tp_shards_sharded_over_dp_move_to_whole_and_back():
    """The four tp shard kinds (plain, fused q/k/v blocks, padded vocabulary, column split) under tp=2 x sdp=2:
    read from whole tensors and written back as pieces that one process reads whole."""
    with tempfile.TemporaryDirectory() as tmp:
        whole_path, path = str(Path(tmp) / "whole"), str(Path(tmp) / "pieces")
        dcp.save({"m": {n: _full(n) for n in SPECS}}, checkpoint_id=whole_path, no_dist=True)
        results = run_distributed(_tp_sdp, 4, whole_path, path, start_method="fork")
        assert all(all(r.values()) for r in results), results
        whole = {n: torch.zeros(shape) for n, (_, shape) in SPECS.items()}
        dcp.load({"m": whole}, checkpoint_id=path, no_dist=True)
    for name in SPECS:
        assert torch.equal(whole[name], _full(name)), name
