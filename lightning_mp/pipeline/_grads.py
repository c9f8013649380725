"""Gradients of the microbatches of a step are summed in microbatch order, whatever order their backwards ran in.

[Note: ordered gradient accumulation] Float addition is not associative, so ``((g0 + g1) + g2)`` and
``((g0 + g2) + g1)`` differ in the last bits. On one process microbatches accumulate in order; a pipeline stage runs
the backwards of several microbatches in the order they become ready, which can change from run to run (a tied
embedding on stage 0 accumulates when each microbatch's backward returns from stage 1). So each local parameter
gets a gradient hook: a microbatch's contribution is accumulated at once when every earlier microbatch has already
contributed to that parameter, and otherwise kept aside (autograd accumulates zeros instead) and added as soon as
the earlier ones have come, or at the end of the step. In the common case (backwards in order) nothing is kept;
a contribution kept aside costs one gradient-sized buffer until its turn. The result is the in-order sum, so
same-seed runs are bitwise equal and so are pipeline degrees. A microbatch may reach a parameter in several
backwards (a remote module called twice in one microbatch: each call's backward is its own request), and when its
last one comes is not known; so only a microbatch's first contribution takes part in the order, and its later ones
are summed per microbatch (in their arrival order, which one microbatch's dependencies fix) and added at the end
of the step in microbatch order, one gradient-sized buffer per such microbatch until then. Under ``"zero_bubble"`` the hooks fire on the
weight pass, where the parameters accumulate ([Note: zero-bubble] in ``_zero_bubble.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["OrderedGradients"]


@dataclass
class _Order:
    seen: set[int] = field(default_factory=set)
    prefix: int = 0  # every microbatch below this one has contributed
    kept: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    later: dict[int, torch.Tensor] = field(default_factory=dict)  # microbatch -> its 2nd, 3rd, ... contributions


class OrderedGradients:
    """In-microbatch-order gradient accumulation for a set of parameters (see [Note: ordered gradient accumulation]).

    Args:
        current_microbatch: the microbatch whose backward the calling thread runs (``None`` outside a step).
    """

    def __init__(self, current_microbatch: Callable[[], int | None]) -> None:
        self._current = current_microbatch
        self._lock = threading.Lock()
        self._orders: dict[nn.Parameter, _Order] = {}

    def register(self, params: Iterable[nn.Parameter]) -> None:
        for param in params:
            if param in self._orders or not param.requires_grad:
                continue
            self._orders[param] = _Order()
            param.register_hook(self._incoming(param))
            param.register_post_accumulate_grad_hook(self._accumulated)

    def report(
        self,
        params: Iterable[nn.Parameter],
        on_accumulated: Callable[[nn.Parameter, int], None],
        wanted: Callable[[], bool] = lambda: True,
    ) -> None:
        """After every accumulation into a parameter's ``.grad``, call ``on_accumulated(param, summed)`` while
        ``wanted()`` (checked first, so the count costs nothing while the listener is idle).

        ``summed``: how many microbatches, from 0 on, are all in ``param.grad`` (nothing of them kept aside). For a
        parameter ordered here it is the ordered prefix; for any other (one stage: microbatches run one after the
        other) the current microbatch plus one, or 0 where the hook runs outside a microbatch's task (e.g. on an
        accelerator's autograd thread). Register after :meth:`register`, so the ordering hook runs first.
        """
        for param in params:
            param.register_post_accumulate_grad_hook(lambda p: on_accumulated(p, self._summed(p)) if wanted() else None)

    def _summed(self, param: nn.Parameter) -> int:
        with self._lock:
            order = self._orders.get(param)
            if order is not None:
                return min(order.prefix, *order.later) if order.later else order.prefix
        microbatch = self._current()
        return 0 if microbatch is None else microbatch + 1

    def start_step(self) -> None:
        with self._lock:
            for param in self._orders:
                self._orders[param] = _Order()

    def end_step(self) -> None:
        """Add what is still kept aside, in microbatch order (some earlier microbatch never reached the parameter),
        then the later contributions, in microbatch order."""
        with self._lock:
            for param, order in self._orders.items():
                kept = [grad for microbatch in sorted(order.kept) for grad in order.kept[microbatch]]
                for grad in kept + [order.later[microbatch] for microbatch in sorted(order.later)]:
                    param.grad = grad if param.grad is None else param.grad.add_(grad)
                self._orders[param] = _Order()

    def _incoming(self, param: nn.Parameter) -> Callable[[torch.Tensor], torch.Tensor | None]:
        def hook(grad: torch.Tensor) -> torch.Tensor | None:
            microbatch = self._current()
            if microbatch is None:
                return None
            with self._lock:
                order = self._orders[param]
                if microbatch in order.seen:  # a later backward of the microbatch: summed apart, added at the end
                    later = order.later.get(microbatch)
                    order.later[microbatch] = grad if later is None else later + grad
                    return torch.zeros_like(grad)
                order.seen.add(microbatch)
                if microbatch == order.prefix:
                    return None  # in order: autograd accumulates it now
                order.kept.setdefault(microbatch, []).append(grad)
            return torch.zeros_like(grad)

        return hook

    def _accumulated(self, param: nn.Parameter) -> None:
        with self._lock:
            order = self._orders[param]
            while order.prefix in order.seen:
                for grad in order.kept.pop(order.prefix, []):
                    param.grad.add_(grad)
                order.prefix += 1
