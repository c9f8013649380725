"""Dropout under tensor parallelism (see [Note: random numbers under tensor parallelism]) in one process: the masks
are slices of one process's masks, the per-rank and shared streams, the region layout rules and their errors."""

from __future__ import annotations

import contextlib
import dataclasses
import warnings

import pytest
import torch

import lightning_mp  # noqa: E402
from lightning_mp.tp import TPGroup  # noqa: E402
from lightning_mp.tp._random import ShardedRandomRegion, _pop, _push  # noqa: E402

P = 0.2


def _region(local: int, replicated: int, fused: int = 0, rank: int = 1, heads: int = 2) -> ShardedRandomRegion:
    return ShardedRandomRegion(
        "h.0.mlp", TPGroup(None, rank, 2), frozenset({local}), frozenset({replicated}), frozenset({fused} - {0}),
        frozenset({heads} - {0}),
    )


def _push_after_column(region: ShardedRandomRegion) -> None:
    """Enter ``region`` as its call does once a column-parallel child has run (its outputs may be sharded)."""
    _push(region).column_ran = True


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("attn", ["dropout", "sdpa"])
def test_masks_are_bitwise_the_slice_of_one_process_masks(rank, attn):
    """A fake tp rank, no group: dropout on ``(B, nh / tp, T, T)`` attention weights inside a region is
    bitwise rank ``r``'s heads of one process's dropout on ``(B, nh, T, T)``, and the stream continues as its does."""

    def draw(x: torch.Tensor) -> torch.Tensor:
        if attn == "dropout":
            return torch.nn.functional.dropout(x, P, training=True)
        return torch.nn.functional.scaled_dot_product_attention(x, x, x, dropout_p=P)  # math path with dropout

    full = torch.randn(2, 4, 8, 8)
    torch.manual_seed(5)
    expected, expected_next = draw(full), torch.rand(3)
    local = full[:, 2 * rank : 2 * rank + 2].clone()
    torch.manual_seed(5)
    _push_after_column(_region(local=32, replicated=16, rank=rank))
    try:
        got = draw(local)
    finally:
        _pop()
    regional = expected[:, 2 * rank : 2 * rank + 2]
    assert torch.equal(got, regional)
    assert torch.equal(torch.rand(3), expected_next)


def test_per_rank_streams_differ_between_ranks_and_leave_the_shared_stream_alike():
    """``streams="per_rank"`` (Megatron's tracker behaviour): each rank's mask comes from its own stream, drawn
    for the local shard only; after the draw, the shared stream is in the same place on every rank."""
    masks, after = [], []
    for rank in (0, 1):
        region = dataclasses.replace(_region(local=32, replicated=16, rank=rank), per_rank=True)
        torch.manual_seed(5)
        _push_after_column(region)
        try:
            masks.append(torch.nn.functional.dropout(torch.ones(2, 2, 8, 8), 0.5, training=True))
        finally:
            _pop()
        after.append(torch.rand(3))
    assert not torch.equal(masks[0], masks[1])
    assert torch.equal(after[0], after[1])


def test_a_draw_that_depends_on_sharded_values_raises():
    _push_after_column(_region(local=32, replicated=16))
    try:
        with pytest.raises(ValueError, match=r"aten.bernoulli.default in tensor-parallel region 'h.0.mlp' drew"):
            torch.bernoulli(torch.full((2, 2, 4, 4), 0.5))
        assert torch.equal(torch.bernoulli(torch.full((2, 8, 16), 0.0)), torch.zeros(2, 8, 16))  # replicated
    finally:
        _pop()


def test_region_layout_rules():
    region = _region(local=32, replicated=16, fused=24)
    assert region.sharded_dim(torch.Size([2, 2, 8, 8]), "op") == 1  # attention weights: heads
    assert region.sharded_dim(torch.Size([2, 3, 8, 8]), "op") is None  # dim 1 is no local head count
    assert _region(32, 16, heads=0).sharded_dim(torch.Size([2, 2, 8, 8]), "op") is None  # head count unknown
    assert region.sharded_dim(torch.Size([2, 8, 32]), "op") == 2  # a column-parallel output
    assert region.sharded_dim(torch.Size([2, 8, 16]), "op") is None  # replicated
    with pytest.raises(ValueError, match="fused column-parallel output"):
        region.sharded_dim(torch.Size([2, 8, 24]), "op")


@pytest.mark.parametrize(("local", "fused"), [(16, 0), (0, 16)], ids=["gpt2-c_fc-tp4", "gpt2-c_attn-tp3"])
def test_a_width_both_sharded_and_replicated_draws_from_the_shared_stream(local, fused):
    """GPT-2 with its default dropout at tp=4 (``c_fc``'s local width 4C/4 == C) and tp=3 (fused ``c_attn``'s
    3C/3 == C): the residual dropout after the row-parallel ``c_proj`` on ``(B, T, C)`` is replicated, so every
    rank draws the same mask, silently; the same width before any row-parallel child ran warns once (it may be
    sharded) and is drawn alike too. An op before the first column-parallel child is replicated."""
    region = dataclasses.replace(_region(local=local, replicated=16, fused=fused), name=f"h.0.{local}.{fused}")
    x = torch.ones(2, 8, 16)
    masks = []
    for rank in (0, 1):
        torch.manual_seed(5)
        call = _push(dataclasses.replace(region, tp=TPGroup(None, rank, 2)))
        try:
            before_column = torch.nn.functional.dropout(x, P)
            call.column_ran = True
            with pytest.warns(UserWarning, match="both a sharded width") if rank == 0 else _no_warning():
                ambiguous = torch.nn.functional.dropout(x, P)
            call.row_ran_since = True
            with _no_warning():
                after_row = torch.nn.functional.dropout(x, P)
        finally:
            _pop()
        masks.append(torch.stack([before_column, ambiguous, after_row]))
    torch.manual_seed(5)
    expected = torch.stack([torch.nn.functional.dropout(x, P) for _ in range(3)])
    assert torch.equal(masks[0], expected)
    assert torch.equal(masks[1], expected)


@contextlib.contextmanager
def _no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


# ---- Trainer.fit: tp=2 against tp=1 at the same microbatching -----------------------------------------------------


def test_tp_random_streams_is_checked():
    with pytest.raises(ValueError, match="`tp_random_streams` must be 'one_process' or 'per_rank', got 'megatron'"):
        lightning_mp.SMPStrategy(tensor_parallel_degree=2, tp_random_streams="megatron")


class _ModeProbe(torch.nn.Module):
    """A region (a column-parallel child, never called here) that records the dispatch mode its call runs under."""

    def __init__(self, p: float, attention_dropout: float):
        from lightning_mp.nn import DistributedLinear  # noqa: PLC0415

        super().__init__()
        self.fc = DistributedLinear(8, 16, tp=TPGroup(None, 0, 2), parallel="column")
        self.drop, self.attention_dropout = torch.nn.Dropout(p), attention_dropout

    def forward(self, x: torch.Tensor):
        from torch.utils._python_dispatch import _get_current_dispatch_mode  # noqa: PLC0415

        return _get_current_dispatch_mode()


@pytest.mark.parametrize(
    ("p", "attention_dropout", "training", "on"),
    [(0.1, 0.0, True, True), (0.0, 0.1, True, True), (0.0, 0.0, True, False), (0.1, 0.1, False, False)],
)
def test_the_draw_mode_is_on_only_while_the_region_can_draw(p, attention_dropout, training, on):
    """The dispatch mode costs time on every op (a slower forward and backward): it is entered only in training
    with a dropout rate above 0 (an ``nn.Dropout``'s ``p`` or a float "drop" attribute)."""
    from lightning_mp.tp._random import install_sharded_random, remove_sharded_random  # noqa: PLC0415

    probe = _ModeProbe(p, attention_dropout).train(training)
    assert install_sharded_random(probe, probe.fc.tp) == [""]
    try:
        assert (probe(torch.ones(1)) is not None) is on
    finally:
        remove_sharded_random(probe)
