"""Initial weights for an ``smp`` run from whole weights (``SMPStrategy(load_weights=...)``): a plain state dict,
a consolidated checkpoint or a Hugging Face folder; each rank keeps its stage's tensors and its tp slices."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor, nn

from lightning_mp.strategy._checkpoint._dtensors import like_local
from lightning_mp.strategy._checkpoint._folder import CheckpointMismatchError
from lightning_mp.strategy._checkpoint._sharding import _shardings
from lightning_mp.strategy._checkpoint._state import model_state_dict
from lightning_mp.strategy._consolidate import hf_info, read_weights
from lightning_mp.strategy._shards import full_shape

__all__ = ["load_weights"]

def load_weights(path: str | Path, model: nn.Module, names: Mapping[str, str], *, strict: bool) -> None:
    """Initialise this rank's part of ``model`` from whole weights at ``path`` (see ``SMPStrategy(load_weights=)``):
    each tensor-parallel parameter keeps its slice of the full tensor (the distributed modules' load hook), each
    parameter sharded over data-parallel ranks its rows (see [Note: sharded data parallelism in checkpoints]).

    Raises:
        CheckpointMismatchError: with ``strict``, if ``path`` lacks a parameter or buffer of this stage; the same
            error on every rank (the lists are gathered).
    """
    info = hf_info(model)
    saved = read_weights(path, info["prefix"] if info else "")
    for other, original in names.items():  # a shared parameter under either of its names
        if other not in saved and original in saved:
            saved[other] = saved[original]
        elif original not in saved and other in saved:
            saved[original] = saved[other]
    local = model_state_dict(model)
    shardings = _shardings(model)
    missing = sorted(k for k in local if k not in saved)
    mismatched = []
    for key, value in local.items():
        if key in saved and isinstance(value, Tensor):
            expected = full_shape(value.shape, shardings[key].spec) if key in shardings else value.shape
            if tuple(saved[key].shape) != tuple(expected):
                mismatched.append((key, tuple(saved[key].shape), tuple(expected)))
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (missing, mismatched))
    all_missing = sorted({k for m, _ in everyone for k in m})
    all_mismatched = sorted({t for _, mm in everyone for t in mm})
    if all_missing or all_mismatched:
        message = f"The weights at {path} do not fit this model: " + "; ".join(
            part
            for part in (
                f"missing keys ({len(all_missing)}): {all_missing[:10]}" if all_missing else "",
                "shape mismatches (key, saved, this model): "
                + ", ".join(f"{k}: {a} vs {b}" for k, a, b in all_mismatched[:10])
                if all_mismatched
                else "",
            )
            if part
        )
        if all_mismatched or strict:
            raise CheckpointMismatchError(
                message + ". Pass weights of this model (original module FQNs and full shapes), or set"
                " `strict_loading = False` on the LightningModule to skip missing keys."
            )
        rank_zero_warn(message + "; they keep their initial values (strict_loading=False).")
    with torch.no_grad():
        model.load_state_dict({k: like_local(saved[k], v) for k, v in local.items() if k in saved}, strict=False)
    rank_zero_info(f"lightning_mp: initial weights loaded from {path}")
