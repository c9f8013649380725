"""The (dp, pp, tp) rank grid, and every process group of a run: created here, in one documented order.

Global rank layout by default (tensor-parallel ranks are neighbours, then pipeline, then data parallel)::

    rank = dp_rank * (pp * tp) + pp_rank * tp + tp_rank

This is SMP's default ``placement_strategy="cluster"`` (``"DPT"``: axes from outermost to innermost, the last
one gets neighbouring ranks). ``"spread"`` is ``"TPD"`` (replicas neighbouring); any permutation of ``D``,
``P``, ``T`` is accepted.

[Note: axis vocabulary] One name per thing. The grid's axes (:class:`MeshAxis`) and the groups made over several
of them are named as torchtitan's ``ParallelDims`` names its axes and flattened meshes (``dp_cp``):

* ``dp``: the data-parallel *replicas*: ranks holding the same stage and tp shard of the model and reading
  different batches; ``dp = world / (pp * tp)``. ``Topology.dp_rank``, ``SMPStrategy.dp_rank`` and the data
  sampler's rank are coordinates on this axis; gradients are averaged over it.
* ``pp``: the stages of one pipeline (one replica, one tp rank).
* ``tp``: the tensor-parallel ranks of one stage of one replica.
* ``dp_tp``: the ranks of one stage over every replica and tp rank (``dp x tp`` of that stage).
* ``dp_shard`` and ``dp_replicate``: under sharded data parallelism the ``dp`` axis unflattened into
  ``(dp_replicate, dp_shard)``, shard groups of ``sharded_data_parallel_degree`` neighbouring replicas
  (``dp_rank = dp_replicate_rank * sdp + dp_shard_rank``), as torchtitan's axes of the same names (FSDP2's HSDP mesh).

SMP's group helpers (``lightning_mp.dp_rank(groups)``, ``CommGroup``) keep SMP's own names, which differ: SMP's
``DP`` group is our ``dp_tp`` and SMP's ``RDP`` ("reduced" data parallel) is our ``dp``. So with tp > 1,
``lightning_mp.dp_rank(strategy.groups)`` differs from ``strategy.dp_rank``, and ``lightning_mp.rdp_rank`` equals it.
The other groups are named by their job: ``pipeline`` (the gloo control group of one pipeline), ``host`` (the world
over gloo, to learn which ranks share a GPU), ``order`` (gloo, the ``dp_tp`` ranks of a stage: grant order),
``reducer`` (the ``dp`` ranks of one stage and tp rank: the bucketed gradient all-reduce's own), ``pair`` (two
stages of one pipeline, one direction: the NCCL data plane) and ``tie`` (the ranks holding copies of one replicated
tied parameter in one replica and tp rank).

[Note: process group order] ``torch.distributed.new_group`` is collective over the whole world: every rank creates
every group, member or not, in one order. This module is the only place that creates groups, in this order:

1. at launch, from the layout alone (:func:`build_process_groups`): the mesh's ``dp``, ``pp`` and ``tp`` groups
   (``DeviceMesh``, one group per line of each axis), then ``dp_tp`` (one per stage), ``pipeline`` (one per
   replica and tp rank), ``host`` (when the data plane must look), ``order`` (one per stage, with deterministic
   order) and ``reducer`` (one per stage and tp rank, with the bucketed all-reduce);
2. at launch, once the data plane is chosen from the ``host`` facts: ``pair`` groups (:func:`build_pair_groups`);
3. at setup, once the partition plan is known: ``tie`` groups, per replicated parameter in the plan's order
   (:func:`build_tie_groups`).

Under HSDP (``1 < sharded_data_parallel_degree < dp``) step 1 ends with the ``dp`` axis unflattened into
``(dp_replicate, dp_shard)`` (``DeviceMesh._unflatten``: one group per line of each, ``DP_REPLICATE`` then
``DP_SHARD``), FSDP2's 2-D mesh; with ``sharded_data_parallel_degree == dp`` FSDP2 shards over the ``dp`` axis.

:func:`plan_process_groups` lists step 1 as pure data, without any process group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from enum import Enum
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from lightning_mp.comm import PairGroups
from lightning_mp.tp import ParallelGroups

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "GroupName",
    "GroupOptions",
    "GroupSpec",
    "MeshAxis",
    "ProcessGroups",
    "Topology",
    "build_device_mesh",
    "build_pair_groups",
    "build_process_groups",
    "build_tie_groups",
    "plan_process_groups",
]


class MeshAxis(str, Enum):
    """Names of the mesh axes, outermost first (see [Note: axis vocabulary]): ``DP`` the replicas."""

    DP = "dp"
    PP = "pp"
    TP = "tp"


class GroupName(str, Enum):
    """Every kind of process group a run creates, in creation order (see [Note: process group order])."""

    DP = "dp"
    PP = "pp"
    TP = "tp"
    DP_TP = "dp_tp"
    PIPELINE = "pipeline"
    HOST = "host"
    ORDER = "order"
    REDUCER = "reducer"
    DP_REPLICATE = "dp_replicate"
    DP_SHARD = "dp_shard"
    PAIR = "pair"
    TIE = "tie"


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
        sharded_data_parallel_degree: the ``dp_shard`` size (see [Note: axis vocabulary]); divides dp.
    """

    world_size: int
    rank: int
    pipeline_parallel_degree: int = 1
    tensor_parallel_degree: int = 1
    placement_strategy: str = "cluster"
    sharded_data_parallel_degree: int = 1

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
        sdp, dp = self.sharded_data_parallel_degree, self.data_parallel_degree
        if sdp < 1 or dp % sdp != 0:
            raise ValueError(
                f"sharded_data_parallel_degree={sdp} does not divide the data-parallel degree {dp} (world size"
                f" {self.world_size} / (pipeline_parallel_degree {self.pipeline_parallel_degree} x"
                f" tensor_parallel_degree {self.tensor_parallel_degree})). Use a divisor of {dp}, e.g. {dp}."
            )

    @property
    def dp_replicate_degree(self) -> int:
        """How many groups of ``sharded_data_parallel_degree`` ranks replicate each other (HSDP; 1: plain FSDP)."""
        return self.data_parallel_degree // self.sharded_data_parallel_degree

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
        """This rank's replica on the ``dp`` axis (SMP's ``rdp_rank``; see [Note: axis vocabulary])."""
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

    def pipelines(self) -> list[list[int]]:
        """Global ranks of every pipeline in stage order, pipelines ordered by (replica, tp rank)."""
        dp, pp, tp = self.mesh_shape
        return [
            [self.global_rank(dp_rank=d, pp_rank=s, tp_rank=t) for s in range(pp)] for d in range(dp) for t in range(tp)
        ]

    def dp_group_ranks(self) -> list[int]:
        """Global ranks of this rank's data-parallel group (same stage, same tp rank, every replica)."""
        return [
            self.global_rank(dp_rank=d, pp_rank=self.pp_rank, tp_rank=self.tp_rank)
            for d in range(self.data_parallel_degree)
        ]


_PLACEMENTS = {"cluster": "DPT", "spread": "TPD"}


@dataclass(frozen=True)
class GroupSpec:
    """One process group of :func:`plan_process_groups`.

    Attributes:
        name: its kind (see [Note: axis vocabulary]).
        ranks: its global ranks.
        backend: ``"gloo"``, or ``None`` for the default process group's backend (NCCL on CUDA).
    """

    name: GroupName
    ranks: tuple[int, ...]
    backend: str | None = None


@dataclass(frozen=True)
class GroupOptions:
    """Which groups beyond the grid's a run needs (the caller's policy; the plan adds the layout's conditions).

    Attributes:
        host: the ``host`` group: the data plane gathers over it which stages of a pipeline share a GPU.
        order: the ``order`` groups of deterministic grant order (made only when a stage has several ranks).
        reducer: the ``reducer`` groups of the bucketed data-parallel all-reduce (made only when dp > 1).
    """

    host: bool = False
    order: bool = False
    reducer: bool = False


def plan_process_groups(topology: Topology, options: GroupOptions = GroupOptions()) -> list[GroupSpec]:
    """Every group of step 1 of [Note: process group order], in creation order: pure, no process group needed.

    The mesh's ``dp``, ``pp`` and ``tp`` groups come first, one per line of the axis, ordered by the other
    coordinates (``DeviceMesh`` creates them, in its own order, the same on every rank).
    """
    dps, pps, tps = (range(n) for n in topology.mesh_shape)

    def at(d: int, p: int, t: int) -> int:
        return topology.global_rank(dp_rank=d, pp_rank=p, tp_rank=t)

    specs = [GroupSpec(GroupName.DP, tuple(at(d, p, t) for d in dps)) for p in pps for t in tps]
    specs += [GroupSpec(GroupName.PP, tuple(at(d, p, t) for p in pps)) for d in dps for t in tps]
    specs += [GroupSpec(GroupName.TP, tuple(at(d, p, t) for t in tps)) for d in dps for p in pps]
    stages = [tuple(sorted(at(d, p, t) for d in dps for t in tps)) for p in pps]
    specs += [GroupSpec(GroupName.DP_TP, ranks) for ranks in stages]
    specs += [GroupSpec(GroupName.PIPELINE, tuple(ranks), "gloo") for ranks in topology.pipelines()]
    if options.host:
        specs.append(GroupSpec(GroupName.HOST, tuple(range(topology.world_size)), "gloo"))
    if options.order and len(dps) * len(tps) > 1:
        specs += [GroupSpec(GroupName.ORDER, ranks, "gloo") for ranks in stages]
    if options.reducer and len(dps) > 1:
        specs += [GroupSpec(GroupName.REDUCER, tuple(at(d, p, t) for d in dps)) for p in pps for t in tps]
    shard, replicate = topology.sharded_data_parallel_degree, topology.dp_replicate_degree
    if shard > 1 and replicate > 1:  # HSDP: the mesh's dp axis unflattened
        specs += [
            GroupSpec(GroupName.DP_REPLICATE, tuple(at(r * shard + s, p, t) for r in range(replicate)))
            for p in pps for t in tps for s in range(shard)
        ]
        specs += [
            GroupSpec(GroupName.DP_SHARD, tuple(at(r * shard + s, p, t) for s in range(shard)))
            for p in pps for t in tps for r in range(replicate)
        ]
    return specs


@dataclass(frozen=True)
class ProcessGroups:
    """This rank's handles of the groups made at launch (step 1 of [Note: process group order]).

    Attributes:
        topology: the grid.
        mesh: its ``DeviceMesh`` over the ``dp``, ``pp`` and ``tp`` axes.
        dp_tp: this stage's ranks over every replica and tp rank (SMP's ``DP`` group).
        pipeline: the gloo control group of this rank's pipeline (group rank = stage).
        host: the world over gloo, when the data plane must learn which stages share a GPU; else ``None``.
        order: the gloo group of this stage's ``dp_tp`` ranks, with deterministic grant order; else ``None``.
        reducer: this stage and tp rank's replicas, for the bucketed gradient all-reduce; else ``None``.
        shard_mesh: under sharded data parallelism, the mesh FSDP2 shards this stage (and tp rank) over: the 1-D
            ``dp`` axis, or the 2-D ``(dp_replicate, dp_shard)`` one for HSDP; else ``None``.
    """

    topology: Topology
    mesh: DeviceMesh
    dp_tp: dist.ProcessGroup
    pipeline: dist.ProcessGroup
    host: dist.ProcessGroup | None = None
    order: dist.ProcessGroup | None = None
    reducer: dist.ProcessGroup | None = None
    shard_mesh: DeviceMesh | None = None

    @property
    def dp(self) -> dist.ProcessGroup:
        """This stage and tp rank's replicas (the mesh's ``dp`` axis; SMP's ``RDP``)."""
        return self.mesh.get_group(MeshAxis.DP.value)

    @property
    def pp(self) -> dist.ProcessGroup:
        """This rank's pipeline (the mesh's ``pp`` axis)."""
        return self.mesh.get_group(MeshAxis.PP.value)

    @property
    def tp(self) -> dist.ProcessGroup:
        """This rank's tensor-parallel group (the mesh's ``tp`` axis)."""
        return self.mesh.get_group(MeshAxis.TP.value)

    def smp_groups(self) -> ParallelGroups:
        """The groups under SMP's names, for ``lightning_mp.allgather`` & co. (``DP`` is ``dp_tp``, ``RDP`` ``dp``)."""
        return ParallelGroups(world=dist.group.WORLD, tp=self.tp, pp=self.pp, dp=self.dp_tp, rdp=self.dp)


def build_process_groups(
    topology: Topology, device_type: str, timeout: timedelta | None = None, options: GroupOptions = GroupOptions()
) -> ProcessGroups:
    """Create the groups of :func:`plan_process_groups` (every rank, in that order) and keep this rank's.

    Args:
        topology: the grid; must match ``torch.distributed``'s world size.
        device_type: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL), for the mesh.
        timeout: how long a collective on any of these groups waits for its peers.
        options: which optional groups to make.

    Raises:
        RuntimeError: if the default process group is not initialised or its size differs.
    """
    mesh = build_device_mesh(topology, device_type, timeout)
    own: dict[GroupName, dist.ProcessGroup] = {}
    for spec in plan_process_groups(topology, options):
        if spec.name in (GroupName.DP, GroupName.PP, GroupName.TP, GroupName.DP_REPLICATE, GroupName.DP_SHARD):
            continue  # the mesh made them (the last two below)
        group = dist.new_group(list(spec.ranks), timeout=timeout, backend=spec.backend)
        if topology.rank in spec.ranks:
            own[spec.name] = group
    return ProcessGroups(
        topology,
        mesh,
        dp_tp=own[GroupName.DP_TP],
        pipeline=own[GroupName.PIPELINE],
        host=own.get(GroupName.HOST),
        order=own.get(GroupName.ORDER),
        reducer=own.get(GroupName.REDUCER),
        shard_mesh=_shard_mesh(mesh, topology, device_type, timeout),
    )


def _shard_mesh(mesh: DeviceMesh, topology: Topology, device_type: str, timeout: timedelta | None) -> DeviceMesh | None:
    """FSDP2's mesh of this rank (see ``ProcessGroups.shard_mesh``), the last groups of step 1 of [Note: process group
    order]; ``None`` without sharded data parallelism."""
    shard, replicate = topology.sharded_data_parallel_degree, topology.dp_replicate_degree
    if shard == 1:
        return None
    dp_mesh = mesh[MeshAxis.DP.value]
    if replicate == 1:
        return dp_mesh
    names = (GroupName.DP_REPLICATE.value, GroupName.DP_SHARD.value)
    options = _group_options(device_type, timeout)
    override = {name: options for name in names} if options is not None else None
    return dp_mesh._unflatten(0, (replicate, shard), names, backend_override=override)


def build_pair_groups(pipelines: Sequence[Sequence[int]], backend: str, timeout: timedelta | None = None) -> PairGroups:
    """Create one 2-rank ``pair`` group per ordered pair of stages of every pipeline, in one global order.

    Every rank of the world must call this with the same ``pipelines`` (``torch.distributed.new_group`` is
    collective over the world), at step 2 of [Note: process group order].

    Args:
        pipelines: the global ranks of each pipeline, in stage order; this rank is in exactly one.
        backend: ``"nccl"`` for the NCCL plane, ``"gloo"`` for the strict mock.
        timeout: of each group.

    Raises:
        ValueError: if this rank is in no pipeline or in several.
    """
    rank = dist.get_rank()
    own = [list(ranks) for ranks in pipelines if rank in ranks]
    if len(own) != 1:
        raise ValueError(f"Rank {rank} must be in exactly one pipeline, it is in {len(own)}: {list(pipelines)}.")
    mine: dict[tuple[int, int], dist.ProcessGroup] = {}
    for ranks in pipelines:
        for src, src_rank in enumerate(ranks):
            for dst, dst_rank in enumerate(ranks):
                if src == dst:
                    continue
                kwargs = {} if timeout is None else {"timeout": timeout}
                group = dist.new_group([src_rank, dst_rank], backend=backend, **kwargs)
                if rank in (src_rank, dst_rank):
                    mine[(src, dst)] = group
    return PairGroups(own[0].index(rank), own[0], mine, backend)


def build_tie_groups(
    topology: Topology, holders: Sequence[Sequence[int]], timeout: timedelta
) -> list[tuple[dist.ProcessGroup | None, int | None]]:
    """Create the ``tie`` groups (step 3 of [Note: process group order]), every rank, in one order.

    Args:
        topology: the grid.
        holders: per replicated parameter, in the plan's order, the stages holding a copy (ascending).
        timeout: of each group.

    Returns:
        Per entry of ``holders``: this rank's tie group (one per replica and tp rank, over the holding stages) and
        the global rank of its lowest stage (the broadcast source), or ``(None, None)`` where this rank holds no copy.
    """
    mine: list[tuple[dist.ProcessGroup | None, int | None]] = []
    for stages in holders:
        own: tuple[dist.ProcessGroup | None, int | None] = (None, None)
        for dp_rank in range(topology.data_parallel_degree):
            for tp_rank in range(topology.tensor_parallel_degree):
                ranks = [topology.global_rank(dp_rank=dp_rank, pp_rank=s, tp_rank=tp_rank) for s in stages]
                group = dist.new_group(ranks, timeout=timeout)
                if topology.rank in ranks:
                    own = (group, ranks[0])
        mine.append(own)
    return mine


def build_device_mesh(topology: Topology, device_type: str, timeout: timedelta | None = None) -> DeviceMesh:
    """Build the 3-axis ``DeviceMesh`` (dp, pp, tp) over the default process group (its groups come first in
    step 1 of [Note: process group order]).

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
