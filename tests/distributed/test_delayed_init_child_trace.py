"""The child process that runs a delayed-init model's meta trace: an exception that does not unpickle keeps its
message, a child that dies or hangs is reported, and the child runs parallel CPU kernels after the parent used its
OpenMP pool."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch

from lightning_mp.strategy._placement import make_plan_in_child


# ---- the trace's child process, and where scratch draws run (found in review) ------------------------------


class _NeedsTwoArguments(Exception):
    def __init__(self, name, shape):
        super().__init__(f"{name} has shape {shape}")
        self.name, self.shape = name, shape


def _raise_needs_two():
    raise _NeedsTwoArguments("wte", (3, 4))


def test_an_exception_that_does_not_unpickle_keeps_its_message():
    with pytest.raises(RuntimeError, match=r"_NeedsTwoArguments: wte has shape \(3, 4\)"):
        make_plan_in_child(_raise_needs_two, timedelta(seconds=60))


def test_a_child_that_dies_and_a_child_that_hangs_are_reported():
    with pytest.raises(RuntimeError, match="died"):
        make_plan_in_child(lambda: os._exit(3), timedelta(seconds=60))
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="did not finish within"):
        make_plan_in_child(lambda: time.sleep(60), timedelta(seconds=1))
    assert time.monotonic() - started < 30  # killed, not waited for


def _parallel_kernel():
    torch.stack([torch.ones(1 << 20) for _ in range(8)]).mul_(2).sum()  # e.g. the DataLoader's collate
    raise ValueError("the child ran a parallel CPU kernel")


def test_the_child_runs_parallel_cpu_kernels_after_the_parent_used_its_openmp_pool():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        (torch.ones(1 << 22) * 2).sum()  # the parent's pool exists now (a datamodule's setup would do this)
        with pytest.raises(ValueError, match="parallel CPU kernel"):
            make_plan_in_child(_parallel_kernel, timedelta(seconds=30))
    finally:
        torch.set_num_threads(threads)
