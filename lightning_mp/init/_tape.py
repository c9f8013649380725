"""The init record's tape: what a build under :func:`~lightning_mp.init.delay_param_initialization` did.

The types the recorder (``_record.py``) writes and the replay (``_replay.py``) reads: each tensor named by its
storage (:class:`TensorRef`), each aten call (:class:`RecordedOp`), each re-seed (:class:`SetRngState`), and the
whole :class:`InitRecord` that the modules of the build point to ([Note: delayed init replays the eager init
record] in ``_record.py``).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["InitRecord", "RecordedOp", "SetRngState", "TensorRef", "find_record", "forget_record"]

_RECORD_ATTR = "_lightning_mp_init_record"


@dataclass(frozen=True)
class TensorRef:
    """A tensor seen on the tape, named by its storage: a view ``as_strided(storage, shape, stride, offset)``."""

    sid: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype


@dataclass
class RecordedOp:
    """One aten call of the build, with tensors replaced by :class:`TensorRef`.

    Attributes:
        func: the aten overload that ran.
        args, kwargs: its arguments as given (factory ``device`` as requested, not meta).
        outputs: the tensor outputs, flattened.
        reads: storage ids of every tensor argument.
        writes: storage ids of mutated arguments and of outputs with a storage new at this op.
        random: whether the op draws from a generator (``Tag.nondeterministic_seeded``).
    """

    func: torch._ops.OpOverload
    args: tuple
    kwargs: dict
    outputs: tuple[TensorRef, ...]
    reads: frozenset[int]
    writes: frozenset[int]
    random: bool


@dataclass(frozen=True)
class SetRngState:
    """The CPU generator was re-seeded inside the build (``torch.manual_seed``, ``seed_everything``): the replay
    sets this state at this point of the tape."""

    state: torch.Tensor


@dataclass
class InitRecord:
    """Everything a build under :func:`delay_param_initialization` did, replayable per rank.

    Attributes:
        ops: the tape, in execution order.
        storage_nbytes: bytes of each storage, by storage id.
        constants: real tensors that came from outside the build (e.g. ``torch.tensor([...])`` data), by storage id.
        cpu_rng_state: the CPU generator state when the build started.
        cuda_rng_states: the CUDA generator states when the build started (empty if CUDA was not initialised).
        storage_devices: the device each storage would have had in the eager build (a factory's ``device``, else
            its first input's), by storage id; absent means CPU. Other stages' random ops draw on scratch there,
            so that a build under ``torch.device("cuda")`` advances the CUDA generator as the eager one does.
    """

    ops: list[RecordedOp | SetRngState] = field(default_factory=list)
    storage_nbytes: list[int] = field(default_factory=list)
    constants: dict[int, torch.Tensor] = field(default_factory=dict)
    cpu_rng_state: torch.Tensor | None = None
    cuda_rng_states: list[torch.Tensor] = field(default_factory=list)
    storage_devices: dict[int, torch.device] = field(default_factory=dict)
    build_device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    # meta storages, kept alive so that their ids (``_cdata``) stay unique while the record lives
    _storages: list[Any] = field(default_factory=list, repr=False)
    _sid_of: dict[int, int] = field(default_factory=dict, repr=False)
    _modules: Any = field(default_factory=weakref.WeakSet, repr=False)
    # module tensors at the end of the build, by Python object: found again after `model.to(dtype)` on meta
    # (meta tensors cost nothing; the record is dropped after materialisation)
    _by_object: dict[int, tuple[Any, TensorRef]] = field(default_factory=dict, repr=False)
    _by_slot: dict[tuple[int, str], tuple[Any, TensorRef]] = field(default_factory=dict, repr=False)

    def ref(self, tensor: torch.Tensor, slot: tuple[nn.Module, str] | None = None) -> TensorRef | None:
        """How ``tensor`` was made during this build, or ``None``.

        Found by storage, else (after ``model.to(dtype)`` on meta made new storages) by the parameter object or
        by the ``(module, name)`` slot a buffer was registered in at the end of the build.
        """
        sid = self._sid_of.get(tensor.untyped_storage()._cdata)
        if sid is not None:
            return TensorRef(sid, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset(), tensor.dtype)
        held, ref = self._by_object.get(id(tensor), (None, None))
        if held is not tensor and slot is not None:
            module, name = slot
            held, ref = self._by_slot.get((id(module), name), (None, None))
            held = tensor if held is module else None
        if held is tensor and ref is not None and ref.shape == tuple(tensor.shape):
            return ref
        return None

    def _remember_module_tensors(self) -> None:
        for module in self._modules:
            for name, tensor in [*module._parameters.items(), *module._buffers.items()]:
                if tensor is not None and (ref := self.ref(tensor)) is not None:
                    self._by_object[id(tensor)] = (tensor, ref)  # strong: swap_tensors refuses weakly referenced ones
                    self._by_slot[(id(module), name)] = (module, ref)

    def _ref_or_add(self, tensor: torch.Tensor) -> TensorRef:
        storage = tensor.untyped_storage()
        if storage._cdata not in self._sid_of:
            self._sid_of[storage._cdata] = len(self.storage_nbytes)
            self.storage_nbytes.append(storage.nbytes())
            self._storages.append(storage)
        ref = self.ref(tensor)
        assert ref is not None
        return ref

    def __reduce__(self) -> Any:
        raise TypeError(
            "A model built under lightning_mp.delay_param_initialization() cannot be pickled (e.g. to processes"
            " started with start_method='spawn'): its init record names meta storages of this process. Use"
            " start_method='popen' or 'fork', or build the model in `configure_model` with"
            " SMPStrategy(delayed_parameter_initialization=True) or the DelayedParameterInit callback."
        )


def find_record(model: nn.Module) -> InitRecord | None:
    """The init record ``model`` was built under, or ``None`` if it was built eagerly.

    Raises:
        ValueError: if parts of ``model`` were built in two separate delayed-init blocks.
    """
    records = {id(r): r for m in model.modules() if (r := m.__dict__.get(_RECORD_ATTR)) is not None}
    if len(records) > 1:
        raise ValueError(
            f"The model was built in {len(records)} separate `delay_param_initialization()` blocks; their random"
            " streams cannot be replayed independently. Build the whole model inside one block."
        )
    return next(iter(records.values()), None)


def forget_record(model: nn.Module) -> None:
    """Drop the record from every module (after materialisation), freeing the tape and its constants."""
    for module in model.modules():
        module.__dict__.pop(_RECORD_ATTR, None)
