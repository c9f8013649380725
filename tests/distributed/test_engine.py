"""The module-server engine without Lightning, against a one-process reference.

Each test trains a few SGD steps with the model split over 2 pipeline stages (2 gloo processes) and compares
the per-step losses, the first step's gradients and the updated parameters with the unmodified model on the
full batch in one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_mp.comm import Transport
from lightning_mp.pipeline import PipelineEngine, split_microbatches
from tests._dist import make_transport, run_distributed
from tests.models import Branchy, MLPStack, TinyLM, expand_placement

MODELS = {"mlp": MLPStack, "branchy": Branchy, "tiedlm": TinyLM}
PLACEMENTS = {
    "mlp": {"layers.3": 1, "layers.4": 1, "layers.5": 1, "head": 1},
    "branchy": {"block": 1, "out": 1},  # block is called once or twice per microbatch, remotely
    "tiedlm": {"blocks.2": 1, "blocks.3": 1},  # embed and the tied head stay together on stage 0
    "nested": {"block": 1, "block.0": 0, "gate": 1},  # stage 1's block calls its child back on stage 0
}
STEPS, LR = 3, 0.1


def _one_step(engine, step_fn, parts, *, loss_fn=lambda loss: loss, backward=True, name="step"):
    """One pipelined step on this rank: the driver runs ``step_fn`` per microbatch, the others serve."""
    with engine.session(name) as session:
        if not engine.is_driver:
            return session.serve()
        outputs = session.drive(step_fn, parts, loss_fn=loss_fn, backward=backward)
        session.finish(None)
        return outputs


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


def _pipelined(
    rank: int, world_size: int, model_name: str, placement: str, microbatches: int, schedule: str, plane: str = "gloo",
    remote_handles: bool = True,
) -> dict:
    torch.manual_seed(0)
    cls = MODELS[model_name]
    model = cls()
    transport = make_transport(list(range(world_size)), plane)
    engine = PipelineEngine(transport, world_size, schedule=schedule, active_microbatches=3, timeout_s=60,
                            remote_handles=remote_handles)
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
    ("model_name", "placement", "microbatches", "schedule", "plane", "remote_handles"),
    [
        ("mlp", "mlp", 1, "interleaved", "gloo", True),
        ("mlp", "mlp", 4, "interleaved", "gloo", True),
        ("mlp", "mlp", 4, "simple", "gloo", True),
        ("branchy", "branchy", 4, "interleaved", "gloo", True),
        ("branchy", "nested", 2, "interleaved", "gloo", True),
        ("tiedlm", "tiedlm", 4, "interleaved", "gloo", True),
        # The same protocol under NCCL's rules (comm/_strict_mock.py: StrictMockBackend).
        ("mlp", "mlp", 4, "simple", "strict_mock", True),
        ("branchy", "nested", 2, "interleaved", "strict_mock", True),
        ("tiedlm", "tiedlm", 4, "interleaved", "strict_mock", True),
        # Without remote handles: every remote call waits for its outputs (one round trip per call).
        ("mlp", "mlp", 4, "interleaved", "gloo", False),
        ("branchy", "nested", 2, "interleaved", "strict_mock", False),
        ("tiedlm", "tiedlm", 4, "simple", "gloo", False),
    ],
)
def test_two_stage_pipeline_matches_one_process(model_name, placement, microbatches, schedule, plane, remote_handles):
    results = run_distributed(_pipelined, 2, model_name, placement, microbatches, schedule, plane, remote_handles)
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
        _one_step(engine, lambda mb, i: model(mb).sum(), [torch.ones(2, 4)])
    except Exception as err:  # noqa: BLE001 - the test inspects the message
        return f"{type(err).__name__}: {err}"
    return "no error"


def test_error_on_a_stage_fails_every_rank_with_its_name():
    driver, server = run_distributed(_failing_step, 2)
    assert driver.startswith("PipelineError") and "pipeline stage 1 (global rank 1)" in driver
    assert "shape mismatch in user code" in driver and "'second'" in driver
    assert server.startswith("PipelineError") and "failed on pipeline stage 0" in server


class _ThreeStage(torch.nn.Module):
    """Stage 0 calls `outer` on stage 1, whose child `inner` lives on stage 2 and calls `leaf` back on stage 0.

    One activation module object is shared by every part (stateless: it runs wherever it is called); the output
    of a remote call is modified in place; `outer` has a forward hook that must run exactly once per call.
    """

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        act = torch.nn.GELU()
        self.first = torch.nn.Sequential(torch.nn.Linear(dim, dim), act)
        self.outer = _Outer(dim, act)
        self.head = torch.nn.Linear(dim, 1)
        self.hook_calls = 0
        self.outer.register_forward_hook(self._count)

    def _count(self, module, args, output):
        self.hook_calls += 1

    def forward(self, x):
        h = self.outer(self.first(x))
        h.mul_(0.5)  # in place on a tensor that came from another stage
        return self.head(h).squeeze(-1)

    @staticmethod
    def loss(model, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(model(x), y)

    @staticmethod
    def batch(n: int = 8, dim: int = 8, seed: int = 3):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(n, dim, generator=g), torch.randn(n, generator=g)


class _Outer(torch.nn.Module):
    def __init__(self, dim: int, act: torch.nn.Module) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(dim, dim)
        self.inner = _Inner(dim, act)

    def forward(self, h):
        return self.inner(self.proj(h))


class _Inner(torch.nn.Module):
    def __init__(self, dim: int, act: torch.nn.Module) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(dim, dim)
        self.act = act
        self.leaf = torch.nn.Linear(dim, dim)

    def forward(self, h):
        return self.leaf(self.act(self.proj(h)))


MODELS["three"] = _ThreeStage
PLACEMENTS["three"] = {"outer": 1, "outer.inner": 2, "outer.inner.leaf": 0}


@pytest.mark.parametrize(("plane", "remote_handles"), [("gloo", True), ("strict_mock", True), ("gloo", False)])
def test_three_stages_nested_calls_shared_stateless_module_inplace_and_hooks(plane, remote_handles):
    results = run_distributed(_pipelined, 3, "three", "three", 4, "interleaved", plane, remote_handles)
    _assert_matches_reference(results, _reference("three"))
    assert [len(r["params"]) for r in results] == [6, 2, 2], "first+head+leaf / outer.proj / inner.proj"


def _hook_calls(rank: int, world_size: int) -> int:
    torch.manual_seed(0)
    model = _ThreeStage()
    transport = Transport(dist.new_group(list(range(world_size))), torch.device("cpu"))
    engine = PipelineEngine(transport, world_size, timeout_s=60)
    engine.install(model, expand_placement(model, PLACEMENTS["three"]))
    _one_step(engine, lambda mb, i: _ThreeStage.loss(model, mb), split_microbatches(_ThreeStage.batch(), 4))
    return model.hook_calls


def test_hooks_of_a_remote_module_run_once_on_its_owner():
    calls = run_distributed(_hook_calls, 3)
    assert calls == [0, 4, 0], "outer's forward hook ran on stage 1 only, once per microbatch"


def _schedule_order(rank: int, world_size: int, schedule: str, active: int) -> list:
    """The driver's compute spans, in order, as (phase, microbatch), phase 1 = forward, 0 = backward."""
    torch.manual_seed(0)
    model = MLPStack()
    transport = Transport(dist.new_group([0, 1]), torch.device("cpu"))
    engine = PipelineEngine(transport, 2, schedule=schedule, active_microbatches=active, timeout_s=60)
    engine.install(model, expand_placement(model, PLACEMENTS["mlp"]))
    engine.timeline.start()
    _one_step(engine, lambda mb, i: MLPStack.loss(model, mb), split_microbatches(MLPStack.batch(n=16), 4))
    events = engine.timeline.stop()
    return [(1 if e.category == "forward" else 0, e.microbatch) for e in events if e.category in ("forward", "backward")]


def _first_backward_before_last_forward(order: list) -> bool:
    forwards = [i for i, (phase, _) in enumerate(order) if phase == 1]
    backwards = [i for i, (phase, _) in enumerate(order) if phase == 0]
    return min(backwards) < max(forwards)


def test_simple_runs_all_forwards_before_backwards_and_interleaved_does_not():
    simple = run_distributed(_schedule_order, 2, "simple", 4)[0]
    assert {mb for _, mb in simple} == {0, 1, 2, 3}
    assert not _first_backward_before_last_forward(simple), simple
    interleaved = run_distributed(_schedule_order, 2, "interleaved", 2)[0]
    assert _first_backward_before_last_forward(interleaved), interleaved
    # with active_microbatches=2, microbatch 2 starts only after microbatch 0 ran (part of) its backward
    first_mb2 = interleaved.index((1, 2))
    assert (0, 0) in interleaved[:first_mb2]


def _out_of_step(rank: int, world_size: int) -> str:
    transport = Transport(dist.new_group([0, 1]), torch.device("cpu"))
    model = MLPStack()
    engine = PipelineEngine(transport, 2, timeout_s=30)
    engine.install(model, expand_placement(model, PLACEMENTS["mlp"]))
    try:
        name = "validation_step" if rank == 0 else "training_step"
        _one_step(engine, lambda mb, i: MLPStack.loss(model, mb), [MLPStack.batch()], backward=False, name=name)
    except Exception as err:  # noqa: BLE001 - the test inspects the message
        return f"{type(err).__name__}: {err}"
    return "no error"


def test_stages_in_different_steps_fail_clearly():
    driver, server = run_distributed(_out_of_step, 2)
    assert "out of step" in server and "'validation_step#0'" in server and "'training_step#0'" in server
    assert driver.startswith("PipelineError")


def _timed_faulty_step(rank: int, timeout_s: float, pick_faulty_module) -> dict:
    """One MLP step on 2 stages where ``pick_faulty_module(model, rank)`` returns (module, hook) to break, or None.

    Returns the error this rank raised (or "no error") and how long the step took, in seconds.
    """
    import time

    torch.manual_seed(0)
    model = MLPStack()
    transport = Transport(dist.new_group([0, 1]), torch.device("cpu"))
    engine = PipelineEngine(transport, 2, timeout_s=timeout_s)
    engine.install(model, expand_placement(model, PLACEMENTS["mlp"]))
    fault = pick_faulty_module(model, rank)
    if fault is not None:
        module, hook = fault
        module.register_forward_pre_hook(hook)
    start = time.monotonic()
    try:
        _one_step(engine, lambda mb, i: MLPStack.loss(model, mb), [MLPStack.batch()])
    except Exception as err:  # noqa: BLE001 - the test inspects the message
        return {"error": f"{type(err).__name__}: {err}", "seconds": time.monotonic() - start}
    return {"error": "no error", "seconds": time.monotonic() - start}


def _vanish(*_):
    import os

    os._exit(0)  # the process vanishes mid-step


def _dying_stage(rank: int, world_size: int) -> dict:
    return _timed_faulty_step(rank, 20, lambda model, r: (model.head, _vanish) if r == 1 else None)


def test_a_rank_that_dies_fails_the_others_with_its_name():
    import os
    import tempfile

    import torch.multiprocessing as mp

    from tests._dist import _worker

    with tempfile.TemporaryDirectory() as tmp:
        context = mp.start_processes(
            _worker, args=(2, os.path.join(tmp, "rdv"), tmp, _dying_stage, ()), nprocs=2, join=False, start_method="spawn"
        )
        while not context.join(timeout=60):
            pass
        result = torch.load(os.path.join(tmp, "0.pt"), weights_only=False)
    assert result["error"].startswith("PipelineError") and "pipeline stage 1 (global rank 1)" in result["error"]
    assert result["seconds"] < 20, "detected through the lost connection, before the timeout"


def _sleep_12_s(*_):
    import time

    time.sleep(12)  # alive (its connections stay open) but never answers within the timeout


def _stuck_stage(rank: int, world_size: int, stuck: int) -> dict:
    def fault(model, r):
        if r != stuck:
            return None
        return (model.layers[0] if stuck == 0 else model.head), _sleep_12_s

    return _timed_faulty_step(rank, 3, fault)


@pytest.mark.parametrize("stuck", [0, 1], ids=["driver-stuck", "server-stuck"])
def test_a_stuck_rank_fails_the_others_within_the_timeout(stuck):
    results = run_distributed(_stuck_stage, 2, stuck)
    other = results[1 - stuck]
    assert other["error"].startswith("PipelineError"), other
    assert f"pipeline stage {stuck} (global rank {stuck})" in other["error"]
    assert 3 <= other["seconds"] < 8, "raised after the 3 s timeout, long before the stuck rank wakes up (12 s)"


def _requests_of_one_microbatch(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = MLPStack()
    transport = Transport(dist.new_group([0, 1]), torch.device("cpu"))
    engine = PipelineEngine(transport, 2, timeout_s=60)
    engine.install(model, expand_placement(model, PLACEMENTS["mlp"]))
    engine.timeline.start()
    _one_step(engine, lambda mb, i: MLPStack.loss(model, mb), [MLPStack.batch()])
    events = engine.timeline.stop()
    return {
        "requests": sum(1 for e in events if e.category == "send" and e.thread.startswith("smp-mb")),
        "served": sorted({e.name for e in events if e.category in ("forward", "backward") and rank == 1}),
    }


def test_a_sequential_run_on_another_stage_is_one_request():
    """layers.3..5 (an nn.Sequential's last three children) and head live on stage 1: 2 one-way calls forward, sent
    together as one message ([Note: coalesced one-way calls] in pipeline/_core.py), then the loss (on head's stage)
    fetched with its backward in one request."""
    driver, server = run_distributed(_requests_of_one_microbatch, 2)
    assert driver["requests"] == 2, "the calls of the runs (layers[3:6], head) in one, the loss's; not one per child"
    assert server["served"] == ["head", "layers[3:6]"]
