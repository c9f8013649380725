"""``split_microbatches`` with ``non_split_inputs``, custom splits, and their errors (issue 4)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import pytest
import torch

from lightning_mp import SMPConfig, SMPStrategy
from lightning_mp.pipeline import MicrobatchSplitError, merge_microbatches, split_microbatches


class Ragged:
    """A custom batch value (flat values + per-row offsets) that knows how to split and merge itself."""

    def __init__(self, values: torch.Tensor, offsets: list[int], parts: int | None = None) -> None:
        self.values, self.offsets, self.parts = values, offsets, parts

    @property
    def rows(self) -> int:
        return len(self.offsets) - 1

    def split_microbatches(self, num_microbatches: int) -> list[Ragged]:
        if self.parts is not None:  # a broken split, for the error tests
            return [self] * self.parts
        step = self.rows // num_microbatches
        out = []
        for i in range(num_microbatches):
            lo, hi = self.offsets[i * step], self.offsets[(i + 1) * step]
            out.append(Ragged(self.values[lo:hi], [o - lo for o in self.offsets[i * step : (i + 1) * step + 1]]))
        return out

    @staticmethod
    def merge_microbatches(parts: list[Ragged]) -> Ragged:
        offsets, base = [0], 0
        for part in parts:
            offsets += [base + o for o in part.offsets[1:]]
            base += part.offsets[-1]
        return Ragged(torch.cat([p.values for p in parts]), offsets)


class Exploding:
    def split_microbatches(self, num_microbatches: int):
        raise RuntimeError("cannot split this")


class Sample(NamedTuple):
    x: torch.Tensor
    table: torch.Tensor


@dataclasses.dataclass
class DataclassBatch:
    x: torch.Tensor
    table: torch.Tensor
    ragged: Ragged | None = None


def test_non_split_inputs_are_given_whole_to_every_microbatch():
    """Dict keys, dataclass and NamedTuple field names, tuple positions; the rest is split along dim 0."""
    x, table = torch.arange(8.0).reshape(8, 1), torch.randn(5, 3)  # 5 rows: not divisible by 4
    batches = [
        ({"x": x, "table": table, "n": 3}, ["table"], lambda b: (b["x"], b["table"])),
        (DataclassBatch(x, table), ("table",), lambda b: (b.x, b.table)),
        (Sample(x, table), {"table"}, lambda b: (b.x, b.table)),
        (Sample(x, table), [1], lambda b: (b.x, b.table)),  # a NamedTuple position
        ((x, table), [1], lambda b: (b[0], b[1])),
        ([x, table], [1], lambda b: (b[0], b[1])),
    ]
    for batch, whole, get in batches:
        parts = split_microbatches(batch, 4, non_split_inputs=whole)
        assert [type(p) for p in parts] == [type(batch)] * 4
        for index, part in enumerate(parts):
            px, ptable = get(part)
            assert ptable is table, "the same object, not a copy or a slice"
            assert torch.equal(px, x[2 * index : 2 * index + 2])
    assert split_microbatches({"x": x, "table": table, "n": 3}, 2, non_split_inputs=["table"])[1]["n"] == 3
    with pytest.raises(MicrobatchSplitError, match=r"batch\['table'\] with shape \(5, 3\).*non_split_inputs"):
        split_microbatches({"x": x, "table": table}, 4)


def test_non_split_inputs_that_the_batch_lacks_are_a_clear_error():
    with pytest.raises(MicrobatchSplitError, match=r"`non_split_inputs` names 'tabel'.*it has \['table', 'x'\]"):
        split_microbatches({"x": torch.ones(4), "table": torch.ones(3)}, 2, non_split_inputs=["tabel"])
    with pytest.raises(MicrobatchSplitError, match=r"names 2, but the batch \(tuple\)"):
        split_microbatches((torch.ones(4), torch.ones(3)), 2, non_split_inputs=[2])
    with pytest.raises(MicrobatchSplitError, match="needs a batch with named or numbered entries.*Tensor"):
        split_microbatches(torch.ones(4), 2, non_split_inputs=["x"])


def test_a_value_can_define_its_own_split_and_merge():
    ragged = Ragged(torch.arange(10.0), [0, 1, 3, 6, 10])  # 4 rows of lengths 1, 2, 3, 4
    parts = split_microbatches(DataclassBatch(torch.zeros(4, 2), torch.ones(3), ragged), 2, non_split_inputs=["table"])
    assert [p.ragged.offsets for p in parts] == [[0, 1, 3], [0, 3, 7]]
    assert torch.equal(parts[1].ragged.values, torch.arange(3.0, 10.0))
    merged = merge_microbatches([{"r": p.ragged, "x": p.x} for p in parts])
    assert isinstance(merged["r"], Ragged) and merged["r"].offsets == ragged.offsets
    assert torch.equal(merged["r"].values, ragged.values) and merged["x"].shape == (4, 2)


def test_an_unsplittable_custom_value_names_its_path_and_the_fix():
    with pytest.raises(MicrobatchSplitError, match=r"batch\['inputs'\]\[1\] into 2.*Ragged.split_microbatches\(2\)"
                       r" returned 3 parts; it must return a sequence of exactly 2"):
        split_microbatches({"inputs": [torch.ones(2), Ragged(torch.ones(1), [0, 1], parts=3)]}, 2)
    with pytest.raises(MicrobatchSplitError, match=r"batch.ragged into 2.*raised RuntimeError: cannot split this"
                       r".*non_split_inputs") as info:
        split_microbatches(DataclassBatch(torch.ones(2), torch.ones(2), Exploding()), 2)
    assert isinstance(info.value.__cause__, RuntimeError)
    # given whole, an unsplittable value is fine
    parts = split_microbatches(DataclassBatch(torch.ones(2), torch.ones(2), Exploding()), 2, non_split_inputs=["ragged"])
    assert parts[0].ragged is parts[1].ragged


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("table", r"must be a tuple of .* got 'table'. For one entry pass \('table',\)"),
        ((1.5,), r"entries must be str .* or int .* got \[1.5\]"),
        ((True,), r"entries must be str .* got \[True\]"),
        (("a", "a"), "names an entry twice"),
    ],
)
def test_non_split_inputs_config_is_validated(value, match):
    with pytest.raises(ValueError, match=match):
        SMPConfig(non_split_inputs=value)
    with pytest.raises(ValueError, match=match):
        SMPStrategy(non_split_inputs=list(value) if isinstance(value, tuple) else value)
    assert SMPStrategy(non_split_inputs=["table", 2]).config.non_split_inputs == ("table", 2)
