"""Data planes: how the tensor bytes of a message travel between pipeline stages.

[Note: two planes] A message is a header (pickled skeleton, shapes, dtypes, byte counts, a per-pair sequence
number) and one data frame (every tensor's bytes packed into one aligned buffer). Headers always go over a CPU
gloo group, the *control plane*, where a receiver thread may sit in an always-posted receive (what the engine's
listeners do). The data frame goes over a *data plane*:

- :class:`GlooDataPlane`: over the same gloo group; CUDA tensors are staged through pinned host buffers
  (device to host on the sender's current stream, awaited before the send; host to device asynchronously on the
  receiver's current stream).
- the NCCL plane (:func:`make_data_plane` with ``"nccl"``): one 2-rank NCCL group per *ordered* pair of stages,
  so each communicator carries one direction only and two ranks never both send first on one communicator
  (NCCL issue #479). NCCL's rules, which the protocol keeps:

  1. a receive must know its byte count: it is posted only after its header was read, with the header's count
     (no speculative receive; an idle always-posted NCCL receive would trip NCCL's watchdog);
  2. sends and receives on one communicator match in issue order: receives are posted strictly in sequence order
     (one receiving thread per source), sends under the per-destination lock right after their header;
  3. one thread issues every NCCL call of the process (NCCL forbids concurrent calls on a communicator, and
     torch's coalescing state is shared between threads, pytorch#175145): :class:`_CommThread`;
  4. a send completes only once its receive is posted, so nothing waits on a send: the buffer is kept until the
     work completes, and the sending thread returns at once;
  5. streams: the sender records an event on its current stream after packing, *before* its header goes out,
     and the communication thread's send stream waits on it before ``isend`` (so the producing kernels come
     before the send, and a send never waits on work enqueued after its header, which could wait on a receive
     that depends on this send). The receiver allocates the buffer on its current stream and records an event
     that the communication thread's separate receive stream waits on before ``irecv`` (the block may still be
     read by a kernel of its previous owner); its current stream waits on the receive's work before the bytes
     are unpacked on it. Every GPU wait thus points back in causal order: no cycle across ranks.

- :class:`StrictMockBackend`: the NCCL plane's code path (pair groups, communication thread, sequence and byte
  bookkeeping) with gloo under it, enforcing rules 1-4 and a watchdog, so CPU CI tests the protocol the NCCL plane
  relies on. A broken rule raises :class:`StrictMockError` naming it.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist

from lightning_mp.comm._transport import Packed, gather

__all__ = [
    "DataPlaneError",
    "DataPlaneKind",
    "GlooDataPlane",
    "PairDataPlane",
    "PairGroups",
    "StrictMockError",
    "make_data_plane",
]

DataPlaneKind = Literal["auto", "gloo", "nccl"]
_POLL_S = 0.05


class DataPlaneError(RuntimeError):
    """The data plane failed (a peer gone, a transfer that never completed)."""


class StrictMockError(DataPlaneError):
    """The strict mock caught a use of the data plane that NCCL would not survive (hang, corruption or abort)."""


class GlooDataPlane:
    """Tensor bytes over the control plane's gloo group; CUDA tensors staged through pinned host memory.

    Args:
        group: the transport's gloo group.
        device: where received tensors live; ``cuda``: stage through pinned host buffers.
    """

    name = "gloo"

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        self.group = group
        self._pin = device.type == "cuda"

    def gather(self, packed: Packed) -> torch.Tensor:
        buffer = torch.empty(packed.data_nbytes, dtype=torch.uint8, pin_memory=self._pin)
        if gather(packed, buffer):  # device-to-host copies on the current stream: done before gloo reads
            torch.cuda.current_stream().synchronize()
        return buffer

    def header_read(self, src: int, seq: int, nbytes: int) -> None:
        pass

    def send(self, wire: torch.Tensor, dst: int, seq: int) -> None:
        dist.send(wire, group=self.group, group_dst=dst)

    def recv(self, nbytes: int, src: int, seq: int) -> torch.Tensor:
        buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._pin)
        dist.recv(buffer, group=self.group, group_src=src)
        return buffer

    def close(self) -> None:
        pass


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


class StrictMockBackend:
    """NCCL's point-to-point rules, enforced on gloo pair groups (see [Note: two planes]).

    Per message: the sender issues a small ``(seq, nbytes)`` frame and the data; its send completes (buffer
    released, watchdog stopped) only when the receiver's "posted" frame has come back (checked on a
    per-destination waiter thread), so a send does not complete before its receive is posted (rule 4). The receiver, after the header was read, posts its receive with
    the header's byte count, checks the sender's ``(seq, nbytes)`` against it before posting the data receive
    (rules 1, 2), and every call checks it runs on the communication thread (rule 3). A send whose receive is not
    posted within ``watchdog_s`` fails the plane.
    """

    name = "strict_mock"
    _META, _DATA, _POSTED = 1, 2, 3  # gloo tags on a pair group

    def __init__(self, pairs: PairGroups, watchdog_s: float) -> None:
        self.pairs = pairs
        self.watchdog_s = watchdog_s
        self.issuer: int | None = None
        self.comm: _CommThread | None = None
        self._lock = threading.Lock()
        self._announced: dict[int, collections.deque[tuple[int, int]]] = collections.defaultdict(collections.deque)
        self._last_send: dict[int, int] = collections.defaultdict(lambda: -1)
        self._last_recv: dict[int, int] = collections.defaultdict(lambda: -1)
        self._waiters: dict[int, queue.SimpleQueue] = {}

    def _group(self, src: int, dst: int) -> tuple[dist.ProcessGroup, int]:
        peer = dst if src == self.pairs.stage else src
        return self.pairs.groups[(src, dst)], self.pairs.global_ranks[peer]

    def warm_up(self, device: torch.device) -> None:
        _connect_pairs(self.pairs, device)

    # ---- sender --------------------------------------------------------------------------------------------

    def isend(self, buffer: torch.Tensor, dst: int, seq: int) -> Any:
        _check_thread(self.issuer, f"the send of message {seq} to stage {dst}")
        if seq <= self._last_send[dst]:  # sequence numbers count every message; the data plane sees those with bytes
            raise StrictMockError(
                f"FIFO per ordered pair: message {seq} to stage {dst} was sent after message {self._last_send[dst]}."
            )
        self._last_send[dst] = seq
        group, peer = self._group(self.pairs.stage, dst)
        meta = torch.tensor([seq, buffer.numel()], dtype=torch.int64)
        meta_work = dist.isend(meta, dst=peer, group=group, tag=self._META)
        # gloo moves the bytes when the peer posts its receive; the send counts as complete (its buffer is released,
        # the watchdog stops) only once the peer says it posted the receive, as an NCCL send.
        data_work = dist.isend(buffer, dst=peer, group=group, tag=self._DATA)
        posted = torch.empty(2, dtype=torch.int64)
        posted_work = dist.irecv(posted, src=peer, group=group, tag=self._POSTED)
        send = _MockSend(buffer, dst, seq, [meta], meta_work, posted, posted_work, data_work)
        if dst not in self._waiters:
            self._waiters[dst] = queue.SimpleQueue()
            threading.Thread(target=self._wait_posted, args=(dst,), daemon=True, name=f"smp-mock-{dst}").start()
        self._waiters[dst].put(send)
        return send

    def _wait_posted(self, dst: int) -> None:
        """Per destination, in order: wait until the receive is posted, then have the data sent."""
        assert self.comm is not None
        while True:
            send: _MockSend = self._waiters[dst].get()
            try:
                send.meta_work.wait(timedelta(seconds=self.watchdog_s))
                send.posted_work.wait(timedelta(seconds=self.watchdog_s))
                posted_seq, posted_nbytes = send.posted.tolist()
                if (posted_seq, posted_nbytes) != (send.seq, send.buffer.numel()):
                    raise StrictMockError(
                        f"Exact byte counts: stage {dst} posted its receive of message {posted_seq} for"
                        f" {posted_nbytes} bytes; the send is message {send.seq} of {send.buffer.numel()} bytes."
                    )
                send.data_work.wait(timedelta(seconds=self.watchdog_s))
                send.done = True
            except BaseException as err:
                self.comm.fail(
                    err if isinstance(err, StrictMockError) else
                    DataPlaneError(f"Watchdog: message {send.seq} to stage {dst}: its receive was not posted within"
                                   f" {self.watchdog_s:.0f} s, or the peer is gone ({err}).")
                )
                return

    # ---- receiver ------------------------------------------------------------------------------------------

    def header_read(self, src: int, seq: int, nbytes: int) -> None:
        with self._lock:
            self._announced[src].append((seq, nbytes))

    def irecv(self, buffer: torch.Tensor, src: int, seq: int) -> Any:
        _check_thread(self.issuer, f"the receive of message {seq} from stage {src}")
        with self._lock:
            announced = self._announced[src]
            if not any(s == seq for s, _ in announced):
                raise StrictMockError(
                    f"No speculative receives: the receive of message {seq} from stage {src} was posted before its"
                    " header was read (NCCL must know the byte count; an idle posted receive trips its watchdog)."
                )
            if announced[0][0] != seq or seq <= self._last_recv[src]:
                raise StrictMockError(
                    f"FIFO per ordered pair: the receive of message {seq} from stage {src} was posted before message"
                    f" {announced[0][0]}'s."
                )
            _, nbytes = announced.popleft()
            self._last_recv[src] = seq
        if buffer.numel() != nbytes:
            raise StrictMockError(
                f"Exact byte counts: the receive of message {seq} from stage {src} was posted for {buffer.numel()}"
                f" bytes; its header says {nbytes}."
            )
        group, peer = self._group(src, self.pairs.stage)
        meta = torch.empty(2, dtype=torch.int64)
        return _MockRecv(buffer, meta, dist.irecv(meta, src=peer, group=group, tag=self._META))

    def wait_recv(self, work: _MockRecv, src: int, seq: int, timeout_s: float) -> None:
        assert self.comm is not None
        work.meta_work.wait(timedelta(seconds=timeout_s))
        sent_seq, sent_nbytes = work.meta.tolist()
        if (sent_seq, sent_nbytes) != (seq, work.buffer.numel()):
            raise StrictMockError(
                f"Exact byte counts / FIFO: stage {src} sent message {sent_seq} of {sent_nbytes} bytes where this"
                f" rank posted the receive of message {seq} for {work.buffer.numel()} bytes."
            )
        posted = torch.tensor([seq, work.buffer.numel()], dtype=torch.int64)
        data_work, posted_work = self.comm.call(self._post_data, work.buffer, posted, src, seq)
        data_work.wait(timedelta(seconds=timeout_s))
        posted_work.wait(timedelta(seconds=timeout_s))  # done before the data came; gloo marks it done on wait()

    def _post_data(self, buffer: torch.Tensor, posted: torch.Tensor, src: int, seq: int) -> tuple[Any, Any]:
        _check_thread(self.issuer, f"the data receive of message {seq} from stage {src}")
        group, peer = self._group(src, self.pairs.stage)
        work = dist.irecv(buffer, src=peer, group=group, tag=self._DATA)
        return work, dist.isend(posted, dst=peer, group=group, tag=self._POSTED)


@dataclass
class _MockSend:
    buffer: torch.Tensor
    dst: int
    seq: int
    keep: list[torch.Tensor]
    meta_work: Any
    posted: torch.Tensor
    posted_work: Any
    data_work: Any
    done: bool = False

    def is_completed(self) -> bool:
        return self.done


@dataclass
class _MockRecv:
    buffer: torch.Tensor
    meta: torch.Tensor
    meta_work: Any


class PairDataPlane:
    """Tensor bytes over one 2-rank group per ordered pair, every call issued by one communication thread.

    The NCCL plane (``backend`` an NCCL backend, CUDA buffers) and the strict mock (gloo, CPU buffers) share this
    code: packing, sequence numbers, the communication thread, buffer lifetimes and stream ordering.

    Args:
        backend: ``_NcclBackend`` or :class:`StrictMockBackend` over this rank's :class:`PairGroups`.
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


def make_data_plane(
    kind: str, group: dist.ProcessGroup, device: torch.device, pairs: PairGroups | None = None, timeout_s: float = 1800.0
) -> Any:
    """The data plane of one transport.

    Args:
        kind: ``"gloo"`` (:class:`GlooDataPlane`), ``"nccl"`` (CUDA only; needs ``pairs`` built with backend
            ``"nccl"``) or ``"strict_mock"`` (CPU; ``pairs`` built with backend ``"gloo"``).
        group: the transport's gloo group (the gloo plane uses it).
        device: the rank's device.
        pairs: from ``lightning_mp.topology.build_pair_groups``, for ``"nccl"`` and ``"strict_mock"``.
        timeout_s: receive timeout and send watchdog of the pair planes.

    Raises:
        ValueError: for an unknown kind, ``"nccl"`` off CUDA, or missing/mismatched pair groups.
    """
    if kind == "gloo":
        return GlooDataPlane(group, device)
    if kind not in ("nccl", "strict_mock"):
        raise ValueError(f"data plane must be 'gloo', 'nccl' or 'strict_mock', got {kind!r}.")
    if kind == "nccl" and device.type != "cuda":
        raise ValueError(f"The NCCL data plane moves CUDA tensors; this rank's device is {device}. Use 'gloo'.")
    expected = "nccl" if kind == "nccl" else "gloo"
    if pairs is None or pairs.backend != expected:
        raise ValueError(f"The {kind} data plane needs pair groups from build_pair_groups(..., backend={expected!r}).")
    if kind == "nccl":
        return PairDataPlane(_NcclBackend(pairs), device, timeout_s)
    return PairDataPlane(StrictMockBackend(pairs, timeout_s), torch.device("cpu"), timeout_s)
