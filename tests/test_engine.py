"""Tier 2: the module-server engine without Lightning, against a one-process reference.

Each test trains a few SGD steps with the model split over 2 pipeline stages (2 gloo processes) and compares
the per-step losses, the first step's gradients and the updated parameters with the unmodified model on the
full batch in one process.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from lightning_mp.comm import Transport
from lightning_mp.pipeline import PipelineEngine, split_microbatches
from tests._dist import run_distributed
from tests.models import Branchy, MLPStack, TinyLM, expand_placement

MODELS = {"mlp": MLPStack, "branchy": Branchy, "tiedlm": TinyLM}
PLACEMENTS = {
    "mlp": {"layers.3": 1, "layers.4": 1, "layers.5": 1, "head": 1},
    "branchy": {"block": 1, "out": 1},  # block is called once or twice per microbatch, remotely
    "tiedlm": {"blocks.2": 1, "blocks.3": 1},  # embed and the tied head stay together on stage 0
    "nested": {"block": 1, "block.0": 0, "gate": 1},  # stage 1's block calls its child back on stage 0
}
STEPS, LR = 3, 0.1


def _reference(model_name: str) -> dict:
    torch.manual_seed(0)
    cls = MODELS[model_name]
    model = cls()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], {}
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = cls.loss(model, cls.batch(seed=step))
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _pipelined(rank: int, world_size: int, model_name: str, placement: str, microbatches: int, schedule: str) -> dict:
    torch.manual_seed(0)
    cls = MODELS[model_name]
    model = cls()
    transport = Transport(dist.new_group(list(range(world_size))), torch.device("cpu"))
    engine = PipelineEngine(transport, world_size, schedule=schedule, active_microbatches=3, timeout_s=60)
    engine.install(model, expand_placement(model, PLACEMENTS[placement]))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], {}
    for step in range(STEPS):
        optimizer.zero_grad()
        with engine.session() as session:
            if engine.is_driver:
                parts = split_microbatches(cls.batch(seed=step), microbatches)
                outputs = session.drive(
                    lambda mb, i: cls.loss(model, mb), parts, loss_fn=lambda l: l / microbatches, backward=True
                )
                loss = torch.stack([o.detach() for o in outputs]).mean()
                session.finish(loss)
            else:
                loss = session.serve()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _assert_matches_reference(results: list[dict], reference: dict) -> None:
    for result in results:
        torch.testing.assert_close(result["losses"], reference["losses"], rtol=1e-5, atol=1e-6)
    owned = [name for result in results for name in result["params"]]
    assert sorted(owned) == sorted(reference["params"]), "every parameter lives on exactly one stage"
    for result in results:
        for name, value in result["params"].items():
            torch.testing.assert_close(value, reference["params"][name], rtol=1e-5, atol=1e-6, msg=name)
        for name, value in result["grads"].items():
            torch.testing.assert_close(value, reference["grads"][name], rtol=1e-5, atol=1e-6, msg=name)
    assert sorted(n for r in results for n in r["grads"]) == sorted(reference["grads"])


@pytest.mark.parametrize(
    ("model_name", "placement", "microbatches", "schedule"),
    [
        ("mlp", "mlp", 1, "interleaved"),
        ("mlp", "mlp", 4, "interleaved"),
        ("mlp", "mlp", 4, "simple"),
        ("branchy", "branchy", 4, "interleaved"),
        ("branchy", "nested", 2, "interleaved"),
        ("tiedlm", "tiedlm", 4, "interleaved"),
    ],
)
def test_two_stage_pipeline_matches_one_process(model_name, placement, microbatches, schedule):
    results = run_distributed(_pipelined, 2, model_name, placement, microbatches, schedule)
    _assert_matches_reference(results, _reference(model_name))
    assert all(len(r["params"]) > 0 for r in results), "both stages own parameters"


class _Exploding(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(4, 4)
        self.second = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.second(self.first(x))
        return h


def _failing_step(rank: int, world_size: int) -> str:
    model = _Exploding()

    def explode(self, x):
        raise ValueError("shape mismatch in user code")

    transport = Transport(dist.new_group([0, 1]), torch.device("cpu"))
    engine = PipelineEngine(transport, 2, timeout_s=30)
    engine.install(model, expand_placement(model, {"second": 1}))
    if rank == 1:
        model.second.forward = explode.__get__(model.second)
    try:
        with engine.session() as session:
            if engine.is_driver:
                session.drive(lambda mb, i: model(mb).sum(), [torch.ones(2, 4)], loss_fn=lambda l: l, backward=True)
                session.finish(None)
            else:
                session.serve()
    except Exception as err:  # noqa: BLE001 - the test inspects the message
        return f"{type(err).__name__}: {err}"
    return "no error"


def test_error_on_a_stage_fails_every_rank_with_its_name():
    driver, server = run_distributed(_failing_step, 2)
    assert driver.startswith("PipelineError") and "pipeline stage 1 (global rank 1)" in driver
    assert "shape mismatch in user code" in driver and "'second'" in driver
    assert server.startswith("PipelineError") and "failed on pipeline stage 0" in server
