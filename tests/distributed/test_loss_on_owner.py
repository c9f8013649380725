"""The loss runs on the stage that holds the logits ([Note: the loss where the logits are] in pipeline/_recorded.py).

The example GPT and Hugging Face's GPT-2 (head untied, on stage 1 with the last block and the final norm) train
for two SGD steps of two microbatches on two gloo processes and on one; losses, first-step gradients and every
updated parameter must match, and the bytes each stage sends per step (``engine.bytes_sent``) must stay below
half of what the step's logits alone would cost to send: only the loss scalar comes back, and only its gradient
goes out. Hugging Face's final hidden states stay on stage 1 too.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mp.pipeline import transport_messages
from tests._dist import run_distributed
from tests.distributed.test_remote_handles import _assert_matches, _batch as _regression_batch, _pipelined, _reference
from tests.models import tiny_gpt2

VOCAB, T, N, MICROBATCHES = 256, 16, 8, 2
LOGITS_NBYTES = N * T * VOCAB * 4  # one step's float32 logits (fetching them sent this, and as much gradient back)


def _gpt() -> nn.Module:
    """``examples.gpt.GPT``, its head untied so that it may live on stage 1 without a replicated tie."""
    from examples.gpt import GPT

    model = GPT(vocab_size=VOCAB, block_size=T, n_layer=2, n_head=2, n_embd=16)
    model.lm_head.weight = nn.Parameter(model.wte.weight.detach().clone())
    return model


GPT_PLACEMENT = {"h.1": 1, "ln_f": 1, "lm_head": 1}


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.randint(0, VOCAB, (N, T + 1), generator=torch.Generator().manual_seed(seed))
    return data[:, :-1], data[:, 1:]


def _gpt_loss(model, batch, log) -> torch.Tensor:
    return model._loss(batch)  # F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def _gpt_inspected(model, batch, log) -> torch.Tensor:
    """Python reads the loss, then the logits themselves: both values are right, gradients flow through the loss."""
    x, y = batch
    logits = model(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
    seen = float(loss)
    hits = (logits.argmax(-1) == y).float().mean()  # fetches the logits
    return loss + 0.0 * hits * seen


def _gpt_loss_module(model, batch, log) -> torch.Tensor:
    x, y = batch
    logits = model(x)
    return nn.CrossEntropyLoss(label_smoothing=0.1)(logits.view(-1, VOCAB), y.reshape(-1))


def _masked(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    labels = batch[1].clone()
    labels[labels % 3 == 0] = -100
    return labels


def _token_weighted(model, batch, log) -> torch.Tensor:
    """A mean over the unmasked tokens of the whole batch: the microbatch's sum over the batch's count (``count``
    holds it once per sample, so that every microbatch gets it); times the microbatches the harness divides by."""
    x, y, count = batch
    labels = _masked((x, y))
    logits = model(x)
    summed = F.cross_entropy(logits.view(-1, VOCAB), labels.reshape(-1), ignore_index=-100, reduction="sum")
    return summed / count[0] * MICROBATCHES


def _weighted_batch(seed: int):
    x, y = _batch(seed)
    count = (_masked((x, y)) != -100).sum().to(torch.float32)
    return x, y, count.expand(N).clone()


GPT_CASES = {
    "loss": (_gpt_loss, _batch),
    "inspected": (_gpt_inspected, _batch),
    "loss_module": (_gpt_loss_module, _batch),
    "token_weighted": (_token_weighted, _weighted_batch),
}


@pytest.mark.parametrize("case", list(GPT_CASES))
def test_example_gpt_loss_on_the_head_stage_matches_one_process(case):
    step, batch_fn = GPT_CASES[case]
    results = run_distributed(_pipelined, 2, step, _gpt, GPT_PLACEMENT, MICROBATCHES, 2, batch_fn)
    _assert_matches(results, _reference(step, _gpt, MICROBATCHES, batch_fn))
    if case != "inspected":  # that one fetches the logits on purpose
        for rank, result in enumerate(results):
            for sent in result["bytes"]:
                assert sent < LOGITS_NBYTES / 2, (rank, sent, LOGITS_NBYTES)  # no logits, no logit gradients


HF_EMBD = 64
HIDDEN_NBYTES = N * T * HF_EMBD * 4  # one step's float32 final hidden states


def _hf_gpt2() -> nn.Module:
    return tiny_gpt2(vocab_size=VOCAB, n_embd=HF_EMBD, n_positions=T, n_layer=2, use_cache=False,
                     tie_word_embeddings=False)


def _hf_step(model, batch, log) -> torch.Tensor:
    ids, labels = batch
    return model(input_ids=ids, labels=labels, use_cache=False).loss  # HF shifts, upcasts and flattens


def test_hf_gpt2_labels_loss_on_the_head_stage_matches_one_process():
    placement = {"transformer.h.1": 1, "transformer.ln_f": 1, "lm_head": 1}
    results = run_distributed(_pipelined, 2, _hf_step, _hf_gpt2, placement, MICROBATCHES, 2, _batch)
    _assert_matches(results, _reference(_hf_step, _hf_gpt2, MICROBATCHES, _batch))
    for rank, result in enumerate(results):
        for sent in result["bytes"]:
            assert sent < LOGITS_NBYTES / 2, (rank, sent, LOGITS_NBYTES)
    for kinds in results[0]["kinds"]:
        # per microbatch: 3 one-way calls (h.1, ln_f, lm_head), ``logits.device`` (metadata only), and the loss with
        # its backward in one exchange (``BaseModelOutputWithPast`` asks ``is_tensor`` of the final norm's output, an
        # ``nn.LayerNorm``'s: known here, [Note: handles in Hugging Face outputs]; the hidden states never cross);
        # the calls go with the metadata fetch as one message ([Note: coalesced one-way calls] in pipeline/_core.py)
        assert kinds == {"call": 3 * MICROBATCHES, "get": MICROBATCHES, "getbwd": MICROBATCHES, "end": 1,
                         "close": 1, "bundle": MICROBATCHES, "bundled": 4 * MICROBATCHES}, kinds
        assert transport_messages(kinds) == 2 * MICROBATCHES + 2, kinds  # was 5 per microbatch
    for kinds in results[1]["kinds"]:
        assert kinds == {"reply": 2 * MICROBATCHES, "close": 1}, kinds
    for rank, result in enumerate(results):
        # one boundary activation per step each way (h.0's output forward, its gradient back) and scalars: the final
        # hidden states never cross (fetching them cost one more of each way, and the head's stage got them back)
        for sent in result["bytes"]:
            assert sent < 1.5 * HIDDEN_NBYTES, (rank, sent, HIDDEN_NBYTES)


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))


def _mlp_step(model, batch, log) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x).squeeze(-1), y)


def test_loss_fetch_and_backward_take_one_exchange_per_microbatch():
    """[Note: the loss's fetch and backward in one exchange]: a Sequential whose last layers (and so the loss) are on
    stage 1 costs one one-way call and one exchange per microbatch, and still matches one process."""
    results = run_distributed(_pipelined, 2, _mlp_step, _mlp, {"3": 1, "4": 1}, 4, 2, _regression_batch)
    _assert_matches(results, _reference(_mlp_step, _mlp, 4, _regression_batch))
    for driver, owner in zip(results[0]["kinds"], results[1]["kinds"]):
        assert driver == {"call": 4, "getbwd": 4, "end": 1, "close": 1}, driver  # was a GET and a FETCH_BACKWARD each
        assert transport_messages(driver) == 2 * 4 + 2, driver  # the call goes at the forward's end, on its own
        assert owner == {"reply": 4, "close": 1}, owner


WIDE = 512  # a classifier's output width: its logits (N x WIDE floats) must not travel


def _wide() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, WIDE))


def _wide_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, 8, generator=g), torch.randint(0, WIDE, (N,), generator=g)


def _nll_of_log_softmax(model, batch, log) -> torch.Tensor:
    x, y = batch
    return F.nll_loss(F.log_softmax(model(x), -1), y)


def _scaled_then_changed_in_place(model, batch, log) -> torch.Tensor:
    x, y = batch
    loss = F.cross_entropy(model(x), y)
    scaled = loss * 2.0  # eager: computed before the next line changes ``loss``
    loss.add_(1.0)
    return scaled


@pytest.mark.parametrize("step", [_nll_of_log_softmax, _scaled_then_changed_in_place])
def test_only_the_loss_and_its_scalings_come_back(step):
    """The exchange that fetches a loss with its backward sends back the loss and the scalings of it, never the
    function ops it was taken from (``log_softmax``'s N x WIDE output); and arithmetic on a loss in the user's own
    step stays eager (a later in-place change does not reach a value computed before it): both match one process."""
    results = run_distributed(_pipelined, 2, step, _wide, {"2": 1}, MICROBATCHES, 2, _wide_batch)
    _assert_matches(results, _reference(step, _wide, MICROBATCHES, _wide_batch))
    for owner_bytes in results[1]["bytes"]:  # was 17,940 with log_softmax's output sent back
        assert owner_bytes < N * WIDE * 4 / 4, owner_bytes
    if step is _nll_of_log_softmax:
        for driver in results[0]["kinds"]:
            assert driver == {"call": MICROBATCHES, "getbwd": MICROBATCHES, "end": 1, "close": 1}, driver
