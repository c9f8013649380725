"""The strategy's transports: a CPU gloo control group per pipeline, and the data plane chosen for the device.

See [Note: two planes] in ``lightning_mp/comm/_planes.py``. Every rank creates every group, in one order.
"""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_mp.comm import Transport, build_pair_groups, make_data_plane
from lightning_mp.config import SMPConfig
from lightning_mp.topology import Topology

__all__ = ["build_order_transport", "build_pipeline_transport", "check_data_plane"]

_NCCL_SHARES_GPUS = (2, 30)  # NCCL before 2.30 refuses two ranks of one communicator on one GPU


def check_data_plane(config: SMPConfig, device: torch.device) -> None:
    """Raise before the first collective for a data plane the device cannot use."""
    if config.data_plane == "nccl" and config.pipeline_parallel_degree > 1 and device.type != "cuda":
        raise ValueError(
            f"data_plane='nccl' moves CUDA tensors, but this rank runs on {device}. Use data_plane='gloo' (or 'auto')"
            " on CPU."
        )


def _pipelines(topology: Topology) -> list[list[int]]:
    return [
        [topology.global_rank(dp_rank=d, pp_rank=s, tp_rank=t) for s in range(topology.pipeline_parallel_degree)]
        for d in range(topology.data_parallel_degree)
        for t in range(topology.tensor_parallel_degree)
    ]


def _shared_gpu(pipelines: list[list[int]], device: torch.device, config: SMPConfig) -> str | None:
    """Which stages of one pipeline share a GPU (a sentence), or None. A collective over the world (gloo)."""
    world = dist.new_group(backend="gloo", timeout=config.timeout)
    where = [None] * dist.get_world_size()
    dist.all_gather_object(where, (socket.gethostname(), device.index), group=world)
    for ranks in pipelines:
        seen: dict[tuple, int] = {}
        for stage, rank in enumerate(ranks):
            other = seen.setdefault(tuple(where[rank]), stage)
            if other != stage:
                host, index = where[rank]
                return f"stages {other} and {stage} (global ranks {ranks[other]}, {rank}) share cuda:{index} on {host}"
    return None


def _data_plane_kind(pipelines: list[list[int]], device: torch.device, config: SMPConfig) -> str:
    """The same answer on every rank (it depends on gathered facts only)."""
    if config.data_plane == "gloo" or device.type != "cuda" or config.pipeline_parallel_degree == 1:
        return "gloo"
    shared = _shared_gpu(pipelines, device, config)
    if shared is None or torch.cuda.nccl.version() >= _NCCL_SHARES_GPUS:
        return "nccl"
    version = ".".join(map(str, torch.cuda.nccl.version()))
    if config.data_plane == "nccl":
        raise ValueError(
            f"data_plane='nccl' cannot run here: {shared}, and NCCL {version} (before 2.30) refuses two ranks on one"
            " GPU ('Duplicate GPU detected'). Give each stage its own GPU, or use data_plane='gloo' (or 'auto')."
        )
    rank_zero_info(f"data_plane='auto' uses gloo with pinned staging: {shared} (NCCL {version} needs one GPU per rank).")
    return "gloo"


def build_pipeline_transport(topology: Topology, device: torch.device, config: SMPConfig) -> Transport:
    """This rank's pipeline transport: a gloo control group per pipeline, and the data plane (pair groups for NCCL)."""
    pipelines = _pipelines(topology)
    own = None
    for ranks in pipelines:
        group = dist.new_group(ranks, timeout=config.timeout, backend="gloo")
        if topology.rank in ranks:
            own = group
    assert own is not None
    kind = _data_plane_kind(pipelines, device, config)
    pairs = build_pair_groups(pipelines, "nccl", config.timeout) if kind == "nccl" else None
    plane = make_data_plane(kind, own, device, pairs, config.timeout.total_seconds())
    return Transport(own, device, plane)


def build_order_transport(topology: Topology, device: torch.device, config: SMPConfig) -> Transport | None:
    """With ``deterministic_order``: one gloo group per stage over every replica and TP rank (lowest rank leads).

    Its messages are small pickles (grant keys), so its data plane is gloo.
    """
    replicas_per_stage = topology.data_parallel_degree * topology.tensor_parallel_degree
    if not config.effective_deterministic_order or replicas_per_stage == 1:
        return None
    own = None
    for stage in range(topology.pipeline_parallel_degree):
        ranks = [
            topology.global_rank(dp_rank=d, pp_rank=stage, tp_rank=t)
            for d in range(topology.data_parallel_degree)
            for t in range(topology.tensor_parallel_degree)
        ]
        group = dist.new_group(sorted(ranks), timeout=config.timeout, backend="gloo")
        if topology.rank in ranks:
            own = group
    assert own is not None
    return Transport(own, device)
