"""Activation checkpointing per module (SMP's ``set_activation_checkpointing``), torch only.

A checkpointed module keeps its place in the module tree (FQNs and state-dict keys unchanged): only its
``forward`` is replaced, on the instance, by one that runs the original under
:func:`torch.utils.checkpoint.checkpoint` in non-reentrant mode. Non-reentrant mode is required: reentrant
checkpointing drops gradients when no input requires grad, as for the first block of a pipeline stage whose
input arrives from another rank (DeepSpeed #4479). With ``preserve_rng_state`` the recompute restores the
random state of the forward, so dropout draws the same masks.

For an ``nn.Sequential`` the ``strategy`` says how its children are grouped: ``"each"`` checkpoints every child,
``"contiguous"`` all of them as one segment, ``"group_N"`` consecutive groups of N. Grouping replaces the
Sequential's own forward, so it needs every child on this rank; a Sequential split over pipeline stages (whose
remote runs the engine sends child by child) has each of its local children checkpointed instead.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["checkpointed_modules", "is_checkpointed", "set_activation_checkpointing"]

_ORIGINAL = "_lightning_mp_checkpoint_original"
OFFLOADER_ATTR = "_lightning_mp_offloader"  # set by ActivationOffloading on checkpointed modules
_GROUP = re.compile(r"^group_([1-9][0-9]*)$")


def _group_size(strategy: str, num_children: int) -> int:
    if strategy == "each":
        return 1
    if strategy == "contiguous":
        return max(1, num_children)
    match = _GROUP.match(strategy)
    if match is None:
        raise ValueError(
            f"Activation checkpointing strategy {strategy!r} is not one of 'each', 'contiguous', 'group_N' (N >= 1,"
            " e.g. 'group_2')."
        )
    return int(match.group(1))


def _offload_context(module: nn.Module) -> AbstractContextManager:
    offloader = module.__dict__.get(OFFLOADER_ATTR)
    return offloader.saved_tensors_hooks() if offloader is not None else nullcontext()


def _wrap(module: nn.Module, run: Callable[..., Any], preserve_rng_state: bool) -> None:
    """Make ``module.forward`` run ``run`` under non-reentrant checkpointing (only when grad is enabled)."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return run(*args, **kwargs)
        with _offload_context(module):  # the checkpoint's saved inputs go through the offloader's hooks
            return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state, **kwargs)

    module.__dict__[_ORIGINAL] = module.__dict__.get("forward")
    module.forward = forward


def _grouped_forward(sequential: nn.Sequential, size: int, preserve_rng_state: bool) -> Callable[[Any], Any]:
    children = list(sequential)
    groups = [children[i : i + size] for i in range(0, len(children), size)]

    def run_group(group: list[nn.Module], x: Any) -> Any:
        for child in group:
            x = child(x)
        return x

    def forward(x: Any) -> Any:
        for group in groups:
            if torch.is_grad_enabled():
                with _offload_context(sequential):
                    x = checkpoint(run_group, group, x, use_reentrant=False, preserve_rng_state=preserve_rng_state)
            else:
                x = run_group(group, x)
        return x

    return forward


def is_checkpointed(module: nn.Module) -> bool:
    """Whether :func:`set_activation_checkpointing` was applied to ``module``."""
    return _ORIGINAL in module.__dict__


def checkpointed_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(fqn, module)`` of every checkpointed module in ``model``."""
    return ((fqn, m) for fqn, m in model.named_modules() if is_checkpointed(m))


def set_activation_checkpointing(
    module: nn.Module,
    preserve_rng_state: bool = True,
    strategy: str = "each",
    is_local: Callable[[nn.Module], bool] | None = None,
) -> list[nn.Module]:
    """Checkpoint ``module``'s activations: keep only its inputs in forward, recompute the rest in backward.

    Args:
        module: the module; for an ``nn.Sequential`` ``strategy`` groups its children.
        preserve_rng_state: restore the forward's random state for the recompute (same dropout masks).
        strategy: ``"each"``, ``"contiguous"`` or ``"group_N"`` (``nn.Sequential`` only; others are one segment).
        is_local: whether a module (with its whole subtree) runs on this rank; ``None`` means all do.

    Returns:
        The modules whose forward now checkpoints (``module`` itself, or its children or it for a Sequential).

    Raises:
        ValueError: for an unknown ``strategy``, or a module already checkpointed or not on this rank.
    """
    local = is_local or (lambda m: True)
    size = _group_size(strategy, len(module) if isinstance(module, nn.Sequential) else 1)
    if is_checkpointed(module):
        raise ValueError(f"{type(module).__name__} is already checkpointed; apply set_activation_checkpointing once.")
    if not isinstance(module, nn.Sequential):
        if not local(module):
            raise ValueError(
                f"{type(module).__name__} does not run wholly on this rank; checkpoint modules of one stage only."
            )
        _wrap(module, module.forward, preserve_rng_state)
        return [module]
    if size > 1 and local(module) and "forward" not in module.__dict__:
        module.__dict__[_ORIGINAL] = None
        module.forward = _grouped_forward(module, size, preserve_rng_state)
        return [module]
    wrapped = []
    for child in module:  # "each", or a Sequential split over stages: its local children one by one
        if local(child) and not is_checkpointed(child):
            _wrap(child, child.forward, preserve_rng_state)
            wrapped.append(child)
    return wrapped
