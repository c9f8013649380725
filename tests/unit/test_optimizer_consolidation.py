"""Stage optimizer states consolidate to one device's state dict (what ``strategy="ddp"`` would save, issue 13)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn


def _two_group_adam(model: nn.Module) -> torch.optim.Optimizer:
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return torch.optim.Adam([{"params": weights}, {"params": biases, "lr": 0.1, "weight_decay": 0.0}], lr=1e-2)


def test_stage_optimizer_states_consolidate_to_one_devices_state_dict():
    """Stages {0, 1} and {2} of a model with two param groups give exactly ``optimizer.state_dict()``, and each
    stage's optimizer loads its part back from it."""
    from lightning_mp.strategy import _checkpoint
    from lightning_mp.strategy._checkpoint import _full

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1))
    optimizer = _two_group_adam(model)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    expected = optimizer.state_dict()
    flat = _checkpoint.optimizer_state_dict(model, optimizer)
    order = [n for n, _ in model.named_parameters()]
    stages = [("0.", "1."), ("2.",)]

    def owned(key: str, prefixes: tuple[str, ...]) -> bool:
        return key.split(".", 1)[1].startswith(prefixes)

    flats = [{k: v for k, v in flat.items() if owned(k, prefixes)} for prefixes in stages]
    whole = _checkpoint.param_groups_by_fqn(model, optimizer)
    groups = [[[n for n in group if n.startswith(prefixes)] for group in whole] for prefixes in stages]
    native = _full._native_optimizer_state(flats, groups, order)
    assert native["param_groups"] == expected["param_groups"]
    assert sorted(native["state"]) == sorted(expected["state"])
    for index, state in expected["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(native["state"][index][key], value, rtol=0, atol=0)

    full_groups = _checkpoint.full_param_groups(groups, order)
    stage1 = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1))
    stage1.load_state_dict(model.state_dict())
    del stage1[0].weight, stage1[0].bias, stage1[1].weight, stage1[1].bias  # what stage 1 does not hold
    local = _two_group_adam(stage1)
    _full._load_native_optimizer_state(local, stage1, native, full_groups, Path("x.ckpt"))
    for name, p in stage1.named_parameters():
        original = dict(model.named_parameters())[name]
        for key, value in optimizer.state[original].items():
            torch.testing.assert_close(local.state[p][key], value, rtol=0, atol=0, msg=f"{name}.{key}")
    assert [g["lr"] for g in local.param_groups] == [1e-2, 0.1]
    with pytest.raises(ValueError, match=r"param groups of sizes \[3, 3\], but this model's optimizer has \[3\]"):
        _full._load_native_optimizer_state(local, stage1, native, [order[::2][:3]], Path("x.ckpt"))
