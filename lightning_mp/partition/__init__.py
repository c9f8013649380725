"""Automatic partitioning: trace a model once, then plan module FQN -> pipeline stage.

``trace(model, run)`` records the module tree, call order, FLOPs, parameter bytes and shared
parameters; ``plan(trace, num_stages, ...)`` turns that into a :class:`PartitionPlan`. Pure
planning: nothing is moved or built here. Imports torch only.
"""

from lightning_mp.partition._plan import PartitionPlan, plan, stage_costs
from lightning_mp.partition._trace import ModelTrace, ModuleRecord, trace

__all__ = ["ModelTrace", "ModuleRecord", "PartitionPlan", "plan", "stage_costs", "trace"]
