"""Remote handles: the ``remote_handles`` switch is checked before anything runs."""

from __future__ import annotations

import pytest


def test_remote_handles_switch_must_be_a_bool():
    from lightning_mp import SMPConfig

    assert SMPConfig().remote_handles is True and SMPConfig(remote_handles=False).remote_handles is False
    with pytest.raises(ValueError, match="remote_handles"):
        SMPConfig(remote_handles="no")
