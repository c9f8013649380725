"""Hugging Face models under tp=2 on 2 gloo ranks, unmodified: a tied-embedding Llama through its own
``tp_plan``; GPT-2 (Conv1D), BERT and RoBERTa (MLM) through built-in translations. Against the same model on
one process: loss, logits, every gradient, and the state dict under the original keys and full shapes."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")

import lightning_mp  # noqa: E402
from lightning_mp.tp import TPGroup, shard, shard_spec  # noqa: E402
from lightning_mp.nn._hf import translate_hf  # noqa: E402
from lightning_mp.tp._swap import swap_modules  # noqa: E402
from tests._dist import run_distributed  # noqa: E402
from tests.unit.test_tp_hf import BUILDERS, VOCAB


EXPECTED = {
    "llama": ("model.layers.1.mlp.down_proj", "lm_head"),
    "gpt2": ("transformer.h.1.attn", "lm_head"),
    "bert": ("bert.encoder.layer.1.attention.self.query", "cls.predictions.decoder"),
    "roberta": ("roberta.encoder.layer.1.output.dense", "lm_head.decoder"),
}


def _worker(rank: int, world: int, name: str) -> dict:
    logging.getLogger("transformers").setLevel(logging.ERROR)
    tp = TPGroup.of(dist.group.WORLD)
    torch.manual_seed(0)
    model = BUILDERS[name]()
    ref = copy.deepcopy(model)
    lightning_mp.set_tensor_parallelism(model)
    report = swap_modules(model, tp, translations=[translate_hf])
    ids = torch.randint(2, VOCAB, (2, 6))
    ref_out, out = ref(input_ids=ids, labels=ids), model(input_ids=ids, labels=ids)
    ref_out.loss.backward()
    out.loss.backward()
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    grads = {}
    for n, p in model.named_parameters():
        spec = shard_spec(p)
        expected = ref_params[n].grad if spec is None else shard(ref_params[n].grad, spec, tp.rank, tp.size)
        grads[n] = (p.grad.clone(), expected)
    state, ref_state = model.state_dict(), ref.state_dict()
    return {
        "swapped": report.swapped,
        "skipped": report.skipped,
        "loss": (out.loss.detach(), ref_out.loss.detach()),
        "logits": (out.logits.detach(), ref_out.logits.detach()),
        "grads": grads,
        "state": {k: (v, ref_state[k]) for k, v in state.items()},
        "state_keys": (sorted(state), sorted(ref_state)),
        "tied": model.get_output_embeddings().weight is model.get_input_embeddings().weight,
        "first_linear": _first_projection(model),
    }


def _first_projection(model) -> tuple[str, bool, tuple]:
    """The plan's split, not a gathered column: (parallel, gather_output, local weight shape)."""
    if hasattr(model, "model"):
        layer = model.model.layers[0].self_attn.q_proj
    elif hasattr(model, "transformer"):
        layer = model.transformer.h[0].attn.c_attn
    else:
        layer = model.base_model.encoder.layer[0].attention.self.query
    return layer.parallel, layer.gather_output, tuple(layer.weight.shape)


@pytest.mark.parametrize("name", ["llama", "gpt2", "bert", "roberta"])
def test_hf_model_matches_one_process(name):
    for result in run_distributed(_worker, 2, name, start_method="fork"):
        assert not result["skipped"], result["skipped"]
        assert set(EXPECTED[name]) <= set(result["swapped"])
        assert result["tied"]
        expected_first = {"llama": (8, 16), "gpt2": (16, 24), "bert": (8, 16), "roberta": (8, 16)}[name]
        assert result["first_linear"] == ("column", False, expected_first)
        torch.testing.assert_close(*result["loss"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(*result["logits"], rtol=1e-5, atol=1e-5)
        for n, (actual, exp) in result["grads"].items():
            torch.testing.assert_close(actual, exp, rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"grad {n}: {m}")
        assert result["state_keys"][0] == result["state_keys"][1]
        for key, (actual, exp) in result["state"].items():
            assert actual.shape == exp.shape, key
            torch.testing.assert_close(actual, exp, msg=lambda m, k=key: f"{k}: {m}")
