"""Which task computes next on a rank: one compute token, granted by priority.

[Note: one compute token per rank] Every task on a rank (a driver microbatch, a served forward or backward
request) runs in its own thread but computes only while it holds the rank's single compute token. A task that
waits for a remote stage gives the token back, and the waiting task with the best priority gets it. So a rank
behaves like SMP's execution server (paper section 3.2): it switches to another microbatch whenever the
current one pauses on communication, never oversubscribes its cores, and runs tasks in an order set by
priorities, not by thread timing. The engine sets the priorities (smaller first, ties by arrival): "simple" runs
``(phase, microbatch)``, "interleaved" the 1F1B order of [Note: 1F1B priorities] (:func:`priority`, below).

[Note: deterministic order] Priorities alone still let arrival times decide between tasks that become ready
at different moments. Ranks that must execute module calls in the same order (one tensor-parallel group, or the
same stage of several data-parallel replicas whose modules enter collectives together) share one order: a
*leader* grants by priority as above and publishes the key of every grant; the *followers* grant exactly the
task with that key next, waiting for it to arrive if needed. A key names a task independently of the rank
(``("mb", microbatch, phase)`` or ``("call", call_id, kind)``, plus how many times that task took the token),
so it matches across ranks as long as they make the same calls. A follower that waits longer than the timeout
for a key that never comes raises (the ranks' control flow diverged).
"""

from __future__ import annotations

import collections
import heapq
import itertools
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager

from lightning_mp.pipeline._messages import Phase, Task

__all__ = ["ComputeToken", "GrantOrder", "OrderDivergedError", "Priority", "priority"]

Priority = tuple[int, ...]


def priority(task: Task, schedule: str, stage: int, num_stages: int) -> Priority:
    """Which ready task computes first on ``stage`` of ``num_stages`` (smaller first). See [Note: 1F1B priorities].

    Args:
        task: the task asking for the compute token.
        schedule: ``"simple"`` (GPipe: backward before forward, then by microbatch), ``"interleaved"`` (1F1B) or
            ``"zero_bubble"`` (1F1B's order for forwards and input passes, each weight pass after the next backward).
    """
    if schedule == "simple":
        return (task.phase, task.microbatch)
    if task.phase == Phase.FORWARD:
        return (2 * task.microbatch, task.phase)
    if task.phase == Phase.WEIGHT:
        return (2 * (task.microbatch + num_stages - stage) + 1, task.phase)
    return (2 * (task.microbatch + num_stages - stage) - 1, task.phase)


# [Note: 1F1B priorities] With ``pipeline="interleaved"`` a rank picks among its *ready* tasks the one that 1F1B
# (PipeDream-Flush, Narayanan et al. 2021; torch.distributed.pipelining's Schedule1F1B) would run first: on stage
# s of P, forward of microbatch j sorts at 2j and backward of microbatch k at 2(k + P - s) - 1, which gives
# F0 .. F(P-s-1) then B0 F(P-s) B1 F(P-s+1) ... (the last stage alternates F0 B0 F1 B1 ...). Unlike a static
# 1F1B schedule the order is work-conserving: when the preferred task is not ready (its message has not
# arrived, or the call graph is not a chain), the next ready one runs instead. Plain "backward first" starved the
# later stages: stage 0 ran every ready backward before feeding the next forward downstream, and stage 1 sat idle
# (benchmarks/pipeline_vs_torch.py measures the schedules). With ``pipeline="zero_bubble"`` the weight pass of
# backward k (Phase.WEIGHT, [Note: zero-bubble] in ``_zero_bubble.py``) sorts at 2(k + P - s) + 1, after backward
# k + 1 and before forward k + P - s + 1: ... B(k) F(k+P-s) B(k+1) W(k) F(k+P-s+1) ..., and any wait for a message
# runs the pending weight passes (ZB-H1's order, Qi et al. 2023, with one weight pass pending beyond 1F1B's memory).


class OrderDivergedError(RuntimeError):
    """A follower was told to run a task that never arrived on it, or was told nothing for the timeout while a task
    waited (see [Note: deterministic order])."""


class GrantOrder:
    """How a :class:`ComputeToken` orders its grants: as the leader (publishing) or as a follower.

    Args:
        publish: leader only: called by the granted thread with the grant's key, before it computes.
        timeout_s: follower only: how long to wait for the task the leader ran next, or for any grant while a task
            waits here, before raising.
    """

    def __init__(self, *, publish: Callable[[Hashable], None] | None, timeout_s: float) -> None:
        self.publish = publish
        self.timeout_s = timeout_s

    @property
    def is_leader(self) -> bool:
        return self.publish is not None


class ComputeToken:
    """A lock granted to the waiting thread with the smallest priority tuple.

    Args:
        check_failed: called while waiting; raise from it to abort every waiter (e.g. a peer died).
        poll_s: how often (seconds) waiters re-check ``check_failed``.

    Attributes:
        on_release: if set, called by the releasing thread with the ``time.perf_counter()`` at which it had
            acquired the token (the engine records compute spans for the timeline with it).
        after_acquire: if set, called by a thread right after it took the token (before it computes).
        before_release: if set, called by the holder right before it gives the token up (while no other thread
            can compute), e.g. to save per-task state of process-wide objects (see [Note: microbatch RNG streams]).
        flush: if set, called by the holder's thread when it gives the token up, unless told not to (``paused``),
            with the giving up itself, which it must call exactly once, and when it hands the token over
            (``handover``, holding it) with a no-op: the engine takes the one-way calls the holder held, gives the
            token up and sends them, so another task computes meanwhile ([Note: coalesced one-way calls] in
            ``_core.py``). It must not raise.
    """

    def __init__(self, check_failed: Callable[[], None], poll_s: float = 0.5) -> None:
        # One lock; each waiter sleeps on its own condition of it and only the waiter that may take the token next
        # is woken, instead of every waiter on every release (measured: 11% fewer context switches per run of the
        # 2-stage benchmark; most of the rest are message and thread wake-ups).
        self._lock = threading.Lock()
        self._holder: int | None = None
        self._queue: list[tuple] = []  # heap of (priority, arrival, thread id, key, condition)
        self._arrival = itertools.count()
        self._check_failed = check_failed
        self._poll_s = poll_s
        self._since = 0.0
        self.on_release: Callable[[float], None] | None = None
        self.after_acquire: Callable[[], None] | None = None
        self.before_release: Callable[[], None] | None = None
        self.flush: Callable[[Callable[[], None]], None] | None = None
        self.order: GrantOrder | None = None
        self._decided: collections.deque[Hashable] = collections.deque()
        self._stalled: tuple[str, float] | None = None  # follower: (which stall, since when), see below
        self._leader_done = False

    def leader_done(self) -> None:
        """Follower: the leader finished its step; a task still waiting here was never run there."""
        with self._lock:
            self._leader_done = True
            for entry in self._queue:
                entry[4].notify()

    def decide(self, key: Hashable) -> None:
        """Follower: the leader granted ``key``; grant the same task next here."""
        with self._lock:
            self._decided.append(key)
            self._wake_next()

    def _wake_next(self) -> None:
        """Wake the one waiter that may take the token now, if any (lock held)."""
        if self._holder is not None or not self._queue:
            return
        if self.order is None or self.order.is_leader:
            self._queue[0][4].notify()
        elif self._decided:
            for entry in self._queue:
                if entry[3] == self._decided[0]:
                    entry[4].notify()
                    return

    def _may_take(self, entry: tuple) -> bool:
        if self._holder is not None:
            return False
        if self.order is None or self.order.is_leader:
            return self._queue[0] is entry
        return bool(self._decided) and self._decided[0] == entry[3]

    def _check_follower_stalled(self) -> None:
        """Follower: raise once one stall has lasted the timeout (or at once if the leader finished without us)."""
        if self.order is None or self.order.is_leader:
            return
        stall = self._follower_stall()
        if stall is None:
            self._stalled = None
            return
        kind, message = stall
        now = time.monotonic()
        if self._stalled is None or self._stalled[0] != kind:
            self._stalled = (kind, now)
        elif now - self._stalled[1] > self.order.timeout_s:
            raise OrderDivergedError(message)

    def _follower_stall(self) -> tuple[str, str] | None:
        """What keeps this follower from progressing, as (kind, error message), or None (lock held)."""
        timeout = f"{self.order.timeout_s:.0f} s"
        if self._decided:
            head = self._decided[0]
            if any(entry[3] == head for entry in self._queue):
                return None
            return "missing", (
                f"The order leader ran task {head!r} next, but it did not arrive on this rank within {timeout}."
                " Ranks that share an execution order (one tensor-parallel group, or one stage of several"
                " data-parallel replicas with `deterministic_order=True`) must make the same module calls;"
                " data-dependent control flow that differs between them cannot be ordered."
            )
        if not self._queue or self._holder is not None:
            return None
        if self._leader_done:
            raise OrderDivergedError(
                f"This rank has task {self._queue[0][3]!r} to run, but the order leader finished the step"
                " without it. Ranks that share an execution order must make the same module calls."
            )
        return "no grant", (
            f"This rank has task {self._queue[0][3]!r} ready, but the order leader granted nothing for {timeout}:"
            " it is stuck or gone, or it waits for work that this rank never sends it. Ranks that share an"
            " execution order must make the same module calls."
        )

    def acquire(self, priority: Priority, key: Hashable = None) -> None:
        """Block until this thread holds the token.

        Args:
            priority: smaller goes first (leader or unordered token).
            key: this grant's rank-independent name; required when :attr:`order` is set.

        Raises:
            OrderDivergedError: follower only, see :class:`GrantOrder`.
        """
        me = threading.get_ident()
        entry = (priority, next(self._arrival), me, key, threading.Condition(self._lock))
        with self._lock:
            heapq.heappush(self._queue, entry)
            try:
                while not self._may_take(entry):
                    entry[4].wait(self._poll_s)
                    self._check_failed()
                    self._check_follower_stalled()
            except BaseException:
                self._queue.remove(entry)
                heapq.heapify(self._queue)
                self._wake_next()
                raise
            self._queue.remove(entry)
            heapq.heapify(self._queue)
            if self.order is not None and not self.order.is_leader:
                self._decided.popleft()
                self._stalled = None
            self._holder = me
            self._since = time.perf_counter()
        if self.order is not None and self.order.is_leader:
            self.order.publish(key)
        if self.after_acquire is not None:
            self.after_acquire()

    def release(self, flush: bool = True) -> bool:
        """Give the token back if this thread holds it (through ``flush`` unless told not to). Returns whether it
        did."""
        if self._holder != threading.get_ident():  # only the holder itself changes a holder that is this thread
            return False
        if not flush or self.flush is None:
            return self._release()
        released: list[bool] = []
        self.flush(lambda: released.append(self._release()))
        return released[0]

    def _release(self) -> bool:
        if self.before_release is not None:
            self.before_release()
        with self._lock:
            if self._holder != threading.get_ident():
                return False
            self._holder = None
            since = self._since
            self._wake_next()
        if self.on_release is not None:
            self.on_release(since)
        return True

    def handover(self, priority: Priority, key: Hashable = None) -> None:
        """The holder goes on with other work of ``priority``: it keeps the token unless a better task waits.

        Without an order this costs nothing when no better task waits; with an order
        (leader or follower) the token is given back and taken again, so the grant is published / followed.
        Records the span so far (``on_release``) when the token is kept, as if it had been released. Calls ``flush``
        first, holding the token.
        """
        if self.flush is not None:
            self.flush(lambda: None)
        me = threading.get_ident()
        with self._lock:
            if self._holder != me:
                raise RuntimeError("handover() called by a thread that does not hold the compute token.")
            keep = self.order is None and (not self._queue or self._queue[0][0] >= priority)
            if keep:
                since, self._since = self._since, time.perf_counter()
        if keep:
            if self.on_release is not None:
                self.on_release(since)
            return
        self.release(flush=False)
        self.acquire(priority, key)

    @contextmanager
    def hold(self, priority: Priority, key: Hashable = None) -> Iterator[None]:
        """Hold the token for the body."""
        self.acquire(priority, key)
        try:
            yield
        finally:
            self.release()

    @contextmanager
    def paused(self, priority: Priority, key: Hashable = None, flush: bool = True) -> Iterator[None]:
        """Give the token away for the body (a wait on communication), then take it back if it was held.
        ``flush=False``: the body sends a message itself, which does what ``flush`` would."""
        held = self.release(flush)
        try:
            yield
        finally:
            if held:
                self.acquire(priority, key)
