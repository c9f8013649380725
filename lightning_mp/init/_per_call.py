"""Real weights for one module call at a time: tracing a delayed model whose forward reads values.

[Note: per-call materialisation] The partitioning trace of a model built under delayed init runs on meta, which
cannot answer ``if x[0, 0].item() > 0`` (a gate on the batch or on an activation). Inside
:func:`materialize_per_call`, each module's own parameters and buffers are made real (from the init record,
bitwise the eager build's) just before its call and given back to meta after it, and the trace runs on the real
sample: the rank holds the weights of the modules on the call stack only (one block, not the model). A module
called while an ancestor is running keeps the ancestor's weights alive; a module called twice is made twice.

To make one module's tensors without replaying the whole build each time, one pass over the record (the same
scratch draws that :func:`~lightning_mp.init._replay.advance_rng` does when the build ends) keeps the CPU
generator's state before each random op (about 5 KB per op); a module's replay then runs only the ops its tensors
need, each random one from its recorded state. CPU builds only: a build under a CUDA device is refused.

A real weight is freed after its module's call by shrinking its storage to zero bytes (FSDP's way to free a
parameter that the autograd graph of the traced step still references); the trace runs no backward. A weight
that the call's output views (``self.table[:T]``, ``self.latents.expand(...)``) is not shrunk: it is freed with
that output.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from lightning_mp.init._tape import InitRecord, TensorRef, find_record
from lightning_mp.init._replay import advance_rng, replay

__all__ = ["PerCallReport", "materialize_per_call"]


@dataclass
class PerCallReport:
    """What :func:`materialize_per_call` held.

    Attributes:
        total_bytes: bytes of every tensor of the model (what a whole materialisation would hold).
        peak_bytes: the most bytes of real weights held at once.
        calls: module calls that made weights real.
        failed_in: FQN of the innermost module whose call raised, if one did.
        live_bytes: bytes of real weights held now.
        stack: FQNs of the modules running now, outermost first.
    """

    total_bytes: int = 0
    peak_bytes: int = 0
    calls: int = 0
    failed_in: str | None = None
    live_bytes: int = 0
    stack: list[str] = field(default_factory=list)


@dataclass
class _Slot:
    kind: str  # "_parameters" or "_buffers"
    name: str
    meta: torch.Tensor
    ref: TensorRef


class _PerCall:
    """The hooks' state: the record, its generator states, each module's own meta tensors."""

    def __init__(self, model: nn.Module, record: InitRecord, device: torch.device | None) -> None:
        self.record, self.device = record, device
        self.rng_states: dict[int, torch.Tensor] = {}
        with torch.random.fork_rng(devices=[]):
            advance_rng(record, self.rng_states)
        self.slots: dict[int, list[_Slot]] = {}
        self.names: dict[int, str] = {}
        self.depth: dict[int, int] = {}
        self.real: dict[int, list[torch.Tensor]] = {}
        self.handling: list[BaseException | None] = []  # per call on the stack: the error being handled at entry
        self.report = PerCallReport()
        seen: set[int] = set()
        for fqn, module in model.named_modules():
            self.names[id(module)] = fqn
            slots = []
            for kind in ("_parameters", "_buffers"):
                for name, tensor in getattr(module, kind).items():
                    ref = record.ref(tensor, (module, name)) if tensor is not None and tensor.is_meta else None
                    if ref is not None:
                        slots.append(_Slot(kind, name, tensor, ref))
                        if id(tensor) not in seen:
                            seen.add(id(tensor))
                            self.report.total_bytes += tensor.numel() * tensor.element_size()
            self.slots[id(module)] = slots

    def pre_hook(self, module: nn.Module, args: tuple) -> None:
        key = id(module)
        self.report.stack.append(self.names.get(key, type(module).__name__))
        self.handling.append(sys.exc_info()[1])
        self.depth[key] = self.depth.get(key, 0) + 1
        slots = self.slots.get(key)
        if self.depth[key] > 1 or not slots:
            return
        storages, _ = replay(self.record, {s.ref.sid for s in slots}, rng_states=self.rng_states)
        reals = []
        for slot in slots:
            ref, storage = slot.ref, storages[slot.ref.sid]
            value = torch.empty(0, dtype=ref.dtype).set_(storage, ref.offset, ref.shape, ref.stride)
            value = value.to(device=self.device, dtype=slot.meta.dtype)
            if slot.kind == "_parameters":
                value = nn.Parameter(value, requires_grad=slot.meta.requires_grad)
            getattr(module, slot.kind)[slot.name] = value
            reals.append(value)
        self.real[key] = reals
        self.report.calls += 1
        self.report.live_bytes += _bytes(reals)
        self.report.peak_bytes = max(self.report.peak_bytes, self.report.live_bytes)

    def post_hook(self, module: nn.Module, args: tuple, output: object) -> None:
        key = id(module)
        name = self.report.stack.pop()
        handled_at_entry = self.handling.pop()
        error = sys.exc_info()[1]  # the call's own error while it unwinds (not one an `except` around it handles)
        if self.report.failed_in is None and error is not None and error is not handled_at_entry:
            self.report.failed_in = name
        self.depth[key] -= 1
        if self.depth[key] or key not in self.real:
            return
        for slot in self.slots[key]:
            getattr(module, slot.kind)[slot.name] = slot.meta
        reals = self.real.pop(key)
        self.report.live_bytes -= _bytes(reals)
        viewed = {t.untyped_storage().data_ptr() for t in tree_leaves(output) if isinstance(t, torch.Tensor)}
        for value in reals:
            if value.untyped_storage().data_ptr() not in viewed:  # an output that views it keeps it (freed with it)
                value.untyped_storage().resize_(0)  # the traced step's graph may still reference it


def _bytes(tensors: list[torch.Tensor]) -> int:
    return sum(s.nbytes() for s in {t.untyped_storage()._cdata: t.untyped_storage() for t in tensors}.values())


@contextmanager
def materialize_per_call(model: nn.Module, device: torch.device | str | None = None) -> Iterator[PerCallReport]:
    """Inside, each module of ``model`` (built under delayed init) holds real weights during its calls only.

    See [Note: per-call materialisation]. The model's tensors are its meta tensors again on exit.

    Args:
        model: a model built under :func:`~lightning_mp.delay_param_initialization`, not materialised.
        device: where the real weights go (the replay runs on CPU); ``None``: CPU.

    Yields:
        A :class:`PerCallReport`, filled as the modules run.

    Raises:
        ValueError: if ``model`` was not built under delayed init, or was built under a CUDA device.
    """
    record = find_record(model)
    if record is None:
        raise ValueError(f"{type(model).__name__} was not built under delayed parameter initialisation.")
    if record.cuda_rng_states or record.storage_devices:
        raise ValueError(
            "A model built under delayed init on a CUDA device cannot be materialised module by module for the"
            " partitioning trace (it replays on CPU). Build it on CPU, or build it eagerly."
        )
    state = _PerCall(model, record, None if device is None else torch.device(device))
    handles = []
    for module in model.modules():
        handles.append(module.register_forward_pre_hook(state.pre_hook))
        handles.append(module.register_forward_hook(state.post_hook, always_call=True))
    try:
        yield state.report  # a call that raises gives its weights back too (its post hook is `always_call`)
    finally:
        for handle in handles:
            handle.remove()
