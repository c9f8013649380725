"""D2D communication: nested structures of tensors between ranks, and autograd across ranks."""

from lightning_mp.comm._autograd import REMOTE_ANCHOR, connect_remote_outputs, ragged_like
from lightning_mp.comm._pair import PairDataPlane, PairGroups
from lightning_mp.comm._planes import DataPlane, DataPlaneError, DataPlaneKind, GlooDataPlane, StrictMockError
from lightning_mp.comm._transport import Transport, make_data_plane
from lightning_mp.comm._wire import Bundle, Message, Packed, bundle, pack

__all__ = [
    "REMOTE_ANCHOR",
    "Bundle",
    "DataPlane",
    "DataPlaneError",
    "DataPlaneKind",
    "GlooDataPlane",
    "Message",
    "Packed",
    "PairDataPlane",
    "PairGroups",
    "StrictMockError",
    "Transport",
    "bundle",
    "connect_remote_outputs",
    "make_data_plane",
    "pack",
    "ragged_like",
]
