"""``strategy="smp"`` against ``strategy="ddp"``: what a user sees must not change (issue 13).

Each test runs both strategies on the same model, data and seed, and compares what Lightning reports.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "LOCAL_RANK", "MASTER_PORT")}
    return {**env, "PYTHONPATH": str(ROOT), **extra}


def _threads(out_dir: Path, spec: str, external: bool = False) -> list[dict]:
    """Run tests/scripts/threads_per_rank.py with popen (or as two externally created processes, like SLURM)."""
    out_dir.mkdir()
    command = [sys.executable, "tests/scripts/threads_per_rank.py", spec, str(out_dir)]
    if external:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = str(s.getsockname()[1])
        envs = [_env(LOCAL_RANK=str(r), NODE_RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
                for r in range(2)]
        procs = [subprocess.Popen(command, cwd=ROOT, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for e in envs]
        outputs = [p.communicate(timeout=300)[0] for p in procs]
        assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outputs)
    else:
        result = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return [json.loads((out_dir / f"threads_{rank}.json").read_text()) for rank in range(2)]


def test_threads_per_rank_match_ddp(tmp_path):
    """Every rank, however started, runs ddp's thread count in training_step and in every engine thread."""
    reference = _threads(tmp_path / "ddp", "ddp")
    assert all(r["step"] and r["layers"] for r in reference), "ddp ran its steps"
    runs = {"popen-pp2": _threads(tmp_path / "pp2", "smp:2"), "external-pp1": _threads(tmp_path / "ext", "smp:1", True)}
    for name, ranks in runs.items():
        for rank, (got, expected) in enumerate(zip(ranks, reference)):
            assert got["layers"], f"{name}: rank {rank} ran layers"
            assert got["step"] in ([], expected["step"]), f"{name}: rank {rank} training_step threads"
            assert set(got["layers"]) == set(expected["layers"]), f"{name}: rank {rank} layer threads"
            assert got["omp"] == expected["omp"], f"{name}: rank {rank} OMP_NUM_THREADS"
    assert runs["popen-pp2"][0]["step"] and runs["external-pp1"][1]["step"], "drivers ran training_step"
