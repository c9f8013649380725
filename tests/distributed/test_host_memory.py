"""Releasing host memory, in a child process: freed tensors go back to the system, and glibc's default keeps them."""

from __future__ import annotations

import os

import pytest

import lightning_mp
from lightning_mp.memory import glibc


_RELEASE_PROBE = """
import sys, threading, torch
from lightning_mp.memory._host import fix_mmap_threshold
def rss():
    return int(next(l for l in open('/proc/self/status') if l.startswith('VmRSS')).split()[1]) * 1024
if sys.argv[1] == 'release':
    assert fix_mmap_threshold()
def churn():  # 4 MiB tensors from a non-main thread's arena, as the engine threads allocate gradients
    for _ in range(3):
        kept = [torch.ones(1 << 20) for _ in range(48)]
        del kept
before = rss()
thread = threading.Thread(target=churn); thread.start(); thread.join()
print((rss() - before) >> 20)
"""


_STEP_FAULTS_PROBE = """
import resource, sys, threading, torch
from lightning_mp.strategy._launch import prepare_process
if sys.argv[1] == 'pipelined':
    prepare_process(2, release_host_memory=False, pipelined=True)
def step():  # a step's activations, 56 MiB in 1-4 MiB tensors, made and freed in a fresh thread (a request worker)
    kept = [torch.ones(1 << (18 + i % 3)) for i in range(24)]
    del kept
def faults_of_step():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    thread = threading.Thread(target=step); thread.start(); thread.join()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults_of_step()
print(*[faults_of_step() for _ in range(3)])
"""


@pytest.mark.skipif(not glibc(), reason="glibc only")
def test_pipelined_ranks_reuse_freed_memory_instead_of_faulting_it_in_each_step():
    """[Note: engine threads and glibc malloc]: a pipelined rank's steps after the first reuse the heap (56 MiB of
    activations are 14336 pages); glibc's default faults most of them in again."""
    import subprocess
    import sys

    def step_faults(mode: str) -> list[int]:
        env = {**os.environ, "PYTHONPATH": os.getcwd()}
        for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX"):
            env.pop(name, None)
        done = subprocess.run([sys.executable, "-c", _STEP_FAULTS_PROBE, mode], capture_output=True, text=True,
                              env=env, timeout=120, check=True)
        return [int(n) for n in done.stdout.split()]

    assert max(step_faults("pipelined")) < 14336 // 8
    assert sum(step_faults("default")) > 14336, "glibc's default faults them in again (else this test shows nothing)"


@pytest.mark.skipif(not glibc(), reason="glibc only")
def test_release_host_memory_gives_freed_tensors_back_and_glibc_default_keeps_them():
    """[Note: freed tensors stay resident under glibc]: 192 MiB allocated and freed in a thread."""
    import subprocess
    import sys

    def retained(mode: str) -> int:
        env = {**os.environ, "PYTHONPATH": os.getcwd()}
        env.pop("MALLOC_MMAP_THRESHOLD_", None)
        done = subprocess.run([sys.executable, "-c", _RELEASE_PROBE, mode], capture_output=True, text=True, env=env,
                              timeout=120, check=True)
        return int(done.stdout.split()[-1])

    assert retained("release") < 16
    assert retained("default") > 64, "glibc's dynamic threshold keeps them (else this test shows nothing)"
    with pytest.raises(ValueError, match="`release_host_memory` must be True or False"):
        lightning_mp.SMPConfig(release_host_memory=1)
