"""``lightning-mp``: LightningCLI with the ``smp`` strategy registered.

Usage::

    lightning-mp fit --config configs/gpt_pp2.yaml
    lightning-mp fit --config configs/gpt_single.yaml --trainer.max_steps 100
    lightning-mp consolidate lightning_logs/version_0/checkpoints/last model.safetensors [--hf]

Any LightningModule/DataModule reachable by import path can be named in the config (``class_path``);
``--trainer.strategy smp`` or ``strategy: {class_path: lightning_mp.SMPStrategy, init_args: {...}}`` selects
the strategy.
"""

from __future__ import annotations

import os
import sys
from functools import partial
from typing import Any

from lightning.pytorch.cli import LightningCLI

import lightning_mp  # registers "smp"


def main(args: list[str] | None = None) -> None:
    """Run LightningCLI over any LightningModule/DataModule subclasses named in the config or arguments;
    ``lightning-mp consolidate CKPT_DIR OUT [--hf]`` writes a checkpoint folder as one plain state dict."""
    argv = sys.argv[1:] if args is None else args
    if argv and argv[0] == "consolidate":
        from lightning_mp.strategy._consolidate import main as consolidate_main

        consolidate_main(argv[1:])
        return
    cwd = os.getcwd()
    if cwd not in sys.path:
        # `examples.*` and user modules in the working directory resolve (absolute path: jsonargparse changes
        # directory to the config file's folder while parsing it)
        sys.path.insert(0, cwd)
    SMPCLI(args=args, subclass_mode_model=True, subclass_mode_data=True, save_config_kwargs={"overwrite": True})


class SMPCLI(LightningCLI):
    """LightningCLI that builds the model under delayed parameter initialisation when the config asks for it.

    The CLI instantiates the model before the trainer, so a model that builds its layers in ``__init__`` (like
    ``examples.gpt.GPT``) would be built eagerly on every rank. With ``delayed_parameter_initialization: true``
    in the ``SMPStrategy`` init args, or a ``lightning_mp.DelayedParameterInit`` callback, the model is
    instantiated inside :func:`lightning_mp.delay_param_initialization` instead (the data module is not).
    """

    def _add_instantiators(self) -> None:
        super()._add_instantiators()
        from lightning.pytorch.cli import _get_module_type  # noqa: PLC0415

        self.parser.add_instantiator(
            self._instantiate_model, _get_module_type(self._model_class), subclasses=self.subclass_mode_model,
            prepend=True,
        )

    def _instantiate_model(self, class_type: type, *args: Any, applied_instantiation_links: dict, **kwargs: Any) -> Any:
        from lightning.pytorch.cli import _InstantiatorFn  # noqa: PLC0415

        build = partial(_InstantiatorFn(cli=self, key="model"), applied_instantiation_links=applied_instantiation_links)
        if not self._delayed_init_requested():
            return build(class_type, *args, **kwargs)
        with lightning_mp.delay_param_initialization():
            return build(class_type, *args, **kwargs)

    def _delayed_init_requested(self) -> bool:
        config = self.config.get(str(self.subcommand)) if self.subcommand else self.config
        trainer = config.get("trainer") if config is not None else None
        if trainer is None:
            return False
        strategy = trainer.get("strategy")
        init_args = strategy.get("init_args") if hasattr(strategy, "get") else None
        if init_args is not None and init_args.get("delayed_parameter_initialization"):
            return True
        callbacks = trainer.get("callbacks") or []
        return any(str(getattr(c, "class_path", "")).endswith("DelayedParameterInit") for c in callbacks)


if __name__ == "__main__":
    main()
