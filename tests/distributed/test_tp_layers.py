"""Distributed layers against their plain originals on 2 gloo ranks: forward, every parameter gradient and the input
gradient, rtol 1e-5."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from examples.gpt import GPT, MLP, Block, CausalSelfAttention
from lightning_mp.nn import (
    DistributedAttention,
    DistributedEmbedding,
    DistributedLinear,
    DistributedMLP,
    DistributedTransformer,
    DistributedTransformerLayer,
    DistributedTransformerLMHead,
    vocab_parallel_cross_entropy,
)
from tests._dist import run_distributed
from tests._tp_helpers import assert_pairs, run_pair, world_tp


def _layers_worker(rank: int, world_size: int) -> dict:
    tp = world_tp()
    torch.manual_seed(0)
    x = torch.randn(2, 5, 8)  # (B, T, C)
    results = {}
    results["column"] = run_pair(
        DistributedLinear(8, 6, tp=tp, parallel="column"), nn.Linear(8, 6), (x,), tp, sharded_out=True
    )
    results["column_gather"] = run_pair(DistributedLinear(8, 6, tp=tp, gather_output=True), nn.Linear(8, 6), (x,), tp)
    results["column_gather_padded"] = run_pair(
        DistributedLinear(8, 7, tp=tp, gather_output=True, vocab_padded=True), nn.Linear(8, 7), (x,), tp
    )
    results["row_split_input"] = run_pair(
        DistributedLinear(8, 6, tp=tp, parallel="row", input_is_parallel=False), nn.Linear(8, 6), (x,), tp
    )
    results["attention"] = run_pair(DistributedAttention(8, 4, tp=tp), CausalSelfAttention(8, 4, 0.0), (x,), tp)
    results["mlp"] = run_pair(DistributedMLP(8, tp=tp), MLP(8, 0.0), (x,), tp)
    results["layer"] = run_pair(DistributedTransformerLayer(8, 4, tp=tp), Block(8, 4, 0.0), (x,), tp)
    results["transformer"] = run_pair(
        DistributedTransformer(2, 8, 4, tp=tp), nn.Sequential(Block(8, 4, 0.0), Block(8, 4, 0.0)), (x,), tp
    )
    x6 = torch.randn(2, 6, 8)
    for name, length_input in (("even", x6), ("padded", x)):  # optimize="memory": sequence parallel; T=5 pads
        results[f"layer_memory_{name}"] = run_pair(
            DistributedTransformerLayer(8, 4, tp=tp, optimize="memory"), Block(8, 4, 0.0), (length_input,), tp
        )
    results["transformer_memory"] = run_pair(
        DistributedTransformer(2, 8, 4, tp=tp, optimize="memory"),
        nn.Sequential(Block(8, 4, 0.0), Block(8, 4, 0.0)),
        (x,),
        tp,
    )
    ids = torch.randint(0, 11, (2, 5))
    results["embedding_odd_vocab"] = run_pair(DistributedEmbedding(11, 8, tp=tp), nn.Embedding(11, 8), (ids,), tp)
    return results


def test_layers_match_plain_modules_at_tp2():
    for rank_results in run_distributed(_layers_worker, 2, start_method="fork"):
        assert set(rank_results) >= {"column", "row_split_input", "attention", "mlp", "layer", "transformer"}
        assert {"layer_memory_even", "layer_memory_padded", "transformer_memory"} <= set(rank_results)
        for name, result in rank_results.items():
            try:
                assert_pairs(result)
            except AssertionError as err:
                raise AssertionError(f"{name}: {err}") from err


def _lm_worker(rank: int, world_size: int, vocab: int) -> dict:
    tp = world_tp()
    torch.manual_seed(0)
    ref = GPT(vocab_size=vocab, block_size=8, n_layer=2, n_head=2, n_embd=8)
    model = DistributedTransformerLMHead(vocab, 8, 2, 2, 8, tp=tp)
    model.load_state_dict(ref.state_dict())
    idx, y = torch.randint(0, vocab, (2, 6)), torch.randint(0, vocab, (2, 6))
    y[0, 0] = -100  # an ignored target
    ref_logits = ref(idx)
    ref_loss = F.cross_entropy(ref_logits.reshape(-1, vocab), y.reshape(-1))
    ref_loss.backward()
    loss = model(idx, y)
    loss.backward()
    with torch.no_grad():
        logits = model(idx)
    from tests._tp_helpers import grad_pairs

    full_state = model.state_dict()  # collective: full shapes, original keys
    return {
        "loss": (loss.detach(), ref_loss.detach()),
        "logits": (logits, ref_logits.detach()),
        "grads": grad_pairs(model, ref, tp),
        "state": {k: (v, ref.state_dict()[k]) for k, v in full_state.items()},
    }


@pytest.mark.parametrize("vocab", [12, 11])
def test_lm_head_and_vocab_parallel_cross_entropy_match_gpt(vocab):
    for result in run_distributed(_lm_worker, 2, vocab, start_method="fork"):
        torch.testing.assert_close(*result["loss"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(*result["logits"], rtol=1e-5, atol=1e-6)
        assert "wte.weight" in result["grads"] and "h.0.attn.c_attn.weight" in result["grads"]
        for name, (actual, expected) in result["grads"].items():
            torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        assert set(result["state"]) >= {"wte.weight", "lm_head.weight", "h.1.mlp.c_fc.weight"}
        for key, (actual, expected) in result["state"].items():
            assert actual.shape == expected.shape, key
            torch.testing.assert_close(actual, expected, msg=lambda m, k=key: f"{k}: {m}")


def _ce_worker(rank: int, world_size: int) -> dict:
    tp = world_tp()
    torch.manual_seed(0)
    full = torch.randn(7, 11, requires_grad=True)  # (N, V), V odd: padded shards of 6
    y = torch.randint(0, 11, (7,))
    ref = F.cross_entropy(full, y, reduction="sum")
    ref.backward()
    padded = torch.cat([full.detach(), torch.zeros(7, 1)], dim=1)
    local = padded[:, rank * 6 : (rank + 1) * 6].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, y, tp, 11, reduction="sum")
    loss.backward()
    expected = torch.cat([full.grad, torch.zeros(7, 1)], dim=1)[:, rank * 6 : (rank + 1) * 6]
    return {"loss": (loss.detach(), ref.detach()), "grad": (local.grad, expected)}


def test_vocab_parallel_cross_entropy_with_odd_vocab():
    for result in run_distributed(_ce_worker, 2, start_method="fork"):
        torch.testing.assert_close(*result["loss"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(*result["grad"], rtol=1e-5, atol=1e-6)
