"""The run's process groups over gloo processes: the device mesh's groups use the strategy's timeout, and the groups
``build_process_groups`` makes are the planned ones, SMP's named groups mapped onto them."""

from __future__ import annotations

from datetime import timedelta

import torch

from lightning_mp.topology import Topology


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


def _built_groups(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from lightning_mp.topology import GroupOptions, build_process_groups, plan_process_groups
    from lightning_mp.tp import dp_rank, dp_size, rdp_rank, rdp_size

    topology = Topology(world_size, rank, pipeline_parallel_degree=1, tensor_parallel_degree=2)
    options = GroupOptions(host=True, order=True, reducer=True)
    groups = build_process_groups(topology, "cpu", timedelta(seconds=30), options)
    built = {name: groups.mesh.get_group(name) for name in ("dp", "pp", "tp")}
    built |= {name: getattr(groups, name) for name in ("dp_tp", "pipeline", "host", "order", "reducer")}
    planned = {spec.name.value: list(spec.ranks) for spec in plan_process_groups(topology, options) if rank in spec.ranks}
    smp = groups.smp_groups()
    return {
        "built": {name: dist.get_process_group_ranks(group) for name, group in built.items()},
        "planned": planned,
        "smp": (dp_rank(smp), dp_size(smp), rdp_rank(smp), rdp_size(smp)),
        "dp_rank": topology.dp_rank,
    }


def test_built_groups_are_the_planned_ones_and_smp_names_map_onto_them():
    """At (dp, pp, tp) = (2, 1, 2): each group this rank holds has the planned ranks; SMP's DP is ``dp_tp`` (every
    rank of the stage) and SMP's RDP the ``dp`` axis, so ``rdp_rank`` is the strategy's ``dp_rank``."""
    from tests._dist import run_distributed

    results = run_distributed(_built_groups, 4, start_method="fork")
    for rank, result in enumerate(results):
        assert result["built"].keys() == result["planned"].keys()
        for name, ranks in result["planned"].items():
            assert result["built"][name] == sorted(ranks), (rank, name)
        assert result["smp"] == (rank, 4, result["dp_rank"], 2)
