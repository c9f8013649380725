"""The bucketed data-parallel all-reduce (``strategy/_reducer.py``) in one process: buckets follow DDP's reverse
order and size caps."""

from __future__ import annotations

import torch
from torch import nn

from lightning_mp.strategy._reducer import _make_buckets


def test_buckets_follow_ddp_reverse_order_and_caps():
    params = [nn.Parameter(torch.zeros(n)) for n in (10, 300, 20, 5)] + [nn.Parameter(torch.zeros(4, dtype=torch.float64))]
    buckets = _make_buckets(params, first_bytes=100, cap_bytes=1210)
    as_sizes = [[p.numel() for p in b.params] for b in buckets]
    # reverse order, one dtype per bucket, a first bucket per dtype: 5+20 floats fill the first 100 bytes, 300 + 10
    # floats are over the 1210-byte cap
    assert as_sizes == [[4], [5, 20], [300], [10]]
