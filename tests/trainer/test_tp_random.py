"""Dropout under tensor parallelism through ``Trainer.fit``: a fit with dropout at tp=2 equals tp=1."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import lightning_mp  # noqa: E402
from tests.unit.test_tp_random import P


# ---- Trainer.fit: tp=2 against tp=1 at the same microbatching -----------------------------------------------------


def _marked_llama():
    config = transformers.LlamaConfig(
        vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, attention_dropout=P,
    )
    return lightning_mp.set_tensor_parallelism(transformers.LlamaForCausalLM(config))


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_fit_with_dropout_at_tp2_equals_tp1(tmp_path, monkeypatch, name):
    """GPT-2 (dropout 0.2 everywhere, SDPA) and Llama (attention dropout 0.2), 2 microbatches, 3 SGD steps, one
    intra-op thread per process: loss and every parameter at tp=2 equal tp=1 (the keyed streams are the same and
    the masks one process's; the shared stream of before gave other losses from the first step). Not bitwise: a row-parallel layer sums two partial products where tp=1 sums one,
    so updated parameters differ in the last bits (measured: at most 6e-9)."""
    from tests.trainer.test_same_maths import SPECS, Spec, _gpt2, _gpt2_step, _lm_batch, assert_state_equal, fit, smp

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    build = (lambda: lightning_mp.set_tensor_parallelism(_gpt2())) if name == "gpt2" else _marked_llama
    monkeypatch.setitem(SPECS, "tp", Spec(build, _lm_batch, _gpt2_step))
    one = fit(str(tmp_path / "tp1"), "tp", smp(1, 2, tensor_parallel_degree=1), seed=3)[0]
    two = fit(str(tmp_path / "tp2"), "tp", smp(1, 2, tensor_parallel_degree=2), devices=2, seed=3)
    for result in two:
        torch.testing.assert_close(result["losses"], one["losses"], rtol=1e-6, atol=1e-7)
        assert_state_equal(result["state"], one["state"], rtol=1e-6, atol=1e-7)
    if name == "gpt2":  # the option: each tp rank's own stream draws other attention masks than one process
        per_rank = smp(1, 2, tensor_parallel_degree=2, tp_random_streams="per_rank")
        other = fit(str(tmp_path / "per_rank"), "tp", per_rank, devices=2, seed=3)
        assert other[0]["losses"] == other[1]["losses"], "replicated activations stay equal over the tp group"
        assert abs(other[0]["losses"][0] - one["losses"][0]) > 1e-4
