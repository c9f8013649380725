"""Generality (issue 4): anything a Python forward does crosses stages and matches one process.

3 gloo processes, one spawn for every engine scenario (see :func:`pipelined`): each scenario trains a model split
over pipeline stages for a few SGD steps with the engine directly (as ``tests/distributed/test_engine.py``) and is
compared with the same model, same seed, full batch on one process: per-step losses, every ``.grad`` of the
first step and the updated parameters. Scenarios:

- ``courier``: nested tuples/lists/dicts/dataclasses/NamedTuples, tensors with and without grad (int64, bool,
  float64, empty, transposed, detached), Python scalars, strings, None and kwargs as arguments and as return
  values; what arrives is compared with what left on both sides of the boundary.
- ``varlen``: a different sequence length every step and every microbatch, microbatches of different sizes.
- ``skip``: three stages: a long skip (stage 0's output consumed by stage 2), nested calls both ways, one module
  called by two stages a data-dependent number of times per step, and an input passed through unchanged."""

from __future__ import annotations

import ast
import dataclasses
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_mp.comm import Transport
from lightning_mp.pipeline import PipelineEngine, split_microbatches
from tests._dist import run_distributed
from tests.models import Courier, Edges, SkipNet, VarLen, expand_placement

STEPS, LR = 3, 0.1
TOL = {"rtol": 1e-5, "atol": 1e-6}


def _equal_parts(num_microbatches: int) -> Callable[[Any, int], list]:
    return lambda batch, step: split_microbatches(batch, num_microbatches)


def _uneven_parts(batch: Any, step: int) -> list:
    """Microbatches of different sizes (and so, after VarLen's crop, different lengths): 3+5, 2+2+4, 1+7."""
    sizes = [[3, 5], [2, 2, 4], [1, 7]][step % 3]
    return list(zip(*(t.split(sizes) for t in batch)))


@dataclasses.dataclass(frozen=True)
class Scenario:
    model: type
    placement: dict[str, int]
    split: Callable[[Any, int], list]
    per_row: bool = False  # the model's loss is a sum over rows: weight 1/rows, not 1/microbatches


SCENARIOS = {
    "courier": Scenario(Courier, {"relay": 1}, _equal_parts(4)),
    "varlen": Scenario(VarLen, {"block": 1}, _uneven_parts, per_row=True),
    "skip": Scenario(SkipNet, {"mid": 1, "shared": 2, "mid.shared": 2, "head": 2, "head.out": 1}, _equal_parts(2)),
    "edges": Scenario(Edges, {"outer": 1, "outer.inner": 2}, _equal_parts(4)),
}
RECORDS = ("sent", "received", "shapes_seen", "shared_calls")  # model attributes a scenario keeps per rank
RELAY_RECORDS = ("arrived", "returned")


def _rows(batch: Any) -> int:
    return batch[0].shape[0]


def _scale(scenario: Scenario, part: Any, batch: Any, parts: list) -> float:
    return 1.0 / _rows(batch) if scenario.per_row else 1.0 / len(parts)


def _records(model: torch.nn.Module) -> dict:
    found = {name: getattr(model, name) for name in RECORDS if hasattr(model, name)}
    relay = getattr(model, "relay", None)
    if relay is not None and not hasattr(relay, "_smp_remote"):
        found.update({name: getattr(relay, name) for name in RELAY_RECORDS})
    return {k: list(v) if isinstance(v, list) else v for k, v in found.items()}


def _clear_records(model: torch.nn.Module) -> None:
    for owner in (model, getattr(model, "relay", None)):
        for name in RECORDS + RELAY_RECORDS:
            if isinstance(getattr(owner, name, None), list):
                getattr(owner, name).clear()


def _train_pipelined(engine: PipelineEngine, name: str, scenario: Scenario) -> dict:
    torch.manual_seed(0)
    cls = scenario.model
    model = cls()
    engine.install(model, expand_placement(model, scenario.placement))
    local = list(model.parameters())  # empty on a stage the scenario does not use
    optimizer = torch.optim.SGD(local or [torch.zeros(0, requires_grad=True)], lr=LR)
    losses, grads = [], {}
    for step in range(STEPS):
        optimizer.zero_grad()
        with engine.session(f"{name}-train") as session:
            if engine.is_driver:
                batch = cls.batch(seed=step)
                parts = scenario.split(batch, step)
                scales = [_scale(scenario, part, batch, parts) for part in parts]
                outputs = session.drive(
                    lambda mb, i: cls.loss(model, mb) * scales[i], parts, loss_fn=lambda loss: loss, backward=True
                )
                loss = torch.stack([o.detach() for o in outputs]).sum()
                session.finish(loss)
            else:
                loss = session.serve()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
        losses.append(loss.item())
    result = {"losses": losses, "grads": grads, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}
    result["records"] = _records(model)
    _clear_records(model)
    with torch.no_grad(), engine.session(f"{name}-eval") as session:  # forward only: nothing requires grad anywhere
        if engine.is_driver:
            batch = cls.batch(seed=STEPS)
            session.drive(lambda mb, i: cls.loss(model, mb), scenario.split(batch, 0), loss_fn=lambda l: None, backward=False)
            session.finish(None)
        else:
            session.serve()
    result["eval_records"] = _records(model)
    return result


def _all_scenarios(rank: int, world_size: int, schedule: str = "interleaved") -> dict[str, dict]:
    transport = Transport(dist.new_group(list(range(world_size))), torch.device("cpu"))
    results = {}
    for name, scenario in SCENARIOS.items():
        engine = PipelineEngine(transport, world_size, schedule=schedule, active_microbatches=3, timeout_s=60)
        try:
            results[name] = _train_pipelined(engine, name, scenario)
        except Exception:  # noqa: BLE001 - reported by the scenario's test; the next scenarios still run
            results[name] = {"error": traceback.format_exc()}
    return results


def _reference(scenario: Scenario) -> dict:
    torch.manual_seed(0)
    cls = scenario.model
    model = cls()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], {}
    for step in range(STEPS):
        optimizer.zero_grad()
        batch = cls.batch(seed=step)
        loss = cls.loss(model, batch) / (_rows(batch) if scenario.per_row else 1)
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
        losses.append(loss.item())
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "grads": grads, "params": params, "records": _records(model)}


@pytest.fixture(scope="module")
def pipelined() -> list[dict[str, dict]]:
    """Every scenario on 3 gloo processes, started once (per rank: scenario name -> result).

    Forked, not spawned: the children do not import Lightning again (about 3 s instead of 20 s on 2 cores).
    """
    return run_distributed(_all_scenarios, 3, start_method="fork")


def _check_against_reference(results: list[dict], reference: dict) -> None:
    for rank, result in enumerate(results):
        assert "error" not in result, f"rank {rank}:\n{result['error']}"
    for result in results:
        torch.testing.assert_close(result["losses"], reference["losses"], **TOL)
        for name, value in result["params"].items():
            torch.testing.assert_close(value, reference["params"][name], **TOL, msg=name)
        for name, value in result["grads"].items():
            torch.testing.assert_close(value, reference["grads"][name], **TOL, msg=name)
    assert sorted(n for r in results for n in r["params"]) == sorted(reference["params"]), "each on one stage"
    assert sorted(n for r in results for n in r["grads"]) == sorted(reference["grads"]), "every .grad, once"


def _scenario(pipelined: list[dict[str, dict]], name: str) -> list[dict]:
    return [per_rank[name] for per_rank in pipelined]


def test_everything_a_forward_passes_crosses_stages_with_dtype_shape_and_grad_flags(pipelined):
    """Arguments and return values of a remote call arrive as they left (structure, container types, dtype,
    shape, requires_grad, Python values), and the gradients match one process: a detached value or an
    integer mask sent across gets no gradient, an input passed back unchanged carries one."""
    results = _scenario(pipelined, "courier")
    _check_against_reference(results, _reference(SCENARIOS["courier"]))
    caller, owner = results[0]["records"], results[1]["records"]
    assert len(caller["sent"]) == len(owner["arrived"]) == STEPS * 4
    assert sorted(caller["sent"]) == sorted(owner["arrived"]), "arguments arrive as they left"
    assert sorted(owner["returned"]) == sorted(caller["received"]), "outputs arrive as they left"
    received = _leaves(caller["received"][0])  # microbatch of 2 rows, dim 6
    assert received["<dict>['h']"] == ("tensor", "torch.float32", (2, 6), True)
    assert received["<dict>['passthrough']"] == ("tensor", "torch.float32", (2, 6), True), "input sent back"
    assert received["<dict>['part']"] == ("tensor", "torch.float32", (2, 2), True), "part of an input"
    assert received["<dict>['bias']"] == ("tensor", "torch.float32", (6,), True)
    assert received["<dict>['weight']"] == ("tensor", "torch.float32", (6, 6), True), "a parameter"
    assert received["<dict>['aux']"] == ("tensor", "torch.float32", (), True), "0-dim with grad"
    assert received["<dict>['stat']"] == ("tensor", "torch.float32", (2,), False), "detached: no grad"
    assert received["<dict>['stat_in']"] == ("tensor", "torch.float32", (2,), False), "detached input sent back"
    assert received["<dict>['mask']"] == ("tensor", "torch.int64", (2,), False)
    assert received["<dict>['keep']<Meta>.keep"] == ("tensor", "torch.bool", (2,), False)
    assert received["<dict>['keep']<Meta>.length"] == ("int", 4)
    assert received["<dict>['info']<list>[2]"] == ("NoneType", None) and received["<dict>['info']<list>[1]"] == ("bool", True)
    sent = _leaves(caller["sent"][0])
    packet, extras, nested = "<tuple>[0]<tuple>[0]<Packet>", "<tuple>[0]<tuple>[1]<dict>", "<tuple>[0]<tuple>[2]<tuple>"
    assert sent[f"{packet}.h"] == ("tensor", "torch.float32", (2, 6), True)
    assert sent[f"{packet}.stat"] == ("tensor", "torch.float32", (2,), False)
    assert sent[f"{extras}['temperature']"] == ("tensor", "torch.float32", (), False), "0-dim"
    assert sent[f"{packet}.scale"] == ("float", 0.5) and sent[f"{packet}.tag"] == ("str", "mb")
    assert sent[f"{extras}['wide']"] == ("tensor", "torch.float64", (2, 6), True)
    assert sent[f"{extras}['empty']"] == ("tensor", "torch.float32", (0, 6), False)
    assert sent[f"{nested}[0]<list>[1]"] == ("tensor", "torch.float32", (6, 2), True), "transposed"
    assert sent[f"{nested}[0]<list>[2]"] == ("tensor", "torch.float32", (2, 6), False), "detached"
    assert sent["<tuple>[1]<dict>['note']"] == ("str", "n" * 5000)
    evaluated = results[0]["eval_records"]["sent"] + results[0]["eval_records"]["received"]
    evaluated += results[1]["eval_records"]["arrived"] + results[1]["eval_records"]["returned"]
    assert len(evaluated) == 4 * 4, "a forward-only step under no_grad"
    for text in evaluated:  # (the owner returns a Parameter, which requires grad even under no_grad)
        leaves = _leaves(text)
        assert all(leaf[-1] is False for path, leaf in leaves.items() if leaf[0] == "tensor" and path != "<dict>['weight']")
    assert sorted(results[0]["eval_records"]["sent"]) == sorted(results[1]["eval_records"]["arrived"])
    for text in results[0]["eval_records"]["received"]:  # no graph to connect under no_grad: a plain tensor
        assert _leaves(text)["<dict>['weight']"] == ("tensor", "torch.float32", (6, 6), False)


def _leaves(described: str) -> dict[str, tuple]:
    """A :func:`describe` repr as ``{path: (kind, ...)}``."""
    return {path: tuple(rest) for path, *rest in ast.literal_eval(described)}


def test_shapes_change_every_step_and_every_microbatch(pipelined):
    results = _scenario(pipelined, "varlen")
    _check_against_reference(results, _reference(SCENARIOS["varlen"]))
    shapes = results[1]["records"]["shapes_seen"]
    assert len(shapes) == 7, "2 + 3 + 2 microbatches ran on stage 1"
    assert len({s[0] for s in shapes}) >= 4 and len({s[1] for s in shapes}) >= 3, shapes
    assert results[0]["records"]["shapes_seen"] == [], "the block ran on its owner only"


def test_three_stages_long_skip_shared_module_from_two_stages_and_data_dependent_calls(pipelined):
    results = _scenario(pipelined, "skip")
    reference = _reference(SCENARIOS["skip"])
    _check_against_reference(results, reference)
    calls = [r["records"]["shared_calls"] for r in results]
    per_row_calls = reference["records"]["shared_calls"] - STEPS  # one process: one driver call per step
    assert calls[0] == calls[1] == 0 and calls[2] == per_row_calls + STEPS * 2, "owner only; driver: per microbatch"
    assert 0 < per_row_calls < STEPS * 8, "the data-dependent branch called stage 2 for some rows only"
    assert [len(r["params"]) for r in results] == [2, 4, 4], "embed / mid.proj + head.out / shared + head.mix"


def test_parameter_as_argument_remote_output_returned_as_is_and_unused_outputs(pipelined):
    """Stage 0's own parameter as an argument of a remote call, a stage-2 output returned by stage 1 unchanged
    (twice), integer outputs and an output the loss never uses: gradients as on one process."""
    results = _scenario(pipelined, "edges")
    _check_against_reference(results, _reference(SCENARIOS["edges"]))
    assert "pos" in results[0]["grads"] and "outer.inner.weight" in results[2]["grads"]
