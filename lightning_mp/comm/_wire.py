"""The wire format of one message: a pickled skeleton with tensor placeholders, and one data frame.

:func:`pack` turns any picklable object into a :class:`Packed` (the pickle, plus the tensors' storage spans and the
byte count of the data frame); :func:`gather` copies those spans into one aligned buffer; :func:`_unpack` rebuilds
the object from the pickle and the received bytes as a :class:`Message`; :func:`bundle` makes one message of several
packed ones, which arrives as a :class:`Bundle` ([Note: bundles on the wire]). How the frames travel is
:class:`~lightning_mp.comm._transport.Transport`'s business ([Note: one frame per message] there).
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from lightning_mp.comm._kinds import Span, TensorTable, UnsupportedTensorError, padded, rebuild_tensors

__all__ = ["Bundle", "Message", "Packed", "bundle", "gather", "pack"]

_BUNDLE = "bundle"  # the first item of a bundle's pickle frame (a plain message's is a 5-tuple)


class _Pickler(pickle.Pickler):
    """Pickles a message's skeleton: each tensor becomes a call of ``_tensor_at`` with its placeholder index.

    [Note: tensor placeholders] The placeholders come from ``reducer_override``, not ``persistent_id``: pickle asks
    ``persistent_id`` (a Python call) of every object it saves, ints, strings and tuples included, about 60 per
    request of the pipeline engine, but ``reducer_override`` only of objects that are not exactly ``None``, a bool,
    an int, a float, bytes, a string, a tuple, a list, a dict or a set, and that it has not saved already in this
    pickle (its memo): the envelope, the enum of its kind, classes and functions, the tensors. The skeleton calls
    ``_tensor_at(i)``, which reads the receiving thread's tensors while ``_load`` runs.
    """

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.table = TensorTable()
        self.tensors: list[torch.Tensor] = []  # the message's own tensors, in placeholder order
        self.indices: list[int] = []  # each one's index in the table
        self._index: dict[int, int] = {}

    def reducer_override(self, obj: Any) -> Any:
        if not issubclass(type(obj), torch.Tensor):  # type(), not isinstance: a proxy's __class__ may fetch
            return NotImplemented
        key = id(obj)
        if key not in self._index:
            self.indices.append(self.table.add(obj))
            self._index[key] = len(self.tensors)
            self.tensors.append(obj)
        return (_tensor_at, (self._index[key],))


_loading = threading.local()  # the tensors of the skeleton being loaded on this thread (``_load``)


def _tensor_at(index: int) -> torch.Tensor:
    """In a skeleton: the message's tensor ``index`` ([Note: tensor placeholders])."""
    return _loading.tensors[index]


def _load(skeleton: bytes, tensors: list[torch.Tensor]) -> Any:
    """The object of ``skeleton`` around ``tensors`` (in placeholder order)."""
    previous = getattr(_loading, "tensors", None)  # a load inside a load (an object's ``__setstate__``)
    _loading.tensors = tensors
    try:
        return pickle.loads(skeleton)
    finally:
        _loading.tensors = previous


@dataclass(frozen=True)
class Packed:
    """A message ready for the wire.

    Attributes:
        payload: the pickle frame.
        tensors: every distinct tensor of the message, in placeholder order (the originals, not copies).
        sources: the bytes of the data frame, one uint8 tensor per span ([Note: tensor kinds on the wire]).
        spans: where each source goes in the data frame.
        data_nbytes: size of the data frame in bytes.
    """

    payload: bytes
    tensors: list[torch.Tensor]
    sources: list[torch.Tensor]
    spans: list[Span]
    data_nbytes: int


@dataclass(frozen=True)
class Message:
    """A received message.

    Attributes:
        obj: the rebuilt object; its tensors are fresh (no autograd history) with ``requires_grad=False``.
        tensors: those tensors, in the sender's placeholder order (same order as ``Packed.tensors``).
        requires_grad: the ``requires_grad`` flag each tensor left with. The receiver decides whether to set it.
        arrived_s: ``time.perf_counter()`` when the message's first frame had arrived (0.0 if not received).
        skeleton: the pickle of ``obj`` with placeholders for ``tensors`` (see :meth:`with_tensors`).
    """

    obj: Any
    tensors: list[torch.Tensor]
    requires_grad: list[bool]
    arrived_s: float = 0.0
    skeleton: bytes = b""

    def with_tensors(self, tensors: list[torch.Tensor]) -> Message:
        """The message rebuilt around other tensors in the places of ``self.tensors`` (new Python objects)."""
        return dataclasses.replace(self, obj=_load(self.skeleton, tensors), tensors=tensors)


def pack(obj: Any) -> Packed:
    """Pickle ``obj`` with every tensor replaced by a placeholder; lay out the tensors' bytes.

    Raises:
        TypeError: for a tensor kind that has no wire format ([Note: tensor kinds on the wire]), or an object pickle
            cannot serialise.
    """
    buffer = io.BytesIO()
    pickler = _Pickler(buffer)
    try:
        pickler.dump(obj)
        table = pickler.table
        data_nbytes = table.close()
        flags = [tensor.requires_grad for tensor in pickler.tensors]
        payload = pickle.dumps(
            (buffer.getvalue(), table.recipes, table.spans, pickler.indices, flags), protocol=pickle.HIGHEST_PROTOCOL
        )
    except UnsupportedTensorError:
        raise
    except (pickle.PicklingError, TypeError, AttributeError) as err:
        raise TypeError(
            f"Cannot send {type(obj).__name__} between pipeline stages: {err}. Values that cross a stage"
            " boundary must be tensors or picklable Python objects (tuples, lists, dicts, dataclasses, ...)."
        ) from err
    return Packed(payload, pickler.tensors, table.sources, table.spans, data_nbytes)


# [Note: bundles on the wire] A sender that holds several messages for one destination sends them as one message:
# its pickle frame is ``("bundle", [(part's pickle frame, offset, data_nbytes), ...])`` and its data frame the
# parts' data frames one after the other, each from a 16-byte aligned offset (so every span stays aligned). The
# transport sends and receives it as any message (one header, one sequence number); the receiver gets a
# :class:`Bundle` and unpacks each part on its own (``Bundle.messages``), in order, exactly as if it had arrived
# alone: its own unpickling (a receiver that collects what unpickling meets, e.g. references, does so per part),
# its own fresh tensors. Bundles do not nest.


def bundle(parts: list[Packed]) -> Packed:
    """One message carrying ``parts`` (two or more packed messages) in order ([Note: bundles on the wire]).

    Raises:
        ValueError: fewer than two parts.
    """
    if len(parts) < 2:
        raise ValueError(f"A bundle carries two messages or more, got {len(parts)}.")
    entries, sources, spans, tensors = [], [], [], []
    at = 0
    for part in parts:
        at = padded(at)
        entries.append((part.payload, at, part.data_nbytes))
        sources.extend(part.sources)
        spans.extend(span._replace(offset=span.offset + at) for span in part.spans)
        tensors.extend(part.tensors)
        at += part.data_nbytes
    payload = pickle.dumps((_BUNDLE, entries), protocol=pickle.HIGHEST_PROTOCOL)
    return Packed(payload, tensors, sources, spans, at)


@dataclass(frozen=True)
class Bundle:
    """A received bundle ([Note: bundles on the wire]): what :attr:`Message.obj` is for one.

    Attributes:
        parts: per part, its pickle frame and its bytes of the data frame (a view of the received buffer, which the
            receiver may reuse for its next message: unpack every part before receiving again).
        device: where the parts' tensors go.
    """

    parts: list[tuple[bytes, torch.Tensor | None]]
    device: torch.device

    def messages(self, arrived_s: float = 0.0) -> Iterator[Message]:
        """Each part as the :class:`Message` it would have been alone, unpacked only when the iterator reaches it."""
        for payload, data in self.parts:
            yield _unpack(payload, data, self.device, arrived_s)


def _unpack(payload: bytes, data: torch.Tensor | None, device: torch.device, arrived_s: float = 0.0) -> Message:
    loaded = pickle.loads(payload)
    if loaded[0] == _BUNDLE:
        parts = [(part, data[at : at + nbytes] if nbytes else None) for part, at, nbytes in loaded[1]]
        return Message(Bundle(parts, device), [], [], arrived_s)
    skeleton, recipes, spans, indices, flags = loaded
    every = rebuild_tensors(recipes, spans, data, device)
    tensors = [every[i] for i in indices]
    return Message(_load(skeleton, tensors), tensors, flags, arrived_s, skeleton)


def gather(packed: Packed, buffer: torch.Tensor) -> bool:
    """Copy every span of ``packed`` into ``buffer`` (uint8, ``packed.data_nbytes``), each 16-byte aligned.

    Copies are issued on the current stream, asynchronously where the devices allow (GPU to pinned host memory,
    GPU to GPU). Returns whether any copy read a CUDA tensor (the caller then orders or awaits the stream).
    """
    from_cuda = False
    for source, span in zip(packed.sources, packed.spans):
        from_cuda = from_cuda or source.is_cuda
        buffer[span.offset : span.offset + span.nbytes].copy_(source, non_blocking=True)
    return from_cuda
