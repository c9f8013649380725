"""Shared pieces of the tensor-parallel tests: compare a distributed module with its plain original."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_mp.tp import TPGroup, reduce_replicated_grads, shard, shard_spec


def world_tp() -> TPGroup:
    """The whole (2-rank) world as the tp group."""
    return TPGroup.of(dist.group.WORLD)


def expected_local(full: torch.Tensor, param: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """What this rank should hold of ``full`` for ``param`` (its shard, or all of it if replicated)."""
    spec = shard_spec(param)
    return full if spec is None else shard(full, spec, tp.rank, tp.size)


def grad_pairs(dist_module: nn.Module, ref: nn.Module, tp: TPGroup) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{name: (local grad, expected local grad from the reference)}`` for every parameter."""
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    pairs = {}
    for name, p in dist_module.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        pairs[name] = (p.grad.clone(), expected_local(ref_params[name].grad, p, tp))
    return pairs


def run_pair(
    dist_module: nn.Module, ref: nn.Module, inputs: tuple, tp: TPGroup, seed: int = 0, sharded_out: bool = False
) -> dict[str, Any]:
    """Load ``ref``'s weights into ``dist_module``, run both on ``inputs``, backprop one upstream gradient.

    ``sharded_out``: the distributed output is this rank's chunk of the last dim of the reference output.
    """
    dist_module.load_state_dict(ref.state_dict())
    float_inputs = [x for x in inputs if x.is_floating_point()]
    ref_inputs = tuple(x.clone().requires_grad_() if x.is_floating_point() else x for x in inputs)
    dist_inputs = tuple(x.clone().requires_grad_() if x.is_floating_point() else x for x in inputs)
    out_ref, out = ref(*ref_inputs), dist_module(*dist_inputs)
    upstream = torch.randn(out_ref.shape, generator=torch.Generator().manual_seed(seed))
    (out_ref * upstream).sum().backward()
    if sharded_out:
        upstream = upstream.chunk(tp.size, dim=-1)[tp.rank]
        out_ref = out_ref.chunk(tp.size, dim=-1)[tp.rank]
    (out * upstream).sum().backward()
    reduce_replicated_grads(list(dist_module.parameters()), tp.group)  # as the strategy does after backward
    result = {"out": (out.detach(), out_ref.detach()), "grads": grad_pairs(dist_module, ref, tp)}
    if float_inputs:
        result["input_grad"] = (dist_inputs[0].grad, ref_inputs[0].grad)
    return result


def assert_pairs(result: dict[str, Any], rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Every (actual, expected) pair in a :func:`run_pair` result is close; at least one gradient was checked."""
    torch.testing.assert_close(*result["out"], rtol=rtol, atol=atol)
    assert result["grads"], "no parameter gradients were compared"
    for name, (actual, expected) in result["grads"].items():
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")
    if "input_grad" in result:
        torch.testing.assert_close(*result["input_grad"], rtol=rtol, atol=atol)
