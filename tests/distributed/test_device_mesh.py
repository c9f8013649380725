"""The device mesh's groups use the strategy's timeout."""

from __future__ import annotations

import torch

from lightning_mp import Topology


def _mesh_group_waits_for_timeout(rank: int, world_size: int, flag: str) -> str | bool:
    import os
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from lightning_mp.topology import MeshAxis, build_device_mesh

    mesh = build_device_mesh(Topology(world_size=2, rank=rank), "cpu", timedelta(seconds=2))
    group = mesh.get_group(MeshAxis.DP.value)
    if rank == 1:  # never joins; stays alive until rank 0 gave up (or 30 s): was rank 0's error a timeout?
        deadline = time.monotonic() + 30
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.1)
        return os.path.exists(flag)
    try:
        dist.all_reduce(torch.ones(1), group=group)
        return "no error"
    except RuntimeError as err:
        return str(err)
    finally:
        open(flag, "w").close()


def test_device_mesh_groups_use_the_strategy_timeout(tmp_path):
    """With torch's default (30 min) rank 0 would fail only when rank 1 exits; with the mesh's 2 s it fails first."""
    from tests._dist import run_distributed

    error, peer_was_alive = run_distributed(_mesh_group_waits_for_timeout, 2, str(tmp_path / "flag"), start_method="fork")
    assert peer_was_alive is True, "rank 0 gave up only after its peer left: not the mesh group's timeout"
    assert "timed out" in error.lower() or "timeout" in error.lower(), error
