"""Memory savers, torch only: per-module activation checkpointing, activation offloading, and giving freed host
memory back on glibc (or keeping it for the next step)."""

from lightning_mp.memory._checkpointing import checkpointed_modules, is_checkpointed, set_activation_checkpointing
from lightning_mp.memory._host import fix_mmap_threshold, glibc, retain_freed_memory, trim_host_memory
from lightning_mp.memory._offloading import ActivationOffloader, OffloadStats

__all__ = [
    "ActivationOffloader",
    "OffloadStats",
    "checkpointed_modules",
    "fix_mmap_threshold",
    "glibc",
    "is_checkpointed",
    "retain_freed_memory",
    "set_activation_checkpointing",
    "trim_host_memory",
]
