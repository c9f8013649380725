"""Data planes that do not exist or cannot work here are named errors, before any collective."""

from __future__ import annotations

import pytest

from lightning_mp.comm import make_data_plane
from tests.distributed.test_data_planes import _CPU


def test_unknown_or_impossible_data_planes_are_named_errors():
    class _Fake:
        pass

    with pytest.raises(ValueError, match="data plane must be"):
        make_data_plane("tcp", _Fake(), _CPU)
    with pytest.raises(ValueError, match="moves CUDA tensors"):
        make_data_plane("nccl", _Fake(), _CPU)


def test_nccl_data_plane_on_cpu_is_refused_before_any_collective():
    from lightning_mp import SMPConfig
    from lightning_mp.strategy._transport import check_data_plane

    with pytest.raises(ValueError, match="data_plane='nccl' moves CUDA tensors, but this rank runs on cpu"):
        check_data_plane(SMPConfig(pipeline_parallel_degree=2, data_plane="nccl"), _CPU)
    check_data_plane(SMPConfig(pipeline_parallel_degree=2, data_plane="auto"), _CPU)
