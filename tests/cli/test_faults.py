"""The fault harness's fixed CI subset: a rank of a 4-process ``lightning-mp fit`` (pp2 x dp2, the example GPT,
tiny) killed in a pipelined forward, killed in the data-parallel gradient all-reduce, and stopped (SIGSTOP).

Each trial (``scripts/fault_harness.py``) must end with every other rank gone within ``timeout`` + 10 s of the fault,
an error that names the failed rank's global rank, and no process of the run left behind. The faults come before
the first checkpoint (step 1), so no trial resumes (the harness's full run does; exact resume after a kill is also
``tests/trainer/test_checkpoint_safety.py``'s).
"""

from __future__ import annotations

import pytest

from scripts.fault_harness import Trial, run_trial

# SMPConfig.timeout of the runs, seconds. It is also their rendezvous timeout, so it must cover 4 processes starting
# (60 s did not at loads 20 to 30 on 2 cores shared with other runs; on an idle 2-core machine 10 trials at 60 s all
# started, see the README's "Faults"); only the SIGSTOP trial waits for it, so only it is short.
TIMEOUT_S = {"forward": 180, "allreduce": 180, "sigstop": 60}
# The goal is every other rank out within timeout + 10 s. A SIGSTOP makes the others detect the silence after the
# timeout and then exit (Python and process-group teardown of 3 processes): 15 s past the timeout at load 20 on 2
# cores, so the SIGSTOP trial is held to timeout + 30 s here; scripts/fault_harness.py reports against the goal.
SLACK_S = {"forward": 10, "allreduce": 10, "sigstop": 30}


@pytest.mark.parametrize(
    ("point", "rank"),
    [("forward", 1), ("allreduce", 3), ("sigstop", 1)],
    ids=["forward-stage1", "allreduce-rank3", "sigstop-stage1"],
)
def test_the_other_ranks_fail_naming_the_faulted_rank(tmp_path, point, rank):
    timeout_s = TIMEOUT_S[point]
    trial = run_trial(Trial(0, "pp2xdp2", point, rank, step=1), tmp_path, timeout_s, reference={})
    log = (tmp_path / "trial-000" / "log.txt").read_text(errors="replace")
    assert trial.fault_s is not None, f"the fault was not reached:\n{log[-3000:]}"
    assert trial.left_behind == 0, f"{trial.extra.get('left_ranks')} left behind:\n{log[-3000:]}"
    late = f"{trial.out_after_s} s:\n{log[-3000:]}"
    assert trial.others_out and trial.out_after_s <= timeout_s + SLACK_S[point], late
    assert trial.named, f"no error names global rank {rank}:\n{log[-5000:]}"
    assert trial.checkpoint == "" and trial.resume_exact is None  # no checkpoint before step 2
