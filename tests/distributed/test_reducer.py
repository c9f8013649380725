"""The bucketed data-parallel all-reduce launched from gradient hooks (``strategy/_reducer.py``) gives the gradients
that the all-reduce after backward (``all_reduce_gradients``) gives, bitwise at dp=2, and falls back on every rank
when one rank's gradients do not arrive once per parameter."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_mp.strategy._reducer import GradientReducer
from lightning_mp.pipeline._grads import OrderedGradients
from lightning_mp.strategy._gradients import GradientStash, all_reduce_gradients
from tests._dist import run_distributed


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 16)
        self.b = nn.Linear(16, 16)
        self.unused_on_rank1 = nn.Linear(16, 16)  # a branch only rank 0 takes: no gradient on rank 1
        self.frozen = nn.Linear(16, 16).requires_grad_(False)
        self.c = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, branch: bool, twice: bool) -> torch.Tensor:
        h = torch.tanh(self.b(torch.tanh(self.a(x))))
        if branch:
            h = h + self.unused_on_rank1(h)
        return self.c(self.frozen(h)) + (self.c(h) if twice else 0)


def _steps(rank: int, world: int, bucketed: bool, microbatches: int, accumulate: int, twice_on_rank: int | None,
           token_weighted_on_rank: int | None, launch_in_hooks: bool = True) -> dict:
    """Two optimizer windows of ``accumulate`` batches of ``microbatches`` backwards each, as the strategy runs
    them: gradients set aside per batch (GradientStash), the reducer armed on a window's last batch."""
    torch.manual_seed(0)
    net = _Net()
    params = list(net.parameters())
    group = torch.distributed.group.WORLD
    stash = GradientStash()
    current: list[int | None] = [None]
    reducer = GradientReducer(
        params, group, world, previous=stash.previous,
        first_bucket_bytes=200, bucket_bytes=1200,  # several buckets, one parameter over the cap alone
        launch_in_hooks=launch_in_hooks,
    ) if bucketed else None
    if reducer is not None:  # as the engine reports accumulations at one stage (``PipelineEngine.report_gradients``)
        OrderedGradients(lambda: current[0]).report(reducer.bucketed_params, reducer.accumulated, lambda: reducer.armed)
    generator = torch.Generator().manual_seed(100 + rank)
    results, fell_back, in_backward = [], [], []
    for window in range(2):
        for batch in range(accumulate):
            last = batch == accumulate - 1
            stash.begin(params, keep_previous=batch > 0)
            armed = reducer is not None and last and reducer.arm(microbatches)
            for mb in range(microbatches):
                current[0] = mb
                x = torch.randn(4, 6, generator=generator)
                twice = twice_on_rank == rank and mb == microbatches - 1 and window == 0
                out = net(x, branch=rank == 0, twice=False)
                (out.pow(2).mean() / (microbatches * accumulate)).backward()
                if twice:  # a second backward call reaching `c` after its last contribution was sent
                    net(x, branch=False, twice=True).sum().mul(1e-3).backward()
            current[0] = None
            if armed:
                in_backward.append(reducer._launched)  # buckets that went out during backward
                if token_weighted_on_rank == rank and window == 0:
                    reducer.surprise()
                reducer.flush()
            stash.end()
            if batch == 0:
                for p in params:
                    p.grad = None  # Lightning's zero_grad at the window's first batch
            stash.apply()
        if reducer is None or not reducer.finish():
            fell_back.append(window)
            all_reduce_gradients(params, group, world)
        results.append({n: None if p.grad is None else p.grad.clone() for n, p in net.named_parameters()})
        for p in params:
            p.grad = None
    return {"grads": results, "fell_back": fell_back, "enabled": reducer.enabled if reducer else None,
            "buckets": reducer.num_buckets if reducer else 0, "in_backward": in_backward}


def _compare(world: int, microbatches: int, accumulate: int, twice_on_rank=None, token_weighted_on_rank=None,
             launch_in_hooks=True):
    args = (microbatches, accumulate, twice_on_rank, token_weighted_on_rank)
    bucketed = run_distributed(_steps, world, True, *args, launch_in_hooks, start_method="fork")
    flat = run_distributed(_steps, world, False, *args, start_method="fork")
    for rank in range(world):
        for window, (got, want) in enumerate(zip(bucketed[rank]["grads"], flat[rank]["grads"])):
            assert got.keys() == want.keys()
            for name in want:
                if want[name] is None:
                    assert got[name] is None, (rank, window, name)
                else:  # the same sums of the same per-rank gradients, then the same division
                    assert torch.equal(got[name], want[name]), (rank, window, name)
    return bucketed


@pytest.mark.parametrize(("microbatches", "accumulate"), [(1, 1), (3, 2)])
def test_bucketed_all_reduce_equals_the_all_reduce_after_backward(microbatches, accumulate):
    torch.set_num_threads(1)
    results = _compare(2, microbatches, accumulate)
    for result in results:
        assert result["fell_back"] == [] and result["enabled"] and result["buckets"] > 2
        assert all(0 < n < result["buckets"] for n in result["in_backward"]), "some, not all, before flush"
        grads = result["grads"][0]
        assert grads["frozen.weight"] is None
        # rank 1 never reaches `unused_on_rank1`: its bucket is flushed after backward; the average is rank 0's half
        assert grads["unused_on_rank1.weight"] is not None


def test_buckets_held_to_flush_give_the_same_gradients():
    """`launch_in_hooks=False` (CUDA at pp > 1: no NCCL call from engine threads): nothing goes out during
    backward, and the gradients are those of the all-reduce after backward."""
    torch.set_num_threads(1)
    for result in _compare(2, 3, 2, launch_in_hooks=False):
        assert result["fell_back"] == [] and result["enabled"]
        assert result["in_backward"] == [0, 0]


@pytest.mark.parametrize("surprise", ["second-backward", "token-weighted"])
def test_a_surprise_on_one_rank_falls_back_on_every_rank(surprise):
    """A gradient after the parameter's bucket went out (or a token-weighted step) on rank 1 only: both ranks drop
    the buckets for the all-reduce after backward, then stay on it."""
    torch.set_num_threads(1)
    kwargs = {"twice_on_rank": 1} if surprise == "second-backward" else {"token_weighted_on_rank": 1}
    results = _compare(2, 2, 1, **kwargs)
    for result in results:
        assert result["fell_back"] == [0, 1] and result["enabled"] is False
