"""Parameters sharded over data-parallel ranks (``sharded_data_parallel_degree``, FSDP2's ``fully_shard``) in
checkpoints: each is a ``DTensor`` of the full logical shape whose local tensor is this rank's shard.

[Note: sharded data parallelism in checkpoints] A DCP folder needs nothing more: ``state_dict()`` of a
``fully_shard``-ed module and ``get_optimizer_state_dict`` give ``DTensor`` parameters and Adam moments under the
original FQNs with their full shapes, DCP writes each rank's shard with its offsets (replicas of HSDP once) and
reads into a ``DTensor`` exactly this rank's rows, so a folder saved at sdp=2 loads at sdp=1, pp=2 or tp=2 and the
other way, as torch's own ``set_model_state_dict`` does for FSDP2. A tensor-parallel shard sharded again over dp
(tp x sdp) is a ``DTensor`` of the shard's shape; it is saved as the pieces of the full tensor where its tp blocks
meet this rank's rows (``_sharding._dp_sharded_view``), so tp x sdp moves to any layout too. Full tensors are
needed where a plain file is involved: a full Lightning file (``save_distributed_checkpoint=False``) is written
from ``DTensor.full_tensor()`` (an all-gather over the shard group, every rank of it calls it), and a full file or
whole weights (``load_weights``) are read by cutting each full tensor to this rank's shard locally
(``distribute_tensor(..., src_data_rank=None)``: no communication, every rank read the whole file).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor
from torch.distributed.tensor import DTensor, distribute_tensor

__all__ = ["full_tensors", "like_local"]


def full_tensors(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with every ``DTensor`` replaced by its full tensor (a collective over its mesh: every rank holding
    the same keys calls this; keys are visited in sorted order so that the all-gathers pair up)."""
    if not any(isinstance(value, DTensor) for value in state.values()):
        return state
    full = {key: state[key].full_tensor() if isinstance(state[key], DTensor) else state[key] for key in sorted(state)}
    return {key: full[key] for key in state}


def like_local(value: Any, like: Any) -> Any:
    """``value`` (a full tensor) as ``like`` holds it: this rank's shard of it when ``like`` is a ``DTensor`` of the
    same logical shape (cut locally, no communication), else ``value`` unchanged.

    Shapes: ``value`` of ``like.shape`` (the full logical shape); the result's local tensor has ``like``'s local
    shape, ``value``'s dtype and ``like``'s device.
    """
    if not (isinstance(like, DTensor) and isinstance(value, Tensor)) or value.shape != like.shape:
        return value
    return distribute_tensor(
        value.detach().to(like.device), like.device_mesh, like.placements, src_data_rank=None
    )
