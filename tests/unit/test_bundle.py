"""Bundles on the wire ([Note: bundles on the wire] in comm/_wire.py): several packed messages as one, each part
unpacked on its own, as if it had arrived alone."""

from __future__ import annotations

import pytest
import torch

from lightning_mp.comm import Bundle, bundle, pack
from lightning_mp.comm._kinds import FRAME_ALIGN
from lightning_mp.comm._wire import _unpack, gather


def _over_the_wire(packed):
    buffer = torch.empty(packed.data_nbytes, dtype=torch.uint8)
    gather(packed, buffer)
    return _unpack(packed.payload, buffer if packed.data_nbytes else None, torch.device("cpu"))


def test_each_part_arrives_as_it_would_alone():
    base = torch.arange(12.0).reshape(3, 4)
    parts = [
        {"x": torch.arange(3, dtype=torch.int16)},  # 6 bytes: the next part starts aligned after it
        "no tensors at all",
        (base, base[1:, ::2], torch.tensor([True, False])),  # a view sharing its base's storage
        [torch.randn(5, dtype=torch.float64).requires_grad_()],
    ]
    alone = [_over_the_wire(pack(p)) for p in parts]
    message = _over_the_wire(bundle([pack(p) for p in parts]))
    assert isinstance(message.obj, Bundle)
    got = list(message.obj.messages(arrived_s=1.5))
    assert len(got) == len(parts)
    for one, part in zip(got, alone):
        assert one.arrived_s == 1.5
        assert one.requires_grad == part.requires_grad
        assert len(one.tensors) == len(part.tensors)
        for a, b in zip(one.tensors, part.tensors):
            assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            torch.testing.assert_close(a, b)
    assert got[1].obj == "no tensors at all"
    whole, view = got[2].obj[0], got[2].obj[1]
    assert view.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr(), "still views of one storage"
    assert got[0].obj["x"].untyped_storage().data_ptr() != whole.untyped_storage().data_ptr(), "parts apart"


def test_every_part_starts_aligned_in_the_data_frame():
    packed = bundle([pack(torch.arange(3, dtype=torch.int8)), pack(torch.arange(5, dtype=torch.int8))])
    assert all(span.offset % FRAME_ALIGN == 0 for span in packed.spans)
    assert packed.spans[1].offset == FRAME_ALIGN


def test_a_bundle_needs_two_parts():
    with pytest.raises(ValueError, match="two messages or more"):
        bundle([pack(1)])
