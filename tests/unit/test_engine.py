"""The module-server engine in one process: installing a plan sends nothing, and a parameterless module runs where
it is called."""

from __future__ import annotations

import torch

from lightning_mp.pipeline import PipelineEngine


def test_a_sequential_without_parameters_runs_where_it_is_called():
    """A parameterless ``nn.Sequential`` is stateless: never a request, whatever stage the plan names for it."""
    from types import SimpleNamespace

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.ReLU()), torch.nn.Linear(4, 4))
    engine = PipelineEngine(SimpleNamespace(rank=0, size=2), 2)  # installing sends nothing
    engine.install(model, {"": 0, "0": 0, "1": 1, "1.0": 1, "2": 1})
    x = torch.randn(3, 4)
    torch.testing.assert_close(model[1](x), torch.relu(x))  # outside a step: a request would raise
