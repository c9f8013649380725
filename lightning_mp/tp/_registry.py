"""SMP's tensor-parallel registry and marks: which module classes have distributed counterparts, and which
module instances the user wants distributed.

* ``tp_register_with_module(module_cls, dist_cls, init_hook, forward_hook, return_hook)`` and the decorator
  ``@tp_register(dist_cls, ...)`` map a class to its distributed counterpart.
* ``with tensor_parallelism(enabled=True, **kwargs):`` marks every module assigned as a child inside (innermost
  context wins); ``set_tensor_parallelism(module, enabled=True, **kwargs)`` marks an existing module and so its
  subtree (a mark deeper in the tree wins for its own subtree).

[Note: hooks take the module] SMP's ``init_hook`` translated the original ``__init__`` arguments; we swap
modules that already exist (possibly built long before any context), so ``init_hook(module)`` receives the
original *instance* and returns ``(args, kwargs)`` for ``dist_cls`` (sizes are read from it). Every distributed
class receives the tensor-parallel group as the keyword ``tp`` (a :class:`~lightning_mp.tp.TPGroup`) and the
mark's ``**kwargs``. ``forward_hook(args, kwargs) -> (args, kwargs)`` translates the call, and
``return_hook(output) -> output`` the result, as in SMP.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from torch import nn

__all__ = [
    "Registration",
    "TPMark",
    "registration_for",
    "set_tensor_parallelism",
    "tensor_parallelism",
    "tp_mark",
    "tp_register",
    "tp_register_with_module",
]

InitHook = Callable[[nn.Module], tuple[tuple, dict]]
ForwardHook = Callable[[tuple, dict], tuple[tuple, dict]]
ReturnHook = Callable[[Any], Any]

_MARK_ATTR = "_lmp_tp_mark"


@dataclass(frozen=True)
class Registration:
    """A distributed counterpart of a module class, with its hooks (see [Note: hooks take the module])."""

    dist_cls: type[nn.Module]
    init_hook: InitHook | None = None
    forward_hook: ForwardHook | None = None
    return_hook: ReturnHook | None = None


@dataclass(frozen=True)
class TPMark:
    """A module's tensor-parallel mark: ``enabled`` and the keyword arguments for its distributed counterpart."""

    enabled: bool = True
    kwargs: dict[str, Any] = field(default_factory=dict)


_registry: dict[type[nn.Module], Registration] = {}


def tp_register_with_module(
    module_cls: type[nn.Module],
    dist_cls: type[nn.Module],
    init_hook: InitHook | None = None,
    forward_hook: ForwardHook | None = None,
    return_hook: ReturnHook | None = None,
) -> None:
    """Register ``dist_cls`` as the distributed counterpart of ``module_cls`` (a later call replaces it).

    Raises:
        ValueError: if either is not an ``nn.Module`` subclass.
    """
    for name, cls in (("module_cls", module_cls), ("dist_cls", dist_cls)):
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise ValueError(f"`{name}` must be an nn.Module subclass, got {cls!r}.")
    _registry[module_cls] = Registration(dist_cls, init_hook, forward_hook, return_hook)


def tp_register(
    dist_cls: type[nn.Module],
    init_hook: InitHook | None = None,
    forward_hook: ForwardHook | None = None,
    return_hook: ReturnHook | None = None,
) -> Callable[[type[nn.Module]], type[nn.Module]]:
    """Class decorator form of :func:`tp_register_with_module`::

        @lightning_mp.tp_register(DistributedTransformerLayer, init_hook=lambda m: ((m.n_embd, m.n_head), {}))
        class MyBlock(nn.Module): ...
    """

    def decorate(module_cls: type[nn.Module]) -> type[nn.Module]:
        tp_register_with_module(module_cls, dist_cls, init_hook, forward_hook, return_hook)
        return module_cls

    return decorate


def registration_for(module: nn.Module) -> Registration | None:
    """The registration of ``type(module)``, exact class first, then its bases in MRO order."""
    for cls in type(module).__mro__:
        if cls in _registry:
            return _registry[cls]
    return None


def tp_mark(module: nn.Module) -> TPMark | None:
    """The mark set on this very module (not inherited), if any."""
    return module.__dict__.get(_MARK_ATTR)


def set_tensor_parallelism(module: nn.Module, enabled: bool = True, **kwargs: Any) -> nn.Module:
    """Mark ``module`` (and so its subtree) for tensor parallelism; the strategy swaps at setup. Returns it.

    Args:
        module: any module, e.g. a whole Hugging Face model (its ``tp_plan`` is then used).
        enabled: ``False`` keeps this subtree as it is (a deeper mark still wins below).
        **kwargs: passed to the distributed counterparts' constructors.
    """
    module.__dict__[_MARK_ATTR] = TPMark(enabled, dict(kwargs))
    return module


_context: contextvars.ContextVar[TPMark | None] = contextvars.ContextVar("lightning_mp_tp_context", default=None)


@contextlib.contextmanager
def tensor_parallelism(enabled: bool = True, **kwargs: Any) -> Iterator[None]:
    """Mark every module assigned as a child of another module inside this block (innermost block wins)."""

    def hook(parent: nn.Module, name: str, child: nn.Module | None) -> None:
        mark = _context.get()
        if child is not None and mark is not None and _MARK_ATTR not in child.__dict__:
            child.__dict__[_MARK_ATTR] = mark

    token = _context.set(TPMark(enabled, dict(kwargs)))
    handle = nn.modules.module.register_module_module_registration_hook(hook)
    try:
        yield
    finally:
        handle.remove()
        _context.reset(token)
