"""Tracing a model: its module tree, call order, FLOPs, parameter bytes and shared parameters.

The trace is the only input of the planner (:func:`lightning_mp.partition.plan`). It runs the user's
code once, unchanged, so Python control flow decides which modules run and how often: a module
called twice is counted twice, a branch not taken leaves its module uncalled.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import time

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

__all__ = ["ModelTrace", "ModuleRecord", "SharedParameter", "trace"]


@dataclass
class ModuleRecord:
    """What tracing learnt about one module, under one fully qualified name (FQN).

    Attributes:
        fqn: the module's name as in ``model.named_modules()``; ``""`` is the root.
        parent: FQN of the module one level up; ``None`` for the root.
        children: FQNs of the direct children, in definition order.
        first_call: global order index (0, 1, ...) of the module's first forward call during the
            trace; ``None`` if it was never called. A module registered under several FQNs is
            called under its first FQN only.
        num_calls: number of forward calls during the trace.
        param_bytes: bytes of the module's own direct parameters and buffers (``recurse=False``);
            a tensor held by several modules counts at its first owner only, in
            ``named_modules`` order.
        flops: inclusive forward FLOPs of all its calls (children included), as counted by
            :class:`torch.utils.flop_counter.FlopCounterMode`.
        num_params: elements of the module's own direct parameters (not buffers), counted at the
            first owner only, like ``param_bytes``.
        activation_bytes: bytes of the tensors the module returned, summed over its calls (what a
            leaf module leaves alive for backward).
        time_s: inclusive wall time of all its calls in seconds, measured in a second, untraced run;
            ``None`` unless :func:`trace` was asked to ``measure_time``.
        updates_buffers: whether a call wrote one of the module's own buffers (``recurse=False``),
            e.g. a BatchNorm's running statistics in training mode, seen from the buffers' version
            counters and (off the meta device) their values.
    """

    fqn: str
    parent: str | None
    children: list[str]
    first_call: int | None
    num_calls: int
    param_bytes: int
    flops: float
    num_params: int = 0
    activation_bytes: int = 0
    time_s: float | None = None
    updates_buffers: bool = False


@dataclass(frozen=True)
class SharedParameter:
    """One ``nn.Parameter`` object held by several modules (a tied weight), or by one module under several names.

    Attributes:
        names: every FQN naming it (``module_fqn.attribute``), in ``named_modules(remove_duplicate=False)`` order;
            ``names[0]`` is its *original* FQN, the one ``model.named_parameters()`` yields.
        num_bytes: bytes of the parameter.
        num_params: elements of the parameter.
    """

    names: tuple[str, ...]
    num_bytes: int
    num_params: int

    @property
    def fqn(self) -> str:
        """The original FQN (``named_parameters()``'s name)."""
        return self.names[0]

    @property
    def holders(self) -> tuple[str, ...]:
        """FQNs of the modules holding it directly, in order, without repeats."""
        return tuple(dict.fromkeys(name.rpartition(".")[0] for name in self.names))


@dataclass
class ModelTrace:
    """The module tree of a model with per-module costs, as recorded by :func:`trace`.

    Attributes:
        modules: one record per FQN of ``model.named_modules(remove_duplicate=False)``, in that
            order (so the root ``""`` comes first and a parent precedes its children).
        shared_groups: groups (two or more members) of module FQNs whose direct parameters
            include one and the same ``nn.Parameter`` object, closed transitively; members and
            groups in ``named_modules`` order. Shared buffers do not form groups.
        total_flops: FLOPs of the whole traced run, including work outside any module (for
            example a loss computed in ``training_step``).
        alias_groups: groups of FQNs that name one and the same module object
            (``self.lin1 = self.lin0``, and the submodules under both names), in
            ``named_modules`` order; a placement of one name places them all.
        shared_parameters: every parameter with more than one FQN (see :class:`SharedParameter`), in the order of
            their original FQNs.
    """

    modules: dict[str, ModuleRecord]
    shared_groups: list[list[str]] = field(default_factory=list)
    total_flops: float = 0.0
    total_time_s: float | None = None
    alias_groups: list[list[str]] = field(default_factory=list)
    shared_parameters: list[SharedParameter] = field(default_factory=list)

    @property
    def timed(self) -> bool:
        """Whether per-module execution times were measured (``trace(..., measure_time=True)``)."""
        return self.total_time_s is not None


def trace(
    model: nn.Module, run: Callable[[], Any], *, measure_time: bool = False, grad_enabled: bool = False
) -> ModelTrace:
    """Runs ``run()`` once and records the module tree, call order, FLOPs and bytes of ``model``.

    With ``measure_time`` (SMP's ``trace_execution_times``), ``run()`` runs twice more without the FLOP
    counter (a warm-up, then a timed run) and each module's inclusive wall time is recorded; the planner
    then balances measured time instead of FLOPs. Not possible on the ``meta`` device.

    Forward pre/post hooks are registered on every module of ``model`` for the duration of the
    run and removed afterwards, also when the run fails. ``run()`` is called under
    :class:`~torch.utils.flop_counter.FlopCounterMode`, with autograd recording only if
    ``grad_enabled`` (a training step takes its training code path: ``nn.TransformerEncoder``'s
    fast path, for one, runs only without gradients); it may be any callable that exercises the
    model, for example ``lambda: module.training_step(batch, 0)``, so the root itself need not be
    called as a module. Tensors may live on the ``meta`` device. The caller sets the modules'
    train/eval mode and restores whatever state the run changes (buffers, random generators).

    Args:
        model: the model to trace; its parameters are not modified.
        run: a callable without arguments that calls the model; its result is discarded.
        measure_time: also measure per-module wall times (see above).
        grad_enabled: run with autograd recording, as a training step does.

    Returns:
        The :class:`ModelTrace` of ``model``.

    Raises:
        RuntimeError: if ``run()`` raises; the original exception is chained.
    """
    records = _module_records(model)
    recorder = _CallRecorder(records)
    handles = _register_hooks(model, recorder)
    try:
        with torch.set_grad_enabled(grad_enabled), FlopCounterMode(display=False) as counter:
            recorder.counter = counter
            _run_user_code(run)
        total_flops = float(counter.get_total_flops())
    finally:
        for handle in handles:
            handle.remove()
    total_time_s = _measure_times(model, run, records, grad_enabled) if measure_time else None
    return ModelTrace(
        modules=records,
        shared_groups=_shared_groups(model),
        total_flops=total_flops,
        total_time_s=total_time_s,
        alias_groups=_alias_groups(model),
        shared_parameters=shared_parameters(model),
    )


def _measure_times(model: nn.Module, run: Callable[[], Any], records: dict[str, ModuleRecord], grad_enabled: bool) -> float:
    """Inclusive wall time per module from one timed run after a warm-up (both without the FLOP counter)."""
    with torch.set_grad_enabled(grad_enabled):
        _run_user_code(run)  # warm-up: allocator, kernels, lazy initialisation
    started: dict[str, list[float]] = {fqn: [] for fqn in records}
    for record in records.values():
        record.time_s = 0.0
    handles = []
    try:
        for fqn, module in model.named_modules():
            handles.append(module.register_forward_pre_hook(lambda m, a, fqn=fqn: started[fqn].append(time.perf_counter())))
            handles.append(module.register_forward_hook(lambda m, a, o, fqn=fqn: _add_time(records[fqn], started[fqn])))
        begin = time.perf_counter()
        with torch.set_grad_enabled(grad_enabled):
            _run_user_code(run)
        return time.perf_counter() - begin
    finally:
        for handle in handles:
            handle.remove()


def _add_time(record: ModuleRecord, starts: list[float]) -> None:
    record.time_s = (record.time_s or 0.0) + time.perf_counter() - starts.pop()


def _output_bytes(output: Any) -> int:
    """Bytes of every tensor in a module's output (nested tuples, lists, dicts, dataclass-like objects)."""
    if isinstance(output, torch.Tensor):
        return output.numel() * output.element_size()
    if isinstance(output, (list, tuple)):
        return sum(_output_bytes(item) for item in output)
    if isinstance(output, dict):
        return sum(_output_bytes(item) for item in output.values())
    if hasattr(output, "__dict__") and not isinstance(output, nn.Module):
        return sum(_output_bytes(item) for item in vars(output).values())
    return 0


def _run_user_code(run: Callable[[], Any]) -> None:
    try:
        run()
    except Exception as exc:
        raise RuntimeError(f"tracing the model failed: the traced run raised {type(exc).__name__}: {exc}") from exc


def _parent_of(fqn: str) -> str | None:
    if fqn == "":
        return None
    return fqn.rpartition(".")[0]


def _module_records(model: nn.Module) -> dict[str, ModuleRecord]:
    """One record per FQN with the tree links and first-owner parameter bytes; no calls yet."""
    records: dict[str, ModuleRecord] = {}
    seen_tensors: set[int] = set()
    for fqn, module in model.named_modules(remove_duplicate=False):
        parent = _parent_of(fqn)
        records[fqn] = ModuleRecord(
            fqn=fqn,
            parent=parent,
            children=[],
            first_call=None,
            num_calls=0,
            param_bytes=0,
            flops=0.0,
        )
        if parent is not None:
            records[parent].children.append(fqn)
        _count_own_tensors(records[fqn], module, seen_tensors)
    return records


def _count_own_tensors(record: ModuleRecord, module: nn.Module, seen: set[int]) -> None:
    for tensor in module.parameters(recurse=False):
        if id(tensor) not in seen:
            seen.add(id(tensor))
            record.param_bytes += tensor.numel() * tensor.element_size()
            record.num_params += tensor.numel()
    for tensor in module.buffers(recurse=False):
        if id(tensor) not in seen:
            seen.add(id(tensor))
            record.param_bytes += tensor.numel() * tensor.element_size()


class _CallRecorder:
    """Hook target: counts calls and their inclusive FLOPs (counter total after minus before)."""

    def __init__(self, records: dict[str, ModuleRecord]) -> None:
        self.records = records
        self.counter: FlopCounterMode | None = None
        self._next_call = 0
        self._flops_at_entry: list[int] = []
        self._versions_at_entry: list[list[tuple[torch.Tensor, int, torch.Tensor | None]]] = []

    def _total(self) -> int:
        return self.counter.get_total_flops() if self.counter is not None else 0

    def enter(self, fqn: str, module: nn.Module) -> None:
        self._versions_at_entry.append([(b, b._version, _value_copy(b)) for b in module.buffers(recurse=False)])
        record = self.records[fqn]
        if record.first_call is None:
            record.first_call = self._next_call
        self._next_call += 1
        record.num_calls += 1
        self._flops_at_entry.append(self._total())

    def exit(self, fqn: str, module: nn.Module, output: Any) -> None:
        versions = self._versions_at_entry.pop()
        record = self.records[fqn]
        if any(_written(b, version, copy) for b, version, copy in versions):
            record.updates_buffers = True
        record.flops += float(self._total() - self._flops_at_entry.pop())
        record.activation_bytes += _output_bytes(output)


def _value_copy(buffer: torch.Tensor) -> torch.Tensor | None:
    """A copy to compare values with after the call (``None`` on meta: only the version counter tells there)."""
    return None if buffer.is_meta else buffer.detach().clone()


def _written(buffer: torch.Tensor, version: int, copy: torch.Tensor | None) -> bool:
    """Whether a call wrote ``buffer``: its version moved, or (kernels that skip the bump) its values did."""
    return buffer._version != version or (copy is not None and not torch.equal(buffer, copy))


def _register_hooks(model: nn.Module, recorder: _CallRecorder) -> list[Any]:
    """Hooks every distinct module once, under its first FQN (``named_modules`` deduplicates)."""
    handles = []
    try:
        for fqn, module in model.named_modules():
            handles.append(module.register_forward_pre_hook(_pre_hook(recorder, fqn)))
            handles.append(module.register_forward_hook(_post_hook(recorder, fqn)))
    except BaseException:
        for handle in handles:
            handle.remove()
        raise
    return handles


def _pre_hook(recorder: _CallRecorder, fqn: str) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any) -> None:
        recorder.enter(fqn, module)

    return hook


def _post_hook(recorder: _CallRecorder, fqn: str) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        recorder.exit(fqn, module, output)

    return hook


def _alias_groups(model: nn.Module) -> list[list[str]]:
    names: dict[int, list[str]] = {}
    for fqn, module in model.named_modules(remove_duplicate=False):
        names.setdefault(id(module), []).append(fqn)
    return [group for group in names.values() if len(group) > 1]


def shared_parameters(model: nn.Module) -> list[SharedParameter]:
    """Every parameter of ``model`` named by more than one FQN (tied weights, aliased modules); works on meta."""
    names: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for fqn, module in model.named_modules(remove_duplicate=False):
        for attribute, param in module._parameters.items():
            if param is not None:
                names.setdefault(id(param), []).append(f"{fqn}.{attribute}" if fqn else attribute)
                tensors[id(param)] = param
    return [
        SharedParameter(tuple(group), tensors[key].numel() * tensors[key].element_size(), tensors[key].numel())
        for key, group in names.items()
        if len(group) > 1
    ]


def _shared_groups(model: nn.Module) -> list[list[str]]:
    """Union-find over FQNs that hold one ``nn.Parameter`` object directly."""
    order: list[str] = []
    root_of: dict[str, str] = {}
    owner_of_param: dict[int, str] = {}

    def find(fqn: str) -> str:
        while root_of[fqn] != fqn:
            root_of[fqn] = root_of[root_of[fqn]]
            fqn = root_of[fqn]
        return fqn

    for fqn, module in model.named_modules(remove_duplicate=False):
        order.append(fqn)
        root_of[fqn] = fqn
        for param in module.parameters(recurse=False):
            first_owner = owner_of_param.setdefault(id(param), fqn)
            if first_owner != fqn:
                root_of[find(fqn)] = find(first_owner)
    groups: dict[str, list[str]] = {}
    for fqn in order:
        groups.setdefault(find(fqn), []).append(fqn)
    return [members for members in groups.values() if len(members) >= 2]
