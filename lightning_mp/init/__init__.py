"""Delayed parameter initialisation: build on meta, initialise only what a rank owns, bitwise as eager.

Torch only (no Lightning): :func:`delay_param_initialization` records a build, :func:`materialize_module`
replays it for the tensors a model still holds. See [Note: delayed init replays the eager init record] in
``_record.py``.
"""

from lightning_mp.init._per_call import PerCallReport, materialize_per_call
from lightning_mp.init._record import delay_param_initialization, is_recording
from lightning_mp.init._replay import MaterializeReport, ShardFn, defer_load, materialize_module
from lightning_mp.init._tape import InitRecord, find_record

__all__ = [
    "InitRecord",
    "MaterializeReport",
    "PerCallReport",
    "ShardFn",
    "defer_load",
    "delay_param_initialization",
    "find_record",
    "is_recording",
    "materialize_module",
    "materialize_per_call",
]
