"""The roll call after a failed collective (``lightning_mp/strategy/_roll_call.py``), in one process: ranks are
answering threads on a real ``TCPStore``; the process groups themselves are tested in
``tests/distributed/test_collective_errors.py``."""

from __future__ import annotations

import pickle
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from lightning_mp.strategy import _roll_call
from lightning_mp.strategy._roll_call import RankFailedError, StoreAddress, is_collective_failure, roll_call


@pytest.fixture
def job(monkeypatch):
    """A store, ranks 0, 1 and 3 of a 4-rank job answering (rank 2 never does), this process being rank 0."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    address = StoreAddress("127.0.0.1", server.port, "/test/roll_call")
    ranks = []
    for rank in (0, 1, 3):  # one answering thread per rank, as in each rank's process
        answering = _roll_call._Answering(address, rank, 4, threading.Thread(), threading.Event())
        answering.thread = threading.Thread(target=_roll_call._answer, args=(address.connect(_WAIT), answering))
        answering.thread.start()
        ranks.append(answering)
    monkeypatch.setattr(_roll_call, "_ANSWERING", ranks[0])
    yield server, address
    for answering in ranks:  # stopped through the store, as at exit
        answering.stopping.set()
        address.connect(_WAIT).set(f"call/{answering.waiting_for}/{answering.rank}", b"stop")
        answering.thread.join(10)
        assert not answering.thread.is_alive()


_WAIT = timedelta(seconds=60)


def test_the_rank_that_does_not_answer_is_named(job):
    absent, detail = roll_call([1, 2, 3], "RuntimeError: Connection closed by peer", wait_s=1.0)
    assert absent == [2], (absent, detail)
    assert "no answer to a roll call" in detail
    absent, _ = roll_call([1, 2, 3], "again", wait_s=1.0)  # a second call is answered too
    assert absent == [2]


def test_a_rank_that_left_with_its_own_error_is_not_named(job):
    _, address = job
    address.connect(timedelta(seconds=5)).set("left/2", b"RuntimeError: gloo ...")
    absent, detail = roll_call([1, 2, 3], "RuntimeError: gloo ...", wait_s=1.0)
    assert absent == [] and "global ranks [2] had left with errors of their own" in detail, (absent, detail)


def test_a_rank_that_finished_and_exited_is_not_named(job):
    _, address = job
    address.connect(timedelta(seconds=5)).set("stopped/2", b"1")  # what `stop_answering` records at a clean exit
    absent, detail = roll_call([1, 2, 3], "RuntimeError: gloo ...", wait_s=1.0)
    assert absent == [] and "global ranks [2] had finished and exited" in detail, (absent, detail)


def test_the_error_survives_pickling():
    error = pickle.loads(pickle.dumps(RankFailedError("the all-reduce failed: global rank 3 died", [3])))
    assert isinstance(error, RankFailedError) and error.ranks == [3] and "global rank 3 died" in str(error)


def test_a_store_that_does_not_answer_names_its_host(monkeypatch):
    alive = threading.Thread(target=time.sleep, args=(30,), daemon=True)  # an answering thread not ended yet
    alive.start()
    gone = StoreAddress("127.0.0.1", _closed_port(), "/test/roll_call")  # a store whose host died: nobody listens
    monkeypatch.setattr(_roll_call, "_ANSWERING", _roll_call._Answering(gone, 0, 4, alive, threading.Event()))
    start = time.monotonic()
    absent, detail = roll_call([1, 2, 3], "RuntimeError: Connection reset by peer", wait_s=1.0)
    assert absent is None and "did not answer" in detail and "global rank 0's process" in detail, detail
    assert time.monotonic() - start < 15  # bounded: the connection's timeout (and its retries)


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_what_counts_as_a_failed_collective():
    gloo = RuntimeError("[third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:9")
    assert is_collective_failure(gloo)
    assert is_collective_failure(dist.DistBackendError("NCCL watchdog"))
    assert is_collective_failure(CheckpointException("save failed", {1: (gloo, None)}))
    assert not is_collective_failure(CheckpointException("save failed", {1: (ValueError("bad key"), None)}))
    assert not is_collective_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_collective_failure(RankFailedError("named already", [2]))
    interrupted = KeyboardInterrupt()
    interrupted.__context__ = gloo
    assert not is_collective_failure(interrupted)
    chained = ValueError("wrapped")
    chained.__cause__ = gloo
    assert is_collective_failure(chained)
