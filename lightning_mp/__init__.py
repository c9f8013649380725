"""lightning_mp: model-parallel training for PyTorch Lightning, ``Trainer(strategy="smp")``.

Importing the package registers the strategy name ``"smp"`` with Lightning's ``StrategyRegistry`` (Lightning
never discovers third-party strategies by itself), so ``Trainer(strategy="smp")`` and ``--trainer.strategy smp``
work after ``import lightning_mp``.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_mp.config import SMPConfig
from lightning_mp.strategy import SMPStrategy
from lightning_mp.topology import MeshAxis, Topology

__all__ = ["MeshAxis", "SMPConfig", "SMPStrategy", "Topology"]
__version__ = "0.1.0"

if "smp" not in StrategyRegistry:
    SMPStrategy.register_strategies(StrategyRegistry)
