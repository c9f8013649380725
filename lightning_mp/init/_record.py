"""Recording a model build on the meta device: the init record of :func:`delay_param_initialization`.

[Note: delayed init replays the eager init record]
A model built under :func:`delay_param_initialization` allocates nothing: a recording
:class:`~torch.utils._python_dispatch.TorchDispatchMode` sends every factory op to the meta device and appends
every aten op to a tape, with each tensor named by its storage (``TensorRef``: storage id, shape, stride, offset,
dtype; the tape's types are in ``_tape.py``). After partitioning, a rank replays the tape from the random-number
state the build started with (:mod:`lightning_mp.init._replay`): ops that write a storage it needs run for real,
random ops on other storages run on a same-shape scratch tensor that is freed at once, and everything else is
skipped. CPU generators cannot skip ahead, so drawing the same numbers in the same order is the only way the owned
tensors come out bitwise equal to an eager one-process build with the same seed, on every layout. When the block
exits, the process's generators are moved forward by the same draws (scratch only), so code after the build sees
the random state an eager build leaves. The dispatch mode is not a ``torch.device("meta")`` context, so libraries
that skip weight init on a meta device context (transformers 5.x) still run their init, and the tape gets it. Under
tensor parallelism the swapped-in distributed modules are built for real (their local shards) and load their shard
of each original tensor when the replay has made it (:func:`lightning_mp.init.defer_load`), which is freed right
after: the eager tp path's weights, with at most one full tensor alive at a time.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from lightning_mp.init._replay import advance_rng
from lightning_mp.init._tape import _RECORD_ATTR, InitRecord, RecordedOp, SetRngState, TensorRef

__all__ = ["delay_param_initialization", "is_recording"]

_ACTIVE = threading.local()


def _is_random(func: torch._ops.OpOverload) -> bool:
    return torch.Tag.nondeterministic_seeded in func.tags


def _mutated_args(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> list[Any]:
    """The values passed to arguments the schema marks as written (``Tensor(a!)``)."""
    written = []
    for index, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        if argument.kwarg_only or index >= len(args):
            if argument.name in kwargs:
                written.append(kwargs[argument.name])
        else:
            written.append(args[index])
    return written


class _Recorder(TorchDispatchMode):
    """Factories to meta, every op on the tape (see [Note: delayed init replays the eager init record])."""

    def __init__(self, record: InitRecord) -> None:
        super().__init__()
        self.record = record
        self._twins: dict[int, torch.Tensor] = {}  # real storage id -> a meta tensor over a twin storage
        self._rng_state = record.cpu_rng_state  # meta ops draw nothing: it changes only by re-seeding

    def note_reseed(self) -> None:
        """Put a :class:`SetRngState` on the tape if the CPU generator was re-seeded since the last random op."""
        state = torch.get_rng_state()
        if self._rng_state is None or not torch.equal(state, self._rng_state):
            self.record.ops.append(SetRngState(state))
            self._rng_state = state

    def _to_meta(self, value: Any) -> Any:
        """Real tensors from outside the build become meta twins; their data is kept as a constant."""
        if not isinstance(value, torch.Tensor) or value.is_meta:
            return value
        storage = value.untyped_storage()
        base = self._twins.get(storage._cdata)
        if base is None:
            base = torch.empty(storage.nbytes(), dtype=torch.uint8, device="meta")
            self._twins[storage._cdata] = base
            sid = self.record._ref_or_add(base).sid
            self.record.constants[sid] = torch.empty(0, dtype=torch.uint8, device=value.device).set_(storage)
            if value.device.type != "cpu":
                self.record.storage_devices[sid] = value.device
        return base.view(value.dtype).as_strided(value.shape, value.stride(), value.storage_offset())

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten.lift_fresh.default:
            # `torch.tensor(data)`: the data is already real; it stays real (libraries probe the device of a
            # context this way, e.g. transformers' `get_torch_context_manager_or_global_device`). Ops that use it
            # with build tensors record it as a constant.
            return args[0]
        if any(isinstance(a, torch.Generator) for a in tree_flatten((args, kwargs))[0]):
            raise RuntimeError(
                f"{func} was called with an explicit torch.Generator while building under delayed parameter"
                " initialisation; the replay draws from the default generator only. Initialise without"
                " `generator=` or build this model eagerly."
            )
        args, kwargs = tree_map(self._to_meta, (args, kwargs))
        if _is_random(func):
            self.note_reseed()
        run_kwargs = kwargs
        if "device" in {a.name for a in func._schema.arguments}:
            run_kwargs = {**kwargs, "device": torch.device("meta")}
        try:
            out = func(*args, **run_kwargs)
        except (NotImplementedError, RuntimeError) as err:
            raise RuntimeError(_meta_failure_message(func, err)) from err
        self._append(func, args, kwargs, out)
        return out

    def _append(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        record = self.record
        known = len(record.storage_nbytes)
        ref = lambda x: record._ref_or_add(x) if isinstance(x, torch.Tensor) else x  # noqa: E731
        rec_args, rec_kwargs = tree_map(ref, (args, kwargs))
        outputs = tuple(ref(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        reads = frozenset(r.sid for r in tree_flatten((rec_args, rec_kwargs))[0] if isinstance(r, TensorRef))
        written = tree_flatten(_mutated_args(func, args, kwargs))[0]
        mutated = {record.ref(t).sid for t in written if isinstance(t, torch.Tensor)}
        new = {o.sid for o in outputs if o.sid >= known}
        if new:
            device = _eager_device(func, kwargs, reads, record.storage_devices, record.build_device)
            if device.type != "cpu":
                record.storage_devices.update(dict.fromkeys(new, device))
        record.ops.append(
            RecordedOp(func, rec_args, rec_kwargs, outputs, reads, frozenset(mutated | new), _is_random(func))
        )


def _eager_device(
    func: Any, kwargs: dict, reads: frozenset[int], devices: dict[int, torch.device], build_device: torch.device
) -> torch.device:
    """Where an op's new storages would be in the eager build: a ``device`` argument as requested (a
    ``torch.device(...)`` context has filled it in for factories before dispatch), else the device of what it reads
    (``*_like``, ``new_*``, ``_to_copy`` without ``device=`` keep their input's), else CPU. A requested ``meta``
    is a build tensor's ``.device`` (``torch.empty(n, device=w.device)``): the eager build had its input's device
    there, or the device the build ran under."""
    requested = kwargs.get("device")
    if requested is not None and torch.device(requested).type != "meta":
        return torch.device(requested)
    for sid in sorted(reads):
        if sid in devices:
            return devices[sid]
    return build_device if requested is not None else torch.device("cpu")


def _meta_failure_message(func: Any, err: BaseException) -> str:
    if func is torch.ops.aten._local_scalar_dense.default:
        return (
            "The model's construction reads a tensor's value (`.item()`, `.tolist()`, `if tensor:` ...) while"
            " building under delayed parameter initialisation, where tensors have no data yet. Compute that value"
            " from Python numbers, or move the read out of `__init__`, or build this model eagerly."
        )
    return (
        f"{func} failed on the meta device while building under delayed parameter initialisation ({err}). The"
        " construction depends on tensor data (a data-dependent op); move it out of `__init__`, or build eagerly."
    )


def is_recording() -> bool:
    """Whether this thread is inside :func:`delay_param_initialization`."""
    return getattr(_ACTIVE, "record", None) is not None


@contextmanager
def delay_param_initialization() -> Iterator[InitRecord | None]:
    """Build models without allocating their parameters; they are initialised after partitioning.

    Inside the block every tensor is created on the meta device and every op is recorded. The ``smp`` strategy
    later replays the record on each rank for the parameters and buffers of its own stage only, so every rank
    allocates only what it owns and the values are bitwise equal to an eager one-process build with the same
    seed (see [Note: delayed init replays the eager init record]). On exit the random state advances as the
    eager build would have advanced it. Nested blocks record into the outermost one. Outside ``smp``, call
    :func:`lightning_mp.init.materialize_module` to materialise a model in one process.

    Example::

        torch.manual_seed(0)
        with lightning_mp.delay_param_initialization():
            model = GPT(n_layer=48)   # no parameter memory

    Yields:
        The :class:`InitRecord` (``None`` for a nested block).

    Raises:
        RuntimeError: if the construction reads tensor data (``.item()``) or passes an explicit generator.
    """
    if is_recording():
        yield None
        return
    record = InitRecord(cpu_rng_state=torch.get_rng_state(), build_device=torch.get_default_device())
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        record.cuda_rng_states = torch.cuda.get_rng_state_all()
    handles = _tag_modules_with(record)
    _ACTIVE.record = record
    recorder = _Recorder(record)
    trunc_normal = torch.nn.init.trunc_normal_
    torch.nn.init.trunc_normal_ = _refuse_trunc_normal
    try:
        with recorder:
            yield record
        recorder.note_reseed()  # a re-seed after the last random op still sets the state code after the block sees
    finally:
        torch.nn.init.trunc_normal_ = trunc_normal
        _ACTIVE.record = None
        for handle in handles:
            handle.remove()
    record._remember_module_tensors()
    advance_rng(record)


def _refuse_trunc_normal(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError(
        "torch.nn.init.trunc_normal_ was called while building under delayed parameter initialisation. It redraws"
        " samples until they fall inside the bounds, so how many random numbers it takes depends on the values it"
        " draws, which a meta build does not have (torch also skips it on meta tensors). Initialise with"
        " `normal_` + `clamp_`, or build this model eagerly."
    )


def _tag_modules_with(record: InitRecord) -> list[Any]:
    """Global registration hooks: every module that gets a parameter, buffer or child here points to ``record``."""

    def tag(module: nn.Module, name: str, value: Any) -> None:
        module.__dict__[_RECORD_ATTR] = record
        record._modules.add(module)
        if isinstance(value, nn.Module):
            value.__dict__.setdefault(_RECORD_ATTR, record)
            record._modules.add(value)

    modules = torch.nn.modules.module
    return [
        modules.register_module_parameter_registration_hook(tag),
        modules.register_module_buffer_registration_hook(tag),
        modules.register_module_module_registration_hook(tag),
    ]
