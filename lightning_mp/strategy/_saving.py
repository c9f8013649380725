"""Which kind of checkpoint a save writes and a load reads, and who writes what (the files: ``_checkpoint``).

A save records the layout (plan, mesh shape, tied names, Hugging Face info) under ``PLAN_KEY``, then writes either
a DCP folder (``save_distributed_checkpoint=True``: every rank its own part) or one full Lightning file
(``False``: ZeRO-1 shards merged over dp, ``sharded_data_parallel_degree`` shards all-gathered, tp shards gathered
into full tensors, the stages of replica 0 sending their parts to global rank 0). A load reads a file as a full
checkpoint and a folder as DCP shards, whatever the save's layout was.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import nn
from torch.optim import Optimizer

from lightning_mp.partition import PartitionPlan
from lightning_mp.strategy import _checkpoint
from lightning_mp.strategy._consolidate import hf_info
from lightning_mp.strategy._placement import PLAN_KEY
from lightning_mp.strategy._zero import local_optimizer, sync_hyperparameters_from_local
from lightning_mp.topology import MeshAxis, Topology

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["CheckpointHooks", "load", "save", "unwrap_optimizer"]


def unwrap_optimizer(optimizer: Any) -> Optimizer:
    """The torch optimizer inside a ``LightningOptimizer`` (or ``optimizer`` itself)."""
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def save(
    checkpoint: dict[str, Any],
    path: Path,
    *,
    distributed: bool,
    plan: PartitionPlan,
    topology: Topology,
    mesh: DeviceMesh,
    module: nn.Module,
    model: nn.Module,
    optimizers: list[Any],
    param_order: list[str] | None,
    names: dict[str, str],
    checkpoint_io: Any,
    is_global_zero: bool,
    storage_options: Any | None = None,
) -> None:
    """Write ``checkpoint`` at ``path`` on every rank (each rank calls this with its own stage's state).

    Args:
        distributed: ``save_distributed_checkpoint``: a DCP folder, else one full file.
        module: the LightningModule (for its Hugging Face info); ``model`` the module Lightning wraps.
        param_order: the whole model's parameter FQNs before placement (the full file's order).
        names: other names of shared parameters -> original FQN (``_tied.py``).
        checkpoint_io: Lightning's checkpoint IO; global rank 0 writes the full file through it.
        storage_options: must be ``None`` (Lightning's argument; DCP takes none).

    Raises:
        TypeError: for ``storage_options``.
    """
    if storage_options is not None:
        raise TypeError("The 'smp' strategy saves through torch.distributed.checkpoint; `storage_options` is unused.")
    checkpoint[PLAN_KEY] = {
        "partition_plan": plan.to_dict(),
        "layout": dict(zip(("dp", "pp", "tp"), topology.mesh_shape)),
        "tied_names": dict(names),  # for consolidation (see _consolidate.py)
        "hf": hf_info(module),
    }
    if distributed:
        _checkpoint.save_checkpoint(checkpoint, path, is_global_zero, names, model)
        return
    checkpoint["state_dict"] = _checkpoint.full_tensors(checkpoint["state_dict"])  # sdp: every dp rank gathers
    checkpoint["optimizer_states"] = [_checkpoint.full_tensors(s) for s in checkpoint.get("optimizer_states", [])]
    torch_optimizers = [unwrap_optimizer(o) for o in optimizers]
    if any(local_optimizer(o) is not o for o in torch_optimizers):  # ZeRO-1: each dp rank holds a share
        group = mesh.get_group(MeshAxis.DP.value)
        merged = _checkpoint.gather_sharded_optimizer_states(
            checkpoint.get("optimizer_states", []), group, dist.get_global_rank(group, 0)
        )
        if merged is not None:
            checkpoint["optimizer_states"] = merged
    if topology.dp_rank == 0 and topology.tensor_parallel_degree > 1:  # tp shards -> full tensors
        checkpoint["state_dict"] = _checkpoint.gather_tp_shards(checkpoint["state_dict"], model)
        checkpoint["optimizer_states"] = [
            _checkpoint.gather_tp_shards(state, model, flat=True) for state in checkpoint.get("optimizer_states", [])
        ]
    if topology.dp_rank == 0 and topology.tp_rank == 0:  # replica 0's stages hold the whole model
        assert param_order is not None
        _checkpoint.save_full_checkpoint(
            checkpoint, path, model, torch_optimizers, param_order, mesh.get_group(MeshAxis.PP.value),
            checkpoint_io if is_global_zero else None, names,
        )
    if _distributed_is_initialized():
        dist.barrier()


def load(
    path: Path,
    *,
    mesh: DeviceMesh,
    model: nn.Module,
    optimizers: list[Any],
    param_order: list[str] | None,
    names: dict[str, str],
    strict: bool,
    weights_only: bool | None,
) -> dict[str, Any]:
    """Read this rank's part of the checkpoint at ``path`` into ``model`` and ``optimizers``; the rest of it
    (loops, callbacks) is returned for Lightning. A file is a full checkpoint (a plain Lightning one, or
    ``save_distributed_checkpoint=False``); a folder holds DCP shards."""
    torch_optimizers = [unwrap_optimizer(o) for o in optimizers]
    local = [local_optimizer(o) for o in torch_optimizers]
    if path.is_file():
        assert param_order is not None
        checkpoint = _checkpoint.load_full_checkpoint(
            path, model, torch_optimizers, param_order, mesh.get_group(MeshAxis.PP.value), strict=strict,
            weights_only=weights_only, local_optimizers=local, names=names,
        )
    else:
        checkpoint = _checkpoint.load_checkpoint(
            path, model, local, strict=strict, weights_only=weights_only, names=names
        )
    for optimizer in torch_optimizers:
        sync_hyperparameters_from_local(optimizer)
    return checkpoint


class CheckpointHooks:
    """``SMPStrategy``'s Lightning checkpoint hooks (``Strategy.save_checkpoint``, ``load_checkpoint``, the state
    dicts), kept here with what they call. A mixin placed before ``ParallelStrategy`` in ``SMPStrategy``'s bases;
    it reads the strategy's config, layout and parameter names.
    """

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return _checkpoint.model_state_dict(self.model)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return _checkpoint.optimizer_state_dict(self.model, local_optimizer(unwrap_optimizer(optimizer)))

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """A DCP folder or one full file, as ``save_distributed_checkpoint`` says (see :func:`save`)."""
        save(
            checkpoint, Path(self.broadcast(str(filepath))), distributed=self.config.save_distributed_checkpoint,
            plan=self.partition_plan, topology=self.topology, mesh=self.device_mesh, module=self.lightning_module,
            model=self.model, optimizers=self.optimizers, param_order=self._param_order, names=self._param_names,
            checkpoint_io=self.checkpoint_io, is_global_zero=self.is_global_zero, storage_options=storage_options,
        )

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:  # its name goes in one rename (see [Note: checkpoint commit] in _checkpoint/_folder.py)
            _checkpoint.remove_checkpoint(Path(filepath))

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Model and optimizer state of any saved layout, loaded here (see :func:`save`); the rest returned."""
        return load(
            Path(self.broadcast(str(checkpoint_path))), mesh=self.device_mesh, model=self.model,
            optimizers=self.optimizers, param_order=self._param_order, names=self._param_names,
            strict=self.lightning_module.strict_loading, weights_only=weights_only,
        )

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # loaded in `load_checkpoint`

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # loaded in `load_checkpoint`
