"""One model and one data order on every rank, whether or not the script seeded (as ``ddp``).

[Note: ranks start alike] Every rank must start from the same weights (data-parallel replicas average gradients,
they never compare weights; tensor-parallel ranks cut their shards out of the weights each rank built) and every
rank of one replica must read the same batches (a ``shuffle=True`` loader draws its order from the global torch
generator when the strategy injects no sampler, as with one replica). With ``seed_everything`` every launcher
already gives that: popen and torchrun re-run the script with ``PL_GLOBAL_SEED`` set, and the spawn and fork
launchers restore the parent's generators. Without it each process starts from its own OS seed, so two replicas
trained from different weights and the ranks of one tp group cut shards from different models and shuffled
differently, silently. So, as torch's ``DistributedDataParallel`` broadcasts the module's state from rank 0 when
it wraps it, the strategy:

* without ``PL_GLOBAL_SEED``, gives every rank global rank 0's generators (torch CPU and CUDA, numpy, Python
  ``random``) once the process group is up (:func:`share_generators`): rank 0 keeps exactly the state the script
  left, as under ``"auto"``; the engine's base seed (``torch.initial_seed()``) then agrees too;
* before partitioning, broadcasts the parameters and buffers of an eagerly built model from global rank 0, or for
  a model built under delayed initialisation, rank 0's generator states at the start of its build, which the
  replay draws from (:func:`sync_initial_states`). With a seed these are no-ops on the values.
"""

from __future__ import annotations

import os
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states, pl_worker_init_function
from torch import nn
from torch.distributed.utils import _sync_module_states

from lightning_mp.init import find_record


# [Note: generators at launch] One replica (pp x tp ranks and no more) is the peer of one device (``"auto"``), which
# leaves the global generators as the user's script left them: the shuffle of a ``shuffle=True`` loader, then every
# draw, equals that run's. Several replicas are the peer of ``ddp``, which re-seeds from ``PL_GLOBAL_SEED`` in
# ``SMPStrategy.setup_environment`` (and shards with ``DistributedSampler``); so do we. Every rank of a replica starts
# from the same state either way: with a seed, popen and torchrun re-run the script, Lightning's spawn launcher
# restores the parent's snapshot, and ours does so under fork too (Python re-seeds `random` in a forked child);
# without one, every rank takes global rank 0's generators and model (see [Note: ranks start alike] above). Setup's
# extra work (first batch, trace) restores them (``generators_kept``).

__all__ = ["seed_workers_by_replica", "share_generators", "sync_initial_states"]

_BUCKET_BYTES = 250 * 2**20  # DDP's default broadcast bucket


def share_generators(src: int = 0) -> None:
    """Without ``PL_GLOBAL_SEED``, set every global generator to global rank ``src``'s (see [Note: ranks start
    alike]). A collective over the default group: every rank calls it."""
    if "PL_GLOBAL_SEED" in os.environ or dist.get_world_size() == 1:
        return
    payload = [_collect_rng_states(include_cuda=torch.cuda.is_initialized()) if dist.get_rank() == src else None]
    dist.broadcast_object_list(payload, src=src)
    _set_rng_states(payload[0])


def sync_initial_states(module: nn.Module, src: int = 0) -> None:
    """Give every rank global rank ``src``'s initial model (see [Note: ranks start alike]).

    Call before partitioning, while every rank holds the whole model. An eager model's parameters and buffers are
    broadcast in buckets (torch's ``_sync_module_states``, as ``DistributedDataParallel``); a delayed model has no
    values yet, so the generator states its init record starts from are broadcast instead. A collective over the
    default group: every rank calls it.
    """
    if dist.get_world_size() == 1:
        return
    record = find_record(module)
    if record is None:
        _sync_module_states(module, dist.group.WORLD, _BUCKET_BYTES, src, params_and_buffers_to_ignore=())
        return
    payload = [(record.cpu_rng_state, record.cuda_rng_states) if dist.get_rank() == src else None]
    dist.broadcast_object_list(payload, src=src)
    record.cpu_rng_state, record.cuda_rng_states = payload[0]


def seed_workers_by_replica(dataloader: Any, dp_rank: int) -> None:
    """Under ``seed_everything(workers=True)``, seed ``dataloader``'s workers by data-parallel rank, not global rank.

    Lightning then leaves the ``worker_init_fn`` alone; every pp/tp rank of a replica draws in its workers what
    ``ddp``'s rank ``dp_rank`` draws (one device's with one replica), so the ranks of a replica read one batch. A
    loader with a ``worker_init_fn`` of its own keeps it.
    """
    if int(os.environ.get("PL_SEED_WORKERS", 0)) and getattr(dataloader, "worker_init_fn", False) is None:
        dataloader.worker_init_fn = partial(pl_worker_init_function, rank=dp_rank)
