"""Automatic partitioning: trace a model once, then plan module FQN -> pipeline stage.

``trace(model, run)`` records the module tree, call order, FLOPs (or measured times), parameter and
activation bytes and shared parameters; ``plan(trace, num_stages, ...)`` turns that into a
:class:`PartitionPlan`. Pure planning: nothing is moved or built here. Imports torch only.

The package is also callable, for manual placement as in SMP (``with smp.partition(k):``)::

    with lightning_mp.partition(1):
        self.decoder = Decoder()          # the decoder and all its submodules go to stage 1
"""

import sys
import types

from lightning_mp.partition._manual import manual_placements, placement
from lightning_mp.partition._cost import stage_costs
from lightning_mp.partition._plan import PartitionPlan, plan
from lightning_mp.partition._table import holds_parameters
from lightning_mp.partition._trace import ModelTrace, ModuleRecord, SharedParameter, shared_parameters, trace

__all__ = [
    "ModelTrace",
    "ModuleRecord",
    "PartitionPlan",
    "SharedParameter",
    "holds_parameters",
    "manual_placements",
    "placement",
    "plan",
    "shared_parameters",
    "stage_costs",
    "trace",
]


class _CallablePackage(types.ModuleType):
    """``lightning_mp.partition(k)`` is ``lightning_mp.partition.placement(k)``."""

    def __call__(self, stage: int):
        return placement(stage)


sys.modules[__name__].__class__ = _CallablePackage
