"""Lightning glue: ``SMPStrategy`` (registered as ``"smp"``), checkpoint I/O, per-step logging and gradients."""

from lightning_mp.strategy._strategy import SMPStrategy

__all__ = ["SMPStrategy"]
