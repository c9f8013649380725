"""How an ``smp`` run ends: preemption (SIGTERM), Ctrl-C (SIGINT), a forked launch, and an elastic restart.

Each test runs ``tests/scripts/preempt.py`` (a pp2 fit of the tiny GPT on 2 processes) in its own session and
watches every process of that session:

* SIGTERM to the launcher, or to rank 1 alone: both ranks stop after the same step with Lightning's ``SIGTERMException``,
  ``OnExceptionCheckpoint`` writes a complete checkpoint, the job exits with status 0 and its ranks are gone when
  the launcher is; the interrupted ``fit`` leaves no thread, file or child process more than a finished one left;
* Ctrl-C (SIGINT to the process group, as a terminal sends it): every rank is gone within 10 s;
* ``start_method="fork"`` after the launching process used its OpenMP pool finishes (it hung in libgomp);
* ``torchrun --max-restarts 1``: a rank killed mid-run makes the job restart, resume from ``ckpt_path="last"``
  and end with the final parameters of the uninterrupted run on one process (float32 tolerance).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lightning_mp.strategy._checkpoint import is_complete_checkpoint
from tests.trainer.test_checkpoint_reshard import _fit, _GPT

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "tests/scripts/preempt.py"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "LOCAL_RANK", "MASTER_PORT")}
    env.pop("PL_GLOBAL_SEED", None)
    return {**env, "PYTHONPATH": str(ROOT), **extra}


def _session(sid: int) -> list[int]:
    """Live (not zombie) processes of session ``sid``."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            alive.append(int(stat.parent.name))
    return alive


def _start(command: list[str], out: Path, **env: str) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "log.txt", "w")
    return subprocess.Popen(command, cwd=ROOT, env=_env(**env), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _wait_ready(run: subprocess.Popen, out: Path, timeout_s: float = 240.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not all((out / f"ready_{rank}").exists() for rank in range(2)):
        assert run.poll() is None, f"the run ended before step 3:\n{_log(out)}"
        assert time.monotonic() < deadline, f"no step 3 within {timeout_s} s:\n{_log(out)}"
        time.sleep(0.1)


def _seconds_until_gone(run: subprocess.Popen, limit_s: float) -> float | None:
    """Seconds until no process of the run's session is left (``None``: some left after ``limit_s``; killed)."""
    started = time.monotonic()
    while time.monotonic() - started < limit_s:
        if not _session(run.pid):
            run.wait()
            return time.monotonic() - started
        time.sleep(0.05)
    for pid in _session(run.pid):
        os.kill(pid, signal.SIGKILL)
    run.wait()
    return None


def _log(out: Path) -> str:
    return (out / "log.txt").read_text()[-4000:]


@pytest.mark.parametrize("target", ["launcher", "rank 1"])
def test_sigterm_stops_every_rank_after_one_step_and_saves(tmp_path, target):
    run = _start([sys.executable, SCRIPT, str(tmp_path), "100000", "signal"], tmp_path)
    _wait_ready(run, tmp_path)
    # the launcher forwards the signal to the rank it started; rank 1 alone must stop the whole job too
    os.kill(run.pid if target == "launcher" else int((tmp_path / "ready_1").read_text()), signal.SIGTERM)
    gone_s = _seconds_until_gone(run, 120.0)
    assert gone_s is not None, f"ranks still running 120 s after SIGTERM:\n{_log(tmp_path)}"
    assert run.returncode == 0, _log(tmp_path)  # Lightning's SIGTERMException is a SystemExit without a code
    counts = [json.loads((tmp_path / f"counts_{rank}.json").read_text()) for rank in range(2)]
    assert [c["how"] for c in counts] == ["SIGTERMException"] * 2, _log(tmp_path)
    assert is_complete_checkpoint(tmp_path / "ckpt" / "on_exception.ckpt"), _log(tmp_path)
    for rank, count in enumerate(counts):
        # the interrupted fit leaves no more than a finished one left: the process groups' threads and sockets
        assert all(count["second"][k] <= count["first"][k] for k in count["first"]), f"rank {rank}: {count}"
        assert not [name for name in count["names"] if name.startswith("smp-")], count["names"]


def test_ctrl_c_ends_every_rank_within_10_s(tmp_path):
    run = _start([sys.executable, SCRIPT, str(tmp_path), "100000", "signal"], tmp_path)
    _wait_ready(run, tmp_path)
    os.killpg(run.pid, signal.SIGINT)  # what a terminal does on Ctrl-C: every process of the foreground group
    gone_s = _seconds_until_gone(run, 10.0)
    assert gone_s is not None, f"ranks still running 10 s after Ctrl-C:\n{_log(tmp_path)}"
    assert run.returncode != 0


def test_fork_after_the_parent_used_openmp_does_not_hang(tmp_path):
    result = subprocess.run(
        [sys.executable, "tests/scripts/fork_after_openmp.py"], cwd=ROOT, env=_env(), capture_output=True,
        text=True, timeout=180,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert "forked rank threads: 1" in result.stdout


@pytest.mark.skipif(shutil.which("torchrun") is None and not (Path(sys.executable).parent / "torchrun").exists(),
                    reason="torchrun not installed")
def test_torchrun_restarts_a_killed_rank_and_resumes_from_last(tmp_path):
    steps = 6
    whole = _fit(_GPT, tmp_path / "whole", 1, steps=steps)[0]  # the uninterrupted run on one process
    torchrun = str(Path(sys.executable).parent / "torchrun")
    elastic = _start(
        [torchrun, "--standalone", "--max-restarts", "1", "--nproc-per-node", "2", SCRIPT,
         str(tmp_path / "elastic"), str(steps), "resume"],
        tmp_path / "elastic", KILL_RANK1_AT="3",
    )
    assert _seconds_until_gone(elastic, 300.0) is not None, _log(tmp_path / "elastic")
    assert elastic.returncode == 0, _log(tmp_path / "elastic")
    for rank in range(2):
        resumed = torch.load(tmp_path / "elastic" / f"final_{rank}.pt", weights_only=True)
        assert (resumed["started_at"], resumed["step"]) == (2, steps), "resumed from step 2's last, ran to the end"
        assert resumed["params"], f"rank {rank} holds parameters"
        for name, value in resumed["params"].items():
            torch.testing.assert_close(value, whole["state"][name], rtol=1e-5, atol=1e-5, msg=f"rank {rank} {name}")


def _srun(out: Path, max_steps: int, port: int) -> list[subprocess.Popen]:
    """Both ranks of a pp2 run as ``srun`` starts them (SLURM's variables, one process each), with a fake
    ``scontrol`` on ``PATH`` that records its arguments in ``out/scontrol.txt``."""
    fake = out / "bin" / "scontrol"
    fake.parent.mkdir(parents=True, exist_ok=True)
    fake.write_text(f'#!/bin/sh\necho "$@" >> {out / "scontrol.txt"}\n')
    fake.chmod(0o755)
    slurm = {"SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NODEID": "0", "SLURM_JOB_ID": "4242",
             "SLURM_JOB_NAME": "smp-requeue", "SLURM_NODELIST": "127.0.0.1", "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": str(port), "PATH": f"{fake.parent}{os.pathsep}{os.environ['PATH']}"}
    return [_start([sys.executable, SCRIPT, str(out), str(max_steps), "slurm"], out / f"rank{rank}",
                   SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), **slurm) for rank in range(2)]


def test_slurm_requeue_saves_an_hpc_checkpoint_at_a_step_boundary_and_resumes_from_it(tmp_path):
    """SIGUSR1 (SLURM's requeue signal) to rank 1 alone (SLURM signals every task, but not at the same point of
    their steps; one rank is the limit): both save ``hpc_ckpt_1.ckpt`` together (a complete DCP folder) and global
    rank 0 alone requeues; the job then ends on SLURM's SIGTERM; started again, it resumes from there. Before, rank 1
    saved from inside its signal handler alone and the job hung."""
    ranks = _srun(tmp_path, 100000, _free_port())
    try:
        deadline = time.monotonic() + 240
        while not all((tmp_path / f"ready_{rank}").exists() for rank in range(2)):
            assert all(r.poll() is None for r in ranks) and time.monotonic() < deadline, _log(tmp_path / "rank0")
            time.sleep(0.1)
        os.kill(ranks[1].pid, signal.SIGUSR1)
        hpc = tmp_path / "hpc_ckpt_1.ckpt"
        while not (is_complete_checkpoint(hpc) and (tmp_path / "scontrol.txt").exists()):
            assert all(r.poll() is None for r in ranks) and time.monotonic() < deadline, _log(tmp_path / "rank1")
            time.sleep(0.1)
        for rank in ranks:
            os.kill(rank.pid, signal.SIGTERM)  # what `scontrol requeue` does to the running job
        assert [r.wait(timeout=120) for r in ranks] == [0, 0], _log(tmp_path / "rank0") + _log(tmp_path / "rank1")
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
                rank.wait()
    assert (tmp_path / "scontrol.txt").read_text() == "requeue 4242\n"  # once, from global rank 0
    saved_at = torch.load(hpc / "meta.pt", weights_only=False)["global_step"]
    requeued = _srun(tmp_path, saved_at + 1, _free_port())
    try:
        assert [r.wait(timeout=240) for r in requeued] == [0, 0], _log(tmp_path / "rank0") + _log(tmp_path / "rank1")
    finally:
        for rank in requeued:
            if rank.poll() is None:
                rank.kill()
                rank.wait()
    for rank in range(2):
        final = torch.load(tmp_path / f"final_{rank}.pt", weights_only=True)
        assert (final["started_at"], final["step"]) == (saved_at, saved_at + 1), final


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
