"""Replaying an init record on the storages one rank owns (see [Note: delayed init replays the eager init record]).

A storage is *needed* if a rank keeps a tensor on it, or if an op that writes a needed storage reads it
(closure over the tape, backwards). Replaying in tape order:

- an op that writes a needed storage runs for real (factory outputs become the storage itself);
- a random op that writes only other storages runs on same-shape scratch tensors, freed at once, so the
  generator advances exactly as in the eager build;
- every other op is skipped (views need no replay: each argument is rebuilt from its storage, shape,
  stride and offset).

A storage is freed after its last use unless a kept tensor lives on it, so the peak is the kept bytes plus the
largest temporary, never another stage's parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from lightning_mp.init._record import InitRecord, RecordedOp, SetRngState, TensorRef, find_record, forget_record

__all__ = ["MaterializeReport", "ShardFn", "advance_rng", "materialize_module", "replay"]

ShardFn = Callable[[str, torch.Tensor], torch.Tensor]
"""``shard_fn(fqn, full_tensor) -> kept_tensor``: what a rank keeps of a materialised tensor (e.g. its tensor-
parallel slice; return a copy, so the full tensor is freed). Called once per distinct tensor, under its first
FQN."""


@dataclass(frozen=True)
class MaterializeReport:
    """What :func:`materialize_module` did.

    Attributes:
        num_tensors: parameters and buffers materialised (distinct tensors).
        kept_bytes: bytes of the storages kept for them.
        ops_run: tape ops run for real.
        ops_scratch: random ops run on scratch tensors (other ranks' tensors).
        max_scratch_bytes: the largest scratch allocation.
        peak_bytes: the most bytes of real (non-scratch) storages alive at once during the replay.
    """

    num_tensors: int
    kept_bytes: int
    ops_run: int
    ops_scratch: int
    max_scratch_bytes: int
    peak_bytes: int = 0


class _Storages:
    """Real storages by storage id, allocated as the tape creates them and freed after their last use."""

    def __init__(self, record: InitRecord) -> None:
        self.record = record
        self.real: dict[int, torch.UntypedStorage] = {}

    def view(self, ref: TensorRef) -> torch.Tensor:
        if ref.sid not in self.real:
            constant = self.record.constants.get(ref.sid)
            if constant is None:
                raise RuntimeError(f"internal: storage {ref.sid} is read before the op that creates it ran")
            self.real[ref.sid] = constant.untyped_storage()
        storage = self.real[ref.sid]
        return torch.empty(0, dtype=ref.dtype, device=storage.device).set_(storage, ref.offset, ref.shape, ref.stride)

    def adopt(self, ref: TensorRef, result: torch.Tensor) -> None:
        """Make ``result`` (an op's fresh output) the storage ``ref`` names, copying only if its layout differs."""
        storage = result.untyped_storage()
        same = (
            storage.nbytes() == self.record.storage_nbytes[ref.sid]
            and result.storage_offset() == ref.offset
            and tuple(result.stride()) == ref.stride
        )
        if same:
            self.real[ref.sid] = storage
            return
        self.real[ref.sid] = torch.UntypedStorage(self.record.storage_nbytes[ref.sid], device=result.device)
        self.view(ref).copy_(result)


def _needed(ops: list[RecordedOp | SetRngState], kept: set[int]) -> set[int]:
    need = set(kept)
    for op in reversed(ops):
        if isinstance(op, RecordedOp) and op.writes & need:
            need |= op.reads
    return need


def _last_use(ops: list[RecordedOp | SetRngState]) -> dict[int, int]:
    last: dict[int, int] = {}
    for index, op in enumerate(ops):
        if isinstance(op, SetRngState):
            continue
        for sid in op.reads | op.writes:
            last[sid] = index
    return last


def _fill_dtype(op: RecordedOp, kwargs: dict) -> dict:
    """Factories that took the default dtype get the recorded one (the default may differ at replay)."""
    names = {a.name for a in op.func._schema.arguments}
    if "dtype" in names and kwargs.get("dtype") is None and len(op.outputs) == 1:
        return {**kwargs, "dtype": op.outputs[0].dtype}
    return kwargs


def _run(op: RecordedOp, convert: Callable[[TensorRef], torch.Tensor]) -> object:
    args, kwargs = tree_map(lambda x: convert(x) if isinstance(x, TensorRef) else x, (op.args, op.kwargs))
    return op.func(*args, **_fill_dtype(op, kwargs))


def _scratch(ref: TensorRef) -> torch.Tensor:
    return torch.empty_strided(ref.shape, ref.stride, dtype=ref.dtype)


def replay(record: InitRecord, kept: Iterable[int]) -> tuple[dict[int, torch.UntypedStorage], MaterializeReport]:
    """Replay ``record`` from its start random state; return the real storages of ``kept`` (storage ids).

    The process's random state is left as it was (``torch.random.fork_rng``).
    """
    kept = set(kept)
    need, last = _needed(record.ops, kept), _last_use(record.ops)
    storages = _Storages(record)
    ran = scratched = max_scratch = peak = 0
    devices = list(range(len(record.cuda_rng_states)))
    with torch.random.fork_rng(devices=devices):
        _set_start_state(record)
        for index, op in enumerate(record.ops):
            if isinstance(op, SetRngState):
                torch.set_rng_state(op.state)
                continue
            if op.writes & need:
                result = _run(op, storages.view)
                fresh = [o for o in op.outputs if o.sid in op.writes and o.sid not in storages.real]
                if fresh:
                    results = [t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)]
                    for ref, tensor in zip(op.outputs, results):
                        if ref in fresh:
                            storages.adopt(ref, tensor)
                ran += 1
            elif op.random:
                result = _run(op, _scratch)
                outputs = [r for r in tree_flatten(result)[0] if isinstance(r, torch.Tensor)]
                max_scratch = max(max_scratch, sum(r.numel() * r.element_size() for r in outputs))
                del result, outputs
                scratched += 1
            peak = max(peak, sum(s.nbytes() for s in storages.real.values()))
            for sid in op.reads | op.writes:
                if last[sid] == index and sid not in kept:
                    storages.real.pop(sid, None)
    real = {sid: storages.real[sid] for sid in kept if sid in storages.real}
    report = MaterializeReport(
        num_tensors=0, kept_bytes=sum(s.nbytes() for s in real.values()), ops_run=ran, ops_scratch=scratched,
        max_scratch_bytes=max_scratch, peak_bytes=peak,
    )
    return real, report


def advance_rng(record: InitRecord) -> None:
    """Move the process's generators forward by the build's draws (all on scratch), as an eager build would."""
    _set_start_state(record)
    for op in record.ops:
        if isinstance(op, SetRngState):
            torch.set_rng_state(op.state)
        elif op.random:
            _run(op, _scratch)


def _set_start_state(record: InitRecord) -> None:
    assert record.cpu_rng_state is not None
    torch.set_rng_state(record.cpu_rng_state)
    for device, state in enumerate(record.cuda_rng_states):
        torch.cuda.set_rng_state(state, device)


def _meta_tensors(model: nn.Module) -> dict[int, tuple[str, torch.Tensor, tuple[nn.Module, str]]]:
    """Distinct meta parameters and buffers still held by ``model``: first FQN, tensor, (module, name) slot."""
    found: dict[int, tuple[str, torch.Tensor, tuple[nn.Module, str]]] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for kind in ("_parameters", "_buffers"):
            for name, tensor in getattr(module, kind).items():
                if tensor is not None and tensor.is_meta and id(tensor) not in found:
                    found[id(tensor)] = (f"{prefix}.{name}" if prefix else name, tensor, (module, name))
    return found


def materialize_module(
    model: nn.Module, device: torch.device | str | None = None, shard_fn: ShardFn | None = None
) -> MaterializeReport:
    """Allocate and initialise every meta parameter and buffer ``model`` still holds, as the eager build did.

    Call it after dropping what this rank does not own (the ``smp`` strategy does, after partitioning): only the
    tensors left are allocated. Each tensor keeps its Python identity (``torch.utils.swap_tensors``), so tied
    parameters stay tied and references held elsewhere see the data. Values are converted to the meta tensor's
    dtype (e.g. after ``model.to(torch.bfloat16)`` on meta) and moved to ``device``.

    Args:
        model: a model built under :func:`~lightning_mp.delay_param_initialization`.
        device: where the tensors go; ``None`` keeps the device the build asked for.
        shard_fn: optional ``(fqn, full) -> kept`` per tensor (tensor parallelism: materialise full, slice, free).

    Returns:
        A :class:`MaterializeReport`.

    Raises:
        RuntimeError: if a meta tensor was not made under delayed init (it has no recorded init).
    """
    record = find_record(model)
    targets = _meta_tensors(model)
    if not targets:
        return MaterializeReport(0, 0, 0, 0, 0)
    refs = {key: record.ref(t, slot) if record is not None else None for key, (_, t, slot) in targets.items()}
    missing = [fqn for key, (fqn, _, _) in targets.items() if refs[key] is None]
    if missing:
        raise RuntimeError(
            f"Tensors {missing[:5]} are on the meta device but were not built under"
            " `lightning_mp.delay_param_initialization()` (or `trainer.init_module(empty_init=True)`), so their"
            " initial values are unknown. Build the whole model inside one delayed-init block, or eagerly."
        )
    real, report = replay(record, {ref.sid for ref in refs.values()})
    storages = _Storages(record)
    storages.real = real
    for key, (fqn, meta, _) in targets.items():
        value = storages.view(refs[key]).to(device=device, dtype=meta.dtype)
        if shard_fn is not None:
            value = shard_fn(fqn, value)
        if isinstance(meta, nn.Parameter):
            value = type(meta)(value, requires_grad=meta.requires_grad)
        torch.utils.swap_tensors(meta, value)
    del real, storages
    forget_record(model)
    return MaterializeReport(
        num_tensors=len(targets), kept_bytes=report.kept_bytes, ops_run=report.ops_run,
        ops_scratch=report.ops_scratch, max_scratch_bytes=report.max_scratch_bytes, peak_bytes=report.peak_bytes,
    )
