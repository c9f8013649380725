"""Dropout under tensor parallelism draws one process's masks (see [Note: random numbers under tensor parallelism]).

Tier 2 on 2 gloo ranks, unmodified Hugging Face models with dropout on: GPT-2 (attention, residual, MLP and
embedding dropout 0.2, eager and SDPA attention) and Llama (attention dropout 0.2), swapped at tp=2, against the
same model on one process with the same seed: loss, logits and every gradient. Tier 1: the region layout rules.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import warnings

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")

import lightning_mp  # noqa: E402
from lightning_mp.tp import TPGroup  # noqa: E402
from lightning_mp.nn._hf import translate_hf  # noqa: E402
from lightning_mp.tp._random import ShardedRandomRegion, _pop, _push  # noqa: E402
from lightning_mp.tp._swap import swap_modules  # noqa: E402
from tests._dist import run_distributed  # noqa: E402
from tests._tp_helpers import grad_pairs  # noqa: E402

VOCAB = 32
P = 0.2


def dropout_gpt2(attn: str):
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=4, n_positions=16, resid_pdrop=P, embd_pdrop=P, attn_pdrop=P,
    )
    config._attn_implementation = attn
    return transformers.GPT2LMHeadModel(config)


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


def _region(local: int, replicated: int, fused: int = 0, rank: int = 1, heads: int = 2) -> ShardedRandomRegion:
    return ShardedRandomRegion(
        "h.0.mlp", TPGroup(None, rank, 2), frozenset({local}), frozenset({replicated}), frozenset({fused} - {0}),
        frozenset({heads} - {0}),
    )


def _push_after_column(region: ShardedRandomRegion) -> None:
    """Enter ``region`` as its call does once a column-parallel child has run (its outputs may be sharded)."""
    _push(region).column_ran = True


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("attn", ["dropout", "sdpa"])
def test_masks_are_bitwise_the_slice_of_one_process_masks(rank, attn):
    """Tier 1 (a fake tp rank, no group): dropout on ``(B, nh / tp, T, T)`` attention weights inside a region is
    bitwise rank ``r``'s heads of one process's dropout on ``(B, nh, T, T)``, and the stream continues as its does."""

    def draw(x: torch.Tensor) -> torch.Tensor:
        if attn == "dropout":
            return torch.nn.functional.dropout(x, P, training=True)
        return torch.nn.functional.scaled_dot_product_attention(x, x, x, dropout_p=P)  # math path with dropout

    full = torch.randn(2, 4, 8, 8)
    torch.manual_seed(5)
    expected, expected_next = draw(full), torch.rand(3)
    local = full[:, 2 * rank : 2 * rank + 2].clone()
    torch.manual_seed(5)
    _push_after_column(_region(local=32, replicated=16, rank=rank))
    try:
        got = draw(local)
    finally:
        _pop()
    regional = expected[:, 2 * rank : 2 * rank + 2]
    assert torch.equal(got, regional)
    assert torch.equal(torch.rand(3), expected_next)


def test_per_rank_streams_differ_between_ranks_and_leave_the_shared_stream_alike():
    """``streams="per_rank"`` (Megatron's tracker behaviour): each rank's mask comes from its own stream, drawn
    for the local shard only; after the draw, the shared stream is in the same place on every rank."""
    masks, after = [], []
    for rank in (0, 1):
        region = dataclasses.replace(_region(local=32, replicated=16, rank=rank), per_rank=True)
        torch.manual_seed(5)
        _push_after_column(region)
        try:
            masks.append(torch.nn.functional.dropout(torch.ones(2, 2, 8, 8), 0.5, training=True))
        finally:
            _pop()
        after.append(torch.rand(3))
    assert not torch.equal(masks[0], masks[1])
    assert torch.equal(after[0], after[1])


def test_a_draw_that_depends_on_sharded_values_raises():
    _push_after_column(_region(local=32, replicated=16))
    try:
        with pytest.raises(ValueError, match=r"aten.bernoulli.default in tensor-parallel region 'h.0.mlp' drew"):
            torch.bernoulli(torch.full((2, 2, 4, 4), 0.5))
        assert torch.equal(torch.bernoulli(torch.full((2, 8, 16), 0.0)), torch.zeros(2, 8, 16))  # replicated
    finally:
        _pop()


def test_region_layout_rules():
    region = _region(local=32, replicated=16, fused=24)
    assert region.sharded_dim(torch.Size([2, 2, 8, 8]), "op") == 1  # attention weights: heads
    assert region.sharded_dim(torch.Size([2, 3, 8, 8]), "op") is None  # dim 1 is no local head count
    assert _region(32, 16, heads=0).sharded_dim(torch.Size([2, 2, 8, 8]), "op") is None  # head count unknown
    assert region.sharded_dim(torch.Size([2, 8, 32]), "op") == 2  # a column-parallel output
    assert region.sharded_dim(torch.Size([2, 8, 16]), "op") is None  # replicated
    with pytest.raises(ValueError, match="fused column-parallel output"):
        region.sharded_dim(torch.Size([2, 8, 24]), "op")


@pytest.mark.parametrize(("local", "fused"), [(16, 0), (0, 16)], ids=["gpt2-c_fc-tp4", "gpt2-c_attn-tp3"])
def test_a_width_both_sharded_and_replicated_draws_from_the_shared_stream(local, fused):
    """GPT-2 with its default dropout at tp=4 (``c_fc``'s local width 4C/4 == C) and tp=3 (fused ``c_attn``'s
    3C/3 == C): the residual dropout after the row-parallel ``c_proj`` on ``(B, T, C)`` is replicated, so every
    rank draws the same mask, silently; the same width before any row-parallel child ran warns once (it may be
    sharded) and is drawn alike too. An op before the first column-parallel child is replicated."""
    region = dataclasses.replace(_region(local=local, replicated=16, fused=fused), name=f"h.0.{local}.{fused}")
    x = torch.ones(2, 8, 16)
    masks = []
    for rank in (0, 1):
        torch.manual_seed(5)
        call = _push(dataclasses.replace(region, tp=TPGroup(None, rank, 2)))
        try:
            before_column = torch.nn.functional.dropout(x, P)
            call.column_ran = True
            with pytest.warns(UserWarning, match="both a sharded width") if rank == 0 else _no_warning():
                ambiguous = torch.nn.functional.dropout(x, P)
            call.row_ran_since = True
            with _no_warning():
                after_row = torch.nn.functional.dropout(x, P)
        finally:
            _pop()
        masks.append(torch.stack([before_column, ambiguous, after_row]))
    torch.manual_seed(5)
    expected = torch.stack([torch.nn.functional.dropout(x, P) for _ in range(3)])
    assert torch.equal(masks[0], expected)
    assert torch.equal(masks[1], expected)


@contextlib.contextmanager
def _no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


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
    from tests.test_same_maths import SPECS, Spec, _gpt2, _gpt2_step, _lm_batch, assert_state_equal, fit, smp

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


def test_tp_random_streams_is_checked():
    with pytest.raises(ValueError, match="`tp_random_streams` must be 'one_process' or 'per_rank', got 'megatron'"):
        lightning_mp.SMPStrategy(tensor_parallel_degree=2, tp_random_streams="megatron")


class _ModeProbe(torch.nn.Module):
    """A region (a column-parallel child, never called here) that records the dispatch mode its call runs under."""

    def __init__(self, p: float, attention_dropout: float):
        from lightning_mp.nn import DistributedLinear  # noqa: PLC0415

        super().__init__()
        self.fc = DistributedLinear(8, 16, tp=TPGroup(None, 0, 2), parallel="column")
        self.drop, self.attention_dropout = torch.nn.Dropout(p), attention_dropout

    def forward(self, x: torch.Tensor):
        from torch.utils._python_dispatch import _get_current_dispatch_mode  # noqa: PLC0415

        return _get_current_dispatch_mode()


@pytest.mark.parametrize(
    ("p", "attention_dropout", "training", "on"),
    [(0.1, 0.0, True, True), (0.0, 0.1, True, True), (0.0, 0.0, True, False), (0.1, 0.1, False, False)],
)
def test_the_draw_mode_is_on_only_while_the_region_can_draw(p, attention_dropout, training, on):
    """The dispatch mode costs time on every op (a slower forward and backward): it is entered only in training
    with a dropout rate above 0 (an ``nn.Dropout``'s ``p`` or a float "drop" attribute)."""
    from lightning_mp.tp._random import install_sharded_random, remove_sharded_random  # noqa: PLC0415

    probe = _ModeProbe(p, attention_dropout).train(training)
    assert install_sharded_random(probe, probe.fc.tp) == [""]
    try:
        assert (probe(torch.ones(1)) is not None) is on
    finally:
        remove_sharded_random(probe)
