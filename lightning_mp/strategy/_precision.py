"""Mixed precision with a pipeline: one ``GradScaler`` decision for every stage and replica.

[Note: GradScaler over stages] With ``precision="16-mixed"`` Lightning's ``MixedPrecision`` scales the loss, unscales
the gradients before the optimizer step, skips the step when a gradient is inf/NaN and updates the scale. Under
``smp`` each rank holds the gradients of one stage only, so its own inf check sees part of the model: a stage whose
gradients are finite would step while another skips, and their scales would drift apart. The strategy therefore
swaps in :class:`SyncedGradScaler`, whose ``unscale_`` takes the max of the "found inf" flags over every rank (all
stages of all replicas) before ``step`` and ``update`` read them; all ranks then skip or step together and keep one
scale, as one device would. The loss of each microbatch is multiplied by the scale inside the pipeline (see
``SMPStrategy._loss_divisor``), so activation gradients are scaled where they could underflow.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

__all__ = ["SyncedGradScaler", "install_synced_scaler", "loss_scale_of"]


class SyncedGradScaler(torch.amp.GradScaler):
    """A ``GradScaler`` whose inf check is reduced (max) over ``group`` (see [Note: GradScaler over stages]).

    Args:
        source: the scaler to take the settings (and the state, if it has one) from.
        group: the ranks that must agree: every rank that holds part of the model's gradients.
    """

    def __init__(self, source: torch.amp.GradScaler, group: dist.ProcessGroup) -> None:
        super().__init__(
            device=source._device,
            init_scale=source._init_scale,
            growth_factor=source._growth_factor,
            backoff_factor=source._backoff_factor,
            growth_interval=source._growth_interval,
            enabled=source._enabled,
        )
        if source._scale is not None:
            self.load_state_dict(source.state_dict())
        self._group = group

    def unscale_(self, optimizer: Optimizer) -> None:
        super().unscale_(optimizer)
        if not self._enabled:
            return
        found = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        local = torch.zeros((), dtype=torch.float32, device=self._scale.device if self._scale is not None else "cpu")
        for flag in found.values():
            local = torch.maximum(local, flag.to(local.device).reshape(()))
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self._group)
        for device, flag in found.items():
            flag.copy_(local.to(flag.device).reshape(flag.shape))
        if not found:  # no gradient on this rank: record the global verdict so `step` can read it
            found[local.device] = local


def install_synced_scaler(precision_plugin: Any, group: dist.ProcessGroup) -> None:
    """Replace the precision plugin's ``GradScaler`` (if it has one) by a :class:`SyncedGradScaler` over ``group``."""
    scaler = getattr(precision_plugin, "scaler", None)
    if scaler is not None and not isinstance(scaler, SyncedGradScaler):
        precision_plugin.scaler = SyncedGradScaler(scaler, group)


def loss_scale_of(precision_plugin: Any) -> float:
    """The factor the loss is multiplied by before backward: the GradScaler's scale, else 1."""
    scaler = getattr(precision_plugin, "scaler", None)
    if scaler is None or not scaler.is_enabled():
        return 1.0
    return float(scaler.get_scale()) if scaler._scale is not None else float(scaler._init_scale)
