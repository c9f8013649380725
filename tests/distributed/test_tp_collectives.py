"""TP collectives: forward and backward of every autograd pair on 2 gloo ranks, against the maths on full
tensors every rank can compute; and the named-group helpers."""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_mp.tp import (
    CommGroup,
    ParallelGroups,
    all_gather_along,
    all_to_all,
    allgather,
    allreduce,
    broadcast,
    copy_to_tp,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_along,
    scatter_to_tp,
    tp_rank,
    tp_size,
)
from tests._dist import run_distributed


def _per_rank(world: int, *shape: int) -> list[torch.Tensor]:
    """The same list of per-rank tensors on every rank (rank r uses element r)."""
    g = torch.Generator().manual_seed(1)
    return [torch.randn(*shape, generator=g) for _ in range(world)]


def _op(fn, x: torch.Tensor, upstream: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.clone().requires_grad_()
    y = fn(x)
    (y * upstream).sum().backward()
    return y.detach(), x.grad


def _collectives_worker(rank: int, world: int) -> dict:
    g = dist.group.WORLD
    xs, ups = _per_rank(world, 4, 6), _per_rank(world, 4, 6)
    full_ups = _per_rank(world, 4, 12)
    out = {}
    # copy-to: fwd identity, bwd sum of every rank's upstream
    out["copy"] = (_op(lambda x: copy_to_tp(x, g), xs[0], ups[rank]), (xs[0], sum(ups)))
    # reduce-from: fwd sum, bwd identity
    out["reduce"] = (_op(lambda x: reduce_from_tp(x, g), xs[rank], ups[0]), (sum(xs), ups[0]))
    # scatter-to along dim 1: fwd chunk r, bwd all-gather of the chunks' upstreams
    up_chunks = [u.chunk(world, 1)[r] for r, u in enumerate(ups)]
    out["scatter"] = (
        _op(lambda x: scatter_to_tp(x, g, dim=1), xs[0], up_chunks[rank]),
        (xs[0].chunk(world, 1)[rank], torch.cat(up_chunks, 1)),
    )
    # gather-from along dim 1: fwd cat, bwd chunk r of the (replicated) upstream
    out["gather"] = (
        _op(lambda x: gather_from_tp(x, g, dim=1), xs[rank], full_ups[0]),
        (torch.cat(xs, 1), full_ups[0].chunk(world, 1)[rank]),
    )
    # reduce-scatter along dim 0: fwd chunk r of the sum, bwd all-gather
    rs_ups = [u.chunk(world, 0)[0] for u in ups]
    out["reduce_scatter"] = (
        _op(lambda x: reduce_scatter_along(x, g, dim=0), xs[rank], rs_ups[rank]),
        (sum(xs).chunk(world, 0)[rank], torch.cat(rs_ups, 0)),
    )
    # all-gather along dim 0 with partial consumers: fwd cat, bwd chunk r of the sum of upstreams
    ag_ups = _per_rank(world, 8, 6)
    out["all_gather"] = (
        _op(lambda x: all_gather_along(x, g, dim=0), xs[rank], ag_ups[rank]),
        (torch.cat(xs, 0), sum(ag_ups).chunk(world, 0)[rank]),
    )
    # all-to-all on dim 0: chunk j of rank i -> chunk i of rank j; backward is the inverse exchange
    a2a = torch.cat([xs[j].chunk(world, 0)[rank] for j in range(world)], 0)
    a2a_grad = torch.cat([ups[j].chunk(world, 0)[rank] for j in range(world)], 0)
    out["all_to_all"] = (_op(lambda x: all_to_all(x, g), xs[rank], ups[rank]), (a2a, a2a_grad))
    return out


def test_autograd_collectives_forward_and_backward():
    for result in run_distributed(_collectives_worker, 2, start_method="fork"):
        assert len(result) == 7
        for name, ((y, grad), (y_expected, grad_expected)) in result.items():
            torch.testing.assert_close(y, y_expected, rtol=1e-6, atol=1e-6, msg=lambda m, n=name: f"{n} fwd: {m}")
            torch.testing.assert_close(grad, grad_expected, rtol=1e-6, atol=1e-6, msg=lambda m, n=name: f"{n} bwd: {m}")


def _helpers_worker(rank: int, world: int) -> dict:
    w = dist.group.WORLD
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    evens, odds = dist.new_group([0, 2]), dist.new_group([1, 3])
    tp = pairs[rank // 2]
    other = evens if rank % 2 == 0 else odds
    groups = ParallelGroups(world=w, tp=tp, pp=other, dp=tp, rdp=other)
    total = allreduce(groups, torch.tensor([float(rank)]), CommGroup.TP)
    return {
        "tp": (tp_rank(groups), tp_size(groups)),
        "gathered": allgather(groups, rank, "tp"),
        "sum": total.item(),
        "bcast": broadcast(groups, f"from {rank}", CommGroup.RDP, src=1),
    }


def test_group_helpers_use_the_named_group():
    results = run_distributed(_helpers_worker, 4, start_method="fork")
    for rank, result in enumerate(results):
        base = 2 * (rank // 2)
        assert result["tp"] == (rank % 2, 2)
        assert result["gathered"] == [base, base + 1]
        assert result["sum"] == float(2 * base + 1)
        assert result["bcast"] == f"from {2 + rank % 2}"


def _rng_worker(rank: int, world: int) -> list[float]:
    from lightning_mp.strategy._tp import sync_rng_over_tp

    torch.manual_seed(100 + rank)  # ranks seeded differently
    w = dist.group.WORLD
    sync_rng_over_tp(ParallelGroups(world=w, tp=w, pp=w, dp=w, rdp=w))
    return torch.rand(3).tolist()


def test_tp_ranks_draw_the_same_random_numbers_after_setup():
    first, second = run_distributed(_rng_worker, 2, start_method="fork")
    torch.manual_seed(100)
    assert first == second == torch.rand(3).tolist()
