"""Checkpoint pieces in one process: a tp shard's chunks cover its full tensor once."""

from __future__ import annotations

from lightning_mp.strategy._shards import piece_chunks
from lightning_mp.tp import ShardSpec


def test_piece_chunks_cover_the_full_tensor_once():
    for spec in (ShardSpec(0, 24, parts=3), ShardSpec(0, 7, padded=True), ShardSpec(0, 5, padded=True)):
        for tp in (1, 2, 4):
            covered = sorted((start, n) for r in range(tp) for _, start, n in piece_chunks(spec, r, tp))
            position = 0
            for start, n in covered:
                assert start == position and n > 0
                position += n
            assert position == spec.full_size
