"""Memory-saver switches as callbacks, so LightningCLI YAML can turn them on.

- :class:`DelayedParameterInit`: build ``configure_model`` on meta; each rank initialises only its stage.
- :class:`ActivationCheckpointing`: checkpoint named modules (classes, FQNs, globs) after partitioning.
- :class:`ActivationOffloading`: move checkpointed modules' saved inputs to host memory between forward and backward.
"""

from __future__ import annotations

import importlib
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from typing_extensions import override

from lightning_mp.memory import ActivationOffloader, checkpointed_modules, set_activation_checkpointing
from lightning_mp.memory._checkpointing import OFFLOADER_ATTR, _group_size, is_checkpointed
from lightning_mp.strategy import SMPStrategy

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["ActivationCheckpointing", "ActivationOffloading", "DelayedParameterInit"]


def _smp_strategy(trainer: pl.Trainer, who: str) -> Any:
    strategy = trainer.strategy
    if not isinstance(strategy, SMPStrategy):
        raise ValueError(f"{who} needs strategy='smp', got {type(strategy).__name__}.")
    return strategy


class DelayedParameterInit(Callback):
    """Turn on delayed parameter initialisation for the model built in ``LightningModule.configure_model``.

    Same as ``SMPStrategy(delayed_parameter_initialization=True)``: ``configure_model`` runs under
    :func:`lightning_mp.delay_param_initialization`; after partitioning each rank allocates and initialises only
    its own stage, bitwise equal to an eager one-process build with the same seed.

    Raises:
        ValueError: at setup, if the strategy is not ``"smp"``.
    """

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        _smp_strategy(trainer, "DelayedParameterInit").enable_delayed_parameter_initialization()


def _resolve_class(name: str) -> type | None:
    module_name, _, attr = name.rpartition(".")
    if not module_name:
        return None
    try:
        value = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError):
        return None
    return value if isinstance(value, type) else None


def select_modules(model: nn.Module, patterns: list[type | str]) -> list[tuple[str, nn.Module]]:
    """Outermost modules of ``model`` that match a class, a class path/name, an FQN or a glob, in tree order.

    Raises:
        ValueError: if a pattern matches nothing.
    """
    named = list(model.named_modules())
    chosen: dict[str, nn.Module] = {}
    for pattern in patterns:
        cls = pattern if isinstance(pattern, type) else _resolve_class(pattern)
        hits = [
            (fqn, m) for fqn, m in named
            if (cls is not None and isinstance(m, cls))
            or (isinstance(pattern, str) and (fnmatchcase(fqn, pattern) or type(m).__name__ == pattern))
        ]
        if not hits:
            raise ValueError(
                f"ActivationCheckpointing: {pattern!r} matches no module (give a class, a class path such as"
                " 'examples.gpt.Block', a class name, an FQN or a glob such as 'h.*')."
                f" Some FQNs: {[f for f, _ in named[1:6]]}."
            )
        chosen.update(hits)
    fqns = sorted(chosen, key=[f for f, _ in named].index)
    return [(f, chosen[f]) for f in fqns if not any(f.startswith(o + ".") for o in fqns if o and o != f)]


class ActivationCheckpointing(Callback):
    """Checkpoint the activations of chosen modules (SMP's ``set_activation_checkpointing``), per stage.

    Applied when fitting starts, after partitioning, to the matched modules that run wholly on this rank
    (non-reentrant ``torch.utils.checkpoint``; FQNs and state dicts unchanged). Works with any strategy.

    Args:
        modules: classes (or their import paths, e.g. ``"examples.gpt.Block"``, or names), module FQNs, or globs.
        strategy: ``"each"``, ``"contiguous"`` or ``"group_N"``: how an ``nn.Sequential``'s children are grouped.
        preserve_rng_state: recompute with the forward's random state (same dropout masks).

    Raises:
        ValueError: for an unknown strategy, or a pattern that matches no module.
    """

    def __init__(self, modules: list[Any], strategy: str = "each", preserve_rng_state: bool = True) -> None:
        if not modules:
            raise ValueError("ActivationCheckpointing needs at least one module (a class, FQN or glob) in `modules`.")
        _group_size(strategy, 1)  # fail at construction on an unknown strategy
        self.modules = list(modules)
        self.strategy = strategy
        self.preserve_rng_state = preserve_rng_state
        self.applied: list[str] = []

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        is_local = _local_predicate(trainer, pl_module)
        names = {id(m): f for f, m in pl_module.named_modules()}
        split, skipped = [], []
        for fqn, module in select_modules(pl_module, self.modules):
            if is_checkpointed(module):
                continue  # a second fit in the same processes
            if not is_local(module):
                if not isinstance(module, nn.Sequential):
                    if any(is_local(m) and next(m.parameters(recurse=False), None) is not None for m in module.modules()):
                        skipped.append(fqn)  # split over stages: cannot be one checkpoint
                    continue  # (else another stage's module)
                split.append(fqn)  # split over stages: its local children, one by one
            for wrapped in set_activation_checkpointing(module, self.preserve_rng_state, self.strategy, is_local):
                self.applied.append(names[id(wrapped)])
        if split and self.strategy != "each":
            rank_zero_warn(
                f"ActivationCheckpointing(strategy={self.strategy!r}): {split} span pipeline stages, so their local"
                " children are checkpointed one by one ('each'). Name the blocks of one stage to group them."
            )
        if skipped:
            rank_zero_warn(
                f"ActivationCheckpointing: {skipped} span pipeline stages and are not checkpointed; name their"
                " children (modules of one stage) instead."
            )
        if not self.applied:
            rank_zero_warn(f"ActivationCheckpointing({self.modules!r}) found no module on global rank 0's stage.")
        rank_zero_info(f"lightning_mp: activation checkpointing on {len(self.applied)} modules of this stage")


def _local_predicate(trainer: pl.Trainer, pl_module: nn.Module) -> Any:
    """Whether a module runs wholly on this rank: under ``smp``, it and every descendant are on this stage."""
    engine = getattr(trainer.strategy, "pipeline_engine", None)
    if engine is None:
        return lambda module: True
    fqn_of = {id(m): f for f, m in pl_module.named_modules()}

    def is_local(module: nn.Module) -> bool:
        return all(engine.stage_of(fqn_of[id(m)]) == engine.stage for m in module.modules())

    return is_local


class ActivationOffloading(Callback):
    """Offload the saved inputs of checkpointed modules to host memory (SMP's ``offload_activations``).

    Needs :class:`ActivationCheckpointing` (or ``set_activation_checkpointing``): only checkpointed modules'
    inputs are offloaded; loads run ``horizon`` tasks (checkpointed module calls) ahead of backward, per
    microbatch (SMP's ``activation_loading_horizon``).

    Args:
        horizon: tasks loaded ahead of the one backward needs, per microbatch (>= 1).

    Raises:
        ValueError: if ``horizon < 1``.
    """

    def __init__(self, horizon: int = 4) -> None:
        self.offloader = ActivationOffloader(horizon, microbatch_fn=_current_microbatch)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        modules = [m for _, m in checkpointed_modules(pl_module)]
        if not modules:
            rank_zero_warn("ActivationOffloading found no checkpointed module; add ActivationCheckpointing first.")
        for module in modules:
            module.__dict__[OFFLOADER_ATTR] = self.offloader

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.offloader.reset()


def _current_microbatch() -> Any:
    from lightning_mp.pipeline import current_task as _current_task  # noqa: PLC0415 (read only)

    task = _current_task()
    return 0 if task is None else task.microbatch
