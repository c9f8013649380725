"""The one-process tier stays one process: a test here that starts a process or a process group fails."""

import multiprocessing.process
import os
import subprocess

import pytest
import torch.distributed as dist


def _refuse(what: str):
    def refuse(*args, **kwargs):
        raise AssertionError(f"a tests/unit test {what}: it belongs in tests/distributed, tests/trainer or tests/cli")

    return refuse


@pytest.fixture(autouse=True)
def one_process(monkeypatch: pytest.MonkeyPatch):
    """Refuse subprocesses, forks and ``multiprocessing`` starts; after the test, no process group may exist."""
    monkeypatch.setattr(subprocess.Popen, "__init__", _refuse("starts a subprocess"))
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", _refuse("starts a process"))
    monkeypatch.setattr(os, "fork", _refuse("forks"))
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()  # the next test starts without it
        pytest.fail("a tests/unit test started a process group: it belongs in tests/distributed or tests/trainer")
