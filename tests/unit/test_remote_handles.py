"""Remote handles: the ``remote_handles`` switch is checked before anything runs."""

from __future__ import annotations

import pytest


def test_remote_handles_switch_must_be_a_bool():
    from lightning_mp import SMPConfig

    assert SMPConfig()._remote_handles is True and SMPConfig(_remote_handles=False)._remote_handles is False
    with pytest.raises(ValueError, match="remote_handles"):
        SMPConfig(_remote_handles="no")
