"""The engine's one-shot ``Future`` (``pipeline/_messages.py``): many waiters, a later ``set``, failures, timeout."""

from __future__ import annotations

import threading
import time

import pytest

from lightning_mp.pipeline._messages import Future, PipelineError


def _never_failed() -> None:
    pass


def test_every_waiter_gets_the_value_and_waits_again_at_once():
    future = Future()
    got: list = []
    waiters = [
        threading.Thread(target=lambda: got.append(future.wait(30.0, _never_failed, "x"))) for _ in range(4)
    ]
    for waiter in waiters:
        waiter.start()
    time.sleep(0.05)
    assert got == []
    future.set("v")
    for waiter in waiters:
        waiter.join(30.0)
    assert got == ["v"] * 4
    assert future.wait(0.0, _never_failed, "x") == "v"  # already set: no wait
    future.set("w")  # a later set replaces the value, and leaves the future set
    assert future.wait(0.0, _never_failed, "x") == "w"
    assert future.wait(0.0, _never_failed, "x") == "w"


def test_a_failure_or_the_timeout_ends_a_wait():
    future = Future()

    def failed() -> None:
        raise PipelineError("the step failed")

    with pytest.raises(PipelineError, match="the step failed"):
        future.wait(30.0, failed, "x")
    with pytest.raises(PipelineError, match="Timed out after 0 s waiting for the reply"):
        future.wait(0.01, _never_failed, "the reply")
    future.set(1)
    with pytest.raises(PipelineError, match="the step failed"):  # a set value after a failure still raises
        future.wait(30.0, failed, "x")
