"""lightning_mp: model-parallel training for PyTorch Lightning, ``Trainer(strategy="smp")``.

Importing the package registers the strategy name ``"smp"`` with Lightning's ``StrategyRegistry`` (Lightning
never discovers third-party strategies by itself), so ``Trainer(strategy="smp")`` and ``--trainer.strategy smp``
work after ``import lightning_mp``.

``lightning_mp.partition`` is both the partitioning package and SMP's placement context manager:
``with lightning_mp.partition(1): self.decoder = Decoder()`` puts the decoder on pipeline stage 1.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_mp import callbacks, partition
from lightning_mp.callbacks import (
    ActivationCheckpointing,
    ActivationOffloading,
    DelayedParameterInit,
    PartitionSummary,
    PipelineTimeline,
)
from lightning_mp.config import SMPConfig
from lightning_mp.init import delay_param_initialization, materialize_module
from lightning_mp.memory import set_activation_checkpointing
from lightning_mp.strategy import SMPStrategy
from lightning_mp.topology import MeshAxis, Topology

__all__ = [
    "ActivationCheckpointing",
    "ActivationOffloading",
    "DelayedParameterInit",
    "MeshAxis",
    "PartitionSummary",
    "PipelineTimeline",
    "SMPConfig",
    "SMPStrategy",
    "Topology",
    "callbacks",
    "delay_param_initialization",
    "materialize_module",
    "partition",
    "set_activation_checkpointing",
]
__version__ = "0.1.0"

if "smp" not in StrategyRegistry:
    SMPStrategy.register_strategies(StrategyRegistry)
