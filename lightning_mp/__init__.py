"""lightning_mp: model-parallel training for PyTorch Lightning, ``Trainer(strategy="smp")``.

Importing the package registers the strategy name ``"smp"`` with Lightning's ``StrategyRegistry`` (Lightning
never discovers third-party strategies by itself), so ``Trainer(strategy="smp")`` and ``--trainer.strategy smp``
work after ``import lightning_mp``.

``lightning_mp.partition`` is both the partitioning package and SMP's placement context manager:
``with lightning_mp.partition(1): self.decoder = Decoder()`` puts the decoder on pipeline stage 1.

The public names, by concept (``__all__``):

- strategy and config: :class:`SMPStrategy`, :class:`SMPConfig`;
- errors: :class:`PipelineError`, :class:`CheckpointMismatchError`, :class:`TPDivisibilityError`,
  :class:`RankFailedError`;
- callbacks: :class:`ActivationCheckpointing`, :class:`ActivationOffloading`, :class:`DelayedParameterInit`,
  :class:`PartitionSummary`, :class:`PipelineTimeline`;
- placement: :func:`partition` (``with lightning_mp.partition(k):``), :class:`PartitionPlan`;
- values held across stages: :class:`RemoteValue`;
- delayed init: :func:`delay_param_initialization`, :func:`materialize_module`;
- TP registry: :func:`tp_register`, :func:`tp_register_with_module`, :func:`tensor_parallelism`,
  :func:`set_tensor_parallelism`;
- activation checkpointing: :func:`set_activation_checkpointing`.

Namespaces: :mod:`lightning_mp.smp` (SMP's group helpers: ``tp_rank``, ``allgather``, ``CommGroup``, ...),
:mod:`lightning_mp.nn` (distributed modules), :mod:`lightning_mp.tp` (TP collectives, sharding, groups),
:mod:`lightning_mp.topology` (the rank grid), :mod:`lightning_mp.callbacks`.
"""

import importlib
import warnings
from typing import Any

from lightning.pytorch.strategies import StrategyRegistry

from lightning_mp import callbacks, nn, partition, smp, tp
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
from lightning_mp.partition import PartitionPlan
from lightning_mp.pipeline import PipelineError, RemoteValue
from lightning_mp.strategy import SMPStrategy
from lightning_mp.strategy._checkpoint import CheckpointMismatchError
from lightning_mp.strategy._roll_call import RankFailedError
from lightning_mp.tp import (
    TPDivisibilityError,
    set_tensor_parallelism,
    tensor_parallelism,
    tp_register,
    tp_register_with_module,
)

__all__ = [
    # strategy and config
    "SMPConfig",
    "SMPStrategy",
    # errors
    "CheckpointMismatchError",
    "PipelineError",
    "RankFailedError",
    "TPDivisibilityError",
    # callbacks
    "ActivationCheckpointing",
    "ActivationOffloading",
    "DelayedParameterInit",
    "PartitionSummary",
    "PipelineTimeline",
    # placement
    "PartitionPlan",
    "partition",
    # values held across stages
    "RemoteValue",
    # delayed init
    "delay_param_initialization",
    "materialize_module",
    # TP registry
    "set_tensor_parallelism",
    "tensor_parallelism",
    "tp_register",
    "tp_register_with_module",
    # activation checkpointing
    "set_activation_checkpointing",
]
__version__ = "0.1.0"

# Top-level names of earlier versions -> the module that holds them now (still importable, with a warning).
_MOVED = {
    **{name: "lightning_mp.smp" for name in smp.__all__},
    "MeshAxis": "lightning_mp.topology",
    "Topology": "lightning_mp.topology",
    "parameter_creation_scope": "lightning_mp.tp",
}


def __getattr__(name: str) -> Any:
    """``lightning_mp.tp_rank`` and the other names of ``_MOVED``: the moved object, with a DeprecationWarning
    (once per name: the object is then kept here).

    Raises:
        AttributeError: for any other name.
    """
    if name not in _MOVED:
        raise AttributeError(f"module 'lightning_mp' has no attribute {name!r}")
    where = f"{_MOVED[name]}.{name}"
    warnings.warn(f"`lightning_mp.{name}` moved to `{where}`; import it from there.", DeprecationWarning, stacklevel=2)
    value = globals()[name] = getattr(importlib.import_module(_MOVED[name]), name)
    return value


if "smp" not in StrategyRegistry:
    SMPStrategy.register_strategies(StrategyRegistry)
