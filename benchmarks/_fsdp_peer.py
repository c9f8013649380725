"""The benchmarks' peer under Lightning's ``ModelParallelStrategy`` (FSDP2): how its model is wrapped."""

from __future__ import annotations

from collections.abc import Iterable

import lightning as L
from torch import nn


def fully_shard_like_torchtitan(module: L.LightningModule, blocks: Iterable[nn.Module]) -> None:
    """In ``configure_model``, under ``ModelParallelStrategy`` only: ``fully_shard`` each of ``blocks`` over the
    ``"data_parallel"`` mesh, then ``module`` (the root: embeddings, final norm, head), as torchtitan's
    ``apply_fsdp`` does and ``sharded_data_parallel_degree`` wraps a stage. A no-op under any other strategy."""
    if not isinstance(module.trainer.strategy, L.pytorch.strategies.ModelParallelStrategy):
        return
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

    mesh = module.device_mesh["data_parallel"]
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(module, mesh=mesh)
