"""Delayed parameter initialisation under tensor parallelism: each rank allocates only its shards, bitwise the
eager build's.

The eager reference of a swapped module (``DistributedLinear``, ``DistributedEmbedding``,
``DistributedTransformerLayer``) is the one-process model before the swap: its full tensor, cut with the
parameter's ``ShardSpec`` for this tp rank, which is what the eager tp=2 path loads. One process, the swap's
sharding maths with ``TPGroup(None, rank, 2)``: the example GPT, tiny HF GPT-2 and a tied HF Llama with rotary
buffers at tp=2 and at pp2 x tp2 (the real partitioner on a meta trace); storage sizes show that no rank keeps a
full tensor of a sharded parameter and that the replay holds at most one full tensor at a time."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lightning_mp
from lightning_mp.init import delay_param_initialization, materialize_module
from lightning_mp.tp import TPGroup, shard, shard_spec
from lightning_mp.nn._hf import translate_hf
from lightning_mp.tp._swap import swap_modules
from tests.unit.test_delayed_init import BUILDS, _drop_other_stages, _stage_of, _tensors

pytestmark = pytest.mark.filterwarnings("ignore:.*copying from a non-meta parameter")


def _tp_gpt() -> nn.Module:
    from examples.gpt_tp import TPGPT

    return TPGPT(vocab_size=33, block_size=16, n_layer=4, n_head=4, n_embd=32, dropout=0.1)


def _marked(name: str) -> nn.Module:
    model = _tp_gpt() if name == "gpt" else BUILDS[name]()
    return lightning_mp.set_tensor_parallelism(model)


MODELS = ["gpt", "gpt2", "llama"]


def _expected_shards(full: dict[str, torch.Tensor], swapped: nn.Module, rank: int) -> dict[str, torch.Tensor]:
    """The eager one-process tensors, cut for ``rank`` where the swapped model's tensor is a shard."""
    out = {}
    for fqn, tensor in _tensors(swapped).items():
        spec = shard_spec(tensor)
        out[fqn] = full[fqn] if spec is None else shard(full[fqn], spec, rank, 2)
    return out


def _check(model: nn.Module, expected: dict[str, torch.Tensor], report, largest_full: int) -> None:
    got = _tensors(model)
    assert got and set(got) <= set(expected)
    for fqn, value in got.items():
        assert not value.is_meta, fqn
        assert value.dtype == expected[fqn].dtype and torch.equal(value, expected[fqn]), f"{fqn} differs from eager"
        # each tensor owns exactly its bytes: a shard is a copy, never a view into a kept full tensor
        assert value.untyped_storage().nbytes() == value.numel() * value.element_size(), fqn
    # the replay held the rank's own unsharded tensors plus at most one full tensor (made, sliced, freed)
    assert report.peak_bytes <= report.kept_bytes + largest_full, (report, largest_full)
    assert report.loaded_bytes > 0, "swapped modules loaded their shards from the replay"


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("name", MODELS)
def test_tp2_shards_are_bitwise_the_eager_swap(name, rank):
    tp = TPGroup(None, rank, 2)
    torch.manual_seed(11)
    eager = _marked(name)
    full = {k: v.detach().clone() for k, v in _tensors(eager).items()}
    eager_report = swap_modules(eager, tp, translations=[translate_hf])
    rng_after_eager_swap = torch.get_rng_state()
    eager_local = _tensors(eager)

    torch.manual_seed(11)
    with delay_param_initialization():
        model = _marked(name)
    report = swap_modules(model, tp, translations=[translate_hf])
    assert report.swapped == eager_report.swapped and not report.skipped
    largest = max(t.numel() * t.element_size() for t in full.values())
    sharded_shapes = {k: v.shape for k, v in eager_local.items()}
    mat = materialize_module(model)
    assert torch.equal(torch.get_rng_state(), rng_after_eager_swap), "code after setup sees eager's random state"
    expected = _expected_shards(full, model, rank)
    _check(model, expected, mat, largest)
    assert set(_tensors(model)) == set(full)
    for fqn, value in _tensors(model).items():
        assert value.shape == sharded_shapes[fqn] and torch.equal(value, eager_local[fqn]), fqn
    assert sum(shard_spec(t) is not None for t in _tensors(model).values()) >= 8, "most weights are shards"
    if name in ("gpt", "llama"):
        inputs = model.get_input_embeddings() if name == "llama" else model.wte
        head = model.lm_head
        assert head.weight is inputs.weight, "the tied embedding is one (sharded) parameter again"


@pytest.mark.parametrize("name", MODELS)
def test_pp2_tp2_each_rank_holds_its_stage_shards_bitwise(name):
    """What the strategy does per rank: swap the owned stage's modules, drop other stages, materialise."""
    torch.manual_seed(11)
    eager = _marked(name)
    full = {k: v.detach().clone() for k, v in _tensors(eager).items()}
    largest = max(t.numel() * t.element_size() for t in full.values())
    covered: set[str] = set()
    for stage in range(2):
        for rank in range(2):
            torch.manual_seed(11)
            with delay_param_initialization():
                model = _marked(name)
            stage_of = _stage_of(name, model, 2)
            swap_modules(model, TPGroup(None, rank, 2), translations=[translate_hf], owns=lambda f: stage_of[f] == stage)
            new_stage_of = {}
            for fqn, _ in model.named_modules(remove_duplicate=False):
                ancestor = fqn
                while ancestor not in stage_of and ancestor:
                    ancestor = ancestor.rpartition(".")[0]
                new_stage_of[fqn] = stage_of.get(ancestor, stage)
            _drop_other_stages(model, new_stage_of, stage)
            report = materialize_module(model)
            _check(model, _expected_shards(full, model, rank), report, largest)
            assert len(_tensors(model)) < len(full), "no rank allocates another stage's tensors"
            covered |= set(_tensors(model))
    assert covered == set(full), "the four ranks hold every tensor"
