"""Tensor parallelism: collectives as autograd pairs, sharding specs, named groups, the module registry and swaps.

Torch only (no Lightning). The distributed layers live in :mod:`lightning_mp.nn`; the strategy glue in
``lightning_mp/strategy/_tp.py``.
"""

from lightning_mp.tp._collectives import (
    all_gather_along,
    all_to_all,
    copy_to_tp,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_along,
    scatter_to_tp,
)
from lightning_mp.tp._groups import (
    CommGroup,
    ParallelGroups,
    allgather,
    allreduce,
    barrier,
    broadcast,
    dp_rank,
    dp_size,
    pp_rank,
    pp_size,
    rdp_rank,
    rdp_size,
    tp_rank,
    tp_size,
)
from lightning_mp.tp._random import register_parallel_linear
from lightning_mp.tp._registry import set_tensor_parallelism, tensor_parallelism, tp_register, tp_register_with_module
from lightning_mp.tp._sharding import (
    ShardSpec,
    TPDivisibilityError,
    TPGroup,
    check_divisible,
    grad_allreduce,
    mark,
    parameter_creation_scope,
    reduce_replicated_grads,
    shard,
    shard_spec,
    unshard,
)
from lightning_mp.tp._swap import Builder, load_from, whole_swaps

__all__ = [
    "Builder",
    "CommGroup",
    "ParallelGroups",
    "ShardSpec",
    "TPDivisibilityError",
    "TPGroup",
    "all_gather_along",
    "all_to_all",
    "allgather",
    "allreduce",
    "barrier",
    "broadcast",
    "check_divisible",
    "copy_to_tp",
    "dp_rank",
    "dp_size",
    "gather_from_tp",
    "grad_allreduce",
    "load_from",
    "mark",
    "parameter_creation_scope",
    "pp_rank",
    "pp_size",
    "rdp_rank",
    "rdp_size",
    "reduce_from_tp",
    "reduce_replicated_grads",
    "reduce_scatter_along",
    "register_parallel_linear",
    "scatter_to_tp",
    "set_tensor_parallelism",
    "shard",
    "shard_spec",
    "tensor_parallelism",
    "tp_rank",
    "tp_register",
    "tp_register_with_module",
    "tp_size",
    "unshard",
    "whole_swaps",
]
