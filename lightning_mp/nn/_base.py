"""``TPModule``: what every distributed module shares (loading shards, saving full tensors).

[Note: full state dicts] A distributed module's ``state_dict`` holds the original keys and *full* shapes: each
of its sharded parameters (those with a :class:`~lightning_mp.tp.ShardSpec`) is all-gathered over the tp group
when the state dict is taken, so every rank of the group must take it together (all ranks do when Lightning
saves a checkpoint). ``load_state_dict`` accepts full tensors and keeps this rank's shard, which is also how a
swap loads the original module's weights: ``dist_module.load_state_dict(original.state_dict())``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_mp.tp import TPGroup, shard, shard_spec, unshard

__all__ = ["TPModule", "local_state_dicts"]

_LOCAL = threading.local()


@contextlib.contextmanager
def local_state_dicts() -> Iterator[None]:
    """Inside, ``state_dict`` of a distributed module holds this rank's shards as they are (no all-gather, no
    collective): for checkpoints that store every rank's piece of the full tensor (``strategy/_shards.py``)."""
    previous = getattr(_LOCAL, "on", False)
    _LOCAL.on = True
    try:
        yield
    finally:
        _LOCAL.on = previous


class TPModule(nn.Module):
    """Base of the ``lightning_mp.nn`` modules: holds the :class:`TPGroup` and the state-dict translation.

    A counterpart of a torch layer also derives from it (``DistributedLinear`` is an ``nn.Linear``), so code
    that dispatches on ``isinstance`` (weight-decay groups, init functions) treats it as the original; the
    swap never swaps a ``TPModule`` again.

    Args:
        tp: the tensor-parallel group (handle, rank, degree).
    """

    _lmp_distributed = True  # the swap leaves these alone

    def __init__(self, tp: TPGroup) -> None:
        nn.Module.__init__(self)  # not the original class's __init__ (it would allocate full weights)
        self.tp = tp
        self._register_state_dict_hook(_gather_full)
        self.register_load_state_dict_pre_hook(_keep_shard)

    def require_group(self) -> dist.ProcessGroup:
        """The process group, for forward.

        Raises:
            RuntimeError: if the module was built without one (sharding maths only).
        """
        if self.tp.group is None:
            raise RuntimeError(f"{type(self).__name__} was built without a process group; it can load shards only.")
        return self.tp.group


def _gather_full(module: TPModule, state: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    if getattr(_LOCAL, "on", False):
        return
    for name, param in module.named_parameters(recurse=False):
        spec = shard_spec(param)
        key = prefix + name
        if spec is None or key not in state or module.tp.size == 1:
            continue
        local = state[key].detach()
        if isinstance(local, DTensor):  # an FSDP shard of this tp piece (sharded data parallelism): the piece first
            local = local.full_tensor()
        local = local.contiguous()
        pieces = [torch.empty_like(local) for _ in range(module.tp.size)]
        dist.all_gather(pieces, local, group=module.require_group())
        state[key] = unshard(pieces, spec)


def _keep_shard(module: TPModule, state: dict[str, Any], prefix: str, *args: Any) -> None:
    for name, param in module.named_parameters(recurse=False):
        spec = shard_spec(param)
        key = prefix + name
        if spec is None or key not in state:
            continue
        value = state[key]
        if value.shape != param.shape and value.size(spec.dim) == spec.full_size:
            state[key] = shard(value, spec, module.tp.rank, module.tp.size)
