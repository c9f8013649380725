"""Module state that forward updates (BatchNorm running statistics, counters) is updated in microbatch order.

[Note: ordered module state] One process with gradient accumulation updates a ``BatchNorm``'s running statistics
microbatch after microbatch. A pipeline stage runs the forwards of several microbatches in whatever order they
become ready, so its running statistics came out in another order (differing from one process by up to 1e-2 on
a ResNet, and from run to run). We cannot make every forward wait for the previous microbatch without losing the
pipeline's overlap, so the *update* is deferred instead: a module whose forward writes its own buffers (found from
the buffers' version counters and values when the model is traced, see ``ModuleRecord.updates_buffers``) runs as usual, but
its buffers are put back as they were right after the call, and the call (module, inputs) is kept. Once a
microbatch is final on a rank (its backward started there, so its forward is over everywhere) and every earlier
microbatch has been committed, its kept calls are run again in order, under ``no_grad``, on the real buffers:
the same op on the same input in the same order gives bitwise the one-process statistics. This assumes what holds
for normalisation layers in training mode: the call's output does not depend on the buffers it updates. A call
repeated by activation checkpointing's recompute (in backward) has its update undone and is not kept, so
recompute does not count a microbatch twice. The extra cost is one more forward of those modules (elementwise for
BatchNorm); the kept inputs are the ones autograd keeps for their backward anyway.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["OrderedStateUpdates"]


@dataclass
class _KeptCall:
    module: nn.Module
    args: tuple
    kwargs: dict
    versions: list[tuple[torch.Tensor, int]]


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in _tensors(item)]
    if isinstance(obj, dict):
        return [t for item in obj.values() for t in _tensors(item)]
    return []


class OrderedStateUpdates:
    """Defers and replays in-forward buffer updates in microbatch order (see [Note: ordered module state]).

    Args:
        forward_context: the context the engine runs forwards in (e.g. autocast); replays run in it too.
    """

    def __init__(self, forward_context: Callable[[], AbstractContextManager] = nullcontext) -> None:
        self.forward_context = forward_context
        self._lock = threading.Lock()
        self._kept: dict[int, list[_KeptCall]] = {}
        self._final: set[int] = set()
        self._committed = 0
        self._in_flight: set[int] = set()
        self._warned: set[str] = set()

    def start_step(self) -> None:
        with self._lock:
            self._kept, self._final, self._committed, self._in_flight = {}, set(), 0, set()

    def before(self, module: nn.Module) -> list[tuple[str, torch.Tensor, int]] | None:
        """Snapshot the module's buffers before its forward (``None``: this call is not deferred)."""
        with self._lock:
            if id(module) in self._in_flight:  # a second call while the first waits on another stage
                self._warn_once(
                    "overlap",
                    f"{type(module).__name__} was called again while an earlier call of it was still running; its"
                    " buffer updates of these calls are applied in the order they happen, not in microbatch order.",
                )
                return None
            self._in_flight.add(id(module))
        return [(name, buf.detach().clone(), buf._version) for name, buf in module.named_buffers(recurse=False)]

    def after(
        self, module: nn.Module, snapshot: list[tuple[str, torch.Tensor, int]], microbatch: int | None, args: tuple, kwargs: dict
    ) -> None:
        """Undo the call's buffer writes; keep the call for its microbatch (``None``: drop it, e.g. a recompute)."""
        with self._lock:
            self._in_flight.discard(id(module))
        buffers = dict(module.named_buffers(recurse=False))
        # Some kernels write a buffer without bumping its version (native_batch_norm's running statistics), so
        # values are compared too, and every buffer of the module is put back once any changed.
        if all(buffers[name]._version == version and torch.equal(buffers[name], saved) for name, saved, version in snapshot):
            return
        with torch.no_grad():
            for name, saved, _ in snapshot:
                # Through ``.data``: the version stays, as autograd saved these buffers for the call's backward.
                buffers[name].data.copy_(saved)
        if microbatch is None:
            return
        versions = [(t, t._version) for t in _tensors((args, kwargs))]
        with self._lock:
            self._kept.setdefault(microbatch, []).append(_KeptCall(module, args, kwargs, versions))

    def finalize(self, microbatch: int) -> None:
        """``microbatch``'s forward is over: commit it and every later final one that is next in order."""
        with self._lock:
            self._final.add(microbatch)
            ready = []
            while self._committed in self._final:
                ready.append(self._kept.pop(self._committed, []))
                self._committed += 1
        for calls in ready:
            self._replay(calls)

    def end_step(self) -> None:
        """Commit whatever is left, in microbatch order (a rank that ran no backward for some microbatch)."""
        with self._lock:
            remaining = [self._kept[k] for k in sorted(self._kept)]
            self._kept, self._final = {}, set()
        for calls in remaining:
            self._replay(calls)

    def _replay(self, calls: list[_KeptCall]) -> None:
        for call in calls:
            if any(t._version != version for t, version in call.versions):
                self._warn_once(
                    "inplace",
                    f"An input of {type(call.module).__name__} was modified in place after its forward; its buffer"
                    " update is replayed on the modified value.",
                )
            with torch.no_grad(), self.forward_context():
                call.module.forward(*call.args, **call.kwargs)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, stacklevel=3)
