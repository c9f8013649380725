"""Remote handles keep eager semantics where the owner could reorder or go stale ([Note: remote handles]).

Each scenario below runs one model for two SGD steps of two microbatches, on one process and on two gloo processes
(the modules named in ``PLACEMENT`` on stage 1) with remote handles on, and compares losses, gradients, updated
parameters and buffers (BatchNorm running statistics) bitwise-close. The cases are those where a handle's lazy
transfer could change the result: one microbatch's calls overtaking each other on their owner ([Note: one
microbatch's requests run in arrival order] in ``pipeline/_server.py``: dropout masks and BatchNorm updates follow the
program's order), a fetch overtaking an earlier in-place change, a part of an output changed in place before the
whole goes back by reference, handles given to ``autograd.Function.apply`` and checkpointing, and a call nobody
waits for behind the compute token. The last tests check that stale handles fail at once with a clear error.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.utils.checkpoint as checkpoint
from torch import nn
from transformers.modeling_outputs import BaseModelOutput

from lightning_mp.pipeline import PipelineEngine, PipelineError, split_microbatches
from tests._dist import make_transport, run_distributed
from tests.models import expand_placement

DIM, LR, SEED = 8, 0.1, 123
SLOW_S = 0.15  # long enough that a later one-way call of the same microbatch arrives while this one computes


class Slow(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)
        self.seconds = SLOW_S

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return self.fc(x)


class DropBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(torch.tanh(self.fc(x)))


class NormBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)
        self.bn = nn.BatchNorm1d(DIM, momentum=0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.fc(x))


class ReluInPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.relu_()  # changes the caller's tensor: eager code that reads ``x`` afterwards sees the change
        return self.fc(x)


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.fc(x)
        return y, 2 * y


class PairSum(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.fc(pair[0] + pair[1])


class Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + y


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.slow = Slow()
        self.drop = DropBlock()
        self.norm = NormBlock()
        self.relu = ReluInPlace()
        self.pair = Pair()
        self.pair_sum = PairSum()
        self.two = Two()
        self.local = nn.Linear(DIM, DIM)  # on the driver
        self.out = nn.Linear(DIM, 1)


PLACEMENT = {name: 1 for name in ("slow", "drop", "norm", "relu", "pair", "pair_sum", "two")}


class Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(t)
        return t * t

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (t,) = ctx.saved_tensors
        return 2 * t * grad


def dropout_called_twice(m: Model, x: torch.Tensor) -> torch.Tensor:
    a = m.slow(m.inp(x))
    first = m.drop(a)  # by reference: waits for the slow call
    second = m.drop(x)  # data: could run first on the owner; its mask must stay the second call's
    return (m.out(first) + 3 * m.out(second)).mean()


def batchnorm_called_twice(m: Model, x: torch.Tensor) -> torch.Tensor:
    a = m.slow(m.inp(x))
    first = m.norm(a)
    second = m.norm(5 * x)  # the running statistics are updated in program order
    return (m.out(first) + m.out(second)).mean()


def fetch_after_in_place_call(m: Model, x: torch.Tensor) -> torch.Tensor:
    a = m.slow(m.inp(x))
    b = m.relu(a)  # by reference: ReLUs ``a`` in place on the owner
    m.slow(x)  # a data call in between
    return (m.out(a) + m.out(b)).mean()  # ``a`` is fetched after the ReLU, as eager code reads it


def part_changed_then_whole_by_reference(m: Model, x: torch.Tensor) -> torch.Tensor:
    pair = m.pair(m.inp(x))
    pair[0].mul_(0.5)  # fetches the part and changes it here
    return m.out(m.pair_sum(pair)).mean()  # the whole goes as data now: the owner's copy is stale


def handle_to_function_apply(m: Model, x: torch.Tensor) -> torch.Tensor:
    a = m.slow(m.inp(x))
    return m.out(Square.apply(a)).mean()  # gradients flow back through the handle to ``slow`` and ``inp``


def handle_to_reentrant_checkpoint(m: Model, x: torch.Tensor) -> torch.Tensor:
    a = m.two(m.inp(x), x)
    y = checkpoint.checkpoint(lambda t: torch.tanh(m.local(t)), a, use_reentrant=True)
    return m.out(y).mean()


def handle_to_checkpointed_local_module(m: Model, x: torch.Tensor) -> torch.Tensor:
    a = m.two(m.inp(x), x)
    return m.out(torch.tanh(m.local(a))).mean()  # ``local`` under set_activation_checkpointing


def discarded_call_behind_the_token(m: Model, x: torch.Tensor) -> torch.Tensor:
    kept = m.pair(m.inp(x))[0]
    slow = m.slow(x)  # discarded, holds stage 1's compute token
    m.two(kept, slow)  # discarded, references ``kept``: must still find it after the loss's backward
    return m.out(kept).mean()


def row_fetched_then_whole_changed(m: Model, x: torch.Tensor) -> torch.Tensor:
    y = m.slow(m.inp(x))
    row = y[0]
    float(row.sum())  # fetches: ``row`` is a view of ``y`` (the whole tensor comes, as eager code has it)
    y.mul_(3.0)  # so the row sees this
    return m.out(row).mean() + m.out(y).mean()


def row_changed_then_whole_used(m: Model, x: torch.Tensor) -> torch.Tensor:
    y = m.slow(m.inp(x))
    row = y[1]
    float(row.sum())
    row.mul_(0.0)  # ``y[1]`` is zero now
    return m.out(y * 1.0).mean()


def metadata_of_a_tuple(m: Model, x: torch.Tensor) -> torch.Tensor:
    """``hasattr`` of tensor metadata on a handle to a tuple is False, as on the tuple (the owner's AttributeError
    comes back as one, not as a failed step); the tuple then goes back to its owner by reference."""
    pair = m.pair(m.inp(x))
    assert not hasattr(pair, "shape") and not hasattr(pair, "dtype") and hasattr(pair[0], "shape")
    with pytest.raises(AttributeError, match="'tuple' object has no attribute 'ndim'"):
        pair.ndim
    return m.out(m.pair_sum(pair)).mean()


def model_output_of_a_handle(m: Model, x: torch.Tensor) -> torch.Tensor:
    """A Hugging Face ``ModelOutput`` built on a handle keeps it unfetched ([Note: handles in Hugging Face outputs]:
    ``Two`` is no torch.nn class, so whether its output is a tensor is asked of its owner), and it goes on to its
    owner by reference."""
    out = BaseModelOutput(last_hidden_state=m.two(m.inp(x), x))
    assert out[0] is out.last_hidden_state and not getattr(out[0], "_rv_fetched", False)
    return m.out(m.pair_sum((out.last_hidden_state, out[0]))).mean()


SCENARIOS = {
    f.__name__: f
    for f in (
        dropout_called_twice, batchnorm_called_twice, fetch_after_in_place_call, part_changed_then_whole_by_reference,
        handle_to_function_apply, handle_to_reentrant_checkpoint, handle_to_checkpointed_local_module,
        discarded_call_behind_the_token, row_fetched_then_whole_changed, row_changed_then_whole_used,
        metadata_of_a_tuple, model_output_of_a_handle,
    )
}


def _batch(step: int) -> torch.Tensor:
    return torch.randn(8, DIM, generator=torch.Generator().manual_seed(step))


def _run(rank: int, world: int, schedule: str, nested: bool = False, remote_handles: bool = True) -> dict:
    """Every scenario of ``SCENARIOS`` (``Model`` over 2 stages) or ``NESTED_SCENARIOS`` (``Nested`` over 3), each
    on a fresh model and engine; ``world == 1``: everything on one process, the reference."""
    from lightning_mp import set_activation_checkpointing

    scenarios, make_model, placement = (NESTED_SCENARIOS, Nested, NESTED_PLACEMENT) if nested else (SCENARIOS, Model, PLACEMENT)
    transport = make_transport(list(range(world)))
    results = {}
    for name, step_fn in scenarios.items():
        torch.manual_seed(0)
        model = make_model()
        if world == 1:  # the sleeps only order calls across processes: the one-process reference needs none
            _no_sleeps(model)
        if name == "handle_to_checkpointed_local_module":
            set_activation_checkpointing(model.local)
        engine = PipelineEngine(transport, world, schedule=schedule, active_microbatches=2, timeout_s=60,
                                seed=SEED, remote_handles=remote_handles)
        engine.install(model, expand_placement(model, placement if world > 1 else {}))
        results[name] = _train(engine, model, step_fn)
    return results


def _no_sleeps(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, (Slow, Caller)):
            module.seconds = 0.0


def _train(engine: PipelineEngine, model: nn.Module, step_fn) -> dict:
    """Two SGD steps of two microbatches; losses, first gradients, final state dict (this rank's part)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], {}
    for index in range(2):
        optimizer.zero_grad()
        with engine.session() as session:
            if engine.is_driver:
                outputs = session.drive(lambda mb, i: step_fn(model, mb), split_microbatches(_batch(index), 2),
                                        loss_fn=lambda loss: loss / 2, backward=True)
                session.finish(None)
                losses.append([float(o) for o in outputs])
            else:
                session.serve()
        if index == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
    state = {k: v.clone() for k, v in model.state_dict().items() if v is not None}
    return {"losses": losses, "grads": grads, "state": state}


def _assert_equal(reference: dict, results: list[dict], placement: dict) -> None:
    """``results`` (one per rank) against the one-process ``reference``: losses, gradients, parameters, buffers."""
    torch.testing.assert_close(results[0]["losses"], reference["losses"], rtol=1e-6, atol=1e-7)
    grads = {name: grad for result in results for name, grad in result["grads"].items()}
    assert sorted(grads) == sorted(reference["grads"]), "every gradient, once"
    for name, grad in grads.items():
        torch.testing.assert_close(grad, reference["grads"][name], rtol=1e-6, atol=1e-7, msg=name)
    stage_of = {}
    for name in reference["state"]:  # the innermost placement entry above a key, else stage 0
        prefixes = [p for p in placement if name == p or name.startswith(p + ".")]
        stage_of[name] = placement[max(prefixes, key=len)] if prefixes else 0
    for name, value in reference["state"].items():  # updated parameters, BatchNorm running statistics
        torch.testing.assert_close(results[stage_of[name]]["state"][name], value, rtol=1e-6, atol=1e-7, msg=name)


@pytest.fixture(scope="module", params=["interleaved", "simple"])
def runs(request) -> tuple[dict, list[dict]]:
    one = run_distributed(_run, 1, request.param)[0]
    two = run_distributed(_run, 2, request.param)
    return one, two


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_remote_handles_match_one_process(runs, scenario):
    one, two = runs
    _assert_equal(one[scenario], [r[scenario] for r in two], PLACEMENT)


class Leaf(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc(x))


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)
        self.leaf = Leaf()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.leaf(torch.tanh(self.fc(x)))


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)
        self.inner = Inner()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * self.inner(self.fc(x))


class Caller(nn.Module):
    def __init__(self, shared: nn.Module) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)
        self.shared = shared  # the same module as the model's ``shared``: one module, two names, one stage
        self.seconds = SLOW_S

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)  # the driver's direct call of ``shared`` would overtake this one's
        return self.shared(self.fc(x))


class Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = NormBlock()
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.norm(x))


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.outer = Outer()
        self.shared = Shared()
        self.caller = Caller(self.shared)
        self.out = nn.Linear(DIM, 1)


NESTED_PLACEMENT = {"outer": 1, "outer.inner": 0, "outer.inner.leaf": 1, "caller": 1, "shared": 2,
                    "caller.shared": 2}


def call_cycle(m: Nested, x: torch.Tensor) -> torch.Tensor:
    """stage 0 -> 1 (outer) -> 0 (inner) -> 1 (leaf), then 0 -> 1 again: nested calls must not queue behind their
    callers, and the second call must come after the whole first one."""
    h = m.outer(m.inp(x))
    return m.out(m.outer(h) + h).mean()


def one_module_from_two_callers(m: Nested, x: torch.Tensor) -> torch.Tensor:
    """``shared`` (dropout, BatchNorm) called in one microbatch through ``caller`` (stage 1 -> 2) and then directly
    (stage 0 -> 2): its calls run in the program's order."""
    first = m.caller(m.inp(x))
    second = m.shared(x)
    return (m.out(first) + 3 * m.out(second)).mean()


NESTED_SCENARIOS = {f.__name__: f for f in (call_cycle, one_module_from_two_callers)}


@pytest.fixture(scope="module")
def nested_reference() -> dict:
    return run_distributed(_run, 1, "interleaved", True)[0]


@pytest.mark.parametrize("remote_handles", [True, False])
def test_nested_calls_match_one_process(nested_reference, remote_handles):
    results = run_distributed(_run, 3, "interleaved", True, remote_handles)
    for scenario in NESTED_SCENARIOS:
        _assert_equal(nested_reference[scenario], [r[scenario] for r in results], NESTED_PLACEMENT)


def _stale(rank: int, world: int, where: str) -> list[str]:
    """A handle kept past its microbatch (or its step) and passed back to its owner by reference."""
    torch.manual_seed(0)
    model = Model()
    engine = PipelineEngine(make_transport(list(range(world))), world, timeout_s=60, remote_handles=True,
                            active_microbatches=2 if where == "in flight" else 1)
    engine.install(model, expand_placement(model, PLACEMENT))
    kept, outcome = [], []
    for index in range(2):
        def step(mb: torch.Tensor, i: int) -> torch.Tensor:
            h = model.inp(mb)
            if not kept:
                kept.append(model.pair(h)[0])  # never touched where it was made
                return model.out(h).mean()
            return model.out(model.two(kept[0], h)).mean()  # passed back untouched: a reference

        started = time.monotonic()
        try:
            with engine.session() as session:
                if engine.is_driver:
                    microbatches = split_microbatches(_batch(index), 1 if where == "step" else 2)
                    session.drive(step, microbatches, loss_fn=lambda loss: loss, backward=True)
                    session.finish(None)
                else:
                    session.serve()
            outcome.append("ok")
        except PipelineError as err:
            outcome.append(f"{err} [{time.monotonic() - started < 30}]")
    return outcome


@pytest.mark.parametrize("where", ["microbatch", "in flight", "step"])
def test_a_stale_handle_passed_by_reference_fails_at_once(where):
    """A handle of a finished microbatch, of another microbatch whatever its progress (whether it has finished
    would depend on timing), or of an earlier step, passed back to its owner: a clear error at once."""
    driver, server = run_distributed(_stale, 2, where)
    message = driver[1] if where == "step" else driver[0]
    expected = {
        "microbatch": ("was used after that microbatch had finished",),
        "in flight": ("was used after that microbatch had finished", "Values cannot cross microbatches"),
        "step": ("was passed to a call after its pipelined step ended",),
    }[where]
    assert any(e in message for e in expected), message
    assert "'pair'" in message and "pipeline stage 1 (global rank 1)" in message, message
    assert message.endswith("[True]"), f"failed at once, not after the 60 s timeout: {message}"
    assert "Timed out" not in message
    server_message = server[1] if where == "step" else server[0]
    assert server_message.startswith("The step failed on pipeline stage 0"), server_message


def _set_attribute(rank: int, world: int) -> list:
    model = Model()
    engine = PipelineEngine(make_transport(list(range(world))), world, timeout_s=60, remote_handles=True)
    engine.install(model, expand_placement(model, PLACEMENT))
    seen = []
    with torch.no_grad(), engine.session() as session:
        if engine.is_driver:
            def step(mb: torch.Tensor, i: int) -> torch.Tensor:
                handle = model.pair(mb)[0]
                handle.tag = "mine"  # an attribute set on a handle lands on the value, as on a tensor
                return handle

            (output,) = session.drive(step, [_batch(0)], loss_fn=lambda out: None, backward=False)
            session.finish(None)
            seen.append((type(output).__name__, getattr(output, "tag", None)))
        else:
            session.serve()
    return seen


def test_setting_an_attribute_on_a_handle_sets_it_on_the_value():
    driver, _ = run_distributed(_set_attribute, 2)
    assert driver == [("Tensor", "mine")]


def _after_a_failed_step(rank: int, world: int) -> dict:
    """Step 0 fails on the driver while stage 1 still runs a slow call with others of its chain queued behind it;
    steps 1 and 2 must then run normally (nothing of step 0 may leak into them, nothing may hang)."""
    torch.manual_seed(0)
    model = Model()
    engine = PipelineEngine(make_transport(list(range(world))), world, timeout_s=30, remote_handles=True)
    engine.install(model, expand_placement(model, PLACEMENT if world > 1 else {}))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    outcome, losses = [], []
    for index in range(3):
        model.slow.seconds = 2.0 if index == 0 and world > 1 else 0.0  # outlasts the failed step's close (0.5 s)

        def step(mb: torch.Tensor, i: int) -> torch.Tensor:
            h = model.inp(mb)
            if index == 0:
                model.slow(h)  # one-way; the calls below queue behind it on stage 1
                model.drop(model.pair(h)[0])
                model.two(h, h)
                raise ValueError("the step fails here")
            if index == 1 and i == 0 and world > 1:
                time.sleep(2.5)  # step 1 is still running when step 0's queued calls are answered
            return model.out(model.two(model.pair(h)[0], h)).mean()

        optimizer.zero_grad()
        try:
            with engine.session() as session:
                if engine.is_driver:
                    outputs = session.drive(step, split_microbatches(_batch(index), 2), loss_fn=lambda l: l / 2,
                                            backward=True)
                    session.finish(None)
                    losses.append([float(o) for o in outputs])
                else:
                    session.serve()
            outcome.append("ok")
            optimizer.step()
        except Exception as err:  # noqa: BLE001 (the outcome is the result)
            outcome.append(type(err).__name__)
    return {"outcome": outcome, "losses": losses,
            "state": {k: v.clone() for k, v in model.state_dict().items() if v is not None}}


def test_the_step_after_a_failed_one_runs_normally():
    reference = run_distributed(_after_a_failed_step, 1)[0]
    results = run_distributed(_after_a_failed_step, 2)
    assert reference["outcome"] == ["ValueError", "ok", "ok"]
    assert [r["outcome"] for r in results] == [["PipelineError", "ok", "ok"]] * 2
    torch.testing.assert_close(results[0]["losses"], reference["losses"], rtol=1e-6, atol=1e-7)
    for name, value in reference["state"].items():
        owner = results[1] if name.split(".")[0] in PLACEMENT else results[0]
        torch.testing.assert_close(owner["state"][name], value, rtol=1e-6, atol=1e-7, msg=name)
