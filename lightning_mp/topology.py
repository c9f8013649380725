"""The (dp, pp, tp) rank grid, its process groups, and rank helpers.

Global rank layout by default (tensor-parallel ranks are neighbours, then pipeline, then data parallel)::

    rank = dp_rank * (pp * tp) + pp_rank * tp + tp_rank

This is SMP's default ``placement_strategy="cluster"`` (``"DPT"``: axes from outermost to innermost, the last
one gets neighbouring ranks). ``"spread"`` is ``"TPD"`` (replicas neighbouring); any permutation of ``D``,
``P``, ``T`` is accepted. Groups come from
``torch.distributed.device_mesh.init_device_mesh`` with axis names from :class:`MeshAxis`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from enum import Enum
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["MeshAxis", "Topology", "build_device_mesh"]


class MeshAxis(str, Enum):
    """Names of the mesh axes, outermost first."""

    DP = "dp"
    PP = "pp"
    TP = "tp"


@dataclass(frozen=True)
class Topology:
    """Coordinates of one rank in the (dp, pp, tp) grid. Pure arithmetic: no process group needed.

    Attributes:
        world_size: number of processes.
        rank: this process's global rank.
        pipeline_parallel_degree: pp, number of pipeline stages.
        tensor_parallel_degree: tp, ranks per tensor-parallel group.
        placement_strategy: which axis gets neighbouring ranks: ``"cluster"`` (= ``"DPT"``, tp neighbours),
            ``"spread"`` (= ``"TPD"``, replicas neighbours) or a permutation of ``D``, ``P``, ``T``, outermost first.
    """

    world_size: int
    rank: int
    pipeline_parallel_degree: int = 1
    tensor_parallel_degree: int = 1
    placement_strategy: str = "cluster"

    def __post_init__(self) -> None:
        order = _PLACEMENTS.get(self.placement_strategy, self.placement_strategy)
        if sorted(order) != ["D", "P", "T"]:
            raise ValueError(
                f"placement_strategy={self.placement_strategy!r} is not 'cluster', 'spread' or a permutation of"
                " 'D', 'P', 'T' (outermost axis first; e.g. 'DPT' puts tensor-parallel ranks next to each other)."
            )
        model_parallel = self.pipeline_parallel_degree * self.tensor_parallel_degree
        if self.world_size % model_parallel != 0:
            raise ValueError(
                f"World size {self.world_size} is not divisible by pipeline_parallel_degree"
                f" ({self.pipeline_parallel_degree}) x tensor_parallel_degree ({self.tensor_parallel_degree})"
                f" = {model_parallel}. Launch a multiple of {model_parallel} processes (devices x num_nodes),"
                " or change the degrees."
            )
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"Rank {self.rank} is outside the world of size {self.world_size}.")

    @property
    def data_parallel_degree(self) -> int:
        """dp = world_size / (pp * tp)."""
        return self.world_size // (self.pipeline_parallel_degree * self.tensor_parallel_degree)

    @property
    def mesh_shape(self) -> tuple[int, int, int]:
        """(dp, pp, tp), in the order of :class:`MeshAxis`."""
        return (self.data_parallel_degree, self.pipeline_parallel_degree, self.tensor_parallel_degree)

    @property
    def axis_order(self) -> str:
        """The axes ``D``, ``P``, ``T`` from outermost to innermost (the last has neighbouring ranks)."""
        return _PLACEMENTS.get(self.placement_strategy, self.placement_strategy)

    def _strides(self) -> dict[str, int]:
        sizes = {"D": self.data_parallel_degree, "P": self.pipeline_parallel_degree, "T": self.tensor_parallel_degree}
        strides, stride = {}, 1
        for axis in reversed(self.axis_order):
            strides[axis] = stride
            stride *= sizes[axis]
        return strides

    def _coordinate(self, axis: str, size: int) -> int:
        return (self.rank // self._strides()[axis]) % size

    @property
    def tp_rank(self) -> int:
        return self._coordinate("T", self.tensor_parallel_degree)

    @property
    def pp_rank(self) -> int:
        return self._coordinate("P", self.pipeline_parallel_degree)

    @property
    def dp_rank(self) -> int:
        return self._coordinate("D", self.data_parallel_degree)

    @property
    def is_driver(self) -> bool:
        """True on pipeline rank 0, which runs the user's step and drives its pipeline."""
        return self.pp_rank == 0

    def global_rank(self, *, dp_rank: int, pp_rank: int, tp_rank: int) -> int:
        """Global rank of the given grid coordinates."""
        strides = self._strides()
        return dp_rank * strides["D"] + pp_rank * strides["P"] + tp_rank * strides["T"]

    def pp_group_ranks(self) -> list[int]:
        """Global ranks of this rank's pipeline group, indexed by stage."""
        return [
            self.global_rank(dp_rank=self.dp_rank, pp_rank=s, tp_rank=self.tp_rank)
            for s in range(self.pipeline_parallel_degree)
        ]

    def dp_group_ranks(self) -> list[int]:
        """Global ranks of this rank's data-parallel group (same stage, same tp rank, every replica)."""
        return [
            self.global_rank(dp_rank=d, pp_rank=self.pp_rank, tp_rank=self.tp_rank)
            for d in range(self.data_parallel_degree)
        ]


_PLACEMENTS = {"cluster": "DPT", "spread": "TPD"}


def build_device_mesh(topology: Topology, device_type: str, timeout: timedelta | None = None) -> DeviceMesh:
    """Build the 3-axis ``DeviceMesh`` (dp, pp, tp) over the default process group.

    Args:
        topology: the grid; must match ``torch.distributed``'s world size.
        device_type: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL).
        timeout: how long a collective on an axis group waits for its peers (torch's default when ``None``;
            ``DeviceMesh`` otherwise gives its groups torch's default, not the world group's timeout).

    Raises:
        RuntimeError: if the default process group is not initialised or its size differs.
    """
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        raise RuntimeError("Initialise torch.distributed before building the device mesh.")
    if dist.get_world_size() != topology.world_size:
        raise RuntimeError(
            f"Topology expects world size {topology.world_size}, torch.distributed has {dist.get_world_size()}."
        )
    names = tuple(axis.value for axis in MeshAxis)
    options = _group_options(device_type, timeout)
    if topology.axis_order == "DPT":
        override = {name: options for name in names} if options is not None else None
        return init_device_mesh(device_type, topology.mesh_shape, mesh_dim_names=names, backend_override=override)
    from torch.distributed.device_mesh import DeviceMesh

    dp, pp, tp = topology.mesh_shape
    ranks = torch.tensor(
        [[[topology.global_rank(dp_rank=d, pp_rank=p, tp_rank=t) for t in range(tp)] for p in range(pp)] for d in range(dp)]
    )
    override = ((None, options),) * len(names) if options is not None else None
    return DeviceMesh(device_type, ranks, mesh_dim_names=names, backend_override=override)


def _group_options(device_type: str, timeout: timedelta | None) -> Any:
    """The backend's group options carrying ``timeout`` (what ``DeviceMesh`` reads it from), or ``None``."""
    if timeout is None:
        return None
    options = dist.ProcessGroupNCCL.Options() if device_type == "cuda" else dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    return options
