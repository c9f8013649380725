"""The skeleton of a message and its tensor placeholders ([Note: tensor placeholders] in ``comm/_wire.py``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightning_mp.comm import pack
from lightning_mp.comm._wire import _loading, _unpack, gather


def _roundtrip(obj):
    packed = pack(obj)
    data = torch.empty(packed.data_nbytes, dtype=torch.uint8)
    gather(packed, data)
    return packed, _unpack(packed.payload, data, torch.device("cpu"))


@dataclasses.dataclass
class _Holder:
    a: torch.Tensor
    b: object


class _UnpacksOnLoad:
    """An object whose unpickling unpacks another message (a load inside a load, on one thread)."""

    def __init__(self, inner_payload: bytes, inner_data: torch.Tensor) -> None:
        self.inner_payload, self.inner_data = inner_payload, inner_data

    def __reduce__(self):
        return (_rebuild_inner, (self.inner_payload, self.inner_data))


def _rebuild_inner(payload: bytes, data: torch.Tensor) -> object:
    return _unpack(payload, data, torch.device("cpu")).obj


def test_placeholders_keep_identity_order_and_flags():
    x = torch.randn(3, requires_grad=True)
    y = torch.arange(4)
    message = {"x": x, "again": [x, (x, 1, "s")], "y": _Holder(y, (None, 2.5, x))}
    packed, received = _roundtrip(message)
    assert [t is u for t, u in zip(packed.tensors, (x, y))] == [True, True]
    assert received.requires_grad == [True, False]
    got = received.obj
    assert got["again"][0] is got["x"] and got["again"][1][0] is got["x"] and got["y"].b[2] is got["x"]
    assert got["again"][1][1:] == (1, "s") and got["y"].b[:2] == (None, 2.5)
    assert torch.equal(got["x"], x.detach()) and torch.equal(got["y"].a, y)
    assert got["x"] is received.tensors[0] and got["y"].a is received.tensors[1]
    # rebuilt around other tensors (``Message.with_tensors``): same structure, the new tensors in their places
    others = [torch.zeros(3), torch.ones(4)]
    rebuilt = received.with_tensors(others).obj
    assert rebuilt["x"] is others[0] and rebuilt["again"][1][0] is others[0] and rebuilt["y"].a is others[1]
    assert getattr(_loading, "tensors", None) is None  # nothing left behind on this thread


def test_a_load_inside_a_load_keeps_each_message_s_tensors():
    inner_packed, _ = _roundtrip([torch.full((2,), 7.0)])
    inner_data = torch.empty(inner_packed.data_nbytes, dtype=torch.uint8)
    gather(inner_packed, inner_data)
    outer, after = torch.full((5,), 3.0), torch.full((1,), 9.0)
    _, received = _roundtrip((outer, _UnpacksOnLoad(inner_packed.payload, inner_data), after))
    first, inner, last = received.obj  # ``after``'s placeholder is loaded after the inner message's
    assert torch.equal(first, outer) and torch.equal(last, after)
    assert torch.equal(inner[0], torch.full((2,), 7.0))
    assert getattr(_loading, "tensors", None) is None


def test_a_failed_load_restores_the_thread_s_tensors():
    _, received = _roundtrip([torch.ones(1)])
    with pytest.raises(Exception):
        received.with_tensors([])  # placeholder 0 has no tensor
    assert getattr(_loading, "tensors", None) is None
