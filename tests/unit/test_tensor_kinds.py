"""A tensor kind without a wire format is an error naming its type ([Note: tensor kinds on the wire] in
``comm/_kinds.py``)."""

from __future__ import annotations

import pytest
import torch

from lightning_mp.comm import pack
from lightning_mp.comm._kinds import UnsupportedTensorError


def test_a_kind_without_a_wire_format_is_an_error_naming_its_type():
    class Opaque(torch.Tensor):  # a wrapper subclass without __tensor_flatten__: no storage, no recipe
        @staticmethod
        def __new__(cls, elem):
            return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype)

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            raise NotImplementedError(f"Opaque does not run {func}")

    with pytest.raises(UnsupportedTensorError, match=r"Cannot send a .*Opaque .* no storage and no __tensor_flatten__"):
        pack({"x": Opaque(torch.randn(2))})
    with pytest.raises(UnsupportedTensorError, match=r"torch\.Tensor .*device meta.* a meta tensor has no data"):
        pack([torch.empty(3, device="meta")])
