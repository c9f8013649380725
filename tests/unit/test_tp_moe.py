"""MoE routing maths in one process: capacity drops later tokens first; indivisible experts are refused."""

from __future__ import annotations

import pytest
import torch

from lightning_mp.nn import DistributedMoE, route
from lightning_mp.tp import TPDivisibilityError, TPGroup


def test_route_capacity_drops_later_tokens_first_choices_first():
    probs = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.7, 0.3], [0.4, 0.6]])  # 3 tokens want expert 0
    experts, gates, kept = route(probs, top_k=1, capacity_factor=1.0)  # capacity ceil(4 / 2) = 2
    assert experts[:, 0].tolist() == [0, 0, 0, 1]
    assert kept[:, 0].tolist() == [True, True, False, True]
    experts, gates, kept = route(probs, top_k=2, capacity_factor=0.5)  # capacity 2; second choices queue after
    assert kept[:, 0].tolist() == [True, True, False, True]  # all first choices
    assert kept[:, 1].tolist() == [True, False, False, False]  # expert 1 already holds token 3
    torch.testing.assert_close(gates.sum(-1), torch.ones(4))


def test_indivisible_experts_are_refused():
    with pytest.raises(TPDivisibilityError, match="num_experts=3 is not divisible by tensor_parallel_degree=2"):
        DistributedMoE(4, 3, 8, tp=TPGroup(None, 0, 2))
