"""Data planes: how the tensor bytes of a message travel between pipeline stages.

[Note: two planes] A message is a header (pickled skeleton, shapes, dtypes, byte counts, a per-pair sequence
number) and one data frame (every tensor's bytes packed into one aligned buffer). Headers always go over a CPU
gloo group, the *control plane*, where a receiver thread may sit in an always-posted receive (what the engine's
listeners do). The data frame goes over a *data plane* (each implements :class:`DataPlane`;
:func:`~lightning_mp.comm._transport.make_data_plane` picks one):

- :class:`GlooDataPlane`: over the same gloo group; CUDA tensors are staged through pinned host buffers
  (device to host on the sender's current stream, awaited before the send; host to device asynchronously on the
  receiver's current stream).
- the NCCL plane (:class:`~lightning_mp.comm._pair.PairDataPlane` in ``_pair.py``): one 2-rank NCCL group per
  *ordered* pair of stages, so each communicator carries one direction only and two ranks never both send first
  on one communicator (NCCL issue #479). NCCL's rules, which the protocol keeps:

  1. a receive must know its byte count: it is posted only after its header was read, with the header's count
     (no speculative receive; an idle always-posted NCCL receive would trip NCCL's watchdog);
  2. sends and receives on one communicator match in issue order: receives are posted strictly in sequence order
     (one receiving thread per source), sends under the per-destination lock right after their header;
  3. one thread issues every NCCL call of the process (NCCL forbids concurrent calls on a communicator, and
     torch's coalescing state is shared between threads, pytorch#175145): ``_pair._CommThread``;
  4. a send completes only once its receive is posted, so nothing waits on a send: the buffer is kept until the
     work completes, and the sending thread returns at once;
  5. streams: the sender records an event on its current stream after packing, *before* its header goes out,
     and the communication thread's send stream waits on it before ``isend`` (so the producing kernels come
     before the send, and a send never waits on work enqueued after its header, which could wait on a receive
     that depends on this send). The receiver allocates the buffer on its current stream and records an event
     that the communication thread's separate receive stream waits on before ``irecv`` (the block may still be
     read by a kernel of its previous owner); its current stream waits on the receive's work before the bytes
     are unpacked on it. Every GPU wait thus points back in causal order: no cycle across ranks.

- ``StrictMockBackend`` (a test double, in ``_strict_mock.py``): the NCCL plane's code path (pair groups,
  communication thread, sequence and byte bookkeeping) with gloo under it, enforcing rules 1-4 and a watchdog, so
  CPU CI tests the protocol the NCCL plane relies on. A broken rule raises :class:`StrictMockError` naming it.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist

from lightning_mp.comm._wire import Packed, gather

__all__ = ["DataPlane", "DataPlaneError", "DataPlaneKind", "GlooDataPlane", "StrictMockError"]

DataPlaneKind = Literal["auto", "gloo", "nccl"]


class DataPlane(Protocol):
    """How the data frame of a message travels (the control frames always go over the transport's gloo group).

    A :class:`~lightning_mp.comm._transport.Transport` calls, per message with tensor bytes: on the sender
    ``gather`` (before the header goes out) then ``send`` (under the per-destination lock, right after the
    header); on the receiver ``header_read`` then ``recv`` (in sequence order, from one thread per source).

    Attributes:
        name: ``"gloo"``, ``"nccl"`` or ``"strict_mock"``; ``"gloo"`` lets CPU data ride in the header frame.
    """

    name: str

    def gather(self, packed: Packed) -> Any:
        """Copy ``packed``'s tensor bytes into a wire buffer (uint8[packed.data_nbytes]); returns what ``send``
        takes."""

    def header_read(self, src: int, seq: int, nbytes: int) -> None:
        """The header of message ``seq`` from ``src`` announced ``nbytes`` data bytes (called before ``recv``)."""

    def send(self, wire: Any, dst: int, seq: int) -> None:
        """Send what ``gather`` returned to group rank ``dst`` as message ``seq``."""

    def recv(self, nbytes: int, src: int, seq: int) -> torch.Tensor:
        """Receive the data frame of message ``seq`` from ``src``: uint8[nbytes].

        Raises:
            DataPlaneError: if the plane failed.
        """

    def close(self) -> None:
        """Stop the plane's threads, after its sends in flight are done."""


class DataPlaneError(RuntimeError):
    """The data plane failed (a peer gone, a transfer that never completed)."""


class StrictMockError(DataPlaneError):
    """The strict mock caught a use of the data plane that NCCL would not survive (hang, corruption or abort)."""


class GlooDataPlane:
    """Tensor bytes over the control plane's gloo group; CUDA tensors staged through pinned host memory.

    Args:
        group: the transport's gloo group.
        device: where received tensors live; ``cuda``: stage through pinned host buffers.
    """

    name = "gloo"

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        self.group = group
        self._pin = device.type == "cuda"

    def gather(self, packed: Packed) -> torch.Tensor:
        buffer = torch.empty(packed.data_nbytes, dtype=torch.uint8, pin_memory=self._pin)
        if gather(packed, buffer):  # device-to-host copies on the current stream: done before gloo reads
            torch.cuda.current_stream().synchronize()
        return buffer

    def header_read(self, src: int, seq: int, nbytes: int) -> None:
        pass

    def send(self, wire: torch.Tensor, dst: int, seq: int) -> None:
        dist.send(wire, group=self.group, group_dst=dst)

    def recv(self, nbytes: int, src: int, seq: int) -> torch.Tensor:
        buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._pin)
        dist.recv(buffer, group=self.group, group_src=src)
        return buffer

    def close(self) -> None:
        pass
