"""Dropout under tensor parallelism draws one process's masks (see [Note: random numbers under tensor parallelism]).

2 gloo ranks, unmodified Hugging Face models with dropout on: GPT-2 (attention, residual, MLP and embedding
dropout 0.2, eager and SDPA attention) and Llama (attention dropout 0.2), swapped at tp=2, against the same
model on one process with the same seed: loss, logits and every gradient."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")

import lightning_mp  # noqa: E402
from lightning_mp.tp import TPGroup  # noqa: E402
from lightning_mp.nn._hf import translate_hf  # noqa: E402
from lightning_mp.tp._swap import swap_modules  # noqa: E402
from tests._dist import run_distributed  # noqa: E402
from tests._tp_helpers import grad_pairs  # noqa: E402
from tests.models import tiny_gpt2  # noqa: E402
from tests.unit.test_tp_random import P

VOCAB = 32


def dropout_gpt2(attn: str):
    return tiny_gpt2(vocab_size=VOCAB, dropout=P, attn_implementation=attn)


def dropout_llama(attn: str):
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, attention_dropout=P,
    )
    config._attn_implementation = attn
    return transformers.LlamaForCausalLM(config)


BUILDERS = {"gpt2": dropout_gpt2, "llama": dropout_llama}


def _worker(rank: int, world: int, name: str, attn: str) -> dict:
    logging.getLogger("transformers").setLevel(logging.ERROR)
    tp = TPGroup.of(dist.group.WORLD)
    torch.manual_seed(0)
    model = BUILDERS[name](attn).train()
    ref = copy.deepcopy(model)
    lightning_mp.set_tensor_parallelism(model)
    swap_modules(model, tp, translations=[translate_hf])
    ids = torch.randint(0, VOCAB, (2, 8))
    outputs = []
    for net in (ref, model):
        torch.manual_seed(1)  # the same stream on every rank and in the reference
        out = net(input_ids=ids, labels=ids)
        out.loss.backward()
        outputs.append(out)
    no_dropout = ref.eval()(input_ids=ids, labels=ids).loss.detach()
    return {
        "loss": (outputs[1].loss.detach(), outputs[0].loss.detach()),
        "logits": (outputs[1].logits.detach(), outputs[0].logits.detach()),
        "grads": grad_pairs(model, ref, tp),
        "no_dropout": no_dropout,
    }


@pytest.mark.parametrize(("name", "attn"), [("gpt2", "eager"), ("gpt2", "sdpa"), ("llama", "eager"), ("llama", "sdpa")])
def test_dropout_at_tp2_draws_one_process_masks(name, attn):
    _check_one_process(run_distributed(_worker, 2, name, attn, start_method="fork"))


def test_gpt2_dropout_at_tp4_where_c_fc_width_is_the_replicated_width():
    """At tp=4 ``c_fc``'s local width 4C/4 equals C: the residual dropout on ``(B, T, C)`` after ``c_proj`` is
    replicated (it raised before), the attention weights ``(B, 1, T, T)`` one process's heads: equal to tp=1."""
    _check_one_process(run_distributed(_worker, 4, "gpt2", "eager", start_method="fork"))


def _check_one_process(results: list[dict]) -> None:
    for result in results:
        loss, ref_loss = result["loss"]
        assert abs(ref_loss - result["no_dropout"]) > 1e-3, "dropout is on and changes the loss"
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(*result["logits"], rtol=1e-5, atol=1e-5)
        for n, (actual, expected) in result["grads"].items():
            torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"grad {n}: {m}")


class _ChannelsLastMLP(torch.nn.Module):
    def __init__(self, fc1: torch.nn.Module, fc2: torch.nn.Module):
        super().__init__()
        self.fc1, self.fc2, self.drop = fc1, fc2, torch.nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(self.drop(torch.relu(self.fc1(x)))))


def _channels_last_worker(rank: int, world: int):
    from lightning_mp.nn import DistributedLinear  # noqa: PLC0415
    from lightning_mp.tp._random import install_sharded_random  # noqa: PLC0415

    tp = TPGroup.of(dist.group.WORLD)
    torch.manual_seed(0)
    ref = _ChannelsLastMLP(torch.nn.Linear(16, 64), torch.nn.Linear(64, 16))
    model = _ChannelsLastMLP(
        DistributedLinear(16, 64, tp=tp, parallel="column"), DistributedLinear(64, 16, tp=tp, parallel="row")
    )
    model.load_state_dict(ref.state_dict())
    assert install_sharded_random(model, tp) == [""]
    x = torch.randn(2, 4, 3, 16)
    outs = []
    for net in (ref, model):
        torch.manual_seed(1)
        outs.append(net(x).detach())
    return outs


def test_channels_last_mlp_draws_one_process_masks():
    """An MLP region on 4-D channels-last ``(B, H, W, C)`` activations (no head size): the hidden ``(B, H, W, 4C)``
    is sharded on its last dim and the output after the row-parallel layer replicated, equal on both ranks and to
    one process (before, every 4-D tensor counted as attention weights sharded on dim 1: the ranks diverged)."""
    (ref0, got0), (ref1, got1) = run_distributed(_channels_last_worker, 2, start_method="fork")
    torch.testing.assert_close(got0, got1, rtol=0, atol=0)
    torch.testing.assert_close(got0, ref0, rtol=1e-5, atol=1e-6)
