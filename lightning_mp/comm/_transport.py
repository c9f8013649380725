"""Point-to-point transfer of nested Python structures holding tensors (the D2D backend, paper section 3.3).

A message is any picklable object; every ``torch.Tensor`` inside it (at any depth: tuples, lists, dicts,
dataclasses, NamedTuples, custom objects) travels as raw bytes over ``torch.distributed`` send/recv, the
rest as a pickle. On the wire one message is one to three frames on one (src, dst) pair::

    header   uint8[<= 1 MiB]        int64 pickle_nbytes, data_nbytes, seq (per ordered pair), inline; then the
                                    pickle if it fits, then (inline = 1) the data too, 16-byte aligned
    pickle   uint8[pickle_nbytes]   only if the pickle does not fit in the header
    data     uint8[data_nbytes]     every tensor's bytes, 16-byte aligned, in placeholder order (omitted if 0 or inline)

Header and pickle form the *control plane* (a CPU gloo group); the data frame goes over a *data plane* (gloo,
staged through pinned host memory for CUDA tensors, or NCCL): [Note: two planes] in ``_planes.py``.

The pickle holds the skeleton with tensor placeholders, each tensor's recipe and ``requires_grad`` flag, and the
layout of the data frame: every tensor kind torch has travels as storage spans plus a recipe ([Note: tensor kinds
on the wire] in ``_kinds.py``). Most
messages (requests, replies, gradients) have a small pickle, so they take one frame plus one for the data, or
one frame in all where the data rides in the header ([Note: one frame per message]).

[Note: one frame per message] The header frame has a variable length: the receiver always posts one receive of
the largest header (``_HEADER_NBYTES``, into a buffer it reuses per peer), and gloo delivers a shorter message
into it (measured on gloo's TCP transport, torch 2.13). On the gloo data plane with CPU tensors, a message whose
pickle and data fit travels as that one frame. A separate data frame costs gloo a rendezvous: the receiver posts
that receive only once it has read the header (it needs the byte count), so the sender's ``send`` waits for the
receiving thread to wake up, read the header and post, then for the bytes to go. With the data inline the
header receive that a listener posted long before takes the whole message. With this and the request workers
of ``pipeline/_server.py``, a 4 KiB request and its reply took about half the voluntary context switches per call and a
fraction of the time (``benchmarks/engine_latency.py``, against the two-frame layout, alternating runs).

Frames of one message are sent under a per-destination lock, so threads may send concurrently. A tensor that
appears twice in a message arrives as one tensor; tensors sharing a storage arrive sharing one. Received tensors
have no autograd history and the kind, dtype, shape and strides they left with; the ``requires_grad`` flag each
left with is returned beside them (:class:`Message`), and the receiver decides whether to set it.
"""

from __future__ import annotations

import struct
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from lightning_mp.comm._kinds import padded
from lightning_mp.comm._pair import PairDataPlane, PairGroups, _NcclBackend
from lightning_mp.comm._planes import DataPlane, GlooDataPlane
from lightning_mp.comm._strict_mock import StrictMockBackend
from lightning_mp.comm._wire import Message, Packed, _unpack, gather, pack

__all__ = ["Transport", "make_data_plane"]

# [Note: control frames without dist.send] The control frames are uint8 CPU tensors between two members of the
# transport's gloo group, with group ranks: ``dist.send`` / ``dist.recv`` would check exactly that, in about 35 Python
# calls per frame (torch-function dispatch, group and rank canonicalisation, the exception logger), before calling the
# process group's own ``send`` / ``recv`` and waiting; the transport calls those itself (same tag 0, the backend's
# errors). ``dist.send``'s own ValueErrors (a send to oneself, a rank outside the group) are not raised here: the
# engine sends only to its peers, and ``send`` asserts that.
_HEADER_NBYTES = 1 << 20  # the largest header frame; a message sends only the bytes it uses
_LENGTHS_NBYTES = 32  # int64 pickle_nbytes, data_nbytes, seq, inline (0 or 1)


class Transport:
    """Framed messages between the ranks of one process group, on two planes ([Note: two planes] in ``_planes.py``).

    The control plane (headers and pickles) always goes over ``group``, which must be a gloo group; the tensor
    bytes go over ``data_plane`` (default: :class:`~lightning_mp.comm.GlooDataPlane` on the same group).

    Args:
        group: a gloo process group; ``src``/``dst`` below are ranks *within* it.
        device: where received tensors live (``cpu``, or the rank's CUDA device).
        data_plane: how tensor bytes travel; see :func:`~lightning_mp.comm.make_data_plane`.

    Raises:
        ValueError: if ``group`` is not a gloo group.

    Thread safety: ``send`` may be called from many threads; ``recv`` from one peer must be called from one
    thread at a time (the engine runs one receiver thread per peer).
    """

    def __init__(self, group: dist.ProcessGroup, device: torch.device, data_plane: DataPlane | None = None) -> None:
        backend = dist.get_backend(group)
        if backend != "gloo":
            raise ValueError(
                f"The control plane of a Transport needs a gloo group (headers are CPU tensors), got a {backend!r}"
                " group. Create it with `dist.new_group(ranks, backend='gloo')`; tensor bytes may still go over NCCL"
                " through `data_plane`."
            )
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.group = group
        self.device = device
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        if data_plane is None:
            data_plane = GlooDataPlane(group, device)
        self.data_plane = data_plane
        self._send_locks = [threading.Lock() for _ in range(self.size)]
        self._send_seq = [0] * self.size  # per destination, under its lock
        self._recv_seq = [0] * self.size  # per source, in its receiving thread
        # [Note: one frame per message]: CPU tensors on the gloo data plane may ride in the header frame
        self._inline_data = getattr(data_plane, "name", None) == "gloo" and device.type == "cpu"
        self._recv_buffers: list[torch.Tensor | None] = [None] * self.size

    def send(self, message: Any, dst: int) -> None:
        """Send ``message`` (an object or a :class:`Packed`) to group rank ``dst``.

        Blocks until the control frames are written to the peer's connection; the data plane may still be moving
        the tensor bytes when it returns (their buffer is kept until it is done).
        """
        packed = message if isinstance(message, Packed) else pack(message)
        payload_nbytes = len(packed.payload)
        inline = _LENGTHS_NBYTES + payload_nbytes <= _HEADER_NBYTES
        data_at = padded(_LENGTHS_NBYTES + payload_nbytes)
        inline_data = inline and self._inline_data and packed.data_nbytes and data_at + packed.data_nbytes <= _HEADER_NBYTES
        if inline_data:  # [Note: one frame per message]
            header = bytearray(data_at + packed.data_nbytes)
            gather(packed, torch.frombuffer(header, dtype=torch.uint8, offset=data_at))
        else:
            header = bytearray(_LENGTHS_NBYTES + payload_nbytes if inline else _LENGTHS_NBYTES)
        if inline:
            header[_LENGTHS_NBYTES : _LENGTHS_NBYTES + payload_nbytes] = packed.payload
        # before the header: see _planes.py
        wire = self.data_plane.gather(packed) if packed.data_nbytes and not inline_data else None
        with self._send_locks[dst]:
            seq = self._send_seq[dst]
            self._send_seq[dst] = seq + 1
            struct.pack_into("<qqqq", header, 0, payload_nbytes, packed.data_nbytes, seq, int(bool(inline_data)))
            # [Note: control frames without dist.send]
            assert dst != self.group.rank(), "a transport sends to its peers only"
            self.group.send([torch.frombuffer(header, dtype=torch.uint8)], dst, 0).wait()
            if not inline:
                self.group.send([torch.frombuffer(bytearray(packed.payload), dtype=torch.uint8)], dst, 0).wait()
            if wire is not None:
                self.data_plane.send(wire, dst, seq)

    def recv(self, src: int) -> Message:
        """Receive the next message from group rank ``src``.

        Raises:
            RuntimeError: what the backend raises when the peer is gone or nothing arrives within its timeout, or
                a message out of sequence (a protocol error).
        """
        header = self._recv_buffers[src]  # one receiving thread per peer at a time: reused
        if header is None:
            header = self._recv_buffers[src] = torch.empty(_HEADER_NBYTES, dtype=torch.uint8)
        self.group.recv([header], src, 0).wait()  # [Note: control frames without dist.send]
        arrived_s = time.perf_counter()
        raw = header.numpy()
        payload_nbytes, data_nbytes, seq, inline_data = struct.unpack_from("<qqqq", raw, 0)
        if seq != self._recv_seq[src]:
            raise RuntimeError(f"internal: message {seq} from rank {src} arrived when {self._recv_seq[src]} was due")
        self._recv_seq[src] = seq + 1
        if _LENGTHS_NBYTES + payload_nbytes <= _HEADER_NBYTES:
            payload = raw[_LENGTHS_NBYTES : _LENGTHS_NBYTES + payload_nbytes].tobytes()
        else:
            pickled = torch.empty(payload_nbytes, dtype=torch.uint8)
            self.group.recv([pickled], src, 0).wait()
            payload = pickled.numpy().tobytes()
        data = None
        if inline_data:  # [Note: one frame per message]; _unpack copies the tensors out of the reused buffer
            data_at = padded(_LENGTHS_NBYTES + payload_nbytes)
            data = header[data_at : data_at + data_nbytes]
        elif data_nbytes:
            # [Note: two planes] the data receive is posted only now, with the byte count from the header.
            self.data_plane.header_read(src, seq, data_nbytes)
            data = self.data_plane.recv(data_nbytes, src, seq)
        return _unpack(payload, data, self.device, arrived_s)

    def close(self) -> None:
        """Stop the data plane's threads (after its sends in flight are done)."""
        self.data_plane.close()


def make_data_plane(
    kind: str, group: dist.ProcessGroup, device: torch.device, pairs: PairGroups | None = None, timeout_s: float = 1800.0
) -> DataPlane:
    """The data plane of one transport, for :class:`Transport`'s ``data_plane``.

    Args:
        kind: ``"gloo"`` (:class:`GlooDataPlane`), ``"nccl"`` (CUDA only; needs ``pairs`` built with backend
            ``"nccl"``) or ``"strict_mock"`` (CPU; ``pairs`` built with backend ``"gloo"``).
        group: the transport's gloo group (the gloo plane uses it).
        device: the rank's device.
        pairs: from ``lightning_mp.topology.build_pair_groups``, for ``"nccl"`` and ``"strict_mock"``.
        timeout_s: receive timeout and send watchdog of the pair planes.

    Raises:
        ValueError: for an unknown kind, ``"nccl"`` off CUDA, or missing/mismatched pair groups.
    """
    if kind == "gloo":
        return GlooDataPlane(group, device)
    if kind not in ("nccl", "strict_mock"):
        raise ValueError(f"data plane must be 'gloo', 'nccl' or 'strict_mock', got {kind!r}.")
    if kind == "nccl" and device.type != "cuda":
        raise ValueError(f"The NCCL data plane moves CUDA tensors; this rank's device is {device}. Use 'gloo'.")
    expected = "nccl" if kind == "nccl" else "gloo"
    if pairs is None or pairs.backend != expected:
        raise ValueError(f"The {kind} data plane needs pair groups from build_pair_groups(..., backend={expected!r}).")
    if kind == "nccl":
        return PairDataPlane(_NcclBackend(pairs), device, timeout_s)
    return PairDataPlane(StrictMockBackend(pairs, timeout_s), torch.device("cpu"), timeout_s)
