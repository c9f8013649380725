"""TP collectives: an unknown group name is a ValueError."""

from __future__ import annotations

import pytest

from lightning_mp.tp import ParallelGroups


def test_unknown_group_name_is_a_value_error():
    groups = ParallelGroups(world=None, tp=None, pp=None, dp=None, rdp=None)
    with pytest.raises(ValueError, match="Unknown group 'mp'.*'tp'"):
        groups.get("mp")
