"""The registry, marks and swaps in one process (construction and shard loading never communicate)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lightning_mp
from examples.gpt import GPT, Block
from examples.gpt_tp import TPGPT  # registers Block
from lightning_mp.nn import DistributedEmbedding, DistributedLinear, DistributedTransformerLayer
from lightning_mp.topology import Topology
from lightning_mp.tp import TPGroup, shard_spec
from lightning_mp.tp._registry import tp_mark
from lightning_mp.tp._swap import swap_modules

TP1 = TPGroup(None, 1, 2)  # rank 1 of 2, no process group: build and load only


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Sequential(nn.Linear(6, 4), nn.LayerNorm(4))


def test_context_marks_children_innermost_wins():
    with lightning_mp.tensor_parallelism(scale=1):
        outer = Pair()
        with lightning_mp.tensor_parallelism(enabled=False):
            inner = nn.Sequential(nn.Linear(2, 2))
    assert tp_mark(outer.a).kwargs == {"scale": 1} and tp_mark(outer.b[1]).enabled
    assert tp_mark(inner[0]).enabled is False
    assert tp_mark(Pair().a) is None  # outside any context


def test_set_tensor_parallelism_swaps_registered_modules_and_loads_shards():
    torch.manual_seed(0)
    model = Pair()
    original = {k: v.clone() for k, v in model.state_dict().items()}
    lightning_mp.set_tensor_parallelism(model)
    report = swap_modules(model, TP1)
    assert report.swapped == {"a": "DistributedLinear", "b.0": "DistributedLinear"}
    assert isinstance(model.b[1], nn.LayerNorm) and not report.skipped  # inherited mark: no complaint
    assert torch.equal(model.a.weight, original["a.weight"][3:6])  # rank 1's half of the output rows
    assert shard_spec(model.a.weight).full_size == 6


def test_disabled_subtree_is_left_alone():
    model = lightning_mp.set_tensor_parallelism(Pair())
    lightning_mp.set_tensor_parallelism(model.b, enabled=False)
    report = swap_modules(model, TP1)
    assert list(report.swapped) == ["a"] and type(model.b[0]) is nn.Linear


def test_unregistered_and_indivisible_marked_modules_are_reported():
    class Custom(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(3))

    with lightning_mp.tensor_parallelism():
        holder = nn.ModuleDict({"custom": Custom(), "block": Block(12, 3, 0.0)})  # 3 heads on 2 ranks
    report = swap_modules(holder, TP1)
    assert "no registration for Custom" in report.skipped["custom"]
    assert "n_head=3 is not divisible by tensor_parallel_degree=2" in report.skipped["block"]
    assert isinstance(holder["block"], Block)
    assert isinstance(holder["block"].mlp.c_fc, DistributedLinear)  # its children still swap
    message = report.warning()
    assert "custom" in message and "block" in message and "stay unswapped" in message


def test_tied_weights_stay_tied_and_half_swapped_ties_are_refused():
    model = TPGPT(vocab_size=11, block_size=4, n_layer=1, n_head=2, n_embd=8)
    report = swap_modules(model, TP1)
    assert {"wte", "wpe", "lm_head", "h.0"} <= set(report.swapped)
    assert isinstance(model.h[0], DistributedTransformerLayer) and isinstance(model.wte, DistributedEmbedding)
    assert model.lm_head.weight is model.wte.weight and model.wte.weight.shape == (6, 8)

    plain = GPT(vocab_size=11, block_size=4, n_layer=1, n_head=2, n_embd=8)
    lightning_mp.set_tensor_parallelism(plain.lm_head)  # only one user of the tied weight
    report = swap_modules(plain, TP1)
    assert "shares weight" in report.skipped["lm_head"] and type(plain.lm_head) is nn.Linear
    assert plain.lm_head.weight is plain.wte.weight


def test_tp_register_decorator_with_hooks():
    class Scale(nn.Module):
        def __init__(self, n: int) -> None:
            super().__init__()
            self.n = n

        def forward(self, x):
            return x * self.n

    calls = []

    class DistScale(nn.Module):
        def __init__(self, n: int, *, tp: TPGroup, factor: int = 1) -> None:
            super().__init__()
            self.n, self.tp = n * factor, tp

        def forward(self, x, extra):
            calls.append(extra)
            return x * self.n

    lightning_mp.tp_register(
        DistScale,
        init_hook=lambda m: ((m.n,), {}),
        forward_hook=lambda args, kwargs: (args, {"extra": "hooked"}),
        return_hook=lambda out: out + 1,
    )(Scale)
    model = nn.Sequential(lightning_mp.set_tensor_parallelism(Scale(3), factor=2))
    report = swap_modules(model, TP1)
    assert report.swapped == {"0": "DistScale"}
    assert model(torch.ones(2)).tolist() == [7.0, 7.0] and calls == ["hooked"]


def test_register_rejects_non_modules():
    with pytest.raises(ValueError, match="`dist_cls` must be an nn.Module subclass"):
        lightning_mp.tp_register_with_module(nn.Linear, object)


def test_parameter_counts_after_swap_halve_the_sharded_weights():
    from lightning_mp.strategy._tp import parameter_counts

    model = TPGPT(vocab_size=12, block_size=4, n_layer=1, n_head=2, n_embd=8)
    full_before = sum(p.numel() for p in model.parameters())
    swap_modules(model, TP1)
    local, full = parameter_counts(model)
    assert full == full_before
    replicated = sum(p.numel() for p in model.parameters() if shard_spec(p) is None)
    assert local - replicated == (full - replicated) // 2


def test_config_accepts_tp_and_turns_deterministic_order_on():
    config = lightning_mp.SMPConfig(tensor_parallel_degree=2, pipeline_parallel_degree=2)
    assert config.effective_deterministic_order
    assert not lightning_mp.SMPConfig(tensor_parallel_degree=2, deterministic_order=False).effective_deterministic_order
    topology = Topology(world_size=8, rank=5, pipeline_parallel_degree=2, tensor_parallel_degree=2)
    assert (topology.dp_rank, topology.pp_rank, topology.tp_rank) == (1, 0, 1)  # tp ranks are neighbours
    with pytest.raises(ValueError, match=r"World size 6 is not divisible by .* = 4"):
        Topology(world_size=6, rank=0, pipeline_parallel_degree=2, tensor_parallel_degree=2)


@pytest.mark.parametrize(
    ("placement", "neighbours"), [("cluster", "tp"), ("DPT", "tp"), ("spread", "dp"), ("TPD", "dp"), ("DTP", "pp")]
)
def test_placement_strategy_decides_which_axis_is_adjacent(placement, neighbours):
    grid = [Topology(8, r, 2, 2, placement) for r in range(8)]
    coords = [(g.dp_rank, g.pp_rank, g.tp_rank) for g in grid]
    assert sorted(coords) == sorted({(d, p, t) for d in range(2) for p in range(2) for t in range(2)})
    assert all(g.global_rank(dp_rank=g.dp_rank, pp_rank=g.pp_rank, tp_rank=g.tp_rank) == g.rank for g in grid)
    axis = {"dp": 0, "pp": 1, "tp": 2}[neighbours]
    other = [i for i in range(3) if i != axis]
    assert coords[0][axis] == 0 and coords[1][axis] == 1 and all(coords[0][i] == coords[1][i] for i in other)


def test_bad_placement_strategy_is_a_value_error():
    with pytest.raises(ValueError, match="`placement_strategy` must be 'cluster', 'spread' or a permutation"):
        lightning_mp.SMPConfig(placement_strategy="DDT")
