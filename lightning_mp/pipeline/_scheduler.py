"""Which task computes next on a rank: one compute token, granted by priority.

[Note: one compute token per rank] Every task on a rank (a driver microbatch, a served forward or backward
request) runs in its own thread but computes only while it holds the rank's single compute token. A task that
waits for a remote stage gives the token back, and the waiting task with the best priority gets it. So a rank
behaves like SMP's execution server (paper section 3.2): it switches to another microbatch whenever the
current one pauses on communication, never oversubscribes its cores, and runs tasks in an order set by
priorities, not by thread timing. Priorities are ``(phase, microbatch, arrival)``: with the "interleaved"
schedule backward work (phase 0) beats forward work (phase 1), then lower microbatches first.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["ComputeToken", "Priority"]

Priority = tuple[int, ...]


class ComputeToken:
    """A lock granted to the waiting thread with the smallest priority tuple.

    Args:
        check_failed: called while waiting; raise from it to abort every waiter (e.g. a peer died).
        poll_s: how often (seconds) waiters re-check ``check_failed``.

    Attributes:
        on_release: if set, called by the releasing thread with the ``time.perf_counter()`` at which it had
            acquired the token (the engine records compute spans for the timeline with it).
    """

    def __init__(self, check_failed: Callable[[], None], poll_s: float = 0.5) -> None:
        self._cv = threading.Condition()
        self._holder: int | None = None
        self._queue: list[tuple[Priority, int, int]] = []
        self._arrival = itertools.count()
        self._check_failed = check_failed
        self._poll_s = poll_s
        self._since = 0.0
        self.on_release: Callable[[float], None] | None = None

    def acquire(self, priority: Priority) -> None:
        """Block until this thread holds the token."""
        me = threading.get_ident()
        entry = (priority, next(self._arrival), me)
        with self._cv:
            heapq.heappush(self._queue, entry)
            try:
                while self._holder is not None or self._queue[0] is not entry:
                    self._cv.wait(self._poll_s)
                    self._check_failed()
            except BaseException:
                self._queue.remove(entry)
                heapq.heapify(self._queue)
                self._cv.notify_all()
                raise
            heapq.heappop(self._queue)
            self._holder = me
            self._since = time.perf_counter()

    def release(self) -> bool:
        """Give the token back if this thread holds it. Returns whether it did."""
        with self._cv:
            if self._holder != threading.get_ident():
                return False
            self._holder = None
            since = self._since
            self._cv.notify_all()
        if self.on_release is not None:
            self.on_release(since)
        return True

    @contextmanager
    def hold(self, priority: Priority) -> Iterator[None]:
        """Hold the token for the body."""
        self.acquire(priority)
        try:
            yield
        finally:
            self.release()

    @contextmanager
    def paused(self, priority: Priority) -> Iterator[None]:
        """Give the token away for the body (a wait on communication), then take it back if it was held."""
        held = self.release()
        try:
            yield
        finally:
            if held:
                self.acquire(priority)
