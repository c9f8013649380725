"""The paths of [Note: the loss's fetch and backward in one exchange] (``pipeline/_caller.py``) beside its main one:
the received gradients are let go, a second backward of such a loss fails clearly, the owner answers as a
plain fetch where its value is no scalar needing a gradient (and the backward here then does what one process
does), a loss with no driver tensor upstream gets no gradient back, and a failure on the owner (in the loss op or in
the backward it runs, or in a weight pass that ``"zero_bubble"`` deferred past the exchange: [Note: "close" carries
the step's failure] in ``pipeline/_engine.py``) fails the step on every rank without a hang, the next step running
normally.

Each test runs a small ``nn.Sequential`` on two gloo processes, its last layers (and so the loss) on stage 1, and
compares with the same model and steps in one process; which kinds of requests the driver made come from
``engine.messages_sent`` (the kinds only: the counts of one-way messages are the transport's business).
"""

from __future__ import annotations

import gc
import time
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mp.pipeline import PipelineEngine, PipelineError, split_microbatches
from lightning_mp.pipeline import _caller
from tests._dist import make_transport, run_distributed
from tests.models import expand_placement

LR, N, DIM, MICROBATCHES = 0.1, 8, 8, 2
PLACEMENT = {"2": 1, "3": 1}  # the second Linear and the head: the loss is computed on stage 1


class _Faulty(torch.autograd.Function):
    """The identity, whose backward raises while ``_Head.fail`` is set (on the stage that runs it)."""

    @staticmethod
    def forward(ctx, x, head):
        ctx.head = head
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.head.fail:
            raise ValueError("the head's backward broke down")
        return grad, None


class _Head(nn.Linear):
    """A ``Linear`` whose output goes through ``_Faulty``: set ``fail`` to make its backward raise, ``fail_weight``
    to make a hook on its weight's gradient raise on the last microbatch's gradient (the ``MICROBATCHES``-th since it
    was set; under ``"zero_bubble"`` that runs in the step's last weight pass: no request of the driver follows it)."""

    fail = False
    fail_weight = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.weight_grads = 0  # gradients seen while ``fail_weight`` was set
        self.weight.register_hook(self._check)

    def _check(self, grad: torch.Tensor) -> torch.Tensor:
        if self.fail_weight:
            self.weight_grads += 1
            if self.weight_grads == MICROBATCHES:
                raise ValueError("the head's weight hook broke down")
        return grad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Faulty.apply(super().forward(x), self)


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(DIM, 16), nn.Tanh(), nn.Linear(16, 16), _Head(16, 4))


def _frozen_first_layer() -> nn.Module:
    """``_model`` whose first layer (stage 0's only parameters) is frozen: the driver sends stage 1 nothing that
    needs a gradient."""
    model = _model()
    model[0].requires_grad_(False)
    return model


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, DIM, generator=g), torch.randint(0, 4, (N,), generator=g)


# ---- steps: each returns what a training step returns (a loss, or a handle for one) --------------------------------


def _ce(model, batch, index):
    x, y = batch
    return F.cross_entropy(model(x), y)


def _ce_under_no_grad(model, batch, index):
    """The loss taken under ``no_grad`` from logits computed with grad: the owner's value needs no gradient."""
    x, y = batch
    logits = model(x)
    with torch.no_grad():
        return F.cross_entropy(logits, y)


def _ce_detached(model, batch, index):
    x, y = batch
    return F.cross_entropy(model(x), y).detach()


def _ce_per_sample(model, batch, index):
    """A vector "loss": one process cannot backpropagate it without a gradient either."""
    x, y = batch
    return F.cross_entropy(model(x), y, reduction="none")


def _ce_per_sample_summed(model, batch, index):
    """The per-sample losses summed here (``sum`` fetches them: it is not recorded), then averaged."""
    x, y = batch
    return F.cross_entropy(model(x), y, reduction="none").sum() / x.shape[0]


def _ce_of_one_row(model, batch, index):
    """A loss on ``logits[0]``: the output is a tensor, so the owner's walk stops at it and the caller indexes and
    computes the loss here ([Note: the loss's fetch and backward in one exchange]: answered as a GET)."""
    x, y = batch
    return F.cross_entropy(model(x)[0], y[0])


def _ce_wrong_target(model, batch, index):
    """In step 0, targets of the wrong length: ``F.cross_entropy`` raises on the owner, in the backward's exchange."""
    x, y = batch
    return F.cross_entropy(model(x), y[:-1] if index == 0 else y)


# ---- one process, and two --------------------------------------------------------------------------------------


def _error_text(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


def _root_cause(err: BaseException) -> str:
    """The error at the bottom of ``err``'s ``__cause__`` chain, as ``_error_text``."""
    while err.__cause__ is not None:
        err = err.__cause__
    return _error_text(err)


def _reference(step, steps: int = 2, fail_step: int | None = None, fault: str = "fail", make_model=_model) -> dict:
    """``step`` in one process, SGD; a step that raises (in the forward or the backward) takes no optimizer step.
    ``fail_step``: the step in which the head's ``fault`` (``_Head``'s flag) is set. ``touched``: per failed step,
    the parameters that got a gradient before it failed."""
    torch.manual_seed(0)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads, errors, touched = [], [], [], []
    for index in range(steps):
        setattr(model[3], fault, index == fail_step)
        optimizer.zero_grad()
        total = 0.0
        try:
            for part in split_microbatches(_batch(index), MICROBATCHES):
                loss = step(model, part, index) / MICROBATCHES
                loss.backward()
                total += loss.item()
        except Exception as err:  # noqa: BLE001 - the outcome is the result
            errors.append(_error_text(err))
            touched.append(sorted(n for n, p in model.named_parameters() if p.grad is not None))
            continue
        errors.append(None)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        optimizer.step()
        losses.append(total)
    return {"losses": losses, "grads": grads, "errors": errors, "touched": touched,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _pipelined(rank: int, world: int, step, steps: int = 2, fail_step: int | None = None,
               schedule: str = "interleaved", timeout_s: float = 30, fault: str = "fail", make_model=_model) -> dict:
    """``step`` on two stages (``PLACEMENT``), as ``_reference``; also, per step, the error's root cause (the bottom
    of its ``__cause__`` chain), the kinds of messages this rank sent and the seconds the step took, and per failed
    step the parameters here that got a gradient; then the engine closes."""
    torch.manual_seed(0)
    model = make_model()
    engine = PipelineEngine(make_transport(list(range(world))), world, schedule=schedule, active_microbatches=2,
                            timeout_s=timeout_s, remote_handles=True)
    engine.install(model, expand_placement(model, PLACEMENT))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads, errors, causes, kinds, seconds, touched = [], [], [], [], [], [], []
    for index in range(steps):
        setattr(model[3], fault, index == fail_step)
        optimizer.zero_grad()
        before, start = dict(engine.messages_sent), time.monotonic()
        try:
            with engine.session() as session:
                if engine.is_driver:
                    parts = split_microbatches(_batch(index), MICROBATCHES)
                    outputs = session.drive(lambda mb, i: step(model, mb, index), parts,
                                            loss_fn=lambda loss: loss / MICROBATCHES, backward=True)
                    loss = sum(float(o.detach()) / MICROBATCHES for o in outputs)
                    session.finish(loss)
                else:
                    loss = session.serve()
            errors.append(None)
            causes.append(None)
        except Exception as err:  # noqa: BLE001 - the outcome is the result
            errors.append(_error_text(err))
            causes.append(_root_cause(err))
        seconds.append(time.monotonic() - start)
        kinds.append({k for k, v in engine.messages_sent.items() if v > before.get(k, 0)})
        if errors[-1] is None:
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
            optimizer.step()
            losses.append(loss)
        else:
            touched.append(sorted(n for n, p in model.named_parameters() if p.grad is not None))
    engine.close()
    return {"losses": losses, "grads": grads, "errors": errors, "causes": causes, "kinds": kinds, "seconds": seconds,
            "touched": touched, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _assert_matches(results: list[dict], reference: dict) -> None:
    """Losses, the gradients of every successful step and the final parameters equal one process's."""
    for result in results:
        torch.testing.assert_close(result["losses"], reference["losses"], rtol=1e-5, atol=1e-6)
        assert len(result["grads"]) == len(reference["grads"])
        for mine, theirs in zip(result["grads"], reference["grads"]):
            for name, value in mine.items():
                torch.testing.assert_close(value, theirs[name], rtol=1e-5, atol=1e-6, msg=name)
        for name, value in result["params"].items():
            torch.testing.assert_close(value, reference["params"][name], rtol=1e-5, atol=1e-6, msg=name)
    for index in range(len(reference["grads"])):
        assert sorted(n for r in results for n in r["grads"][index]) == sorted(reference["grads"][index])
    assert sorted(n for r in results for n in r["params"]) == sorted(reference["params"]), "every parameter, once"


# ---- 1. the received gradients are let go ------------------------------------------------------------------------


def _received_gradients(rank: int, world: int) -> dict:
    """One step of ``_ce``; on the driver, every ``_ReceivedGradients`` made (weak references to the gradients the
    owner sent, taken as they arrive), then a second ``backward()`` of each microbatch's returned loss."""
    made: list = []

    class Recorded(_caller._ReceivedGradients):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.arrived = [weakref.ref(g) for part in self.grads for g in part if g is not None]
            made.append(self)

    _caller._ReceivedGradients = Recorded  # this process only (a forked child); fetch_with_backward makes these
    torch.manual_seed(0)
    model = _model()
    engine = PipelineEngine(make_transport(list(range(world))), world, timeout_s=30, remote_handles=True)
    engine.install(model, expand_placement(model, PLACEMENT))
    with engine.session() as session:
        if engine.is_driver:
            parts = split_microbatches(_batch(0), MICROBATCHES)
            outputs = session.drive(lambda mb, i: _ce(model, mb, 0), parts,
                                    loss_fn=lambda loss: loss / MICROBATCHES, backward=True)
            session.finish(None)
        else:
            session.serve()
    if not engine.is_driver:
        return {}
    gc.collect()
    result = {
        "made": len(made),
        "arrived": sum(len(r.arrived) for r in made),
        "alive": sum(ref() is not None for r in made for ref in r.arrived),
        "kept": [r.grads is not None for r in made],
        "nodes": [type(o.grad_fn.call).__name__ for o in outputs],  # the losses the step returned: of those nodes
        "param_grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
    }
    sent = dict(engine.messages_sent)
    again = []
    for output in outputs:
        try:
            output.backward()
            again.append("no error")
        except PipelineError as err:
            again.append(_error_text(err))
    result["again"] = again
    result["sent_again"] = {k: v - sent.get(k, 0) for k, v in engine.messages_sent.items() if v != sent.get(k, 0)}
    result["param_grads_after"] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return result


def test_received_gradients_are_released_and_a_second_backward_fails_clearly():
    """After the step, nothing keeps the gradients the owner sent with the loss (its node handed them back once);
    backpropagating a returned loss again raises a ``PipelineError`` saying so, sends nothing and changes no
    gradient (one process would raise too: the graph was freed)."""
    driver, _ = run_distributed(_received_gradients, 2)
    assert driver["made"] == MICROBATCHES, "one exchange per microbatch"
    assert driver["arrived"] > 0, "the owner sent gradients of the driver's tensors"
    assert driver["alive"] == 0, "a received gradient outlived the step"
    assert driver["kept"] == [False] * MICROBATCHES
    assert driver["nodes"] == ["Recorded"] * MICROBATCHES
    for text in driver["again"]:
        assert text.startswith("PipelineError: The loss '[2:4]' was backpropagated twice"), text
        assert "ran on its owner stage once" in text, text
    assert driver["sent_again"] == {}, "nothing went to the owner"
    for name, grad in driver["param_grads"].items():
        torch.testing.assert_close(driver["param_grads_after"][name], grad, rtol=0, atol=0, msg=name)


# ---- 2. the owner answers as a GET where its value is no scalar needing a gradient ---------------------------------

NO_BACKWARD = {  # step -> (what the driver's requests must include, what they must not)
    "no_grad": (_ce_under_no_grad, {"getbwd"}, {"get", "gbwd"}),  # the owner's loss needs no gradient: a GET's reply
    "per_sample": (_ce_per_sample, {"getbwd"}, {"get"}),  # a vector: the owner runs no backward
    "detached": (_ce_detached, {"get"}, {"getbwd", "gbwd"}),  # ``detach`` is not recorded: fetched in the forward
}


@pytest.mark.parametrize("case", list(NO_BACKWARD))
def test_a_loss_that_cannot_be_backpropagated_fails_as_in_one_process(case):
    """A loss that needs no gradient (taken under ``no_grad``, or detached) or is no scalar: the backward raises
    autograd's own error, as in one process, on the driver (as the root cause of its ``PipelineError``), and the other
    stage fails the step naming it; no backward ran on either stage (no parameter got a gradient)."""
    step, made, not_made = NO_BACKWARD[case]
    reference = _reference(step, steps=1)
    driver, owner = run_distributed(_pipelined, 2, step, 1)
    expected = reference["errors"][0]
    assert expected is not None and expected.startswith("RuntimeError: "), reference["errors"]
    assert driver["causes"] == [expected], (driver["errors"], expected)
    assert driver["errors"] == ["PipelineError: " + expected.removeprefix("RuntimeError: ")], driver["errors"]
    assert owner["errors"][0].startswith("PipelineError: The step failed on pipeline stage 0 (global rank 0)")
    assert expected.removeprefix("RuntimeError: ") in owner["errors"][0], owner["errors"]
    assert made <= driver["kinds"][0] and not not_made & driver["kinds"][0], driver["kinds"]
    assert reference["touched"] == [[]] and driver["touched"] == owner["touched"] == [[]], "no backward ran anywhere"


FETCHED = {  # step -> (what the driver's requests must include, what they must not)
    "scalar": (_ce, {"getbwd"}, {"get", "gbwd"}),  # the exchange itself: computed and backpropagated on the owner
    "one_row": (_ce_of_one_row, {"getbwd", "gbwd"}, {"get"}),  # answered with the whole output, as a GET
    "per_sample_summed": (_ce_per_sample_summed, {"get", "gbwd"}, {"getbwd"}),  # ``sum`` fetches in the forward
}


@pytest.mark.parametrize("schedule", ["interleaved", "zero_bubble"])
@pytest.mark.parametrize("case", list(FETCHED))
def test_a_loss_its_owner_answers_as_a_fetch_matches_one_process(case, schedule):
    """Where the owner's walk stops at the tensor output (a loss on ``logits[0]``) it sends that output as a GET
    would, the loss is computed here and backpropagated through a FETCH_BACKWARD; per-sample losses summed here are
    fetched in the forward. Losses, every gradient and every updated parameter equal one process, also with the
    owner's backward split (``"zero_bubble"``)."""
    step, made, not_made = FETCHED[case]
    results = run_distributed(_pipelined, 2, step, 2, None, schedule)
    _assert_matches(results, _reference(step))
    for kinds in results[0]["kinds"]:
        assert made <= kinds and not not_made & kinds, kinds


# ---- 2c, 3. a failure on the owner inside the exchange ------------------------------------------------------------

TIMEOUT_S = 20
WRONG_TARGET = "ValueError: Expected input batch_size (4) to match target batch_size (3)."
BACKWARD_BROKE = "ValueError: the head's backward broke down"
HOOK_BROKE = "ValueError: the head's weight hook broke down"
OWNER_FAILURES = {  # case -> (step, schedule, the head's fault set in step 0, the one-process error)
    "loss_op": (_ce_wrong_target, "interleaved", None, WRONG_TARGET),
    "backward": (_ce, "interleaved", "fail", BACKWARD_BROKE),
    "backward_zero_bubble": (_ce, "zero_bubble", "fail", BACKWARD_BROKE),  # a Python Function: in the input pass
    "backward_simple": (_ce, "simple", "fail", BACKWARD_BROKE),
    "weight_hook": (_ce, "interleaved", "fail_weight", HOOK_BROKE),
}


@pytest.mark.parametrize("case", list(OWNER_FAILURES))
def test_a_failure_on_the_owner_in_the_exchange_fails_every_rank_and_the_next_step_runs(case):
    """Step 0 fails on the owner inside the GET_BACKWARD: the loss op raises (targets of the wrong length; one
    process raises it in the forward), or the head's backward does (its ``autograd.Function``, or a hook on its
    weight's gradient). Both ranks fail the step at once (well within the timeout), naming stage 1, the cause and,
    for the op, ``cross_entropy``; step 1 then runs normally, and the engine closes: losses, gradients and
    parameters equal one process, where step 0 raised the same error."""
    step, schedule, fault, cause = OWNER_FAILURES[case]
    fail_step = None if fault is None else 0
    reference = _reference(step, fail_step=fail_step, fault=fault or "fail")
    assert reference["errors"] == [cause, None]
    driver, owner = run_distributed(_pipelined, 2, step, 2, fail_step, schedule, TIMEOUT_S, fault or "fail")
    first = driver["errors"][0]
    assert first is not None, driver["errors"]
    assert first.startswith("PipelineError: pipeline stage 1 (global rank 1) failed running"), first
    assert first.rstrip().endswith(cause), first  # the owner's traceback, ending in the cause
    if case == "loss_op":
        assert ", in cross_entropy\n" in first, first
    assert owner["errors"][0] == "PipelineError: The step failed on pipeline stage 0 (global rank 0): " + first, owner
    assert "getbwd" in driver["kinds"][0], driver["kinds"]
    for result in (driver, owner):
        assert result["seconds"][0] < TIMEOUT_S / 2, result["seconds"]
        assert result["errors"][1] is None, result["errors"]
    _assert_matches([driver, owner], reference)


def test_a_weight_pass_failing_on_the_owner_under_zero_bubble_fails_every_rank():
    """Under ``"zero_bubble"`` the hook on the head's weight runs in the owner's weight pass, after the exchange
    replied (the last microbatch's: no request of the driver is left to answer with the error): the step must still
    fail on every rank (as one process's step fails), and step 1 match one process."""
    reference = _reference(_ce, fail_step=0, fault="fail_weight")
    assert reference["errors"] == [HOOK_BROKE, None]
    driver, owner = run_distributed(_pipelined, 2, _ce, 2, 0, "zero_bubble", TIMEOUT_S, "fail_weight")
    for result in (owner, driver):
        assert result["errors"][0] is not None and HOOK_BROKE.removeprefix("ValueError: ") in result["errors"][0], (
            result["errors"])
        assert result["errors"][1] is None, result["errors"]
    _assert_matches([driver, owner], reference)


def test_a_loss_with_nothing_to_send_back_matches_one_process():
    """Stage 0's layer frozen: the driver sends stage 1 no tensor that needs a gradient, so the exchange brings back
    no gradient (its node hands back none); stage 1's gradients and parameters still equal one process's."""
    results = run_distributed(_pipelined, 2, _ce, 2, None, "interleaved", 30, "fail", _frozen_first_layer)
    _assert_matches(results, _reference(_ce, make_model=_frozen_first_layer))
    assert sorted(results[1]["grads"][0]) == ["2.bias", "2.weight", "3.bias", "3.weight"]
    assert results[0]["grads"][0] == {}
    for kinds in results[0]["kinds"]:
        assert "getbwd" in kinds and not {"get", "gbwd"} & kinds, kinds
