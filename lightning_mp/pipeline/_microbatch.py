"""Splitting a batch into microbatches and merging per-microbatch results.

Matches SMP's ``@smp.step`` input splitting (tensors split along dim 0, everything else replicated, and
``non_split_inputs`` given whole to every microbatch) and
``torch.distributed.pipelining.microbatch.split_args_kwargs_into_chunks``, but recurses through any
list/tuple/NamedTuple/dict/dataclass so LightningModule batches of any shape work unchanged.

[Note: custom microbatch split] A value of any other class decides its own split by defining a method
``split_microbatches(self, num_microbatches: int) -> Sequence`` that returns exactly ``num_microbatches`` parts
(part ``i`` goes to microbatch ``i``), e.g. a ragged batch that splits its offsets, or a graph batch that splits
by graph. It is called once per batch, before any recursion into the value. It may also define a classmethod or
staticmethod ``merge_microbatches(parts: list) -> value`` that :func:`merge_microbatches` uses to merge step
outputs of that class (without it, such outputs are merged as other unknown objects: one value if all are
equal, else the list of parts). A split that raises or returns another number of parts is a
:class:`MicrobatchSplitError` naming where in the batch the value sits. Values without the method (and that are
not tensors or containers) are given to every microbatch unchanged.

[Note: sequences of samples] A batch of strings (texts tokenised inside ``training_step``), file names or ids is
what ``default_collate`` makes of such samples: a list of ``B`` plain values. A list, tuple (not a NamedTuple) or
other ``Sequence`` whose elements are plain values (no tensor, no container) and whose length is the batch size
``B`` is therefore split into contiguous runs like a tensor's dim 0. ``B`` is dim 0 of the first tensor with dims
in the batch (in the order the batch is walked), or, with no such tensor, the length of the first sequence of
plain values. Sequences of another length (a list of label names) are given whole to every microbatch, as are
sequences of containers (nested token lists: give them a ``split_microbatches`` method, or make them tensors).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch

__all__ = ["MicrobatchSplit", "MicrobatchSplitError", "merge_microbatches", "split_batch", "split_microbatches"]


class MicrobatchSplitError(ValueError):
    """A batch cannot be split into equal microbatches."""


@dataclasses.dataclass(frozen=True)
class MicrobatchSplit:
    """A batch split into microbatches (see :func:`split_batch`).

    Attributes:
        parts: the microbatches, ``num_microbatches`` of them.
        replicated: where in the batch the values given whole to every microbatch sit (``"batch['text']"``).
        split_any: whether any value was split (``False``: every microbatch is the whole batch).
    """

    parts: list[Any]
    replicated: tuple[str, ...]
    split_any: bool


def split_microbatches(
    batch: Any, num_microbatches: int, *, non_split_inputs: Collection[str | int] = ()
) -> list[Any]:
    """Split ``batch`` into ``num_microbatches`` equal parts along its batch dim: :func:`split_batch`'s parts."""
    return split_batch(batch, num_microbatches, non_split_inputs=non_split_inputs).parts


def split_batch(batch: Any, num_microbatches: int, *, non_split_inputs: Collection[str | int] = ()) -> MicrobatchSplit:
    """Split ``batch`` into ``num_microbatches`` equal parts along dim 0 of every tensor.

    Tensors of shape ``(B, ...)`` become ``num_microbatches`` tensors of shape ``(B / num_microbatches, ...)``
    (views, no copy); sequences of ``B`` plain values (strings, numbers) become contiguous runs of
    ``B / num_microbatches`` (see [Note: sequences of samples]). Lists, tuples, NamedTuples, dicts and dataclasses
    are split recursively; a value with its own ``split_microbatches(num_microbatches)`` method is split by it (see
    [Note: custom microbatch split]); other values (ints, strings, None, 0-dim tensors) are given to every
    microbatch unchanged.

    Args:
        batch: what the DataLoader yielded.
        num_microbatches: number of parts.
        non_split_inputs: top-level entries of ``batch`` given whole (the same object) to every microbatch, as
            SMP's ``@smp.step(non_split_inputs=...)``: keys of a dict batch, attribute names of a dataclass or
            NamedTuple batch, integer positions of a tuple or list batch (NamedTuple: names or positions).

    Returns:
        The parts, and where the values given whole to every microbatch sit.

    Raises:
        MicrobatchSplitError: if a tensor's dim 0 (or a sequence of ``B`` plain values) is not divisible by
            ``num_microbatches``, a custom split raises or returns another number of parts, or ``non_split_inputs``
            names an entry the batch does not have.
        ValueError: if ``num_microbatches < 1``.
    """
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}.")
    if isinstance(non_split_inputs, str):
        non_split_inputs = (non_split_inputs,)
    if non_split_inputs:
        splitter = _Splitter(num_microbatches)
        parts = _split_top_level(batch, splitter, set(non_split_inputs))
    else:
        splitter = _Splitter(num_microbatches, _batch_size(batch))
        parts = splitter.split(batch, "batch")
    return MicrobatchSplit(parts, tuple(splitter.replicated), splitter.split_any)


def _split_top_level(batch: Any, splitter: _Splitter, whole: set[str | int]) -> list[Any]:
    """Split every top-level entry of ``batch`` except those in ``whole``, which every microbatch gets as is."""
    entries = _top_level_entries(batch)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a NamedTuple entry by position or by name
        whole = {batch._fields[k] if isinstance(k, int) and 0 <= k < len(batch) else k for k in whole}
    missing = sorted(map(repr, whole - set(entries)))
    if missing:
        raise MicrobatchSplitError(
            f"`non_split_inputs` names {', '.join(missing)}, but the batch ({type(batch).__name__}) has no such"
            f" top-level entries; it has [{', '.join(sorted(map(repr, entries)))}]. Name dict keys, dataclass/NamedTuple fields"
            " or tuple/list positions of the batch the DataLoader yields."
        )
    splitter.batch_size = _batch_size([value for key, (_, value) in entries.items() if key not in whole])
    parts = splitter.parts
    split = {}
    for key, (path, value) in entries.items():
        split[key] = [value] * parts if key in whole else splitter.split(value, path)
        if key in whole:
            splitter.replicated.append(path)
    return [_rebuild(batch, {key: values[index] for key, values in split.items()}) for index in range(parts)]


def _top_level_entries(batch: Any) -> dict[str | int, tuple[str, Any]]:
    """``{name: (path, value)}`` of what ``non_split_inputs`` can name."""
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return {f.name: (f"batch.{f.name}", getattr(batch, f.name)) for f in dataclasses.fields(batch) if f.init}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return {k: (f"batch.{k}", v) for k, v in zip(batch._fields, batch)}
    if isinstance(batch, (list, tuple)):
        return {i: (f"batch[{i}]", v) for i, v in enumerate(batch)}
    if isinstance(batch, Mapping):
        return {k: (f"batch[{k!r}]", v) for k, v in batch.items()}
    raise MicrobatchSplitError(
        f"`non_split_inputs` needs a batch with named or numbered entries (dict, dataclass, NamedTuple, tuple or"
        f" list), but the batch is a {type(batch).__name__}. Return such a container from the DataLoader, or drop"
        " `non_split_inputs`."
    )


def _rebuild(batch: Any, values: dict[str | int, Any]) -> Any:
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return dataclasses.replace(batch, **values)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(values[name] for name in batch._fields))
    if isinstance(batch, (list, tuple)):
        return type(batch)(values[i] for i in range(len(batch)))
    return type(batch)({k: values[k] for k in batch})


def _is_container(value: Any) -> bool:
    return (
        isinstance(value, (torch.Tensor, Mapping))
        or (isinstance(value, Sequence) and not isinstance(value, (str, bytes)))
        or (dataclasses.is_dataclass(value) and not isinstance(value, type))
        or callable(getattr(type(value), "split_microbatches", None))
    )


def _is_sample_sequence(value: Any) -> bool:
    """A sequence of plain values, as ``default_collate`` makes of strings (see [Note: sequences of samples])."""
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)) or hasattr(value, "_fields"):
        return False
    if callable(getattr(type(value), "split_microbatches", None)):
        return False
    return len(value) > 0 and not any(_is_container(v) for v in value)


def _batch_size(batch: Any) -> int | None:
    """``B``: dim 0 of the first tensor with dims, else the length of the first sequence of plain values."""
    sequences: list[int] = []

    def first_tensor(value: Any) -> int | None:
        if isinstance(value, torch.Tensor):
            return value.shape[0] if value.dim() > 0 else None
        if _is_sample_sequence(value):
            sequences.append(len(value))
            return None
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            children: Any = [getattr(value, f.name) for f in dataclasses.fields(value) if f.init]
        elif isinstance(value, Mapping):
            children = value.values()
        elif isinstance(value, (list, tuple)):
            children = value
        else:
            return None
        return next((size for size in map(first_tensor, children) if size is not None), None)

    size = first_tensor(batch)
    return size if size is not None else next(iter(sequences), None)


@dataclasses.dataclass
class _Splitter:
    """One batch's split: ``parts`` microbatches along batch size ``batch_size``; records what it replicated."""

    parts: int
    batch_size: int | None = None
    replicated: list[str] = dataclasses.field(default_factory=list)
    split_any: bool = False

    def split(self, value: Any, path: str) -> list[Any]:
        """``parts`` microbatches of ``value`` (``path`` says where it sits in the batch, for messages)."""
        if isinstance(value, torch.Tensor):
            return self._split_tensor(value, path)
        if callable(getattr(type(value), "split_microbatches", None)):
            self.split_any = True
            return _split_custom(value, self.parts, path)
        if _is_sample_sequence(value) and len(value) == self.batch_size:
            return self._split_samples(value, path)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            fields = [f.name for f in dataclasses.fields(value) if f.init]
            split = {name: self.split(getattr(value, name), f"{path}.{name}") for name in fields}
            return [dataclasses.replace(value, **{name: split[name][i] for name in fields}) for i in range(self.parts)]
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # NamedTuple
            split = [self.split(v, f"{path}.{k}") for k, v in zip(value._fields, value)]
            return [type(value)(*(s[i] for s in split)) for i in range(self.parts)]
        if isinstance(value, (list, tuple)):
            split = [self.split(v, f"{path}[{j}]") for j, v in enumerate(value)]
            return [type(value)(s[i] for s in split) for i in range(self.parts)]
        if isinstance(value, Mapping):
            split = {k: self.split(v, f"{path}[{k!r}]") for k, v in value.items()}
            return [type(value)({k: s[i] for k, s in split.items()}) for i in range(self.parts)]
        self.replicated.append(path)
        return [value] * self.parts

    def _split_tensor(self, value: torch.Tensor, path: str) -> list[torch.Tensor]:
        if value.dim() == 0:
            self.replicated.append(path)
            return [value] * self.parts
        size = value.shape[0]
        if size % self.parts != 0:
            raise MicrobatchSplitError(
                f"Cannot split {path} with shape {tuple(value.shape)} into {self.parts} microbatches: dim 0 ({size}) is"
                f" not divisible by {self.parts}. Use a batch size that is a multiple of `microbatches={self.parts}` and"
                " `drop_last=True` in the DataLoader so the last batch is not smaller; or, if every microbatch needs"
                " this input whole (e.g. a lookup table), list its top-level entry in `non_split_inputs`."
            )
        self.split_any = True
        return list(value.split(size // self.parts))

    def _split_samples(self, value: Sequence, path: str) -> list[Any]:
        """Contiguous runs of a sequence of ``batch_size`` plain values (see [Note: sequences of samples])."""
        size = len(value)
        if size % self.parts != 0:
            raise MicrobatchSplitError(
                f"Cannot split {path} (a {type(value).__name__} of {size} samples, the batch size) into {self.parts}"
                f" microbatches: {size} is not divisible by {self.parts}. Use a batch size that is a multiple of"
                f" `microbatches={self.parts}` and `drop_last=True` in the DataLoader; or, if every microbatch needs"
                " it whole, list its top-level entry in `non_split_inputs`."
            )
        self.split_any = True
        step = size // self.parts
        return [value[i * step : (i + 1) * step] for i in range(self.parts)]


def _split_custom(value: Any, parts: int, path: str) -> list[Any]:
    """Split through the value's own ``split_microbatches`` (see [Note: custom microbatch split])."""
    name = f"{type(value).__name__}.split_microbatches"
    try:
        result = value.split_microbatches(parts)
    except Exception as err:
        raise MicrobatchSplitError(
            f"Cannot split {path} into {parts} microbatches: {name}({parts}) raised {type(err).__name__}: {err}."
            f" Fix {name}, or list the batch entry in `non_split_inputs` to give it whole to every microbatch."
        ) from err
    count = len(result) if isinstance(result, Sequence) and not isinstance(result, (str, bytes)) else None
    if count != parts:
        got = f"{count} parts" if count is not None else f"a {type(result).__name__}"
        raise MicrobatchSplitError(
            f"Cannot split {path} into {parts} microbatches: {name}({parts}) returned {got}; it must return a"
            f" sequence of exactly {parts} parts (part i goes to microbatch i)."
        )
    return list(result)


def merge_microbatches(outputs: list[Any]) -> Any:
    """Merge per-microbatch outputs into one batch-shaped result (inverse of :func:`split_microbatches`).

    Tensors with dims are concatenated along dim 0; floating 0-dim tensors and floats are averaged (the mean
    over microbatches of a mean-reduced value equals the full-batch mean, as microbatches are equal-sized);
    integer 0-dim tensors and ints are summed (counts), unless all are equal (a constant); containers are merged
    element-wise; a value whose class defines ``merge_microbatches(parts)`` is merged by it (see [Note: custom
    microbatch split]); other values are taken from the first microbatch if all are equal, else returned as a list.

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
    merge = getattr(type(first), "merge_microbatches", None)
    if callable(merge):  # see [Note: custom microbatch split]
        return merge(list(outputs))
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
