"""lightning_mp: model-parallel training for PyTorch Lightning, ``Trainer(strategy="smp")``.

Importing the package registers the strategy name ``"smp"`` with Lightning's ``StrategyRegistry`` (Lightning
never discovers third-party strategies by itself), so ``Trainer(strategy="smp")`` and ``--trainer.strategy smp``
work after ``import lightning_mp``.

``lightning_mp.partition`` is both the partitioning package and SMP's placement context manager:
``with lightning_mp.partition(1): self.decoder = Decoder()`` puts the decoder on pipeline stage 1.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_mp import callbacks, nn, partition, tp
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
from lightning_mp.tp import (
    CommGroup,
    ParallelGroups,
    allgather,
    allreduce,
    barrier,
    broadcast,
    dp_rank,
    dp_size,
    parameter_creation_scope,
    pp_rank,
    pp_size,
    rdp_rank,
    rdp_size,
    tp_rank,
    tp_size,
)
from lightning_mp.tp._registry import set_tensor_parallelism, tensor_parallelism, tp_register, tp_register_with_module

__all__ = [
    "ActivationCheckpointing",
    "ActivationOffloading",
    "CommGroup",
    "DelayedParameterInit",
    "MeshAxis",
    "ParallelGroups",
    "PartitionSummary",
    "PipelineTimeline",
    "SMPConfig",
    "SMPStrategy",
    "Topology",
    "allgather",
    "allreduce",
    "barrier",
    "broadcast",
    "callbacks",
    "delay_param_initialization",
    "dp_rank",
    "dp_size",
    "materialize_module",
    "nn",
    "parameter_creation_scope",
    "partition",
    "pp_rank",
    "pp_size",
    "rdp_rank",
    "rdp_size",
    "set_activation_checkpointing",
    "set_tensor_parallelism",
    "tensor_parallelism",
    "tp",
    "tp_rank",
    "tp_register",
    "tp_register_with_module",
    "tp_size",
]
__version__ = "0.1.0"

if "smp" not in StrategyRegistry:
    SMPStrategy.register_strategies(StrategyRegistry)
