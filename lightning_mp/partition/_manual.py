"""Manual placement by construction: ``with lightning_mp.partition(k):`` around module creation.

Matches SMP's ``with smp.partition(k):`` (the SageMaker model parallelism library's Python API): every
``nn.Module`` constructed inside the block (and so every submodule it builds) is marked for stage ``k``; the
innermost block wins. The marks are read once the model is complete, by :func:`manual_placements`, and join the
strategy's ``partition={fqn: stage}`` map (which wins for the same FQN); automatic partitioning fills the rest.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

__all__ = ["manual_placements", "placement"]

_STAGE: contextvars.ContextVar[int | None] = contextvars.ContextVar("lightning_mp_partition_stage", default=None)
_ATTRIBUTE = "_lightning_mp_stage"
_lock = threading.Lock()
_active = 0
_original_init = nn.Module.__init__


def _marking_init(self: nn.Module, *args: Any, **kwargs: Any) -> None:
    _original_init(self, *args, **kwargs)
    stage = _STAGE.get()
    if stage is not None:
        self.__dict__[_ATTRIBUTE] = stage


@contextmanager
def placement(stage: int) -> Iterator[None]:
    """Place every module created in the block on pipeline stage ``stage``.

    Args:
        stage: 0-based pipeline stage; checked against ``pipeline_parallel_degree`` when the plan is made.

    Raises:
        ValueError: if ``stage`` is not a non-negative integer.
    """
    global _active
    if not isinstance(stage, int) or isinstance(stage, bool) or stage < 0:
        raise ValueError(f"lightning_mp.partition(stage) needs a stage index >= 0, got {stage!r}.")
    token = _STAGE.set(stage)
    with _lock:
        if _active == 0:
            nn.Module.__init__ = _marking_init
        _active += 1
    try:
        yield
    finally:
        with _lock:
            _active -= 1
            if _active == 0:
                nn.Module.__init__ = _original_init
        _STAGE.reset(token)


def manual_placements(model: nn.Module) -> dict[str, int]:
    """``{fqn: stage}`` of every module of ``model`` created inside ``with lightning_mp.partition(stage):``."""
    return {
        fqn: module.__dict__[_ATTRIBUTE]
        for fqn, module in model.named_modules(remove_duplicate=False)
        if _ATTRIBUTE in module.__dict__
    }
