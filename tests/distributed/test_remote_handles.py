"""Remote handles ([Note: remote handles] in pipeline/_handles.py): outputs stay on the stage that made them.

Every test runs the pipelined model on 2 or 3 gloo processes and compares losses, gradients and updated
parameters with the same model in one process; the message counts come from ``engine.messages_sent``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mp.pipeline import PipelineEngine, RemoteValue, split_microbatches, transport_messages
from tests._dist import make_transport, run_distributed
from tests.models import expand_placement, tiny_gpt2

LR, DIM = 0.1, 8


class Block(nn.Module):
    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, D) -> (B, D)
        return x + torch.tanh(self.fc(self.norm(x)))


class Score(nn.Module):
    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, D) -> () scalar
        return self.fc(x).mean()


class Touchy(nn.Module):
    """Blocks in an ``nn.ModuleList``; the step below calls them one by one and touches their outputs."""

    def __init__(self, dim: int = DIM, blocks: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList([Block(dim) for _ in range(blocks)])
        self.score = Score(dim)
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, D) -> (B,)
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h).squeeze(-1)


def _batch(seed: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, DIM, generator=g), torch.randn(n, generator=g)


def _touching_step(model: Touchy, batch, log) -> torch.Tensor:
    """``log(name)`` after each stretch; on stage 1: blocks 2 and 3 and score."""
    x, y = batch
    h = model.inp(x)
    a = model.blocks[2](h)
    b = model.blocks[3](a)  # a handle into a call on its own stage: no fetch
    log("chain")
    rows = b.shape[0]  # fetches b's shape only (b stays on stage 1)
    log("shape")
    s = model.score(model.blocks[3](h))  # two calls on stage 1, nothing fetched
    log("score")
    value = s.item()  # fetches s
    log("item")
    c = model.blocks[2](h)
    c.mul_(0.5)  # in place on the caller: fetches c, which later calls then get as data
    log("inplace")
    d = model.blocks[3](c)
    t = model.score(d)
    log("calls")
    e = d * 2.0 if t > 0 else d * 3.0  # the branch fetches t, the product fetches d
    log("branch")
    out = model.head(b + e).squeeze(-1)  # the sum fetches b
    log("sum")
    return F.mse_loss(out, y) + 0.1 * s * (1.0 + 0.0 * value) + 0.0 * rows


EXPECTED_FETCHES = {"chain": 0, "shape": 1, "score": 0, "item": 1, "inplace": 1, "calls": 0, "branch": 2, "sum": 1}


def _reference(step, make_model, microbatches: int, batch_fn=_batch, steps: int = 2) -> dict:
    torch.manual_seed(0)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], {}
    for index in range(steps):
        optimizer.zero_grad()
        total = 0.0
        for part in split_microbatches(batch_fn(index), microbatches):
            loss = step(model, part, lambda name: None) / microbatches
            loss.backward()
            total += loss.item()
        if index == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
        losses.append(total)
    return {"losses": losses, "grads": grads, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _pipelined(rank: int, world: int, step, make_model, placement: dict, microbatches: int, active: int,
               batch_fn=_batch, plane: str = "gloo", steps: int = 2) -> dict:
    torch.manual_seed(0)
    model = make_model()
    transport = make_transport(list(range(world)), plane)
    engine = PipelineEngine(transport, world, active_microbatches=active, timeout_s=60, remote_handles=True)
    engine.install(model, expand_placement(model, placement))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads, fetches, kinds, sent = [], {}, [], [], []
    last = [0]

    def log(name: str) -> None:
        count = engine.messages_sent["get"]
        fetches.append((name, count - last[0]))
        last[0] = count

    for index in range(steps):
        optimizer.zero_grad()
        before, bytes_before = dict(engine.messages_sent), sum(engine.bytes_sent.values())
        with engine.session() as session:
            if engine.is_driver:
                parts = split_microbatches(batch_fn(index), microbatches)
                outputs = session.drive(
                    lambda mb, i: step(model, mb, log), parts, loss_fn=lambda l: l / microbatches, backward=True
                )
                loss = sum(o.detach() / microbatches for o in outputs)
                session.finish(loss)
            else:
                loss = session.serve()
        kinds.append({k: v - before.get(k, 0) for k, v in engine.messages_sent.items() if v - before.get(k, 0)})
        sent.append(sum(engine.bytes_sent.values()) - bytes_before)
        if index == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
        losses.append(float(loss))
    return {
        "losses": losses, "grads": grads, "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "fetches": fetches, "kinds": kinds, "bytes": sent,
    }


def _assert_matches(results: list[dict], reference: dict) -> None:
    for result in results:
        torch.testing.assert_close(result["losses"], reference["losses"], rtol=1e-5, atol=1e-6)
        for name, value in result["params"].items():
            torch.testing.assert_close(value, reference["params"][name], rtol=1e-5, atol=1e-6, msg=name)
        for name, value in result["grads"].items():
            torch.testing.assert_close(value, reference["grads"][name], rtol=1e-5, atol=1e-6, msg=name)
    assert sorted(n for r in results for n in r["grads"]) == sorted(reference["grads"]), "every gradient, once"


def test_a_value_is_fetched_only_when_local_code_touches_it():
    placement = {"blocks.2": 1, "blocks.3": 1, "score": 1}
    results = run_distributed(_pipelined, 2, _touching_step, Touchy, placement, 2, 1)
    _assert_matches(results, _reference(_touching_step, Touchy, 2))
    per_microbatch = [dict(results[0]["fetches"][i : i + len(EXPECTED_FETCHES)])
                      for i in range(0, len(results[0]["fetches"]), len(EXPECTED_FETCHES))]
    assert per_microbatch == [EXPECTED_FETCHES] * 4, "2 steps x 2 microbatches, one at a time"


def _loop_step(model: Touchy, batch, log) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


@pytest.mark.parametrize("plane", ["gloo", "strict_mock"])
def test_backward_through_chained_handles_matches_one_process_in_one_round_trip_each_way(plane):
    """blocks 1..3 on stage 1 in a ModuleList loop: 3 one-way calls, then 1 fetch and 1 backward per microbatch;
    the calls go with the fetch, as one message ([Note: coalesced one-way calls] in pipeline/_core.py)."""
    placement = {"blocks.1": 1, "blocks.2": 1, "blocks.3": 1}
    results = run_distributed(_pipelined, 2, _loop_step, Touchy, placement, 4, 3, _batch, plane)
    _assert_matches(results, _reference(_loop_step, Touchy, 4))
    for kinds in results[0]["kinds"]:
        assert kinds == {"call": 3 * 4, "get": 4, "gbwd": 4, "close": 1, "end": 1, "bundle": 4, "bundled": 4 * 4}, kinds
        assert transport_messages(kinds) == 2 * 4 + 2, kinds  # per microbatch: calls and fetch, backward


class Returned(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(4)])
        self.head = nn.Linear(DIM, 1)


def _third_stage_step(model: Returned, batch, log) -> dict:
    """Block 1 on stage 1 feeds block 2 on stage 2; block 2's output is returned from the step untouched."""
    x, y = batch
    h = model.blocks[0](x)
    h = model.blocks[1](h)  # stage 1
    h = model.blocks[2](h)  # stage 2: gets stage 1's output through the driver
    hidden = model.blocks[2](x)  # stage 2, never touched in the step
    out = model.head(model.blocks[3](h)).squeeze(-1)
    return {"loss": F.mse_loss(out, y), "hidden": hidden}


def _third_stage(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = Returned()
    reference = Returned()
    reference.load_state_dict(model.state_dict())
    engine = PipelineEngine(make_transport(list(range(world))), world, timeout_s=60, remote_handles=True)
    engine.install(model, expand_placement(model, {"blocks.1": 1, "blocks.2": 2}))
    parts = split_microbatches(_batch(0), 2)
    result: dict = {}
    for backward in (True, False):
        with torch.set_grad_enabled(backward), engine.session() as session:
            if engine.is_driver:
                outputs = session.drive(
                    lambda mb, i: _third_stage_step(model, mb, None), parts, loss_fn=lambda o: o["loss"] / 2,
                    backward=backward,
                )
                session.finish(None)
                assert not any(type(v) is RemoteValue for o in outputs for v in o.values())
                result[backward] = [{k: v.detach() for k, v in o.items()} for o in outputs]
            else:
                session.serve()
    result["grads"] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    if rank == 0:
        expected = []
        for part in parts:
            out = _third_stage_step(reference, part, None)
            (out["loss"] / 2).backward()
            expected.append({k: v.detach() for k, v in out.items()})
        result["expected"] = expected
        result["expected_grads"] = {n: p.grad.clone() for n, p in reference.named_parameters()}
    result["gets"] = engine.messages_sent["get"]
    return result


def test_a_handle_passed_to_a_third_stage_and_returned_from_the_step():
    results = run_distributed(_third_stage, 3)
    driver = results[0]
    for backward in (True, False):
        for got, want in zip(driver[backward], driver["expected"]):
            assert type(got["hidden"]) is torch.Tensor and type(got["loss"]) is torch.Tensor, "fetched, not handles"
            torch.testing.assert_close(got["hidden"], want["hidden"].detach())
            torch.testing.assert_close(got["loss"], want["loss"].detach())
    owned = {n: g for r in results for n, g in r["grads"].items()}
    assert sorted(owned) == sorted(driver["expected_grads"])
    for name, grad in owned.items():
        torch.testing.assert_close(grad, driver["expected_grads"][name], rtol=1e-5, atol=1e-6, msg=name)
    # per microbatch and step: stage 1's output for stage 2, stage 2's for block 3, the returned hidden
    assert driver["gets"] == 2 * 2 * 3


def _tiny_gpt2():
    return tiny_gpt2(n_layer=4, use_cache=False)


def _gpt2_batch(seed: int, n: int = 4):
    ids = torch.randint(0, 32, (n, 12), generator=torch.Generator().manual_seed(seed))
    return ids, ids


def _gpt2_step(model, batch, log) -> torch.Tensor:
    ids, labels = batch
    return model(input_ids=ids, labels=labels, use_cache=False).loss


GPT2_PLACEMENT = {"transformer.h.2": 1, "transformer.h.3": 1, "transformer.ln_f": 1}


def test_hf_gpt2_at_pp2_costs_one_round_trip_per_microbatch_each_way():
    """Unmodified HF GPT-2 (a ModuleList loop): h.2, h.3 and ln_f on stage 1, the tied embedding/head on stage 0."""
    results = run_distributed(_pipelined, 2, _gpt2_step, _tiny_gpt2, GPT2_PLACEMENT, 2, 2, _gpt2_batch)
    _assert_matches(results, _reference(_gpt2_step, _tiny_gpt2, 2, _gpt2_batch))
    for kinds in results[0]["kinds"]:
        assert kinds.get("fwd", 0) == kinds.get("bwd", 0) == 0
        assert kinds["get"] == 2 and kinds["gbwd"] == 2, kinds  # round trips forward / backward: 1 per microbatch
        assert kinds["call"] == 3 * 2, kinds  # one-way: h.2, h.3, ln_f


def _tiny_bert():
    import transformers

    config = transformers.BertConfig(
        vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32,
        max_position_embeddings=16, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    return transformers.BertForTokenClassification(config)


def _bert_batch(seed: int, n: int = 4):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 32, (n, 10), generator=g), torch.randint(0, 3, (n, 10), generator=g)


def _bert_step(model, batch, log) -> torch.Tensor:
    ids, labels = batch
    return model(input_ids=ids, labels=labels).loss


def test_hf_model_output_indexed_then_read_by_attribute():
    """Unmodified HF BertForTokenClassification, ``bert`` on stage 1: the head on the driver reads ``outputs[0]``,
    then ``outputs.hidden_states`` (a remote ``ModelOutput`` indexed by position, then read by attribute)."""
    results = run_distributed(_pipelined, 2, _bert_step, _tiny_bert, {"bert": 1}, 2, 2, _bert_batch)
    _assert_matches(results, _reference(_bert_step, _tiny_bert, 2, _bert_batch))


def _stale_handle(rank: int, world: int) -> str:
    torch.manual_seed(0)
    model = Touchy()
    engine = PipelineEngine(make_transport(list(range(world))), world, active_microbatches=1, timeout_s=60, remote_handles=True)
    engine.install(model, expand_placement(model, {"blocks.2": 1}))
    kept = []

    def step(mb, index):
        h = model.blocks[2](model.inp(mb[0]))
        if index == 0:
            kept.append(model.blocks[2](h))  # never touched in its own microbatch
            return F.mse_loss(model.head(h).squeeze(-1), mb[1])
        return F.mse_loss(model.head(h + kept[0]).squeeze(-1), mb[1])  # microbatch 1 touches microbatch 0's

    try:
        with engine.session() as session:
            if engine.is_driver:
                session.drive(step, split_microbatches(_batch(0), 2), loss_fn=lambda l: l, backward=True)
                session.finish(None)
            else:
                session.serve()
    except Exception as err:  # noqa: BLE001 (the message is the result)
        return f"{type(err).__name__}: {err}"
    return "no error"


def test_a_handle_touched_after_its_microbatch_finished_fails_clearly():
    driver, server = run_distributed(_stale_handle, 2)
    assert driver.startswith("PipelineError") and "microbatch 0 was used after that microbatch had finished" in driver
    assert "pipeline stage 1 (global rank 1)" in driver, driver
    assert server.startswith("PipelineError"), server
