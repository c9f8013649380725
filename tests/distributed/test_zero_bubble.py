"""``pipeline="zero_bubble"`` on 2 stages without Lightning: the same losses, gradients and updated parameters as
``"interleaved"`` (bitwise, one intra-op thread per process) and as one process (float tolerance), for a Sequential,
control flow with a module called twice, a ModuleList loop with a tied embedding and head, nested calls, with and
without remote handles and under activation checkpointing; the weight passes run as their own timeline spans, after
the input pass of their backward."""

from __future__ import annotations

import pytest
import torch

from lightning_mp.memory import set_activation_checkpointing
from lightning_mp.pipeline import PipelineEngine, split_microbatches
from tests._dist import make_transport, run_distributed
from tests.distributed import test_generality
from tests.distributed.test_engine import LR, MODELS, PLACEMENTS, STEPS, _assert_matches_reference, _reference
from tests.models import expand_placement


def _train(transport, rank: int, world_size: int, model_name: str, placement: str, schedule: str,
           remote_handles: bool, checkpoint: bool) -> dict:
    """STEPS SGD steps of 4 microbatches; the first step's gradients and timeline events, the losses, the params."""
    torch.manual_seed(0)
    cls = MODELS[model_name]
    model = cls()
    stage_of = expand_placement(model, PLACEMENTS[placement])
    if checkpoint:  # every block of this rank recomputes its forward in backward
        for block in model.blocks:
            set_activation_checkpointing(block, is_local=lambda m: True)
    engine = PipelineEngine(transport, world_size, schedule=schedule, active_microbatches=3, timeout_s=60,
                            remote_handles=remote_handles)
    engine.install(model, stage_of)
    engine.order_gradients(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads, events = [], {}, []
    for step in range(STEPS):
        optimizer.zero_grad()
        if step == 0:
            engine.timeline.start()
        with engine.session() as session:
            if engine.is_driver:
                parts = split_microbatches(cls.batch(seed=step), 4)
                outputs = session.drive(lambda mb, i: cls.loss(model, mb), parts, loss_fn=lambda l: l / 4,
                                        backward=True)
                loss = torch.stack([o.detach() for o in outputs]).mean()
                session.finish(loss)
            else:
                loss = session.serve()
        if step == 0:
            events = [(e.category, e.microbatch, e.start_s, e.end_s) for e in engine.timeline.stop()]
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
        losses.append(loss.item())
    params = {n: p.detach().clone() for n, p in model.named_parameters()}  # this stage's own
    return {"losses": losses, "grads": grads, "params": params, "events": events}


def _both_schedules(rank: int, world_size: int, model_name: str, placement: str, remote_handles: bool,
                    checkpoint: bool) -> dict:
    torch.set_num_threads(1)  # bitwise equality holds at one intra-op thread per process
    transport = make_transport(list(range(world_size)))
    return {schedule: _train(transport, rank, world_size, model_name, placement, schedule, remote_handles, checkpoint)
            for schedule in ("interleaved", "zero_bubble")}


def _assert_bitwise(a: dict, b: dict) -> None:
    assert a["losses"] == b["losses"]
    for key in ("grads", "params"):
        assert sorted(a[key]) == sorted(b[key])
        for name in a[key]:
            torch.testing.assert_close(b[key][name], a[key][name], rtol=0, atol=0, msg=f"{key} {name}")


@pytest.mark.parametrize(
    ("model_name", "placement", "remote_handles", "checkpoint", "bitwise"),
    [
        ("mlp", "mlp", True, False, True),  # a Sequential split over 2 stages
        # control flow, a remote module called twice, a dict crossing stages; stage 1's block calling its child back
        # on stage 0, with waited calls; the two calls of a microbatch reach block.0 in separate backwards (see
        # [Note: ordered gradient accumulation])
        ("branchy", "branchy", True, False, True),
        ("branchy", "nested", False, False, True),
        ("tiedlm", "tiedlm", True, False, True),  # a ModuleList loop, the tied embedding and head on stage 0
        ("tiedlm", "tiedlm", True, True, True),  # the same with every block checkpointed
    ],
)
def test_zero_bubble_equals_interleaved_and_one_process(model_name, placement, remote_handles, checkpoint, bitwise):
    results = run_distributed(_both_schedules, 2, model_name, placement, remote_handles, checkpoint)
    for result in results:
        if bitwise:
            _assert_bitwise(result["interleaved"], result["zero_bubble"])
    zero_bubble = [result["zero_bubble"] for result in results]
    _assert_matches_reference(zero_bubble, _reference(model_name))
    for rank, result in enumerate(zero_bubble):
        weights = [e for e in result["events"] if e[0] == "weight"]
        assert not any(e[0] == "weight" for e in results[rank]["interleaved"]["events"])
        assert {e[1] for e in weights} == set(range(4)), f"rank {rank}: a weight pass per microbatch"
        backwards = [e for e in result["events"] if e[0] == "backward"]
        for category, microbatch, start, _ in weights:  # a weight pass runs after its backward's input pass
            assert any(b[1] == microbatch and b[3] <= start for b in backwards), (rank, microbatch)


def test_zero_bubble_on_every_engine_scenario_matches_one_process():
    """tests/distributed/test_generality.py's scenarios on 3 stages (every tensor kind a forward passes, shapes
    changing every step, a long skip, a module shared from two stages, data-dependent calls, a parameter passed as
    an argument, unused outputs) under "zero_bubble": losses, gradients and parameters as one process."""
    results = run_distributed(test_generality._all_scenarios, 3, "zero_bubble", start_method="fork")
    for name, scenario in test_generality.SCENARIOS.items():
        test_generality._check_against_reference([per_rank[name] for per_rank in results],
                                                 test_generality._reference(scenario))
