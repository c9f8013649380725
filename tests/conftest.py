"""Test-session setup: every process the tests start runs one intra-op thread unless a test says otherwise.

A child forked from the pytest process hangs in libgomp if it raises its OpenMP thread count after the pytest
process has used its OpenMP pool (the pool's threads do not exist in the child), and the ``ddp`` thread policy that
``smp`` applies raises a one-process run to ``cpu_count`` threads; this hung CI twice (``test_tied.py``,
``test_checkpoint_reshard.py``). With ``OMP_NUM_THREADS`` set the policy leaves the thread count alone, as under
``ddp``. The test of the policy itself (``tests/test_parity.py``) builds its subprocesses' environment without it.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
