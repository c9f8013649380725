"""A test double: NCCL's point-to-point rules enforced on gloo, so CPU CI tests the pair plane's protocol.

:class:`StrictMockBackend` plugs into :class:`~lightning_mp.comm._pair.PairDataPlane` in place of the NCCL backend
(``make_data_plane("strict_mock", ...)``); rules 1-4 of [Note: two planes] in ``_planes.py``.
"""

from __future__ import annotations

import collections
import queue
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_mp.comm._pair import PairGroups, _check_thread, _CommThread, _connect_pairs
from lightning_mp.comm._planes import DataPlaneError, StrictMockError

__all__ = ["StrictMockBackend"]


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
