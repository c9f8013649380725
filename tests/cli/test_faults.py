"""The fault harness's fixed CI subset: a rank of a 4-process ``lightning-mp fit`` (pp2 x dp2, the example GPT,
tiny) killed in a pipelined forward, killed in the data-parallel gradient all-reduce, and stopped (SIGSTOP).

Each trial (``scripts/fault_harness.py``) must end with every other rank gone within ``timeout`` + 10 s of the fault,
an error that names the failed rank's global rank, and no process of the run left behind. The faults come before
the first checkpoint (step 1), so no trial resumes (the harness's full run does; exact resume after a kill is also
``tests/trainer/test_checkpoint_safety.py``'s).
"""

from __future__ import annotations

import pytest

from scripts.fault_harness import Trial, outcome, run_trial

TIMEOUT_S = 60  # SMPConfig.timeout of the runs: also their rendezvous timeout, so not much shorter on a busy machine


@pytest.mark.parametrize(
    ("point", "rank"),
    [("forward", 1), ("allreduce", 3), ("sigstop", 1)],
    ids=["forward-stage1", "allreduce-rank3", "sigstop-stage1"],
)
def test_the_other_ranks_fail_naming_the_faulted_rank(tmp_path, point, rank):
    trial = run_trial(Trial(0, "pp2xdp2", point, rank, step=1), tmp_path, TIMEOUT_S, reference={})
    log = (tmp_path / "trial-000" / "log.txt").read_text(errors="replace")
    assert trial.fault_s is not None, f"the fault was not reached:\n{log[-3000:]}"
    assert trial.left_behind == 0, f"{trial.extra.get('left_ranks')} left behind:\n{log[-3000:]}"
    assert trial.others_out and trial.out_after_s <= TIMEOUT_S + 10, f"{trial.out_after_s} s:\n{log[-3000:]}"
    assert trial.named, f"no error names global rank {rank}:\n{log[-5000:]}"
    assert trial.checkpoint == "" and trial.resume_exact is None  # no checkpoint before step 2
    assert outcome(trial, TIMEOUT_S) == "ok"
