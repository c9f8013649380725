"""``lightning-mp``: LightningCLI with the ``smp`` strategy registered.

Usage::

    lightning-mp fit --config configs/gpt_pp2.yaml
    lightning-mp fit --config configs/gpt_single.yaml --trainer.max_steps 100
    lightning-mp consolidate lightning_logs/gpt_pp2/version_0/checkpoints/last model.safetensors [--hf]

Any LightningModule/DataModule reachable by import path can be named in the config (``class_path``);
``--trainer.strategy smp`` or ``strategy: {class_path: lightning_mp.SMPStrategy, init_args: {...}}`` selects
the strategy.
"""

from __future__ import annotations

import importlib
import os
import sys
from functools import partial
from typing import Any

from jsonargparse import set_parsing_settings
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
    set_parsing_settings(docstring_parse_attribute_docstrings=True)  # `--help` shows each SMPConfig field's docstring
    SMPCLI(
        args=args,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"description": _DESCRIPTION},
    )


_PLUGINS = ("accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin")  # built later
_DESCRIPTION = (
    "lightning-mp: Lightning's CLI with the 'smp' strategy (lightning_mp.SMPStrategy) registered. Subcommands: fit,"
    " validate, test, predict (below), and consolidate CKPT_DIR OUT [--hf], which writes a lightning_mp checkpoint"
    " folder as one plain state dict (.pt / .safetensors) or a Hugging Face folder (lightning-mp consolidate --help)."
)


class SMPCLI(LightningCLI):
    """LightningCLI that builds the model under delayed parameter initialisation when the config asks for it.

    The CLI instantiates the model before the trainer, so a model that builds its layers in ``__init__`` (like
    ``examples.gpt.GPT``) would be built eagerly on every rank. With ``delayed_parameter_initialization: true``
    in the ``SMPStrategy`` init args, or a ``lightning_mp.DelayedParameterInit`` callback, the model is
    instantiated inside :func:`lightning_mp.delay_param_initialization` instead (the data module is not).
    """

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        """The trainer; with ``default_root_dir`` set and Lightning's default logger, runs go to
        ``<default_root_dir>/version_N`` (the configs name a folder per config: ``lightning_logs/gpt_pp2/version_0``),
        not ``<default_root_dir>/lightning_logs/version_N``."""
        trainer = super().instantiate_trainer(**kwargs)
        config = {**self._get(self.config_init, "trainer", default={}), **kwargs}
        if config.get("default_root_dir") is not None and config.get("logger") in (None, True):
            _one_folder_per_run(trainer)
        return trainer

    def before_instantiate_classes(self) -> None:
        """Check the ``SMPStrategy`` arguments before anything is built, so that a bad value (a stage out of range in
        ``--trainer.strategy.init_args.partition``) is reported alone, as an argument error; jsonargparse would
        report it inside the errors of every type ``Trainer(strategy=...)`` accepts."""
        config = self.config.get(str(self.subcommand)) if self.subcommand else self.config
        strategy = config.get("trainer", {}).get("strategy") if config is not None else None
        class_path = strategy.get("class_path") if hasattr(strategy, "get") else None
        if class_path is None:
            return
        module_name, _, name = str(class_path).rpartition(".")
        strategy_class = getattr(importlib.import_module(module_name), name, None)
        if not (isinstance(strategy_class, type) and issubclass(strategy_class, lightning_mp.SMPStrategy)):
            return
        init_args = strategy.get("init_args")
        arguments = {k: v for k, v in vars(init_args).items() if k not in _PLUGINS} if init_args is not None else {}
        try:
            strategy_class(**arguments)
        except (ValueError, TypeError) as err:
            self._parser(self.subcommand).error(f"trainer.strategy ({class_path}): {err}")

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


def _one_folder_per_run(trainer: Any) -> None:
    """Lightning's default logger again (TensorBoard if installed, else CSV), without its ``lightning_logs`` name."""
    from lightning.fabric.plugins.environments import SLURMEnvironment
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    logger = trainer.loggers[0] if len(trainer.loggers) == 1 else None
    if type(logger) in (CSVLogger, TensorBoardLogger) and logger.name == "lightning_logs":
        trainer.loggers = [type(logger)(save_dir=logger.save_dir, name="", version=SLURMEnvironment.job_id())]


if __name__ == "__main__":
    main()
