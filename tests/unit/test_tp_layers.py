"""Distributed layers' sharding maths in one process (arange weights): shards are exact slices, round trips, errors."""

from __future__ import annotations

import pytest
import torch

from lightning_mp.nn import DistributedAttention, DistributedLinear, DistributedMLP, DistributedTransformerLMHead
from lightning_mp.tp import ShardSpec, TPDivisibilityError, TPGroup, shard, unshard


def _arange(*shape: int) -> torch.Tensor:
    return torch.arange(float(torch.Size(shape).numel())).reshape(shape)


@pytest.mark.parametrize("rank", [0, 1])
def test_column_row_shards_are_exact_slices(rank):
    tp = TPGroup(None, rank, 2)
    column = DistributedLinear(3, 4, tp=tp, parallel="column")
    column.load_state_dict({"weight": _arange(4, 3), "bias": _arange(4)})
    assert torch.equal(column.weight.data, _arange(4, 3)[2 * rank : 2 * rank + 2])
    assert torch.equal(column.bias.data, _arange(4)[2 * rank : 2 * rank + 2])
    row = DistributedLinear(4, 3, tp=tp, parallel="row")
    row.load_state_dict({"weight": _arange(3, 4), "bias": _arange(3)})
    assert torch.equal(row.weight.data, _arange(3, 4)[:, 2 * rank : 2 * rank + 2])
    assert torch.equal(row.bias.data, _arange(3))  # replicated


@pytest.mark.parametrize("rank", [0, 1])
def test_fused_qkv_shard_takes_each_block(rank):
    tp = TPGroup(None, rank, 2)
    attn = DistributedAttention(4, 2, tp=tp)  # c_attn: (12, 4) = [q; k; v], 4 rows each
    full = _arange(12, 4)
    attn.c_attn.load_state_dict({"weight": full, "bias": _arange(12)})
    rows = [b * 4 + rank * 2 + i for b in range(3) for i in range(2)]
    assert torch.equal(attn.c_attn.weight.data, full[rows])


@pytest.mark.parametrize("vocab", [10, 11, 3])
def test_padded_vocab_shard_round_trip(vocab):
    spec = ShardSpec(0, vocab, padded=True)
    full = _arange(vocab, 2)
    pieces = [shard(full, spec, r, 4) for r in range(4)]
    assert all(p.shape == (spec.local_size(4), 2) for p in pieces)
    assert torch.equal(unshard(pieces, spec), full)


def test_fused_round_trip():
    spec = ShardSpec(0, 12, parts=3)
    full = _arange(12, 2)
    assert torch.equal(unshard([shard(full, spec, r, 2) for r in range(2)], spec), full)


def test_divisibility_errors_name_values_and_fix():
    tp = TPGroup(None, 0, 2)
    with pytest.raises(TPDivisibilityError, match=r"n_head=3 is not divisible by tensor_parallel_degree=2.*multiple of 2"):
        DistributedAttention(6, 3, tp=tp)
    with pytest.raises(TPDivisibilityError, match=r"in_features=5 is not divisible by tensor_parallel_degree=2"):
        DistributedLinear(5, 4, tp=tp, parallel="row")
    with pytest.raises(TPDivisibilityError, match=r"hidden=5 is not divisible"):
        DistributedMLP(4, tp=tp, hidden=5)


def test_lm_head_ties_embedding_shard():
    head = DistributedTransformerLMHead(11, 8, 1, 2, 4, tp=TPGroup(None, 1, 2))
    assert head.lm_head.weight is head.wte.weight
    assert head.wte.weight.shape == (6, 4)
