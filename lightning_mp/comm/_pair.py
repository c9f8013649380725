"""The pair plane: tensor bytes over one 2-rank group per ordered pair of stages, every call issued by one thread.

NCCL's point-to-point rules and how this plane keeps them: [Note: two planes] in ``_planes.py``. The NCCL backend
lives here; the strict mock that runs the same code path on gloo is in ``_strict_mock.py``.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_mp.comm._planes import DataPlaneError, StrictMockError
from lightning_mp.comm._wire import Packed, gather

__all__ = ["PairDataPlane", "PairGroups"]

_POLL_S = 0.05


@dataclass(frozen=True)
class PairGroups:
    """This rank's 2-rank groups, one per ordered pair of its pipeline's stages.

    Attributes:
        stage: this rank's stage.
        global_ranks: the global rank of each stage of this rank's pipeline.
        groups: ``(src stage, dst stage) -> group`` for every pair this rank is in; ``src`` only sends on it.
        backend: ``"nccl"`` or ``"gloo"`` (the strict mock).
    """

    stage: int
    global_ranks: list[int]
    groups: dict[tuple[int, int], dist.ProcessGroup]
    backend: str


@dataclass
class _Pending:
    work: Any
    buffer: torch.Tensor
    since: float
    what: str


_STOP = object()


class _CommThread:
    """The one thread of this process that issues every call of a pair plane (NCCL rule 3 of [Note: two planes]).

    Sends are fire-and-forget (rule 4): the thread keeps each send's work and buffer until the work completes; a
    send not completed within ``watchdog_s`` fails the plane (NCCL's own watchdog would abort the process).
    """

    def __init__(self, device: torch.device, watchdog_s: float) -> None:
        self.device = device
        self.watchdog_s = watchdog_s
        self.error: BaseException | None = None
        self._ops: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: collections.deque[_Pending] = collections.deque()
        self._started = threading.Event()
        self.send_stream: torch.cuda.Stream | None = None
        self.recv_stream: torch.cuda.Stream | None = None
        self._thread = threading.Thread(target=self._loop, daemon=True, name="smp-comm")
        self._thread.start()
        self._started.wait()
        self.ident = self._thread.ident

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the communication thread and return its result (or raise its error)."""
        self.raise_if_failed()
        done, box = threading.Event(), []
        self._ops.put((fn, args, done, box))
        deadline = time.monotonic() + self.watchdog_s
        while not done.wait(_POLL_S):
            self.raise_if_failed()
            if time.monotonic() > deadline:
                raise DataPlaneError(f"The communication thread did not run {fn.__name__} within {self.watchdog_s:.0f} s.")
        result, error = box
        if error is not None:
            raise error
        return result

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the communication thread without waiting; a failure fails the plane."""
        self.raise_if_failed()
        self._ops.put((fn, args, None, None))

    def keep(self, work: Any, buffer: torch.Tensor, what: str) -> None:
        """Keep ``buffer`` alive until ``work`` completes (called on the communication thread)."""
        self._pending.append(_Pending(work, buffer, time.monotonic(), what))

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise DataPlaneError(str(self.error)) from self.error

    def fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error

    def close(self) -> None:
        """Wait (at most the watchdog) for the sends in flight, then stop the thread."""
        self._ops.put(_STOP)
        self._thread.join(self.watchdog_s + 1.0)

    def _loop(self) -> None:
        if self.device.type == "cuda":  # every thread that issues CUDA work names its device
            torch.cuda.set_device(self.device)
            # Rule 5: sends and receives each wait on their own stream, never on the default one (see PairDataPlane).
            self.send_stream, self.recv_stream = torch.cuda.Stream(self.device), torch.cuda.Stream(self.device)
            torch.cuda.set_stream(self.send_stream)
        self._started.set()
        stopping = False
        while True:
            try:
                op = self._ops.get(timeout=_POLL_S)
            except queue.Empty:
                op = None
            if op is _STOP:
                stopping = True
            elif op is not None:
                self._run(*op)
            self._reap()
            if stopping and (not self._pending or self.error is not None):
                return

    def _run(self, fn: Callable[..., Any], args: tuple, done: threading.Event | None, box: list | None) -> None:
        try:
            result, error = fn(*args), None
        except BaseException as err:  # handed to the caller, or fails the plane
            result, error = None, err
            if done is None:
                self.fail(err)
        if done is not None:
            box.extend((result, error))
            done.set()

    def _reap(self) -> None:
        while self._pending and self._pending[0].work.is_completed():
            self._pending.popleft()
        if self._pending and self.error is None:
            oldest = self._pending[0]
            if time.monotonic() - oldest.since > self.watchdog_s:
                self.fail(
                    DataPlaneError(
                        f"Watchdog: {oldest.what} did not complete within {self.watchdog_s:.0f} s: its receive was"
                        " never posted (the peer is gone or stuck, or the protocol posted receives out of order)."
                    )
                )


def _connect_pairs(pairs: PairGroups, device: torch.device) -> None:
    """Connect every pair group of this rank, in the one global order (each pair's two ranks take it in turn:
    the smallest pair not yet connected always has both its ranks waiting on it, so this cannot deadlock)."""
    for (src, dst), group in sorted(pairs.groups.items()):
        probe = torch.ones(1, dtype=torch.uint8, device=device)
        if src == pairs.stage:
            work = dist.isend(probe, dst=pairs.global_ranks[dst], group=group)
        else:
            work = dist.irecv(probe, src=pairs.global_ranks[src], group=group)
        work.wait()


def _check_thread(ident: int | None, what: str) -> None:
    if threading.get_ident() != ident:
        raise StrictMockError(
            f"One issuing thread: {what} was issued from thread {threading.current_thread().name!r}, not the"
            " communication thread. NCCL forbids concurrent calls on a communicator; every call goes through"
            " _CommThread."
        )


class _NcclBackend:
    """Point-to-point NCCL calls on the pair groups (rules 1-5 of [Note: two planes])."""

    name = "nccl"

    def __init__(self, pairs: PairGroups) -> None:
        self.pairs = pairs
        self.issuer: int | None = None

    def warm_up(self, device: torch.device) -> None:
        _connect_pairs(self.pairs, device)  # NCCL creates a communicator on its first call

    def isend(self, buffer: torch.Tensor, dst: int, seq: int) -> Any:
        _check_thread(self.issuer, f"the send of message {seq} to stage {dst}")
        group = self.pairs.groups[(self.pairs.stage, dst)]
        return dist.isend(buffer, dst=self.pairs.global_ranks[dst], group=group)

    def header_read(self, src: int, seq: int, nbytes: int) -> None:
        pass

    def irecv(self, buffer: torch.Tensor, src: int, seq: int) -> Any:
        _check_thread(self.issuer, f"the receive of message {seq} from stage {src}")
        group = self.pairs.groups[(src, self.pairs.stage)]
        return dist.irecv(buffer, src=self.pairs.global_ranks[src], group=group)

    def wait_recv(self, work: Any, src: int, seq: int, timeout_s: float) -> None:
        # Work.wait on NCCL makes the *calling* thread's current stream wait for the receive (no NCCL call, no
        # host block): the bytes are then unpacked on that stream.
        work.wait()


class PairDataPlane:
    """Tensor bytes over one 2-rank group per ordered pair, every call issued by one communication thread.

    The NCCL plane (``backend`` an NCCL backend, CUDA buffers) and the strict mock (gloo, CPU buffers) share this
    code: packing, sequence numbers, the communication thread, buffer lifetimes and stream ordering.

    Args:
        backend: ``_NcclBackend`` or ``_strict_mock.StrictMockBackend`` over this rank's :class:`PairGroups`.
        device: where wire buffers live (the rank's CUDA device for NCCL, ``cpu`` for the mock).
        timeout_s: how long a receive waits for its bytes, and the send watchdog.
    """

    def __init__(self, backend: Any, device: torch.device, timeout_s: float) -> None:
        self.backend = backend
        self.name = backend.name
        self.device = device
        self.timeout_s = timeout_s
        self.comm = _CommThread(device, timeout_s)
        backend.issuer = self.comm.ident
        backend.comm = self.comm
        self.comm.call(self._warm_up)  # on the communication thread: it issues every call, the first ones too

    def _warm_up(self) -> None:
        self.backend.warm_up(self.device)
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()

    def gather(self, packed: Packed) -> tuple[torch.Tensor, Any]:
        buffer = torch.empty(packed.data_nbytes, dtype=torch.uint8, device=self.device)
        gather(packed, buffer)
        ready = None
        if self.device.type == "cuda":  # rule 5: recorded before the header is sent
            ready = torch.cuda.Event()
            ready.record()
        return buffer, ready

    def header_read(self, src: int, seq: int, nbytes: int) -> None:
        self.backend.header_read(src, seq, nbytes)

    def send(self, wire: tuple[torch.Tensor, Any], dst: int, seq: int) -> None:
        self.comm.post(self._issue_send, wire, dst, seq)

    def _issue_send(self, wire: tuple[torch.Tensor, Any], dst: int, seq: int) -> None:
        buffer, ready = wire
        if ready is not None:
            torch.cuda.current_stream().wait_event(ready)
        work = self.backend.isend(buffer, dst, seq)
        self.comm.keep(work, buffer, f"the send of message {seq} to stage {dst} ({buffer.numel()} bytes)")

    def recv(self, nbytes: int, src: int, seq: int) -> torch.Tensor:
        # Allocated on this thread's current stream, where it is unpacked; NCCL keeps it for its own stream. The
        # receive waits for this stream's work so far (the block may have been freed by a kernel still running),
        # on the communication thread's *receive* stream: the send stream must not inherit that wait, or a send
        # that came before this stream's wait on some other receive could end up waiting on it (a cycle).
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        work = self.comm.call(self._issue_recv, buffer, ready, src, seq)
        self.backend.wait_recv(work, src, seq, self.timeout_s)
        self.comm.raise_if_failed()
        return buffer

    def _issue_recv(self, buffer: torch.Tensor, ready: Any, src: int, seq: int) -> Any:
        if ready is None:
            return self.backend.irecv(buffer, src, seq)
        with torch.cuda.stream(self.comm.recv_stream):
            self.comm.recv_stream.wait_event(ready)
            return self.backend.irecv(buffer, src, seq)

    def close(self) -> None:
        self.comm.close()
