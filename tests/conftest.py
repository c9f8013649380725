"""Test-session setup: tier markers by folder, and one intra-op thread in every process the tests start.

Tiers (one folder each, marked by path so that no test can miss its marker; ``pytest -m unit`` or
``pytest tests/unit`` runs one tier alone):

* ``unit``: one process, no process group (``tests/unit/conftest.py`` fails a test that starts a process or one).
* ``distributed``: several gloo processes (or child processes) without a ``Trainer``.
* ``trainer``: ``Trainer`` runs, most of them on several processes, against one process.
* ``cli``: the ``lightning-mp`` console script and the shipped configs.

A child forked from the pytest process hangs in libgomp if it raises its OpenMP thread count after the pytest
process has used its OpenMP pool (the pool's threads do not exist in the child), and the ``ddp`` thread policy that
``smp`` applies raises a one-process run to ``cpu_count`` threads; this hung CI twice (the tied-weight and
resharding ``Trainer`` tests). With ``OMP_NUM_THREADS`` set the policy leaves the thread count alone, as under
``ddp``. The test of the policy itself (``tests/trainer/test_ddp_parity.py``) builds its subprocesses'
environment without it.
"""

import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

TIERS = ("unit", "distributed", "trainer", "cli")
_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test with the tier of its folder; a test file outside the tier folders is a usage error."""
    for item in items:
        folder = Path(item.path).resolve().relative_to(_HERE).parts[0]
        if folder not in TIERS:
            raise pytest.UsageError(f"{item.nodeid}: test files live in tests/<tier>/ with tier one of {TIERS}")
        item.add_marker(getattr(pytest.mark, folder))
