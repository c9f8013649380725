"""``lightning-mp``: LightningCLI with the ``smp`` strategy registered.

Usage::

    lightning-mp fit --config configs/gpt_pp2.yaml
    lightning-mp fit --config configs/gpt_single.yaml --trainer.max_steps 100

Any LightningModule/DataModule reachable by import path can be named in the config (``class_path``);
``--trainer.strategy smp`` or ``strategy: {class_path: lightning_mp.SMPStrategy, init_args: {...}}`` selects
the strategy.
"""

from __future__ import annotations

import os
import sys

from lightning.pytorch.cli import LightningCLI

import lightning_mp  # noqa: F401  (registers "smp")


def main(args: list[str] | None = None) -> None:
    """Run LightningCLI over any LightningModule/DataModule subclasses named in the config or arguments."""
    cwd = os.getcwd()
    if cwd not in sys.path:
        # `examples.*` and user modules in the working directory resolve (absolute path: jsonargparse changes
        # directory to the config file's folder while parsing it)
        sys.path.insert(0, cwd)
    LightningCLI(args=args, subclass_mode_model=True, subclass_mode_data=True, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
