"""Install time: which module runs where, and what replaces the modules of other stages on this rank.

:class:`Placement` owns the map from module FQN to stage and does the install: it frees the parameters and
buffers of every module placed elsewhere and swaps its ``__call__`` for a stub that hands the call to a
``call_remote`` callable (the engine's), batches the runs of a local ``nn.Sequential`` whose children span stages
([Note: sequential runs]), and hooks the local modules that need a per-call random stream or ordered buffer
updates (:class:`_CallHooks`). A served request runs its module through :meth:`Placement.run`. Nothing here
knows the session; the stubs and hooks get what they call at install.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from types import MethodType
from typing import Any, Protocol

import torch
from torch import nn

from lightning_mp.pipeline._messages import CallRequest, Phase, PipelineError, current_task
from lightning_mp.pipeline._rng import MicrobatchRNG, draws_no_random_numbers
from lightning_mp.pipeline._state import OrderedStateUpdates

__all__ = ["CallRemote", "Placement"]


class CallRemote(Protocol):
    """Run module ``fqn`` (or its children ``span``) on ``stage``: what a stub calls instead of the module."""

    def __call__(self, fqn: str, stage: int, args: tuple, kwargs: dict, span: tuple[int, int] | None = None) -> Any: ...


class Placement:
    """The stage of every module of one model on one rank, and the install that makes it so.

    Args:
        stage: this rank's stage.
        num_stages: pipeline_parallel_degree.
    """

    def __init__(self, stage: int, num_stages: int) -> None:
        self.stage = stage
        self.num_stages = num_stages
        self._modules: dict[str, nn.Module] = {}
        self._stage_of: dict[str, int] = {}
        self._subtree_stages: dict[str, set[int]] = {}  # stages of the modules with parameters under each FQN

    def stage_of(self, fqn: str) -> int:
        return self._stage_of[fqn]

    def install(
        self,
        model: nn.Module,
        stage_of: Mapping[str, int],
        ordered_state: Sequence[str] | None,
        *,
        call_remote: CallRemote,
        hooks: _HookTargets,
    ) -> None:
        """Place ``model``: stub the modules of other stages, batch Sequential runs, hook the local modules.

        See ``PipelineEngine.install`` for the rules.

        Raises:
            ValueError: if ``stage_of`` misses a module, names a stage out of range, or puts one module object
                that has parameters on two stages (it is registered under two names).
        """
        modules = list(model.named_modules(remove_duplicate=False))
        missing = sorted({fqn for fqn, _ in modules} - set(stage_of))
        if missing:
            raise ValueError(f"The partition plan has no stage for modules {missing[:5]}; re-plan the model.")
        writers = _buffer_writers(modules, ordered_state)
        stateful = {
            id(m) for _, m in modules
            if next(m.parameters(), None) is not None or any(id(sub) in writers for sub in m.modules())
        }
        first_name = self._place(modules, stage_of, stateful, writers)
        for fqn, module in modules:
            if self._stage_of[fqn] != self.stage and first_name[id(module)] == fqn:
                _release_and_stub(module, fqn, self._stage_of[fqn], call_remote)
        for fqn, module in modules:
            if self._stage_of[fqn] == self.stage and first_name[id(module)] == fqn:
                _batch_sequential_runs(module, fqn, stage_of, stateful, self.stage, call_remote)
        self._hook_calls(modules, first_name, stateful, ordered_state, hooks)

    def _place(
        self, modules: list[tuple[str, nn.Module]], stage_of: Mapping[str, int], stateful: set[int], writers: set[int]
    ) -> dict[int, str]:
        """Record every module's stage (a stateless one runs where it is called); return each object's first name."""
        first_name: dict[int, str] = {}
        for fqn, module in modules:
            stage = stage_of[fqn]
            if not 0 <= stage < self.num_stages:
                raise ValueError(f"Module {fqn!r} is planned on stage {stage}, outside 0..{self.num_stages - 1}.")
            other = first_name.setdefault(id(module), fqn)
            if id(module) in stateful and stage_of[other] != stage:
                raise ValueError(
                    f"One module object is registered as {other!r} (stage {stage_of[other]}) and {fqn!r} (stage"
                    f" {stage}); a module with parameters must live on one stage. Place both names on one stage."
                )
            self._modules[fqn] = module
            self._stage_of[fqn] = stage if id(module) in stateful else self.stage
            if next(module.parameters(recurse=False), None) is not None or id(module) in writers:
                parts = fqn.split(".") if fqn else []
                for depth in range(len(parts) + 1):
                    self._subtree_stages.setdefault(".".join(parts[:depth]), set()).add(stage)
        return first_name

    def _hook_calls(
        self,
        modules: list[tuple[str, nn.Module]],
        first_name: Mapping[int, str],
        stateful: set[int],
        ordered_state: Sequence[str] | None,
        hooks: _HookTargets,
    ) -> None:
        """Per-call random streams and ordered buffer updates on the modules that run here."""
        in_sequential = {
            id(child) for _, m in modules if isinstance(m, nn.Sequential) and id(m) in stateful for child in m.children()
        }
        ordered = set(ordered_state) if ordered_state is not None else None
        for fqn, module in modules:
            if first_name[id(module)] != fqn or self._stage_of[fqn] != self.stage:
                continue
            # a call that never draws needs no stream (see [Note: calls that draw no random numbers] in _rng.py)
            keyed = (id(module) in stateful or id(module) in in_sequential) and not draws_no_random_numbers(module)
            has_buffers = any(b is not None for b in module._buffers.values())
            defer = self.num_stages > 1 and has_buffers and (ordered is None or fqn in ordered)
            if keyed or defer:
                _CallHooks(hooks, fqn, keyed, defer).register(module)

    def calls_other_stages(self, fqn: str, stage: int, span: tuple[int, int] | None) -> bool:
        """May running ``fqn`` (its children ``span``) on ``stage`` call modules on other stages?

        [Note: which calls are one-way] With remote handles only the driver's microbatch code makes one-way calls,
        and only to modules whose whole subtree lives on the owner. A call that may make nested calls, and every
        call made while serving a request, waits for its outputs instead: so a nested call has run by the time its
        caller's program goes on, as on one process. Otherwise a module called in one microbatch both through a
        nested call (stage 0 -> 1 -> 2) and directly (stage 0 -> 2) could run those calls in the opposite order on
        its owner, and its random streams and BatchNorm updates would depend on the layout.
        """
        if span is None:
            return bool(self._subtree_stages.get(fqn, set()) - {stage})
        names = list(self._modules[fqn]._modules)[span[0] : span[1]]
        prefix = f"{fqn}." if fqn else ""
        return any(self._subtree_stages.get(prefix + name, set()) - {stage} for name in names)

    def returns_tensor(self, fqn: str, span: tuple[int, int] | None) -> bool:
        """Does a call of ``fqn`` (its children ``span``) return one tensor, as its class says (no hook may change it)?

        ``True`` only for the ``torch.nn`` classes of ``_TENSOR_CLASSES``: a handle to such an output knows that its
        value is a tensor without asking the owner ([Note: handles in Hugging Face outputs] in ``_handles.py``).
        """
        module = self._modules[fqn]
        if span is not None:
            module = list(module)[span[1] - 1]
        cls = _ORIGINAL_CLASSES.get(type(module), type(module))
        return cls in _TENSOR_CLASSES and not module._forward_hooks and not _global_forward_hooks()

    def run(self, request: CallRequest, args: tuple, kwargs: dict, context: Callable[[], AbstractContextManager]) -> Any:
        """Run the requested module (or the ``span`` of a Sequential's children) here on ``args``/``kwargs``.

        Raises:
            PipelineError: the module lives on another stage.
        """
        fqn, span = request.fqn, request.span
        module = self._modules[fqn]
        if span is None and self.stage_of(fqn) != self.stage:
            raise PipelineError(f"Module {fqn!r} was requested from stage {self.stage} but lives elsewhere.")
        with torch.set_grad_enabled(request.grad_enabled), context():
            if span is None:
                return module(*args, **kwargs)
            (output,) = args
            for child in list(module)[span[0] : span[1]]:
                output = child(output)
            return output


class _HookTargets(Protocol):
    """What the per-call hooks of local modules work on (the engine)."""

    rng: MicrobatchRNG
    state_updates: OrderedStateUpdates

    @property
    def in_step(self) -> bool: ...


# [Note: sequential runs] A Python loop over children (``for block in self.h: x = block(x)``) makes one request
# per remote child, as the loop runs on the parent's stage (with remote handles a one-way one; without, a round
# trip). ``nn.Sequential.forward`` is such a loop that we can
# see: when the children of a Sequential span stages, its forward is replaced (on its owner only) by one that
# sends each maximal run of consecutive children living on one other stage as a single request, so stage 0
# calling blocks 3..5 on stage 1 costs one round trip forward and one backward per microbatch, as in a
# static pipeline. Children without parameters join the run before them (the first run if they lead), as they
# run wherever they are called. A subclass that overrides ``forward`` keeps its own forward.


def _buffer_writers(modules: list[tuple[str, nn.Module]], ordered_state: Sequence[str] | None) -> set[int]:
    """Ids of the modules whose forward writes their own buffers: those named in ``ordered_state`` (``None``, a plan
    that did not record it: every module with buffers)."""
    if ordered_state is None:
        return {id(m) for _, m in modules if any(b is not None for b in m._buffers.values())}
    named = set(ordered_state)
    return {id(m) for fqn, m in modules if fqn in named}


def _sequential_runs(module: nn.Sequential, fqn: str, stage_of: Mapping[str, int], stateful: set[int]) -> list[tuple[int, int, int]]:
    """``[(stage, start, stop), ...]`` covering the children of ``module`` in order; stateless children join a run."""
    names = list(module._modules)
    stages: list[int | None] = []
    for name in names:
        child = module._modules[name]
        stages.append(stage_of[f"{fqn}.{name}" if fqn else name] if child is not None and id(child) in stateful else None)
    current = next((st for st in stages if st is not None), stage_of[fqn])
    runs: list[tuple[int, int, int]] = []
    for index, stage in enumerate(stages):
        stage = current if stage is None else stage
        if runs and runs[-1][0] == stage:
            runs[-1] = (stage, runs[-1][1], index + 1)
        else:
            runs.append((stage, index, index + 1))
        current = stage
    return runs


def _batch_sequential_runs(
    module: nn.Module, fqn: str, stage_of: Mapping[str, int], stateful: set[int], local: int, call_remote: CallRemote
) -> None:
    """Make a local ``nn.Sequential`` whose children span stages send each remote run as one request."""
    if not isinstance(module, nn.Sequential) or type(module).forward is not nn.Sequential.forward:
        return
    if id(module) not in stateful:  # stateless: runs where it is called, whatever stage the plan names
        return
    runs = _sequential_runs(module, fqn, stage_of, stateful)
    if all(stage == local for stage, _, _ in runs):
        return
    children = list(module)

    def forward(self: nn.Sequential, input: Any) -> Any:
        for stage, start, stop in runs:
            if stage == local:
                for child in children[start:stop]:
                    input = child(input)
            else:
                input = call_remote(fqn, stage, (input,), {}, span=(start, stop))
        return input

    module.forward = MethodType(forward, module)


_hook_frames = threading.local()  # per thread: what each pre-hook started, for its post-hook (calls nest)


class _CallHooks:
    """Forward hooks of one local module: its call's random stream and its deferred buffer updates."""

    def __init__(self, targets: _HookTargets, fqn: str, keyed: bool, defer: bool) -> None:
        self.targets, self.fqn, self.keyed, self.defer = targets, fqn, keyed, defer

    def register(self, module: nn.Module) -> None:
        module.register_forward_pre_hook(self.pre, with_kwargs=True)
        module.register_forward_hook(self.post, with_kwargs=True, always_call=True)

    def pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        frames = getattr(_hook_frames, "stack", None)
        if frames is None:
            frames = _hook_frames.stack = []
        task = current_task()
        if task is None or not self.targets.in_step:
            frames.append(None)
            return
        if self.keyed:
            self.targets.rng.enter(task.microbatch, self.fqn, recompute=task.phase != Phase.FORWARD)
        snapshot = self.targets.state_updates.before(module) if self.defer else None
        frames.append((task, snapshot, args, kwargs))

    def post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        frame = _hook_frames.stack.pop()
        if frame is None:
            return
        task, snapshot, args, kwargs = frame
        if snapshot is not None:
            microbatch = task.microbatch if task.phase == Phase.FORWARD else None  # recompute in backward: not again
            self.targets.state_updates.after(module, snapshot, microbatch, args, kwargs)
        if self.keyed:
            self.targets.rng.exit()


_REMOTE_CLASSES: dict[type, type] = {}
_ORIGINAL_CLASSES: dict[type, type] = {}  # the other way round
_TENSOR_CLASSES = frozenset(  # modules with parameters whose forward returns one tensor
    getattr(nn, name)
    for name in (
        "Linear", "Bilinear", "Embedding", "LayerNorm", "RMSNorm", "GroupNorm", "BatchNorm1d", "BatchNorm2d",
        "BatchNorm3d", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d", "PReLU",
    )
)


def _global_forward_hooks() -> bool:
    from torch.nn.modules import module as torch_module

    return bool(torch_module._global_forward_hooks)


def _remote_call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    fqn, stage, call_remote = self._smp_remote
    return call_remote(fqn, stage, args, kwargs)


def _release_and_stub(module: nn.Module, fqn: str, stage: int, call_remote: CallRemote) -> None:
    """Free the module's own tensors and make calling it a request to ``stage``.

    ``__call__`` itself is replaced (through a per-class subclass, as Python looks ``__call__`` up on the type),
    so the module's hooks run once, on the owner, not also on the caller where its parameters are gone.
    """
    for name in module._parameters:
        module._parameters[name] = None
    for name in module._buffers:
        module._buffers[name] = None
    cls = type(module)
    if cls not in _REMOTE_CLASSES:
        _REMOTE_CLASSES[cls] = type(f"Remote{cls.__name__}", (cls,), {"__call__": _remote_call, "__module__": cls.__module__})
        _ORIGINAL_CLASSES[_REMOTE_CLASSES[cls]] = cls
    module.__class__ = _REMOTE_CLASSES[cls]
    module._smp_remote = (fqn, stage, call_remote)
    module.forward = MethodType(_remote_call, module)
