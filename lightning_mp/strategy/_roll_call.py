"""Which ranks are gone when a collective fails: a roll call through the job's c10d store.

[Note: roll call after a failed collective] gloo reports a dead peer as "Connection closed by peer
[127.0.0.1]:port" or "Connection reset by peer", and a hung one as a timeout, without a rank; DCP's collectives
and Lightning's broadcasts pass those errors on as they are. Every rank of an ``smp`` run therefore keeps one
daemon thread (``lightning_mp-roll-call``, living as long as the process groups) with its own connection to the
job's store (the ``TCPStore`` the process group rendezvoused on: global rank 0's process under Lightning's
launchers, the agent under torchrun). A rank whose collective failed calls the roll: ``n = add("calls", 1)``, sets
``call/<n>/<r>`` for every rank (one ``multi_set``), and waits up to ``ANSWER_S`` for ``answer/<n>/<r>`` of every
rank it asks about. Each live process's thread answers every call in order, whatever its main thread is doing
(blocked in the same collective, tearing down), so a rank that does not answer died or is stopped (SIGSTOP); a
main thread in an endless loop still answers (its thread gets the GIL), and is found by ``SMPConfig.timeout``
instead. A rank that leaves with an error first writes ``left/<r>`` (its error's first line), so a later roll
call does not take it for dead once it has exited. If the store does not
answer, its host is named. Every wait is bounded: the connection, each store call (``ANSWER_S``) and the roll.
The cost is one thread and one store connection per process, nothing per step (torchelastic's agents keep
heartbeats running instead; this asks only after a failure). At exit the thread is woken through its own key and
joined (:func:`stop_answering`) before the process groups are destroyed.

The failure is re-raised as :class:`RankFailedError` (the backend's error as its ``__cause__``) when some rank did
not answer, else the original error with a note saying every rank answered.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import PrefixStore, Store, TCPStore
from torch.distributed.checkpoint.api import CheckpointException

from lightning_mp.pipeline import PipelineError

__all__ = ["ANSWER_S", "RankFailedError", "answer_roll_calls", "is_collective_failure", "leave", "naming_failed_ranks",
           "roll_call", "stop_answering", "store_address"]

ANSWER_S = 3.0
"""Seconds a roll call waits for the answers (and for each store call): a live rank's thread answers in
milliseconds; a process that is descheduled for longer on an overloaded machine would be named wrongly."""

_BLOCKING = timedelta(days=30)  # the answering thread's store calls wait for the next call this long


class RankFailedError(dist.DistError):
    """A collective failed because ranks died or stopped answering (found by a roll call; see the Note).

    Attributes:
        ranks: the global ranks that did not answer (empty when the job's store itself did not answer).
    """

    def __init__(self, message: str, ranks: Sequence[int]) -> None:
        super().__init__(message)
        self.ranks = list(ranks)

    def __reduce__(self) -> tuple[type, tuple[str, list[int]]]:  # pickled across processes (spawn, the CLI)
        return type(self), (str(self), self.ranks)


@dataclass(frozen=True)
class StoreAddress:
    """Where the job's ``TCPStore`` listens, and the key prefix of this job attempt's roll calls."""

    host: str
    port: int
    prefix: str

    def connect(self, timeout: timedelta) -> Store:
        client = TCPStore(self.host, self.port, is_master=False, timeout=timeout, wait_for_workers=False)
        return PrefixStore(self.prefix, client)

    def owner(self) -> str:
        """Who hosts the store, in words."""
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True):
            return f"the torchrun agent on {self.host}"
        return f"global rank 0's process (MASTER_ADDR {self.host})"


def store_address(store: Store) -> StoreAddress | None:
    """The address of the ``TCPStore`` under ``store`` (through its ``PrefixStore`` layers); ``None`` for another
    kind of store (a ``FileStore``: no roll call, errors are named from the group's ranks only)."""
    while isinstance(store, PrefixStore):
        store = store.underlying_store
    if not isinstance(store, TCPStore):
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # the agent's store outlives a restart
    return StoreAddress(store.host, store.port, f"/lightning_mp/roll_call/attempt_{attempt}")


@dataclass
class _Answering:
    address: StoreAddress
    rank: int
    world_size: int
    thread: threading.Thread
    stopping: threading.Event
    waiting_for: int = 1  # the call the thread waits for
    failed: bool = False  # this process leaves with an error (see stop_answering)


_ANSWERING: _Answering | None = None  # this process's answering thread: one per process, as its default group


def answer_roll_calls(store: Store | None = None) -> None:
    """Start this process's answering thread, for roll calls through ``store`` (the default process group's store
    when ``None``; a store not over a ``TCPStore`` gets none). Once per process, again after its store went away.
    Call after ``init_process_group``; :func:`stop_answering` ends it (at exit, before the groups are destroyed)."""
    global _ANSWERING
    if _ANSWERING is not None and _ANSWERING.thread.is_alive():
        return
    address = store_address(store if store is not None else dist.distributed_c10d._get_default_store())
    if address is None:
        return
    _ANSWERING = _Answering(address, dist.get_rank(), dist.get_world_size(), threading.Thread(), threading.Event())
    _ANSWERING.thread = threading.Thread(
        target=_answer, args=(address.connect(_BLOCKING), _ANSWERING), daemon=True, name="lightning_mp-roll-call"
    )
    _ANSWERING.thread.start()
    atexit.register(stop_answering)


def _answer(store: Store, me: _Answering) -> None:
    while True:
        try:
            store.get(f"call/{me.waiting_for}/{me.rank}")  # blocks until someone calls (or this process stops it)
            if me.stopping.is_set():
                store.set(f"stopped/{me.rank}", b"1")
                return
            store.set(f"answer/{me.waiting_for}/{me.rank}", b"1")
        except Exception:  # noqa: BLE001 - the store went away (the job ends): nobody will call again
            return
        me.waiting_for += 1


def stop_answering(wait_s: float = ANSWER_S) -> None:
    """End this process's answering thread (bounded by ``wait_s``): it is woken through the store and joined, so
    that no thread waits in the store's client when the interpreter finalises (a store call that fails then aborts
    the process) or when the store goes away. The process that hosts the store (global rank 0 under Lightning's
    launchers) first gives the others up to ``wait_s`` to stop theirs, as their waits would fail noisily when its
    store goes; not when it leaves with an error (dead ranks never stop theirs)."""
    me = _ANSWERING
    if me is None or me.stopping.is_set():
        return
    me.stopping.set()
    if not me.thread.is_alive():
        return
    deadline = time.monotonic() + wait_s
    with contextlib.suppress(Exception):
        store = me.address.connect(timedelta(seconds=wait_s))
        store.set(f"call/{me.waiting_for}/{me.rank}", b"stop")
        me.thread.join(max(0.0, deadline - time.monotonic()))
        if me.rank == 0 and not me.failed and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
            keys, deadline = [f"stopped/{r}" for r in range(me.world_size)], time.monotonic() + wait_s
            while not store.check(keys) and time.monotonic() < deadline:
                time.sleep(0.05)


def is_collective_failure(err: BaseException) -> bool:
    """Whether ``err`` (or an error it was raised from) is a failed collective: a ``DistError``, gloo's plain
    ``RuntimeError`` (its text names gloo), or DCP's ``CheckpointException`` over one of those."""
    seen = 0
    while err is not None and seen < 8:
        if isinstance(err, RankFailedError) or not isinstance(err, (Exception, CheckpointException)):
            return False  # named already; or Ctrl-C, an exit: those must not wait for a roll call
        if isinstance(err, dist.DistError) or (isinstance(err, RuntimeError) and "gloo" in str(err)):
            return True
        if isinstance(err, CheckpointException):
            return any(is_collective_failure(failure) for failure, _ in err.failures.values())
        err, seen = err.__cause__ or err.__context__, seen + 1
    return False


@contextlib.contextmanager
def naming_failed_ranks(what: str, ranks: Sequence[int] | None = None) -> Iterator[None]:
    """Name the ranks behind a failed collective (see the Note).

    Args:
        what: what failed, for the message (e.g. "the checkpoint save to /ckpt/last").
        ranks: the global ranks the collective involved (``None``: the world).

    Raises:
        RankFailedError: ``what`` failed and ranks of ``ranks`` did not answer a roll call (or the job's store did
            not), from the backend's error. Otherwise the backend's error itself, with a note. Errors that are not a
            collective's failure pass unchanged.
    """
    try:
        yield
    except BaseException as err:
        if not dist.is_initialized() or isinstance(err, RankFailedError):
            raise
        first = _first_line(err)
        if not is_collective_failure(err):
            if isinstance(err, Exception):  # not Ctrl-C or an exit: those must not wait for the store
                leave(f"{type(err).__name__}: {first}")
            raise
        me = dist.get_rank()
        ranks = list(range(dist.get_world_size())) if ranks is None else list(ranks)
        absent, detail = roll_call([r for r in ranks if r != me], f"{type(err).__name__}: {first}")
        where = f"{what} over global ranks {ranks} failed on global rank {me}"
        if absent is None and detail is None:  # no roll call in this process (no TCPStore)
            peers = [r for r in ranks if r != me]
            who = f"global rank {peers[0]}" if len(peers) == 1 else f"one of global ranks {peers}"
            raise RankFailedError(f"{where}: {who} died or stopped answering ({first}).", peers) from err
        if absent is None:
            raise RankFailedError(f"{where}: {detail} ({first}).", []) from err
        if absent and isinstance(err, PipelineError):  # it names the stage and rank it lost: keep it, as users catch it
            err.add_note(f"lightning_mp: {where}; global ranks {absent} did not answer a roll call ({detail}).")
            raise
        if absent:
            who = f"global rank {absent[0]}" if len(absent) == 1 else f"global ranks {absent}"
            raise RankFailedError(
                f"{where}: {who} died or stopped answering ({detail}). The backend said: {first}. Its own log says"
                " what it was doing; a rank that stops answering fails the others after `SMPConfig.timeout`.", absent,
            ) from err
        err.add_note(f"lightning_mp: {where}; every other rank answered a roll call after it ({detail}): none died.")
        raise


def roll_call(ranks: Sequence[int], my_error: str, wait_s: float = ANSWER_S) -> tuple[list[int] | None, str | None]:
    """Ask ``ranks`` (global) whether they are alive, after recording that this rank leaves with ``my_error``.

    Returns:
        ``(absent, detail)``: the ranks that did not answer within ``wait_s`` and had not left with their own error,
        and a sentence on how that was found; ``(None, sentence)`` when the store did not answer;
        ``(None, None)`` when this process answers no roll calls (its store is not a ``TCPStore``).
    """
    answering = _ANSWERING
    if answering is None:
        return None, None
    answering.failed = True
    address = answering.address
    try:
        if not answering.thread.is_alive():  # its connection to the store broke: the store went away
            raise ConnectionError("the connection of this rank's answering thread was closed")
        store = address.connect(timedelta(seconds=wait_s))
        store.set(f"left/{answering.rank}", my_error[:300].encode())
        call = store.add("calls", 1)
        store.multi_set([f"call/{call}/{r}" for r in range(answering.world_size)], [b"1"] * answering.world_size)
        keys = [f"answer/{call}/{r}" for r in ranks]
        deadline = time.monotonic() + wait_s
        while not store.check(keys) and time.monotonic() < deadline:
            time.sleep(0.05)
        silent = [r for r, key in zip(ranks, keys) if not store.check([key])]
        left = {r for r in silent if store.check([f"left/{r}"])}
        exited = {r for r in silent if r not in left and store.check([f"stopped/{r}"])}
    except Exception as err:  # noqa: BLE001 - the store did not answer: its host is gone or hung
        return None, (f"the job's store at {address.host}:{address.port} did not answer ({_first_line(err)[:200]}):"
                      f" its host, {address.owner()}, died or stopped answering")
    absent = [r for r in silent if r not in left and r not in exited]
    detail = f"no answer to a roll call through the job's store within {wait_s:.0f} s"
    if left:
        detail += f"; global ranks {sorted(left)} had left with errors of their own"
    if exited:
        detail += f"; global ranks {sorted(exited)} had finished and exited"
    return absent, detail


def leave(my_error: str, wait_s: float = ANSWER_S) -> None:
    """Record in the store that this rank leaves with ``my_error`` (its error's first line), so that roll calls
    after its exit do not name it as dead. Bounded by ``wait_s``; a store that does not answer is left alone."""
    answering = _ANSWERING
    if answering is None:
        return
    answering.failed = True
    if not answering.thread.is_alive():
        return
    with contextlib.suppress(Exception):
        answering.address.connect(timedelta(seconds=wait_s)).set(f"left/{answering.rank}", my_error[:300].encode())


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
