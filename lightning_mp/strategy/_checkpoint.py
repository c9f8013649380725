"""Checkpoints through ``torch.distributed.checkpoint`` (DCP), keyed by the original parameter FQNs.

Every rank holds its own stage's parameters under their original names (the engine never renames), so one DCP
save writes each parameter once, from the rank that owns it (replicas on other data-parallel ranks are
deduplicated by DCP's planner), and a load reads each rank's keys wherever they were saved from. A checkpoint
is a folder: DCP's shards plus ``meta.pt`` with Lightning's non-tensor state (epoch, loops, callbacks), the same
layout as Lightning's ``ModelParallelStrategy`` with ``save_distributed_checkpoint=True``.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

from lightning_mp.nn._base import sharded_parameter_ranks

__all__ = ["load_checkpoint", "model_state_dict", "optimizer_state_dict", "save_checkpoint"]

METADATA_FILENAME = "meta.pt"


def model_state_dict(model: nn.Module) -> dict[str, Any]:
    """This rank's parameters and buffers, under their original FQNs."""
    return get_model_state_dict(model, options=StateDictOptions(cpu_offload=True))


# Flattened: one key per (parameter FQN, state or hyper-parameter), e.g. "state.h.0.attn.weight.momentum_buffer"
# and "param_groups.h.0.attn.weight.lr". Nested param_groups lists would be one key shared by every stage,
# which DCP deduplicates to rank 0's copy.
_OPTIM_OPTIONS = StateDictOptions(cpu_offload=True, flatten_optimizer_state_dict=True)


def optimizer_state_dict(model: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """This rank's optimizer state, keyed by parameter FQN (not by index, so it survives a new layout).

    The state of a tensor-parallel shard gets the suffix ``@tp<rank>``: its value differs between the ranks of a
    tp group, and DCP would otherwise keep one rank's copy of the shared key.
    """
    state = get_optimizer_state_dict(model, optimizer, options=_OPTIM_OPTIONS)
    ranks = sharded_parameter_ranks(model)
    if not ranks:
        return state
    return {_tp_key(key, ranks): value for key, value in state.items()}


def _tp_key(key: str, ranks: dict[str, int]) -> str:
    if key.startswith("state."):
        fqn = key[len("state.") :].rpartition(".")[0]
        if fqn in ranks:
            return f"{key}@tp{ranks[fqn]}"
    return key


def save_checkpoint(checkpoint: dict[str, Any], path: Path, is_global_zero: bool) -> None:
    """Write ``checkpoint`` (Lightning's dict) as a DCP folder. Every rank must call this.

    An existing file or folder at ``path`` is replaced (shards of an earlier layout would otherwise stay).
    """
    if is_global_zero and path.is_file():
        path.unlink()
    elif is_global_zero and path.is_dir():
        shutil.rmtree(path)
    dist.barrier()
    path.mkdir(parents=True, exist_ok=True)
    tensors = {"state_dict": checkpoint.pop("state_dict")}
    for index, state in enumerate(checkpoint.pop("optimizer_states", [])):
        tensors[f"optimizer_{index}"] = state
    dcp.save(tensors, checkpoint_id=path)
    if is_global_zero:
        torch.save(checkpoint, path / METADATA_FILENAME)


def load_checkpoint(
    path: Path, model: nn.Module, optimizers: list[Optimizer], *, strict: bool, weights_only: bool | None
) -> dict[str, Any]:
    """Load a folder written by :func:`save_checkpoint` into ``model`` and ``optimizers``; return the rest.

    Raises:
        FileNotFoundError: if ``path`` is not such a folder (e.g. a single-file checkpoint of another strategy).
    """
    if not (path / METADATA_FILENAME).is_file():
        raise FileNotFoundError(
            f"{path} is not a lightning_mp checkpoint (a folder with {METADATA_FILENAME}). To start from a plain"
            " PyTorch/Lightning checkpoint file, load its weights into the LightningModule before `fit` instead."
        )
    state = {"state_dict": model_state_dict(model)}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["state_dict"], strict=strict)
    for index, optimizer in enumerate(optimizers):
        key = f"optimizer_{index}"
        optim_state = {key: optimizer_state_dict(model, optimizer)}
        dcp.load(optim_state, checkpoint_id=path)
        loaded = {k.partition("@tp")[0]: v for k, v in optim_state[key].items()}  # see optimizer_state_dict
        set_optimizer_state_dict(model, optimizer, optim_state_dict=loaded, options=_OPTIM_OPTIONS)
    return torch.load(path / METADATA_FILENAME, weights_only=weights_only)
