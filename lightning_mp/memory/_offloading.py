"""Activation offloading (SMP's ``offload_activations`` / ``activation_loading_horizon``), torch only.

The inputs a checkpointed module saves for its recompute are packed to host memory right after its forward and
loaded back before its backward (:class:`torch.autograd.graph.saved_tensors_hooks`, entered around the
checkpointed call, so only those inputs are offloaded: everything inside the checkpoint is recomputed). Loads are
issued ``horizon`` tasks ahead, a task being one checkpointed module call (SMP's unit: one module execution of
one microbatch): when backward unpacks an entry, the rest of its call's entries and every entry of the next
``horizon`` calls that microbatch will need (those packed before it) are loaded too. Queues are per microbatch, so under the
interleaved schedule a microbatch's backward never waits on another's loads. On CUDA copies go to pinned host
memory on a side stream; on CPU the same bookkeeping runs with real copies (the original is dropped at pack).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import saved_tensors_hooks

__all__ = ["ActivationOffloader", "OffloadStats"]


@dataclass
class OffloadStats:
    """Counters of an :class:`ActivationOffloader` (for tests and benchmarks).

    Attributes:
        packs: tensors moved to host.
        unpacks: tensors handed back to autograd.
        prefetches: loads issued ahead of their unpack.
        host_bytes: bytes currently held on host.
        max_host_bytes: the peak of ``host_bytes``.
        unpack_order: ``(microbatch, pack index)`` of every unpack, in order.
    """

    packs: int = 0
    unpacks: int = 0
    prefetches: int = 0
    host_bytes: int = 0
    max_host_bytes: int = 0
    unpack_order: list[tuple[Hashable, int]] = field(default_factory=list)


class _Entry:
    __slots__ = ("device", "host", "index", "loaded", "microbatch", "nbytes", "task")

    def __init__(
        self, microbatch: Hashable, index: int, host: torch.Tensor, device: torch.device, task: Hashable
    ) -> None:
        self.microbatch, self.index, self.host, self.device, self.task = microbatch, index, host, device, task
        self.nbytes = host.numel() * host.element_size()
        self.loaded: torch.Tensor | None = None


class ActivationOffloader:
    """Pack saved activations to host memory, load them back ``horizon`` tasks ahead of backward.

    Args:
        horizon: how many tasks of one microbatch are loaded ahead of the one backward needs (>= 1).
        microbatch_fn: returns the running microbatch (so queues are per microbatch); ``None``: one queue.

    Raises:
        ValueError: if ``horizon < 1``.
    """

    def __init__(self, horizon: int = 4, microbatch_fn: Callable[[], Hashable] | None = None) -> None:
        if not isinstance(horizon, int) or horizon < 1:
            raise ValueError(f"`horizon` must be an integer >= 1, got {horizon!r}.")
        self.horizon = horizon
        self._microbatch_fn = microbatch_fn or (lambda: 0)
        self._calls = 0  # checkpointed calls entered so far (each one task)
        self._local = threading.local()  # the call this thread is in (engine threads run calls concurrently)
        self._pending: dict[Hashable, list[_Entry]] = {}  # packed, not yet unpacked, in pack order
        self._count: dict[Hashable, int] = {}
        self.stats = OffloadStats()
        self._stream: torch.cuda.Stream | None = None

    @contextmanager
    def saved_tensors_hooks(self) -> Iterator[None]:
        """The hooks to enter around a checkpointed call (one task: its entries are loaded together)."""
        self._calls += 1
        previous = getattr(self._local, "call", None)
        self._local.call = self._calls
        try:
            with saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._local.call = previous

    def _pack(self, tensor: torch.Tensor) -> _Entry | torch.Tensor:
        if tensor.numel() == 0 or isinstance(tensor, torch.nn.Parameter):
            return tensor  # the checkpoint's empty marker, or weights: nothing to gain
        microbatch = self._microbatch_fn()
        index = self._count.get(microbatch, 0)
        self._count[microbatch] = index + 1
        call = getattr(self._local, "call", None)
        task = (microbatch, "entry", index) if call is None else (microbatch, "call", call)
        entry = _Entry(microbatch, index, self._to_host(tensor), tensor.device, task)
        self._pending.setdefault(microbatch, []).append(entry)
        self.stats.packs += 1
        self.stats.host_bytes += entry.nbytes
        self.stats.max_host_bytes = max(self.stats.max_host_bytes, self.stats.host_bytes)
        return entry

    def _unpack(self, packed: _Entry | torch.Tensor) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        pending = self._pending.get(packed.microbatch, [])
        if packed in pending:
            position = pending.index(packed)
            tasks = [packed.task]  # this task, then the next `horizon` ones in backward (reverse pack) order
            for entry in reversed(pending[:position]):
                if entry.task not in tasks:
                    if len(tasks) > self.horizon:
                        break
                    tasks.append(entry.task)
            for ahead in pending:
                if ahead is not packed and ahead.task in tasks and ahead.loaded is None:
                    self._load(ahead)
                    self.stats.prefetches += 1
            pending.pop(position)
        if packed.loaded is None:
            self._load(packed)
        self.stats.unpacks += 1
        self.stats.unpack_order.append((packed.microbatch, packed.index))
        loaded = packed.loaded
        assert loaded is not None
        if loaded.device.type == "cuda":  # made on the side stream, used on the current one
            current = torch.cuda.current_stream(loaded.device)
            current.wait_stream(self._side_stream(loaded.device))
            loaded.record_stream(current)
        return loaded

    def _to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type != "cuda":
            return tensor.detach().clone()  # CPU: a real copy, the original is dropped with the autograd ref
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        stream = self._side_stream(tensor.device)
        stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(stream):
            host.copy_(tensor, non_blocking=True)
        tensor.record_stream(stream)
        return host

    def _load(self, entry: _Entry) -> None:
        if entry.device.type != "cuda":
            entry.loaded = entry.host.clone()
        else:
            with torch.cuda.stream(self._side_stream(entry.device)):
                entry.loaded = entry.host.to(entry.device, non_blocking=True)
        entry.host = torch.empty(0)
        self.stats.host_bytes -= entry.nbytes

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def reset(self) -> None:
        """Forget entries never unpacked (e.g. after a step that did not run backward)."""
        self._pending.clear()
        self._count.clear()
        self.stats.host_bytes = 0
