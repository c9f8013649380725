"""Activation memory savers, torch only: per-module activation checkpointing and activation offloading."""

from lightning_mp.memory._checkpointing import checkpointed_modules, is_checkpointed, set_activation_checkpointing
from lightning_mp.memory._offloading import ActivationOffloader, OffloadStats

__all__ = [
    "ActivationOffloader",
    "OffloadStats",
    "checkpointed_modules",
    "is_checkpointed",
    "set_activation_checkpointing",
]
