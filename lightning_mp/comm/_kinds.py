"""Every tensor kind as bytes on the wire: storage spans plus a recipe that rebuilds it on the receiver.

[Note: tensor kinds on the wire] A message's tensors are taken apart into *dense strided* tensors, and those into
*storage spans* (runs of bytes of one storage); the data frame holds the spans, the pickle holds one recipe per
tensor. The receiver rebuilds each tensor from its recipe, components first:

- dense strided, any dtype (complex, ``bool``, ``uint8``, float8 included): a view into its span, with its shape,
  strides and storage offset; conjugate and negative bits are kept (the bytes are the unresolved storage, as in
  one process). Tensors of one message that share a storage arrive sharing one storage, as views of one base (one
  version counter, as in one process), unless the bytes they span are at least twice the bytes they hold and at
  least 8 KiB (``x[:, -1]`` of a large activation): then each travels as a compact copy. The rule is
  ``torch.distributed.rpc``'s for views (``worthRecopying`` in ``torch/csrc/distributed/rpc/utils.cpp``).
- sparse COO (indices, values, coalesced flag) and compressed CSR/CSC/BSR/BSC (compressed and plain indices,
  values): rebuilt with ``torch.sparse_coo_tensor`` / ``torch.sparse_compressed_tensor``.
- nested tensors of the strided layout (``NestedTensorImpl``, what ``nn.TransformerEncoder``'s fast path makes):
  their contiguous buffer and per-component sizes, rebuilt with ``torch._nested_view_from_buffer``.
- tensor subclasses implementing ``__tensor_flatten__`` / ``__tensor_unflatten__`` (nested tensors of the jagged
  layout, ``AsyncCollectiveTensor`` from ``DTensor.to_local()``, torchao-style wrappers): their inner tensors
  (recursively) and their context, which must pickle; rebuilt with the class's ``__tensor_unflatten__``.
- quantized tensors (``per_tensor_affine``, ``per_channel_affine``): integer representation, scales, zero points.

Anything else (meta tensors, wrapper subclasses without ``__tensor_flatten__``, other quantization schemes) is a
``TypeError`` naming the type. Autograd is the transport user's business: it sees the top-level tensors only
(``Packed.tensors`` / ``Message.tensors``); components travel detached.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

__all__ = ["FRAME_ALIGN", "Span", "TensorTable", "UnsupportedTensorError", "padded", "rebuild_tensors"]

FRAME_ALIGN = 16  # every span starts 16-byte aligned in the data frame
_RECOPY_MULTIPLE = 2  # torch.distributed.rpc's kMinMultiple
_RECOPY_MIN_NBYTES = 8 * 1024  # torch.distributed.rpc's kMinRecopyBytes
_COMPRESSED = {
    torch.sparse_csr: ("crow_indices", "col_indices"),
    torch.sparse_bsr: ("crow_indices", "col_indices"),
    torch.sparse_csc: ("ccol_indices", "row_indices"),
    torch.sparse_bsc: ("ccol_indices", "row_indices"),
}
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


class Span(NamedTuple):
    """Bytes of one storage region in the data frame.

    Attributes:
        offset: where they start in the data frame.
        nbytes: how many are sent.
        alloc: how many the receiver allocates (``nbytes`` rounded up to the largest element size viewing it).
        on_cpu: the receiver keeps it on the CPU (metadata inside a subclass on a CUDA sender), else on its device.
    """

    offset: int
    nbytes: int
    alloc: int
    on_cpu: bool


class _Dense(NamedTuple):  # a tuple: cheap to build and to pickle, one per tensor of every message
    span: int | None  # index into the spans; None for a tensor without elements
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int  # in elements of ``dtype``, from the span's start
    shared: bool  # a view of a base shared with other tensors of the message
    conj: bool
    neg: bool
    subclass: type | None  # a subclass with its own storage (no ``__tensor_flatten__``): ``as_subclass``


def padded(nbytes: int, align: int = FRAME_ALIGN) -> int:
    """``nbytes`` rounded up to a multiple of ``align``."""
    return -(-nbytes // align) * align


def _byte_extent(tensor: torch.Tensor) -> tuple[int, int]:
    """``[first, end)`` bytes of ``tensor``'s storage that it reads (it has elements)."""
    size = tensor.element_size()
    first = tensor.storage_offset() * size
    if tensor.is_contiguous():
        return first, first + tensor.numel() * size
    last = sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()))
    return first, first + (last + 1) * size


class UnsupportedTensorError(TypeError):
    """A tensor of a kind that has no wire format."""


def _unsupported(tensor: torch.Tensor, why: str) -> UnsupportedTensorError:
    return UnsupportedTensorError(
        f"Cannot send a {type(tensor).__module__}.{type(tensor).__qualname__} ({tensor.layout}, {tensor.dtype}, device"
        f" {tensor.device}) between pipeline stages: {why}. Tensors that cross stages may be dense (any dtype),"
        " sparse, nested, quantized (affine) or subclasses implementing __tensor_flatten__/__tensor_unflatten__."
    )


class TensorTable:
    """Sender side: every tensor of a message and its components, each once, with recipes and storage spans.

    ``add`` registers a tensor (components first); ``close`` lays out the spans of the dense ones. Then ``recipes``
    (picklable) and ``spans`` (``Span`` per entry of ``sources``, the uint8 bytes to copy) describe the message.
    """

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []  # every registered tensor, components before what contains them
        self.recipes: list[Any] = []
        self.spans: list[Span] = []
        self.sources: list[torch.Tensor] = []  # uint8, one per span
        self._index: dict[int, int] = {}
        self._cpu_inner: set[int] = set()  # CPU inner tensors of a subclass on another device: they stay on the CPU

    def add(self, tensor: torch.Tensor) -> int:
        """Register ``tensor``; returns its index. Raises ``TypeError`` for a kind that cannot travel."""
        index = self._index.get(id(tensor))
        if index is None:
            recipe = self._recipe(tensor)
            index = self._index[id(tensor)] = len(self.tensors)
            self.tensors.append(tensor)
            self.recipes.append(recipe)
        return index

    def _recipe(self, tensor: torch.Tensor) -> Any:
        cls = type(tensor)
        if cls not in _PLAIN_TYPES and hasattr(cls, "__tensor_flatten__"):
            names, context = tensor.__tensor_flatten__()
            inner = {name: self._add_inner(tensor, getattr(tensor, name)) for name in names}
            shape = tuple(tensor.shape) if all(isinstance(n, int) for n in tensor.shape) else None  # jagged: None
            stride = tuple(tensor.stride()) if shape is not None else None
            return ("subclass", cls, inner, context, shape, stride)
        if tensor.is_nested:  # the strided layout; the jagged one is a subclass
            contiguous = tensor.detach().contiguous()
            meta = [contiguous._nested_tensor_size().tolist(), contiguous._nested_tensor_strides().tolist(),
                    contiguous._nested_tensor_storage_offsets().tolist()]
            return ("nested", self.add(contiguous.values()), meta)
        if tensor.layout == torch.sparse_coo:
            parts = (self.add(tensor._indices()), self.add(tensor._values()))
            return ("coo", *parts, tuple(tensor.shape), tensor.is_coalesced())
        if tensor.layout in _COMPRESSED:
            compressed, plain = (getattr(tensor, name)() for name in _COMPRESSED[tensor.layout])
            parts = (self.add(compressed), self.add(plain), self.add(tensor.values()))
            return ("compressed", tensor.layout, *parts, tuple(tensor.shape))
        if tensor.is_quantized:
            return self._quantized(tensor)
        if tensor.layout != torch.strided:
            raise _unsupported(tensor, f"the {tensor.layout} layout has no wire format")
        if tensor.device.type == "meta":
            raise _unsupported(tensor, "a meta tensor has no data")
        try:
            tensor.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError) as err:
            raise _unsupported(tensor, f"it has no storage and no __tensor_flatten__ ({err})") from err
        return None  # dense: filled in by ``close``

    def _add_inner(self, outer: torch.Tensor, inner: torch.Tensor) -> int:
        index = self.add(inner)
        if inner.device.type == "cpu" and outer.device.type != "cpu":  # metadata (a jagged tensor's seqlens)
            self._cpu_inner.add(index)
        return index

    def _quantized(self, tensor: torch.Tensor) -> Any:
        scheme = tensor.qscheme()
        ints = self.add(tensor.int_repr())
        if scheme == torch.per_tensor_affine:
            return ("quantized", scheme, ints, tensor.q_scale(), tensor.q_zero_point())
        if scheme == torch.per_channel_affine:
            scales = self.add(tensor.q_per_channel_scales())
            zero_points = self.add(tensor.q_per_channel_zero_points())
            return ("quantized", scheme, ints, scales, zero_points, tensor.q_per_channel_axis())
        raise _unsupported(tensor, f"the quantization scheme {scheme} has no wire format")

    def close(self) -> int:
        """Lay out the dense tensors' bytes (see [Note: tensor kinds on the wire]); returns the data frame's size."""
        groups: dict[tuple, list[int]] = {}
        for index, (tensor, recipe) in enumerate(zip(self.tensors, self.recipes)):
            if recipe is None:
                key = (tensor.device, tensor.untyped_storage().data_ptr()) if tensor.numel() else ("empty", index)
                groups.setdefault(key, []).append(index)
        offset = 0
        for members in groups.values():
            layout = self._sharing(members) if self.tensors[members[0]].numel() else [(members, False)]
            for group, compact in layout:
                offset = self._lay_out(group, compact, offset)
        return offset

    def _sharing(self, members: list[int]) -> list[tuple[list[int], bool]]:
        """The members of one storage as groups, each one span, and whether it travels as a compact copy: one
        that spans at least twice the bytes it holds, and 8 KiB, does (rpc's recopy rule), each member alone."""
        if len(members) == 1 and self.tensors[members[0]].is_contiguous():
            return [(members, False)]
        extents = [_byte_extent(self.tensors[i]) for i in members]
        span = max(end for _, end in extents) - min(first for first, _ in extents)
        useful = sum(self.tensors[i].numel() * self.tensors[i].element_size() for i in members)
        if span >= _RECOPY_MIN_NBYTES and span >= _RECOPY_MULTIPLE * useful:
            return [([i], True) for i in members]
        return [(members, False)]

    def _lay_out(self, group: list[int], compact: bool, offset: int) -> int:
        tensors = [self.tensors[i] for i in group]
        if tensors[0].numel() == 0:
            self._set_dense(group[0], None, tensors[0], 0, shared=False)
            return offset
        if compact:
            tensors = [tensors[0].detach().resolve_conj().resolve_neg().contiguous()]
        if len(tensors) == 1:  # most messages: one tensor per storage (the same sums, without a generator each)
            align = tensors[0].element_size()
            first, end = _byte_extent(tensors[0])
            first = first // align * align
            on_cpu = group[0] in self._cpu_inner
        else:
            align = max(t.element_size() for t in tensors)
            extents = [_byte_extent(t) for t in tensors]
            first = min(start for start, _ in extents) // align * align
            end = max(stop for _, stop in extents)
            on_cpu = all(i in self._cpu_inner for i in group)
        self.spans.append(Span(offset, end - first, padded(end - first, align), on_cpu))
        self.sources.append(_storage_bytes(tensors[0], first, end))
        for index, sent in zip(group, tensors):
            storage_offset = sent.storage_offset() - first // sent.element_size()
            self._set_dense(index, len(self.spans) - 1, sent, storage_offset, shared=len(group) > 1)
        return offset + padded(end - first)

    def _set_dense(self, index: int, span: int | None, sent: torch.Tensor, storage_offset: int, shared: bool) -> None:
        """``sent``: the tensor itself, or the compact copy that travels for it."""
        tensor = self.tensors[index]
        subclass = None if type(tensor) in _PLAIN_TYPES else type(tensor)
        self.recipes[index] = _Dense(span, tensor.dtype, tuple(tensor.shape), tuple(sent.stride()), storage_offset,
                                     shared, sent.is_conj(), sent.is_neg(), subclass)


def _storage_bytes(tensor: torch.Tensor, first: int, end: int) -> torch.Tensor:
    """Bytes ``[first, end)`` of ``tensor``'s storage, as a uint8 tensor (no copy)."""
    raw = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    return raw.set_(tensor.untyped_storage(), first, (end - first,), (1,))


def rebuild_tensors(recipes: list[Any], spans: list[Span], data: torch.Tensor | None, device: torch.device) -> list:
    """Receiver side: every tensor of ``recipes`` (as ``TensorTable.tensors``), its bytes read from ``data``.

    Each span is copied into a fresh buffer on ``device`` (from a pinned staging buffer the copy to the GPU is
    asynchronous on the current stream; the caching host allocator keeps the staging buffer until it is done).
    """
    assert data is not None or not spans
    bases = []
    for span in spans:
        base = torch.empty(span.alloc, dtype=torch.uint8, device="cpu" if span.on_cpu else device)
        # to the host from a GPU buffer: synchronous, or the CPU could read the bytes before they arrive
        base[: span.nbytes].copy_(data[span.offset : span.offset + span.nbytes], non_blocking=not span.on_cpu)
        bases.append(base)
    alone = {recipe.span for recipe in recipes if isinstance(recipe, _Dense) and not recipe.shared}
    tensors: list = []
    for recipe in recipes:
        if isinstance(recipe, _Dense):
            tensors.append(_dense(recipe, bases, recipe.span in alone, device))
        else:
            tensors.append(_composite(recipe, tensors))
    return tensors


def _dense(recipe: _Dense, bases: list[torch.Tensor], alone: bool, device: torch.device) -> torch.Tensor:
    if recipe.span is None:
        tensor = torch.empty(recipe.shape, dtype=recipe.dtype, device=device)
    elif alone:  # its own storage (not a view of the wire buffer), with its strides
        base = bases[recipe.span]
        tensor = torch.empty(0, dtype=recipe.dtype, device=base.device).set_(
            base.untyped_storage(), recipe.storage_offset, recipe.shape, recipe.stride
        )
    else:
        tensor = bases[recipe.span].view(recipe.dtype).as_strided(recipe.shape, recipe.stride, recipe.storage_offset)
    if recipe.neg:
        tensor = torch._neg_view(tensor)
    if recipe.conj:
        tensor = tensor.conj()
    return tensor if recipe.subclass is None else tensor.as_subclass(recipe.subclass)


def _composite(recipe: tuple, tensors: list) -> torch.Tensor:
    kind = recipe[0]
    if kind == "subclass":
        _, cls, inner, context, shape, stride = recipe
        return cls.__tensor_unflatten__({name: tensors[i] for name, i in inner.items()}, context, shape, stride)
    if kind == "nested":
        _, values, (sizes, strides, offsets) = recipe
        meta = [torch.tensor(x, dtype=torch.int64) for x in (sizes, strides, offsets)]
        return torch._nested_view_from_buffer(tensors[values], *meta)
    if kind == "coo":
        _, indices, values, shape, coalesced = recipe
        return torch.sparse_coo_tensor(tensors[indices], tensors[values], shape, is_coalesced=coalesced)
    if kind == "compressed":
        _, layout, compressed, plain, values, shape = recipe
        return torch.sparse_compressed_tensor(tensors[compressed], tensors[plain], tensors[values], shape, layout=layout)
    if kind == "quantized":
        scheme, ints = recipe[1], tensors[recipe[2]]
        if scheme == torch.per_tensor_affine:
            return torch._make_per_tensor_quantized_tensor(ints, recipe[3], recipe[4])
        return torch._make_per_channel_quantized_tensor(ints, tensors[recipe[3]], tensors[recipe[4]], recipe[5])
    raise AssertionError(f"internal: unknown tensor recipe {kind!r}")
