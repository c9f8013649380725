"""Replaying an init record on the storages one rank owns (see [Note: delayed init replays the eager init record]).

A storage is *needed* if a rank keeps a tensor on it, or if an op that writes a needed storage reads it
(closure over the tape, backwards). Replaying in tape order:

- an op that writes a needed storage runs for real (factory outputs become the storage itself);
- a random op that writes only other storages runs on same-shape scratch tensors, freed at once, so the
  generator advances exactly as in the eager build;
- every other op is skipped (views need no replay: each argument is rebuilt from its storage, shape,
  stride and offset).

A storage is freed after its last use unless a kept tensor lives on it, so the peak is the kept bytes plus the
largest temporary, never another stage's parameters. A kept storage is handed over as soon as its last op has
run, so a tensor that is only sliced (``shard_fn``, or a deferred load into a tensor-parallel module, see
:func:`defer_load`) is cut and freed before the next one is made: the peak is then the rank's shards plus one
full tensor (Megatron's "materialise the full tensor, slice, free").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils._pytree import tree_flatten, tree_map

from lightning_mp.init._tape import InitRecord, RecordedOp, SetRngState, TensorRef, find_record, forget_record

__all__ = ["MaterializeReport", "ShardFn", "advance_rng", "defer_load", "materialize_module", "replay"]

_DEFERRED_ATTR = "_lightning_mp_deferred_load"

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
        peak_bytes: the most bytes of real (non-scratch) storages alive at once during the replay (the ones
            the replay holds plus the ones already handed to the model).
        loaded_bytes: bytes of full tensors loaded into deferred targets (:func:`defer_load`) and freed after.
    """

    num_tensors: int
    kept_bytes: int
    ops_run: int
    ops_scratch: int
    max_scratch_bytes: int
    peak_bytes: int = 0
    loaded_bytes: int = 0


class _Storages:
    """Real storages by storage id, allocated as the tape creates them and freed after their last use."""

    def __init__(self, record: InitRecord) -> None:
        self.record = record
        self.real: dict[int, torch.UntypedStorage] = {}
        self.live = 0  # bytes in `real` (summing it per op would be quadratic on a long tape)
        # uninitialised factories (`torch.empty`) not run yet: allocated when an op first touches their storage,
        # so a tensor created long before its init (`self.apply(init_weights)` at the end of `__init__`) takes
        # no memory in between
        self.pending: dict[int, RecordedOp] = {}

    def ensure(self, sid: int) -> None:
        """Run the pending factory of ``sid`` now, if any."""
        op = self.pending.pop(sid, None)
        if op is None:
            return
        out = next(o for o in op.outputs if o.sid == sid)
        devices = self.record.storage_devices
        if op.func in _LAZY:
            self.adopt(out, _run(op, self.view, devices))
        else:  # its factory's values are dead (overwritten whole before any read): a fresh allocation will do
            device = devices.get(sid, _CPU)
            self.adopt(out, torch.empty_strided(out.shape, out.stride, dtype=out.dtype, device=device))

    def _put(self, sid: int, storage: torch.UntypedStorage) -> None:
        self.real[sid] = storage
        self.live += storage.nbytes()

    def pop(self, sid: int) -> torch.UntypedStorage:
        storage = self.real.pop(sid)
        self.live -= storage.nbytes()
        return storage

    def view(self, ref: TensorRef) -> torch.Tensor:
        self.ensure(ref.sid)
        if ref.sid not in self.real:
            constant = self.record.constants.get(ref.sid)
            if constant is None:
                raise RuntimeError(f"internal: storage {ref.sid} is read before the op that creates it ran")
            self._put(ref.sid, constant.untyped_storage())
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
            self._put(ref.sid, storage)
            return
        self._put(ref.sid, torch.UntypedStorage(self.record.storage_nbytes[ref.sid], device=result.device))
        self.view(ref).copy_(result)


_LAZY = frozenset({torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default})
# in-place ops whose result does not depend on what ``self`` held: a write of the whole storage "kills" it
_OVERWRITES = frozenset(
    {
        torch.ops.aten.normal_.default, torch.ops.aten.uniform_.default, torch.ops.aten.fill_.Scalar,
        torch.ops.aten.fill_.Tensor, torch.ops.aten.zero_.default, torch.ops.aten.copy_.default,
        torch.ops.aten.bernoulli_.float, torch.ops.aten.exponential_.default, torch.ops.aten.log_normal_.default,
        torch.ops.aten.cauchy_.default, torch.ops.aten.geometric_.default, torch.ops.aten.random_.default,
        getattr(torch.ops.aten.random_, "from"), torch.ops.aten.random_.to,
    }
)


def _covers(ref: TensorRef, nbytes: int) -> bool:
    """Whether the view ``ref`` is every byte of its storage, each once (dense, non-overlapping, offset 0)."""
    if ref.offset != 0 or math.prod(ref.shape) * ref.dtype.itemsize != nbytes:
        return False
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(ref.shape, ref.stride) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _kills(op: RecordedOp, record: InitRecord, factories: set[int]) -> frozenset[int]:
    """Storages ``op`` overwrites whole without reading (only those a pure factory made: they can be
    allocated again from it)."""
    if op.func not in _OVERWRITES or not op.args or not isinstance(op.args[0], TensorRef):
        return frozenset()
    target = op.args[0]
    if target.sid in factories and _covers(target, record.storage_nbytes[target.sid]):
        return frozenset({target.sid})
    return frozenset()


@dataclass
class _Plan:
    """Which ops a rank runs for real, and where storages first and last appear among them."""

    real: list[bool]
    creator: dict[int, int]  # sid -> index of the pure factory that made it
    last: dict[int, int]  # sid -> last real op touching it


def _plan(record: InitRecord, kept: set[int]) -> _Plan:
    """Backward liveness over the tape: an op runs for real if it writes a storage whose value is needed later;
    a whole overwrite (``normal_`` after ``kaiming_uniform_``) makes the earlier writes dead, so a tensor
    re-initialised at the end of ``__init__`` (``self.apply(_init_weights)``) is only allocated there."""
    ops = record.ops
    creator: dict[int, int] = {}
    for index, op in enumerate(ops):
        if isinstance(op, RecordedOp) and not op.reads:
            for out in op.outputs:
                if out.sid in op.writes:
                    creator.setdefault(out.sid, index)
    factories = set(creator)
    real = [False] * len(ops)
    live = set(kept)
    for index in range(len(ops) - 1, -1, -1):
        op = ops[index]
        if isinstance(op, SetRngState) or not op.writes & live:
            continue
        real[index] = True
        kills = _kills(op, record, factories)
        live -= kills
        live |= op.reads - kills
    last: dict[int, int] = {}
    for index, op in enumerate(ops):
        if real[index]:
            for sid in op.reads | op.writes:
                last[sid] = index
    return _Plan(real, creator, last)


def _fill_dtype(op: RecordedOp, kwargs: dict) -> dict:
    """Factories that took the default dtype get the recorded one (the default may differ at replay)."""
    names = {a.name for a in op.func._schema.arguments}
    if "dtype" in names and kwargs.get("dtype") is None and len(op.outputs) == 1:
        return {**kwargs, "dtype": op.outputs[0].dtype}
    return kwargs


def _run(op: RecordedOp, convert: Callable[[TensorRef], torch.Tensor], devices: dict[int, torch.device]) -> object:
    """Run ``op`` on real tensors; a factory makes its output on the device of the eager build (the recorded
    ``device=`` may be a build tensor's meta device: ``torch.randn(n, device=w.device)``)."""
    args, kwargs = tree_map(lambda x: convert(x) if isinstance(x, TensorRef) else x, (op.args, op.kwargs))
    if "device" in kwargs and op.outputs:
        kwargs = {**kwargs, "device": devices.get(op.outputs[0].sid, _CPU)}
    return op.func(*args, **_fill_dtype(op, kwargs))


_CPU = torch.device("cpu")


# [Note: chunked scratch draws] A random op on another rank's tensor only has to advance the generator as the
# full op would. CPU generators draw a fixed count per element for these in-place fills, so the op can run on a
# small buffer, chunk after chunk, as long as every chunk but the last is a multiple of 16 elements and the last
# has at least 16 (`normal_` fills 16 at a time and redraws a ragged tail). That saves a scratch tensor as large
# as the largest tensor of another stage at the setup peak. It is checked once per op and dtype against a full
# draw (`_chunking_holds`), and used only for contiguous CPU tensors; anything else runs on a full-size scratch.
_CHUNKED = frozenset(
    {
        torch.ops.aten.normal_.default, torch.ops.aten.uniform_.default, torch.ops.aten.bernoulli_.float,
        torch.ops.aten.exponential_.default, torch.ops.aten.log_normal_.default, torch.ops.aten.cauchy_.default,
        torch.ops.aten.geometric_.default, torch.ops.aten.random_.default, torch.ops.aten.random_.to,
        getattr(torch.ops.aten.random_, "from"),
    }
)
_CHUNK = 1 << 16  # elements, a multiple of 16
_CHUNKING_HOLDS: dict[tuple, bool] = {}


def _contiguous(ref: TensorRef) -> bool:
    expected = 1
    for size, stride in reversed(list(zip(ref.shape, ref.stride))):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _chunks(numel: int) -> list[int]:
    sizes, left = [], numel
    while left:
        size = _CHUNK if left - _CHUNK >= 16 else left
        sizes.append(size)
        left -= size
    return sizes


def _fill(func, buffer: torch.Tensor, sizes: list[int], args: tuple, kwargs: dict) -> None:
    for size in sizes:
        func(buffer[:size], *args, **kwargs)


def _chunking_holds(func, dtype: torch.dtype, args: tuple, kwargs: dict) -> bool:
    """Whether chunked draws advance the CPU generator as one full draw does, for this op and dtype."""
    key = (func, dtype, args, tuple(sorted(kwargs.items())))
    if key not in _CHUNKING_HOLDS:
        numel = 2 * _CHUNK + 37
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            func(torch.empty(numel, dtype=dtype), *args, **kwargs)
            full = torch.get_rng_state()
            torch.manual_seed(0)
            _fill(func, torch.empty(_CHUNK + 16, dtype=dtype), _chunks(numel), args, kwargs)
            _CHUNKING_HOLDS[key] = torch.equal(full, torch.get_rng_state())
    return _CHUNKING_HOLDS[key]


def _draw_on_scratch(op: RecordedOp, devices: dict[int, torch.device]) -> int:
    """Run random ``op`` on scratch memory only (see [Note: chunked scratch draws]), on the device each tensor
    would have had in the eager build (``InitRecord.storage_devices``); returns the bytes used."""
    target = op.args[0] if op.args else None
    rest = (op.args[1:], op.kwargs)
    chunkable = (
        op.func in _CHUNKED
        and isinstance(target, TensorRef)
        and not any(isinstance(x, TensorRef) for x in tree_flatten(rest)[0])
        and math.prod(target.shape) > _CHUNK + 16
        and _contiguous(target)
        and op.kwargs.get("generator") is None
        and target.sid not in devices  # on CPU
    )
    if chunkable and _chunking_holds(op.func, target.dtype, op.args[1:], op.kwargs):
        buffer = torch.empty(_CHUNK + 16, dtype=target.dtype)
        _fill(op.func, buffer, _chunks(math.prod(target.shape)), op.args[1:], op.kwargs)
        return buffer.numel() * buffer.element_size()
    scratch = lambda ref: torch.empty_strided(ref.shape, ref.stride, dtype=ref.dtype, device=devices.get(ref.sid, _CPU))  # noqa: E731
    result = _run(op, scratch, devices)  # a random factory draws where the eager one did
    return sum(r.numel() * r.element_size() for r in tree_flatten(result)[0] if isinstance(r, torch.Tensor))


OnReady = Callable[[int, torch.UntypedStorage], int]
"""``on_ready(sid, storage) -> bytes kept``: a kept storage whose last op has run (the replay lets go of it)."""


def _release_last_uses(
    op: RecordedOp, index: int, last: dict[int, int], storages: _Storages, kept: set[int], on_ready: OnReady | None
) -> int:
    """After op ``index`` ran: free the storages it used last that are not ``kept``, hand the kept ones to
    ``on_ready``; returns the bytes ``on_ready`` keeps."""
    held = 0
    for sid in op.reads | op.writes:
        if last[sid] != index:
            continue
        if sid not in storages.real:
            if sid not in kept:
                storages.pending.pop(sid, None)
            continue
        if sid not in kept:
            storages.pop(sid)
        elif on_ready is not None:
            held += on_ready(sid, storages.pop(sid))
    return held


def replay(
    record: InitRecord,
    kept: Iterable[int],
    on_ready: OnReady | None = None,
    rng_states: dict[int, torch.Tensor] | None = None,
) -> tuple[dict[int, torch.UntypedStorage], MaterializeReport]:
    """Replay ``record`` from its start random state; return the real storages of ``kept`` (storage ids).

    With ``on_ready``, each kept storage is handed to it right after its last op instead (and not returned);
    it returns how many bytes of it the caller keeps (for ``peak_bytes``). With ``rng_states`` (from
    :func:`advance_rng`: the CPU generator state before each random op, by tape index), a random op that runs for
    real starts from its recorded state and the others are not drawn at all, so only the ops ``kept`` needs run
    (CPU builds only). The process's random state is left as it was (``torch.random.fork_rng``).
    """
    kept = set(kept)
    plan = _plan(record, kept)
    last = plan.last
    storages = _Storages(record)
    ran = scratched = max_scratch = peak = held = 0
    devices = list(range(len(record.cuda_rng_states)))
    with torch.random.fork_rng(devices=devices):
        _set_start_state(record)
        for index, op in enumerate(record.ops):
            if isinstance(op, SetRngState):
                torch.set_rng_state(op.state)
                continue
            made = [o.sid for o in op.outputs if plan.creator.get(o.sid) == index and o.sid in last]
            if plan.real[index] and op.func in _LAZY and len(op.outputs) == 1 and made:
                storages.pending[made[0]] = op  # allocated when first touched
                ran += 1
            elif plan.real[index]:
                if op.random and rng_states is not None:
                    torch.set_rng_state(rng_states[index])
                result = _run(op, storages.view, record.storage_devices)
                fresh = [o for o in op.outputs if o.sid in op.writes and o.sid not in storages.real]
                if fresh:
                    results = [t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)]
                    for ref, tensor in zip(op.outputs, results):
                        if ref in fresh:
                            storages.adopt(ref, tensor)
                del result
                ran += 1
            else:
                for sid in made:  # its values are dead, but a later op overwrites the storage: allocate it then
                    storages.pending[sid] = op
                if op.random and rng_states is None:
                    max_scratch = max(max_scratch, _draw_on_scratch(op, record.storage_devices))
                    scratched += 1
            peak = max(peak, storages.live + held)
            if plan.real[index]:
                held += _release_last_uses(op, index, last, storages, kept, on_ready)
        for sid in sorted(kept & set(storages.pending)):  # kept `torch.empty` tensors nothing initialised
            storages.ensure(sid)
    if on_ready is not None:
        for sid in sorted(kept & set(storages.real)):  # kept storages the tape never touched after making them
            held += on_ready(sid, storages.pop(sid))
    real = {sid: storages.real[sid] for sid in kept if sid in storages.real}
    report = MaterializeReport(
        num_tensors=0, kept_bytes=sum(s.nbytes() for s in real.values()) + held, ops_run=ran, ops_scratch=scratched,
        max_scratch_bytes=max_scratch, peak_bytes=peak,
    )
    return real, report


def advance_rng(record: InitRecord, rng_states: dict[int, torch.Tensor] | None = None) -> None:
    """Move the process's generators forward by the build's draws (all on scratch), as an eager build would.

    ``rng_states``: filled with the CPU generator state before each random op, by tape index (for
    :func:`replay`'s ``rng_states``).
    """
    _set_start_state(record)
    for index, op in enumerate(record.ops):
        if isinstance(op, SetRngState):
            torch.set_rng_state(op.state)
        elif op.random:
            if rng_states is not None:
                rng_states[index] = torch.get_rng_state()
            _draw_on_scratch(op, record.storage_devices)


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


def defer_load(target: nn.Module, source: nn.Module) -> None:
    """At materialisation, load ``source``'s state (built under delayed init, on meta) into ``target``.

    For modules that replace part of a delayed model before it is materialised (tensor-parallel swaps): eagerly
    they would run ``target.load_state_dict(source.state_dict())`` (a distributed module keeps its shard of each
    full tensor); delayed, :func:`materialize_module` on a model that contains ``target`` does the same one key
    at a time, as soon as that tensor's init ops have replayed, and frees the full tensor right after, so a rank
    never holds more than one full tensor it does not own. ``target`` must already hold real tensors (its own
    shards); keys whose ``target`` tensor is still on meta are materialised as the model's own tensors instead.

    Raises:
        ValueError: if ``source`` was not built under delayed init, or the state-dict keys differ.
    """
    if find_record(source) is None:
        raise ValueError(f"{type(source).__name__} was not built under delayed parameter initialisation.")
    keys, target_keys = set(_state_tensors(source)), set(_state_tensors(target))
    if keys != target_keys:
        raise ValueError(
            f"{type(target).__name__} does not have the state-dict keys of {type(source).__name__}: missing"
            f" {sorted(keys - target_keys)[:4]}, unexpected {sorted(target_keys - keys)[:4]}."
        )
    target.__dict__[_DEFERRED_ATTR] = source  # not a submodule: it is not part of the model


def _state_tensors(module: nn.Module) -> dict[str, tuple[torch.Tensor, tuple[nn.Module, str]]]:
    """``state_dict`` keys -> (tensor, its (module, name) slot), without running state-dict hooks (no collectives)."""
    out = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for name, tensor in [*sub._parameters.items(), *sub._buffers.items()]:
            if tensor is not None and name not in sub._non_persistent_buffers_set:
                out[f"{prefix}.{name}" if prefix else name] = (tensor, (sub, name))
    return out


def _deferred_loads(model: nn.Module) -> list[tuple[str, nn.Module, nn.Module]]:
    """(FQN, target, source) of every :func:`defer_load` inside ``model``."""
    return [(fqn, m, m.__dict__[_DEFERRED_ATTR]) for fqn, m in model.named_modules() if _DEFERRED_ATTR in m.__dict__]


def _consumers(
    record: InitRecord | None, targets: dict[int, tuple[str, torch.Tensor, tuple[nn.Module, str]]],
    loads: list[tuple[str, nn.Module, nn.Module]],
) -> tuple[InitRecord | None, dict[int, list[tuple[str, object, TensorRef]]]]:
    """The record, and per storage id who takes its values: ``("own", key)`` swaps a model tensor in,
    ``("load", (target, key, source tensor))`` loads a deferred target's shard.

    Raises:
        RuntimeError: if a meta tensor (or a deferred source's) has no recorded init, or a deferred source was
            built in another delayed-init block.
    """
    consumers: dict[int, list[tuple[str, object, TensorRef]]] = {}
    missing: list[str] = []
    for key, (fqn, tensor, slot) in targets.items():
        ref = record.ref(tensor, slot) if record is not None else None
        if ref is None:
            missing.append(fqn)
        else:
            consumers.setdefault(ref.sid, []).append(("own", key, ref))
    for prefix, target, source in loads:
        source_record = find_record(source)
        if record is None:
            record = source_record
        if source_record is not record:
            raise RuntimeError(f"{prefix}: its deferred source was built in another delayed-init block than the model.")
        target_tensors = _state_tensors(target)
        for key, (tensor, slot) in _state_tensors(source).items():
            if target_tensors[key][0].is_meta:  # e.g. a replicated tied weight the swap kept as the original
                continue
            ref = record.ref(tensor, slot)
            if ref is None:
                missing.append(f"{prefix}.{key} (source)")
            else:
                consumers.setdefault(ref.sid, []).append(("load", (target, key, tensor), ref))
    if missing:
        raise RuntimeError(
            f"Tensors {missing[:5]} are on the meta device but were not built under"
            " `lightning_mp.delay_param_initialization()` (or `trainer.init_module(empty_init=True)`), so their"
            " initial values are unknown. Build the whole model inside one delayed-init block, or eagerly."
        )
    return record, consumers


def _local_piece(full: torch.Tensor, meta: DTensor) -> DTensor:
    """This rank's piece of ``full`` (the whole tensor) as a DTensor laid out like ``meta`` (a meta DTensor, e.g.
    an FSDP2 shard made by ``fully_shard`` on a meta model): a copy, so that ``full`` can be freed. No
    communication (``distribute_tensor(..., src_data_rank=None)`` splits locally): every rank replays the same
    ``full`` and keeps its own piece."""
    piece = distribute_tensor(full, meta.device_mesh, meta.placements, src_data_rank=None).to_local()
    return DTensor.from_local(
        piece.clone(memory_format=torch.contiguous_format), meta.device_mesh, meta.placements, run_check=False,
        shape=meta.shape, stride=meta.stride(),
    )


def materialize_module(
    model: nn.Module, device: torch.device | str | None = None, shard_fn: ShardFn | None = None
) -> MaterializeReport:
    """Allocate and initialise every meta parameter and buffer ``model`` still holds, as the eager build did.

    Call it after dropping what this rank does not own (the ``smp`` strategy does, after partitioning): only the
    tensors left are allocated. Each tensor keeps its Python identity and attributes (``torch.utils.swap_tensors``),
    so tied parameters stay tied and references held elsewhere see the data. Values are converted to the meta
    tensor's dtype (e.g. after ``model.to(torch.bfloat16)`` on meta) and moved to ``device``. Modules swapped in
    before materialisation (:func:`defer_load`, tensor parallelism) load their shards of the original tensors. A
    meta DTensor (``fully_shard`` applied on meta, torchtitan's order) gets this rank's piece of the full tensor
    (split locally, no communication), so a sharded model is materialised straight into its shards: the rank holds
    its shards plus one full tensor at a time.
    Each tensor is handed over as soon as its init ops have run, so with ``shard_fn`` or deferred loads a full
    tensor is freed before the next one is made.

    Args:
        model: a model built under :func:`~lightning_mp.delay_param_initialization`.
        device: where the tensors go; ``None`` keeps the device the build asked for.
        shard_fn: optional ``(fqn, full) -> kept`` per tensor (tensor parallelism: materialise full, slice, free).

    Returns:
        A :class:`MaterializeReport`.

    Raises:
        RuntimeError: if a meta tensor was not made under delayed init (it has no recorded init).
    """
    targets = _meta_tensors(model)
    loads = _deferred_loads(model)
    record, consumers = _consumers(find_record(model), targets, loads)
    if not consumers:
        for _, target, _ in loads:
            del target.__dict__[_DEFERRED_ATTR]
        return MaterializeReport(0, 0, 0, 0, 0)
    for _, target, _ in loads:
        if device is not None:  # the target's own tensors (made by its constructor) go where the model goes
            target._apply(lambda t: t if t.is_meta else t.to(device))
    loaded = 0

    def hand_over(sid: int, storage: torch.UntypedStorage) -> int:
        nonlocal loaded
        storages = _Storages(record)
        storages.real[sid] = storage
        kept: dict[int, int] = {}  # data_ptr -> nbytes of the storages the model keeps from this one
        for kind, item, ref in consumers[sid]:
            if kind == "own":
                fqn, meta, _ = targets[item]
                value = storages.view(ref).to(device=device, dtype=meta.dtype)
                if isinstance(meta, DTensor):
                    value = _local_piece(value, meta)
                elif shard_fn is not None:
                    value = shard_fn(fqn, value)
                if isinstance(meta, nn.Parameter):  # a DTensor parameter's type is DTensor: make a Parameter of it
                    make = nn.Parameter if isinstance(meta, DTensor) else type(meta)
                    value = make(value, requires_grad=meta.requires_grad)
                value.__dict__.update(meta.__dict__)  # swap_tensors swaps __dict__: keep marks (tp specs, flags)
                torch.utils.swap_tensors(meta, value)
                held = (meta.to_local() if isinstance(meta, DTensor) else meta).untyped_storage()
                kept[held.data_ptr()] = held.nbytes()
            else:
                target, key, source = item
                value = storages.view(ref).to(device=device, dtype=source.dtype)
                loaded += value.numel() * value.element_size()
                target.load_state_dict({key: value}, strict=False)  # the target's hooks keep its shard
                del value
        return sum(kept.values())

    _, report = replay(record, consumers, on_ready=hand_over)
    for _, target, _ in loads:
        del target.__dict__[_DEFERRED_ATTR]
    forget_record(model)
    return MaterializeReport(
        num_tensors=len(targets), kept_bytes=report.kept_bytes, ops_run=report.ops_run,
        ops_scratch=report.ops_scratch, max_scratch_bytes=report.max_scratch_bytes, peak_bytes=report.peak_bytes,
        loaded_bytes=loaded,
    )
