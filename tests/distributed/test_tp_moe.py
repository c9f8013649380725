"""MoE: the experts spread over 2 gloo ranks against the dense one-process MoE with the same routing
(outputs, aux loss, every gradient, the input gradient), including capacity dropping and all tokens routed
to one expert."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import lightning_mp
from lightning_mp.nn import MoE, route
from lightning_mp.tp import TPGroup, shard, shard_spec
from lightning_mp.tp._swap import swap_modules
from tests._dist import run_distributed


def _moe_worker(rank: int, world: int, top_k: int, one_expert: bool) -> dict:
    tp = TPGroup.of(dist.group.WORLD)
    torch.manual_seed(0)
    ref = MoE(8, 4, 16, top_k=top_k, capacity_factor=1.0)
    x = torch.randn(2, 6, 8)
    if one_expert:  # every token prefers expert 0
        x = x.abs()
        with torch.no_grad():
            ref.router.weight.zero_()
            ref.router.weight[0] = 1.0
    model = lightning_mp.set_tensor_parallelism(torch.nn.Sequential(ref.__class__(8, 4, 16, top_k, 1.0)))
    model[0].load_state_dict(ref.state_dict())
    report = swap_modules(model, tp)
    xr, xd = x.clone().requires_grad_(), x.clone().requires_grad_()
    (y_ref, aux_ref), (y, aux) = ref(xr), model[0](xd)
    up = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
    ((y_ref * up).sum() + 0.1 * aux_ref).backward()
    ((y * up).sum() + 0.1 * aux).backward()
    ref_params = dict(ref.named_parameters())
    grads = {}
    for n, p in model[0].named_parameters():
        spec = shard_spec(p)
        grads[n] = (p.grad, ref_params[n].grad if spec is None else shard(ref_params[n].grad, spec, tp.rank, tp.size))
    experts, _, kept = route(ref.router(x.reshape(-1, 8)).softmax(-1), top_k, 1.0)
    return {
        "swapped": report.swapped, "y": (y.detach(), y_ref.detach()), "aux": (aux.detach(), aux_ref.detach()),
        "grads": grads, "x_grad": (xd.grad, xr.grad), "dropped": int((~kept).sum()), "experts": experts,
    }


@pytest.mark.parametrize(("top_k", "one_expert"), [(1, False), (2, False), (1, True)], ids=["top1", "top2", "all-to-one"])
def test_distributed_moe_matches_dense(top_k, one_expert):
    for result in run_distributed(_moe_worker, 2, top_k, one_expert, start_method="fork"):
        assert result["swapped"] == {"0": "DistributedMoE"}
        if one_expert:
            assert (result["experts"][:, 0] == 0).all() and result["dropped"] == 12 - math.ceil(12 / 4)
            dropped_rows = result["y"][1].reshape(12, 8)[3:]
            assert torch.count_nonzero(dropped_rows) == 0, "tokens over capacity contribute nothing"
        torch.testing.assert_close(*result["y"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(*result["aux"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(*result["x_grad"], rtol=1e-5, atol=1e-6)
        assert set(result["grads"]) == {"router.weight", "w1", "w2"}
        for n, (actual, expected) in result["grads"].items():
            torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
