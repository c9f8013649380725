"""Checkpoints through ``torch.distributed.checkpoint`` (DCP), keyed by the original parameter FQNs.

Every rank holds its own stage's parameters under their original names (the engine never renames), so one DCP
save writes each parameter once, from the rank that owns it (replicas on other data-parallel ranks are
deduplicated by DCP's planner), and a load reads each rank's keys wherever they were saved from. A tensor-parallel
shard is saved as its piece of the full tensor, and so is the optimizer state of the shard (see [Note: shards in
checkpoints] in ``_shards.py``), so every layout reads its own slices: a checkpoint resumes at any (pp, tp, dp),
with or without ZeRO-1. A folder becomes visible only once every rank wrote it (see [Note: checkpoint commit]). A parameter with
several names (a tied weight, copied on several stages under ``tied_weights="replicate"``) is saved once, under its
original FQN, and a load fills every name and copy from it (see [Note: replicated tied weights] in ``_tied.py``). A checkpoint
is a folder: DCP's shards plus ``meta.pt`` with Lightning's non-tensor state (epoch, loops, callbacks), the same
layout as Lightning's ``ModelParallelStrategy`` with ``save_distributed_checkpoint=True``. With
``save_distributed_checkpoint=False`` a checkpoint is one full Lightning file instead (see
[Note: full checkpoint files]); a plain Lightning checkpoint file loads the same way.

Modules: ``_folder`` (a DCP folder: save, commit, load, key checks), ``_state`` (this rank's model and flattened
optimizer state under original FQNs), ``_sharding`` (tensor-parallel shards as pieces of the full tensor),
``_dtensors`` (parameters sharded over data-parallel ranks: [Note: sharded data parallelism in checkpoints]),
``_full`` (one full Lightning file), ``_weights`` (initial weights from a plain state dict or an HF folder).
"""

from lightning_mp.strategy._checkpoint._dtensors import full_tensors
from lightning_mp.strategy._checkpoint._folder import (
    METADATA_FILENAME,
    PARTIAL_SUFFIX,
    CheckpointMismatchError,
    is_complete_checkpoint,
    load_checkpoint,
    name_checkpoint_folders,
    remove_checkpoint,
    save_checkpoint,
)
from lightning_mp.strategy._checkpoint._full import (
    consolidate_checkpoint,
    full_param_groups,
    gather_sharded_optimizer_states,
    load_full_checkpoint,
    param_groups_by_fqn,
    save_full_checkpoint,
)
from lightning_mp.strategy._checkpoint._sharding import gather_tp_shards
from lightning_mp.strategy._checkpoint._state import model_state_dict, optimizer_state_dict, set_flat_optimizer_state
from lightning_mp.strategy._checkpoint._weights import load_weights

__all__ = [
    "METADATA_FILENAME",
    "PARTIAL_SUFFIX",
    "CheckpointMismatchError",
    "consolidate_checkpoint",
    "full_param_groups",
    "full_tensors",
    "gather_sharded_optimizer_states",
    "gather_tp_shards",
    "is_complete_checkpoint",
    "load_checkpoint",
    "load_full_checkpoint",
    "load_weights",
    "model_state_dict",
    "name_checkpoint_folders",
    "optimizer_state_dict",
    "param_groups_by_fqn",
    "remove_checkpoint",
    "save_checkpoint",
    "save_full_checkpoint",
    "set_flat_optimizer_state",
]
