"""Splitting a batch into microbatches and merging per-microbatch results.

Matches SMP's ``@smp.step`` input splitting (tensors split along dim 0, everything else replicated) and
``torch.distributed.pipelining.microbatch.split_args_kwargs_into_chunks``, but recurses through any
list/tuple/NamedTuple/dict/dataclass so LightningModule batches of any shape work unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["MicrobatchSplitError", "merge_microbatches", "split_microbatches"]


class MicrobatchSplitError(ValueError):
    """A batch cannot be split into equal microbatches."""


def split_microbatches(batch: Any, num_microbatches: int) -> list[Any]:
    """Split ``batch`` into ``num_microbatches`` equal parts along dim 0 of every tensor.

    Tensors of shape ``(B, ...)`` become ``num_microbatches`` tensors of shape ``(B / num_microbatches, ...)``
    (views, no copy). Lists, tuples, NamedTuples, dicts and dataclasses are split recursively; other values
    (ints, strings, None, 0-dim tensors) are given to every microbatch unchanged.

    Raises:
        MicrobatchSplitError: if a tensor's dim 0 is not divisible by ``num_microbatches``.
        ValueError: if ``num_microbatches < 1``.
    """
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}.")
    return [_take(batch, index, num_microbatches, path="batch") for index in range(num_microbatches)]


def _take(value: Any, index: int, parts: int, path: str) -> Any:
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            return value
        size = value.shape[0]
        if size % parts != 0:
            raise MicrobatchSplitError(
                f"Cannot split {path} with shape {tuple(value.shape)} into {parts} microbatches: dim 0 ({size}) is"
                f" not divisible by {parts}. Use a batch size that is a multiple of `microbatches={parts}` and"
                " `drop_last=True` in the DataLoader so the last batch is not smaller."
            )
        step = size // parts
        return value[index * step : (index + 1) * step]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {
            f.name: _take(getattr(value, f.name), index, parts, f"{path}.{f.name}")
            for f in dataclasses.fields(value)
            if f.init
        }
        return dataclasses.replace(value, **changes)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # NamedTuple
        return type(value)(*(_take(v, index, parts, f"{path}.{k}") for k, v in zip(value._fields, value)))
    if isinstance(value, (list, tuple)):
        return type(value)(_take(v, index, parts, f"{path}[{i}]") for i, v in enumerate(value))
    if isinstance(value, Mapping):
        return type(value)({k: _take(v, index, parts, f"{path}[{k!r}]") for k, v in value.items()})
    return value


def merge_microbatches(outputs: list[Any]) -> Any:
    """Merge per-microbatch outputs into one batch-shaped result (inverse of :func:`split_microbatches`).

    Tensors with dims are concatenated along dim 0; floating 0-dim tensors and floats are averaged (the mean
    over microbatches of a mean-reduced value equals the full-batch mean, as microbatches are equal-sized);
    integer 0-dim tensors and ints are summed (counts), unless all are equal (a constant); containers are merged
    element-wise; other values are taken from the first microbatch if all are equal, else returned as a list.

    Raises:
        ValueError: if ``outputs`` is empty, some outputs are None and others not, or the microbatches returned
            structures of different kinds.
    """
    if not outputs:
        raise ValueError("No microbatch outputs to merge.")
    first = outputs[0]
    if any(o is None for o in outputs):
        if all(o is None for o in outputs):
            return None
        raise ValueError(
            "Some microbatches returned None and others a value; a pipelined step must return the same kind of"
            " value for every microbatch (return None for all of them to skip the step)."
        )
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            stacked = torch.stack([o.detach() for o in outputs])
            return stacked.mean(dim=0) if stacked.is_floating_point() else stacked.sum(dim=0)
        return torch.cat(outputs, dim=0)
    if isinstance(first, (bool, str)):
        return first if all(o == first for o in outputs) else list(outputs)
    if isinstance(first, int):
        return first if all(o == first for o in outputs) else sum(outputs)
    if isinstance(first, float):
        return sum(outputs) / len(outputs)
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        return dataclasses.replace(
            first,
            **{f.name: merge_microbatches([getattr(o, f.name) for o in outputs]) for f in dataclasses.fields(first)},
        )
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(merge_microbatches(list(parts)) for parts in zip(*outputs)))
    if isinstance(first, (list, tuple)):
        if any(len(o) != len(first) for o in outputs):
            raise ValueError("Microbatches returned sequences of different lengths; cannot merge them.")
        return type(first)(merge_microbatches(list(parts)) for parts in zip(*outputs))
    if isinstance(first, Mapping):
        if any(set(o) != set(first) for o in outputs):
            raise ValueError("Microbatches returned dicts with different keys; cannot merge them.")
        return type(first)({k: merge_microbatches([o[k] for o in outputs]) for k in first})
    return list(outputs)
