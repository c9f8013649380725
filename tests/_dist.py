"""Run a function on N gloo processes (file rendezvous, no TCP port) and collect each rank's result."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world_size: int, init_file: str, out_dir: str, fn: Callable, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
    )
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        for transport in _TRANSPORTS:  # stop the pair planes' communication threads before their groups go
            transport.close()
        _TRANSPORTS.clear()
        dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, start_method: str | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return the results by rank.

    ``fn`` must be a module-level function. An exception on any rank fails the call. ``start_method="fork"`` (the
    default without CUDA; with CUDA ``"spawn"``, as a CUDA runtime initialised in this process cannot be forked) starts
    in well under a second; ``"spawn"`` makes each child import torch, and through ``lightning_mp``
    Lightning, torchmetrics and Hugging Face ``transformers`` (torchmetrics' BERTScore imports it), again: seconds
    per child on the 2-core CI machine.
    """
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        worker_args = (world_size, init_file, tmp, fn, args)
        start_method = start_method or ("spawn" if torch.cuda.is_available() else "fork")
        mp.start_processes(_worker, args=worker_args, nprocs=world_size, join=True, start_method=start_method)
        return [torch.load(os.path.join(tmp, f"{r}.pt"), weights_only=False) for r in range(world_size)]


_TRANSPORTS: list = []  # made by ``make_transport`` in this process

PLANES = ("gloo", "strict_mock")
"""Data planes the CPU engine tests run over: gloo, and the strict mock of NCCL's rules (see comm/_planes.py and comm/_strict_mock.py)."""


def make_transport(ranks: list[int], plane: str = "gloo", timeout_s: float = 60.0):
    """A CPU transport over ``ranks`` (every rank of the world calls this, in the same order) on ``plane``."""
    from lightning_mp.comm import Transport, make_data_plane
    from lightning_mp.topology import build_pair_groups

    group = dist.new_group(ranks)
    if plane == "gloo":
        return Transport(group, torch.device("cpu"))
    pairs = build_pair_groups([ranks], "gloo")
    data_plane = make_data_plane(plane, group, torch.device("cpu"), pairs, timeout_s) if group is not None else None
    transport = Transport(group, torch.device("cpu"), data_plane)
    _TRANSPORTS.append(transport)
    return transport


def assert_states_match(
    states: Iterable[Mapping[str, torch.Tensor]],
    expected: Mapping[str, torch.Tensor],
    *,
    exact: bool = False,
    rtol: float = 1e-5,
    atol: float = 1e-6,
) -> None:
    """Every parameter and buffer after training equals the one-process run's.

    ``states``: each rank's state dict (a pipeline stage holds its own entries; entries held by several ranks,
    replicas or tp ranks with full tensors, must all agree). Together they must name exactly ``expected``'s
    entries; ``exact`` compares bitwise, otherwise with ``rtol`` / ``atol``.
    """
    held: set[str] = set()
    for rank, state in enumerate(states):
        held.update(state)
        for key, value in state.items():
            assert key in expected, f"rank {rank} holds {key!r}, which the one-process run does not have"
            if exact:
                assert torch.equal(value, expected[key]), f"rank {rank}: {key} differs bitwise"
            else:
                torch.testing.assert_close(
                    value, expected[key], rtol=rtol, atol=atol, msg=lambda m, k=key, r=rank: f"rank {r}: {k}: {m}"
                )
    assert held == set(expected), f"held by no rank: {sorted(set(expected) - held)[:5]}"
