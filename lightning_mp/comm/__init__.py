"""D2D communication: nested structures of tensors between ranks, and autograd across ranks."""

from lightning_mp.comm._autograd import connect_remote_outputs, ragged_like
from lightning_mp.comm._planes import (
    DataPlaneError,
    DataPlaneKind,
    GlooDataPlane,
    PairDataPlane,
    PairGroups,
    StrictMockError,
    make_data_plane,
)
from lightning_mp.comm._transport import Message, Packed, Transport, pack

__all__ = [
    "DataPlaneError",
    "DataPlaneKind",
    "GlooDataPlane",
    "Message",
    "Packed",
    "PairDataPlane",
    "PairGroups",
    "StrictMockError",
    "Transport",
    "connect_remote_outputs",
    "make_data_plane",
    "pack",
    "ragged_like",
]
