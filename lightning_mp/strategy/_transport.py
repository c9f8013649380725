"""The strategy's transports: a CPU gloo control group per pipeline, and the data plane chosen for the device.

See [Note: two planes] in ``lightning_mp/comm/_planes.py``. The groups come from ``lightning_mp.topology`` (see
[Note: process group order] there); this module decides which ones a run needs and wires them into transports.
"""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_mp.comm import Transport, make_data_plane
from lightning_mp.config import SMPConfig
from lightning_mp.topology import GroupOptions, ProcessGroups, Topology, build_pair_groups

__all__ = ["build_order_transport", "build_pipeline_transport", "check_data_plane", "group_options"]

_NCCL_SHARES_GPUS = (2, 30)  # NCCL before 2.30 refuses two ranks of one communicator on one GPU


def check_data_plane(config: SMPConfig, device: torch.device) -> None:
    """Raise before the first collective for a data plane the device cannot use."""
    if config.data_plane == "nccl" and config.pipeline_parallel_degree > 1 and device.type != "cuda":
        raise ValueError(
            f"data_plane='nccl' moves CUDA tensors, but this rank runs on {device}. Use data_plane='gloo' (or 'auto')"
            " on CPU."
        )


def group_options(topology: Topology, config: SMPConfig, device: torch.device) -> GroupOptions:
    """Which optional groups this run needs: ``host`` (the data plane may be NCCL: look which stages share a GPU),
    ``order`` (deterministic grant order) and ``reducer`` (the bucketed dp all-reduce, which runs without tensor
    parallelism; see ``StepGradients`` in ``_gradients.py``)."""
    return GroupOptions(
        host=config.data_plane != "gloo" and device.type == "cuda" and topology.pipeline_parallel_degree > 1,
        order=config.effective_deterministic_order,
        reducer=topology.tensor_parallel_degree == 1 and topology.sharded_data_parallel_degree == 1,
    )


def _shared_gpu(pipelines: list[list[int]], device: torch.device, host: dist.ProcessGroup) -> str | None:
    """Which stages of one pipeline share a GPU (a sentence), or None. A collective over the world (gloo)."""
    where = [None] * dist.get_world_size()
    dist.all_gather_object(where, (socket.gethostname(), device.index), group=host)
    for ranks in pipelines:
        seen: dict[tuple, int] = {}
        for stage, rank in enumerate(ranks):
            other = seen.setdefault(tuple(where[rank]), stage)
            if other != stage:
                host_name, index = where[rank]
                return f"stages {other} and {stage} (global ranks {ranks[other]}, {rank}) share cuda:{index} on {host_name}"
    return None


def _data_plane_kind(groups: ProcessGroups, device: torch.device, config: SMPConfig) -> str:
    """The same answer on every rank (it depends on gathered facts only)."""
    if groups.host is None:  # gloo asked for, a CPU device, or one stage (see `group_options`)
        return "gloo"
    shared = _shared_gpu(groups.topology.pipelines(), device, groups.host)
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


def build_pipeline_transport(groups: ProcessGroups, device: torch.device, config: SMPConfig) -> Transport:
    """This rank's pipeline transport: its pipeline's gloo control group, and the data plane (pair groups for NCCL,
    created here at step 2 of [Note: process group order])."""
    kind = _data_plane_kind(groups, device, config)
    pairs = build_pair_groups(groups.topology.pipelines(), "nccl", config.timeout) if kind == "nccl" else None
    plane = make_data_plane(kind, groups.pipeline, device, pairs, config.timeout.total_seconds())
    return Transport(groups.pipeline, device, plane)


def build_order_transport(groups: ProcessGroups, device: torch.device) -> Transport | None:
    """With ``deterministic_order``: over this stage's ``order`` group (every replica and TP rank; lowest rank leads).

    Its messages are small pickles (grant keys), so its data plane is gloo.
    """
    return None if groups.order is None else Transport(groups.order, device)
