"""D2D communication: nested structures of tensors between ranks, and autograd across ranks."""

from lightning_mp.comm._autograd import connect_remote_outputs
from lightning_mp.comm._transport import Message, Packed, Transport, pack

__all__ = ["Message", "Packed", "Transport", "connect_remote_outputs", "pack"]
