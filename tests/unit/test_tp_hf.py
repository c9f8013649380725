"""Hugging Face tp plans in one process: a region the plan cannot shard (indivisible heads, an unsupported style)
is left replicated, with the reason."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

import lightning_mp  # noqa: E402
from lightning_mp.tp import TPGroup
from lightning_mp.nn._hf import translate_hf  # noqa: E402
from lightning_mp.tp._swap import swap_modules  # noqa: E402
from tests.models import tiny_gpt2  # noqa: E402

VOCAB = 33  # odd: padded vocab-parallel shards


def tiny_llama(tie: bool = True, heads: int = 4, kv_heads: int = 2):
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=heads,
        num_key_value_heads=kv_heads, tie_word_embeddings=tie, max_position_embeddings=32,
    )
    return transformers.LlamaForCausalLM(config)


def tiny_encoder(kind: str):
    config_cls, model_cls = {
        "bert": (transformers.BertConfig, transformers.BertForMaskedLM),
        "roberta": (transformers.RobertaConfig, transformers.RobertaForMaskedLM),
    }[kind]
    config = config_cls(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32,
        max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=1,
    )
    return model_cls(config)


BUILDERS = {
    "llama": tiny_llama,
    "gpt2": lambda: tiny_gpt2(vocab_size=VOCAB, bos_token_id=0, eos_token_id=0),
    "bert": lambda: tiny_encoder("bert"),
    "roberta": lambda: tiny_encoder("roberta"),
}


def test_llama_plan_with_indivisible_heads_is_left_unswapped_with_reasons():
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=12, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=3, num_key_value_heads=3, max_position_embeddings=32)
    )
    lightning_mp.set_tensor_parallelism(model)
    report = swap_modules(model, TPGroup(None, 0, 2), translations=[translate_hf])
    assert "num_attention_heads=3 is not divisible" in report.skipped["model.layers.0.self_attn.q_proj"]
    assert "model.layers.0.mlp.gate_proj" in report.swapped  # the rest of the plan still applies


def test_unsupported_plan_style_leaves_only_that_region_replicated():
    model = tiny_llama()
    model.tp_plan = {**model.tp_plan, "model.layers.*.mlp.up_proj": "sequence_parallel"}
    lightning_mp.set_tensor_parallelism(model)
    report = swap_modules(model, TPGroup(None, 0, 2), translations=[translate_hf])
    assert "'sequence_parallel' is not supported" in report.skipped["model.layers.0.mlp.up_proj"]
    # gate_proj alone split would meet a whole up_proj in act(gate) * up: its region stays replicated whole
    assert "sharded region 'model.layers.0.mlp' left replicated" in report.skipped["model.layers.0.mlp.gate_proj"]
    assert "model.layers.0.self_attn.q_proj" in report.swapped  # the rest of the plan still applies
