"""The module-server pipeline engine (paper section 3.2): no static graph, any eager model.

Every rank of a pipeline runs an execution server. Pipeline rank 0 (the *driver*) runs the user's step once
per microbatch. A module placed on another stage has its ``forward`` replaced by a stub; calling it sends an
execution request (module FQN, args, kwargs) to the owner, whose server runs the real module and keeps the
outputs; the call returns at once with a :class:`~lightning_mp.pipeline.RemoteValue` handle, which a later call on
that stage takes by reference and which fetches the value when local code touches it ([Note: remote handles] in
``_handles.py``; ``remote_handles=False``: the owner replies with the outputs and the call waits for them).
Backward crosses ranks through :mod:`lightning_mp.comm._autograd` (see [Note: remote autograd]).
Because requests are made by ordinary Python calls, data-dependent branches, loops and calling one module
several times keep working, and any stage may call any other.

Concurrency: the driver runs its microbatches on ``active_microbatches`` long-lived threads, and each peer's
requests are received and served by a pool of long-lived workers ([Note: request workers]); every one of them
computes only while holding the rank's compute token ([Note: one compute token per rank] in ``_scheduler.py``).

One pipelined step is a :class:`PipelineSession`::

    with engine.session() as session:
        if engine.is_driver:
            outputs = session.drive(step_fn, microbatches, loss_fn=..., backward=True)
            session.finish(summary)            # sent to every other stage
        else:
            summary = session.serve()          # answer requests until the driver finishes
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from types import MethodType
from typing import Any

import torch
from torch import nn

from lightning_mp.comm import Message, Transport, connect_remote_outputs, pack, ragged_like
from lightning_mp.pipeline._grads import OrderedGradients
from lightning_mp.pipeline._handles import (
    RemoteValue,
    _PackingFor,
    _unpacked,
    materialize,
    materialize_module_inputs,
    resolve,
    walk_containers,
)
from lightning_mp.pipeline._rng import MicrobatchRNG, draws_no_random_numbers
from lightning_mp.pipeline._scheduler import ComputeToken, GrantOrder, Priority
from lightning_mp.pipeline._state import OrderedStateUpdates
from lightning_mp.pipeline._timeline import TimelineRecorder

__all__ = ["PipelineEngine", "PipelineError", "PipelineSession"]

_BACKWARD, _FORWARD = 0, 1  # phase component of a priority: backward work first ("interleaved")
_POLL_S = 0.5


class PipelineError(RuntimeError):
    """A pipelined step failed on some stage, or a stage stopped answering."""


@dataclass(frozen=True)
class _Envelope:
    # "fwd" | "bwd": a call that waits for its outputs, and its backward; "call": a call that returns a handle
    # ([Note: remote handles]); "get" | "gbwd": fetch a call's output, and the backward of that fetch;
    # "reply" | "error" | "end" | "close"
    kind: str
    step: str  # which session of which hook, e.g. "training_step#12": stages must agree
    call_id: tuple[int, int] | None = None
    body: Any = None
    microbatch: int = 0
    done: tuple[int, ...] = ()  # microbatches the driver finished since its last message to this stage ("free")
    origin: tuple | None = None  # the served request the sender sent this from (None: a microbatch's own code)


@dataclass(frozen=True)
class _Task:
    """What the current thread is computing: which microbatch, forward or backward."""

    microbatch: int
    phase: int
    label: str = "step"  # module FQN of a served request, "step" for the driver's microbatch code
    ident: tuple = ()  # rank-independent name: ("mb", microbatch, phase) or ("call", call_id, kind)


def _priority(task: _Task, schedule: str, stage: int, num_stages: int) -> Priority:
    """Which ready task computes first on ``stage`` (smaller first). See [Note: 1F1B priorities]."""
    if schedule == "simple":
        return (task.phase, task.microbatch)
    if task.phase == _FORWARD:
        return (2 * task.microbatch, task.phase)
    return (2 * (task.microbatch + num_stages - stage) - 1, task.phase)


# [Note: 1F1B priorities] With ``pipeline="interleaved"`` a rank picks among its *ready* tasks the one that 1F1B
# (PipeDream-Flush, Narayanan et al. 2021; torch.distributed.pipelining's Schedule1F1B) would run first: on stage
# s of P, forward of microbatch j sorts at 2j and backward of microbatch k at 2(k + P - s) - 1, which gives
# F0 .. F(P-s-1) then B0 F(P-s) B1 F(P-s+1) ... (the last stage alternates F0 B0 F1 B1 ...). Unlike a static
# 1F1B schedule the order is work-conserving: when the preferred task is not ready (its message has not
# arrived, or the call graph is not a chain), the next ready one runs instead. Plain "backward first" starved the
# later stages: stage 0 ran every ready backward before feeding the next forward downstream, and stage 1 sat idle
# (benchmarks/pipeline_vs_torch.py measures the schedules).


_current = threading.local()


def _current_task() -> _Task | None:
    return getattr(_current, "task", None)


def _current_microbatch() -> int | None:
    task = _current_task()
    return None if task is None else task.microbatch


@contextmanager
def _as_task(task: _Task) -> Iterator[None]:
    previous = _current_task()
    _current.task = task
    try:
        yield
    finally:
        _current.task = previous


class _Future:
    def __init__(self) -> None:
        self._event = threading.Event()
        self.value: Any = None

    def set(self, value: Any) -> None:
        self.value = value
        self._event.set()

    def wait(self, timeout_s: float, check_failed: Callable[[], None], what: str) -> Any:
        deadline = time.monotonic() + timeout_s
        while not self._event.wait(_POLL_S):
            check_failed()
            if time.monotonic() > deadline:
                raise PipelineError(f"Timed out after {timeout_s:.0f} s waiting for {what}.")
        check_failed()
        return self.value


@dataclass
class _SavedCall:
    """What a server keeps of a forward request until its backward arrives."""

    leaves: list[torch.Tensor]
    outputs: list[torch.Tensor]
    fqn: str


@dataclass
class _RemoteBackward:
    """Caller side of a remote call's backward (see ``connect_remote_outputs``)."""

    session: PipelineSession
    stage: int
    call_id: tuple[int, int]
    microbatch: int
    fqn: str

    def run_backward(self, grad_outputs: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        # Autograd runs CPU backward in the thread that called backward(), which holds the token as its task.
        task = _current_task() or _Task(self.microbatch, _BACKWARD)
        envelope = self.session.envelope("bwd", self.call_id, (self.fqn, grad_outputs), self.microbatch)
        reply = self.session.exchange(self.stage, envelope, task, f"backward of {self.fqn!r}")
        return list(reply.obj.body)


@dataclass
class _SavedFetch:
    """What an owner keeps of a fetched value until the backward of the fetch arrives."""

    outputs: list[torch.Tensor]
    microbatch: int
    backed: bool = False  # a backward of it has run


@dataclass
class _FetchCount:
    """Per microbatch on an owner: fetches with differentiable outputs whose backward has not come yet, and whether
    any came from a stage other than the driver (see [Note: backward of fetches])."""

    pending: int = 0
    foreign: bool = False


@dataclass
class _FetchBackward:
    """Caller side of a fetch's backward: output gradients to the owner, gradients of ``upstream`` back."""

    session: PipelineSession
    stage: int
    fetch_id: tuple[int, int]
    microbatch: int
    label: str
    upstream: list[tuple[tuple[int, int], int]]  # (call_id, how many caller tensors that call sent as data)

    def run_backward(self, grad_outputs: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        task = _current_task() or _Task(self.microbatch, _BACKWARD)
        body = (self.label, grad_outputs, [call_id for call_id, _ in self.upstream])
        envelope = self.session.envelope("gbwd", self.fetch_id, body, self.microbatch)
        reply = self.session.exchange(self.stage, envelope, task, f"backward of {self.label!r}")
        grads: list[torch.Tensor | None] = []
        for (call_id, count), part in zip(self.upstream, reply.obj.body):
            if len(part) != count:
                raise PipelineError(f"internal: the owner of {self.label!r} returned {len(part)} gradients of call"
                                    f" {call_id}, expected {count}")
            grads.extend(part)
        return grads


class PipelineEngine:
    """Runs one pipeline replica's steps: places modules, serves requests, drives microbatches.

    Args:
        transport: framed messages over this replica's pipeline process group (group rank = stage).
        num_stages: pipeline_parallel_degree.
        schedule: ``"interleaved"`` (backward first whenever ready, 1F1B-like) or ``"simple"`` (GPipe: all
            forwards of a wave of microbatches, then all backwards).
        active_microbatches: at most this many microbatches in flight on the driver.
        timeout_s: seconds to wait for any reply before raising :class:`PipelineError`.
        forward_context: a context manager factory wrapping every served forward request (e.g. autocast).
        global_ranks: global rank of each stage, for error messages.
        order_transport: messages over the ranks that must run this stage's tasks in one order (the same stage of
            every data-parallel replica and tensor-parallel rank); its group rank 0 leads. ``None`` or a group of
            one: this rank orders its tasks alone. See [Note: deterministic order] in ``_scheduler.py``.
        seed: base seed of the per-microbatch random streams ([Note: microbatch RNG streams] in ``_rng.py``); the
            same on every rank. ``None``: ``torch.initial_seed()``.
        remote_handles: a remote call returns at once with a :class:`~lightning_mp.pipeline.RemoteValue` that keeps
            its output on the owner until local code touches it ([Note: remote handles] in ``_handles.py``).
            ``False``: every remote call waits for its outputs (one round trip per call). The same on every stage.
    """

    def __init__(
        self,
        transport: Transport,
        num_stages: int,
        *,
        schedule: str = "interleaved",
        active_microbatches: int = 4,
        timeout_s: float = 1800.0,
        forward_context: Callable[[], AbstractContextManager] = nullcontext,
        global_ranks: Sequence[int] | None = None,
        order_transport: Transport | None = None,
        seed: int | None = None,
        remote_handles: bool = True,
    ) -> None:
        self.transport = transport
        self.remote_handles = remote_handles
        if remote_handles:
            materialize_module_inputs()
        self.order_transport = order_transport if order_transport is not None and order_transport.size > 1 else None
        self.stage = transport.rank
        self.num_stages = num_stages
        self.schedule = schedule
        self.active_microbatches = active_microbatches
        self.timeout_s = timeout_s
        self.forward_context = forward_context
        self.global_ranks = list(global_ranks) if global_ranks is not None else list(range(num_stages))
        self._modules: dict[str, nn.Module] = {}
        self._stage_of: dict[str, int] = {}
        self._subtree_stages: dict[str, set[int]] = {}  # stages of the modules with parameters under each FQN
        self._session: PipelineSession | None = None
        self._call_ids = itertools.count()
        self._sessions = itertools.count()
        self._step_names: dict[str, int] = {}
        self.rng = MicrobatchRNG(torch.initial_seed() if seed is None else seed)
        self.state_updates = OrderedStateUpdates(forward_context)
        self.gradients = OrderedGradients(_current_microbatch)
        self.messages_sent: collections.Counter[str] = collections.Counter()
        """Messages this rank sent, by kind ("call", "get", "gbwd", "fwd", "bwd", "reply", ...), over its lifetime."""
        self.timeline = TimelineRecorder()
        """Off by default; ``timeline.start()`` records every compute span and message (see ``_timeline.py``)."""

    @property
    def is_driver(self) -> bool:
        return self.stage == 0

    def describe_stage(self, stage: int) -> str:
        return f"pipeline stage {stage} (global rank {self.global_ranks[stage]})"

    # ---- placement -------------------------------------------------------------------------------------------

    def install(self, model: nn.Module, stage_of: Mapping[str, int], ordered_state: Sequence[str] | None = None) -> None:
        """Keep this stage's modules, free every other module's own parameters and buffers, stub their calls.

        Module FQNs, the tree and the local parameters stay where they were, so ``model.state_dict()`` on a
        rank holds exactly its own parameters under their original names. A module with no parameters in its
        whole subtree (activations, dropout, pooling, ...) is stateless: it stays on every rank and runs where it
        is called, which never costs a transfer (its input is already there).

        A module whose forward writes its own buffers (those in ``ordered_state``: BatchNorm's running statistics,
        also without affine parameters; spectral norm's power-iteration vectors) is stateful too, with its parents:
        its buffers live on its stage only, as one process keeps one copy.

        Every local module call that may run on another stage on some layout gets its own random stream ([Note:
        microbatch RNG streams]); with several stages, the modules named in ``ordered_state`` (those whose forward
        writes their own buffers; ``None``: every module with buffers) update them in microbatch order ([Note:
        ordered module state]).

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
        for fqn, module in modules:
            if self._stage_of[fqn] != self.stage and first_name[id(module)] == fqn:
                _release_and_stub(module, fqn, self._stage_of[fqn], self)
        for fqn, module in modules:
            if self._stage_of[fqn] == self.stage and first_name[id(module)] == fqn:
                _batch_sequential_runs(module, fqn, stage_of, stateful, self)
        self._hook_calls(modules, first_name, stateful, ordered_state)

    def order_gradients(self, model: nn.Module) -> None:
        """Sum this stage's gradients in microbatch order ([Note: ordered gradient accumulation] in ``_grads.py``).

        Call once the local parameters are final (after ``install`` and after materialising delayed parameters).
        """
        if self.num_stages > 1:  # one stage runs its microbatches one after the other anyway
            self.gradients.register(p for p in model.parameters() if p is not None)

    def report_gradients(
        self, params: Iterable[nn.Parameter], on_accumulated: Callable[[nn.Parameter, int], None]
    ) -> None:
        """Tell the gradients' owner, after each accumulation into a parameter's ``.grad``, how many microbatches (from
        0 on) are summed into it: ``on_accumulated(param, summed)`` (see ``OrderedGradients.report``). Call after
        :meth:`order_gradients`."""
        self.gradients.report(params, on_accumulated)

    def _hook_calls(
        self,
        modules: list[tuple[str, nn.Module]],
        first_name: Mapping[int, str],
        stateful: set[int],
        ordered_state: Sequence[str] | None,
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
                _CallHooks(self, fqn, keyed, defer).register(module)

    def stage_of(self, fqn: str) -> int:
        return self._stage_of[fqn]

    def _calls_other_stages(self, fqn: str, stage: int, span: tuple[int, int] | None) -> bool:
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

    # ---- sessions --------------------------------------------------------------------------------------------

    @contextmanager
    def session(self, name: str = "step", rng_key: Any = None) -> Iterator[PipelineSession]:
        """One pipelined step on every stage of this replica. Every stage must enter it for the same step.

        Args:
            name: what the step runs (e.g. the hook name); with a per-engine counter it tags every message, and a
                stage that receives a message of another step raises :class:`PipelineError` instead of mixing
                steps (e.g. one rank in ``validation_step`` while another is in ``training_step``).
            rng_key: names the step's random streams (e.g. hook, epoch, batch index): the same key gives the same
                random numbers. ``None``: ``(name, how many steps of that name this engine ran before)``.
        """
        if self._session is not None:
            raise RuntimeError("A pipelined step is already running on this rank; steps cannot nest.")
        session = PipelineSession(self, f"{name}#{next(self._sessions)}")
        if rng_key is None:
            rng_key = (name, self._step_names.get(name, 0))
            self._step_names[name] = rng_key[1] + 1
        self._session = session
        self.rng.start_step(rng_key)
        self.state_updates.start_step()
        self.gradients.start_step()
        try:
            session.start()
            yield session
        except BaseException as err:
            session.abort(err)
            raise
        finally:
            try:
                session.close()
                if session._error is None:
                    self.state_updates.end_step()
                    self.gradients.end_step()
            finally:
                self._session = None
                self.rng.end_step()
        if session._error is not None:  # e.g. a remote call whose output nobody touched failed after the step
            raise PipelineError(str(session._error)) from session._error

    def call_remote(self, fqn: str, stage: int, args: tuple, kwargs: dict, span: tuple[int, int] | None = None) -> Any:
        """Run module ``fqn`` on ``stage`` with ``args``/``kwargs``; the stub of every remote module calls this.

        With ``span=(start, stop)``, ``fqn`` is an ``nn.Sequential`` and the owner runs its children
        ``start .. stop-1`` one after the other on ``args[0]`` (see [Note: sequential runs]).
        """
        session, task = self._session, _current_task()
        if session is None or task is None:
            raise RuntimeError(
                f"Module {fqn!r} lives on pipeline stage {stage}, not on this rank (stage {self.stage}); it can only"
                " be called inside a pipelined step (training_step, validation_step, test_step, predict_step)."
                " Call the model from those steps, not from hooks or callbacks."
            )
        grad_enabled = torch.is_grad_enabled()
        call_id = (self.stage, next(self._call_ids))
        caches = _caches_written_back(args, kwargs, grad_enabled)
        if (self.remote_handles and task.ident[:1] == ("mb",) and not caches
                and not self._calls_other_stages(fqn, stage, span)):
            return session.call_async(stage, call_id, (fqn, args, kwargs, grad_enabled, span), task)
        envelope = session.envelope("fwd", call_id, (fqn, args, kwargs, grad_enabled, span), task.microbatch)
        packed = pack(envelope)
        grad_inputs = [t for t in packed.tensors if t.requires_grad] if grad_enabled else []
        reply = session.exchange(stage, packed, task, f"forward of {fqn!r}", call_id=call_id)
        outputs = [t for t, rg in zip(reply.tensors, reply.requires_grad) if rg and _differentiable(t)]
        if grad_enabled and outputs:
            handle = _RemoteBackward(session, stage, call_id, task.microbatch, _label(fqn, span))
            reply = _connected(reply, outputs, connect_remote_outputs(handle, grad_inputs, outputs))
        if not caches:
            return reply.obj.body
        output, states = reply.obj.body
        for cache, state in zip(caches, states):  # [Note: caches written back]
            cache.__dict__.update(state.__dict__)
        return output


def _earlier(step: str, than: str) -> bool:
    """Was session ``step`` (``"name#n"``, numbered per engine) started before ``than`` on the same engine?"""
    try:
        return int(step.rsplit("#", 1)[1]) < int(than.rsplit("#", 1)[1])
    except (IndexError, ValueError):
        return False


def _label(fqn: str, span: tuple[int, int] | None) -> str:
    return fqn if span is None else f"{fqn}[{span[0]}:{span[1]}]"


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
    module: nn.Module, fqn: str, stage_of: Mapping[str, int], stateful: set[int], engine: PipelineEngine
) -> None:
    """Make a local ``nn.Sequential`` whose children span stages send each remote run as one request."""
    if not isinstance(module, nn.Sequential) or type(module).forward is not nn.Sequential.forward:
        return
    if id(module) not in stateful:  # stateless: runs where it is called, whatever stage the plan names
        return
    runs = _sequential_runs(module, fqn, stage_of, stateful)
    if all(stage == engine.stage for stage, _, _ in runs):
        return
    children = list(module)

    def forward(self: nn.Sequential, input: Any) -> Any:
        for stage, start, stop in runs:
            if stage == engine.stage:
                for child in children[start:stop]:
                    input = child(input)
            else:
                input = engine.call_remote(fqn, stage, (input,), {}, span=(start, stop))
        return input

    module.forward = MethodType(forward, module)


_hook_frames = threading.local()  # per thread: what each pre-hook started, for its post-hook (calls nest)


class _CallHooks:
    """Forward hooks of one local module: its call's random stream and its deferred buffer updates."""

    def __init__(self, engine: PipelineEngine, fqn: str, keyed: bool, defer: bool) -> None:
        self.engine, self.fqn, self.keyed, self.defer = engine, fqn, keyed, defer

    def register(self, module: nn.Module) -> None:
        module.register_forward_pre_hook(self.pre, with_kwargs=True)
        module.register_forward_hook(self.post, with_kwargs=True, always_call=True)

    def pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        frames = getattr(_hook_frames, "stack", None)
        if frames is None:
            frames = _hook_frames.stack = []
        task = _current_task()
        if task is None or self.engine._session is None:
            frames.append(None)
            return
        if self.keyed:
            self.engine.rng.enter(task.microbatch, self.fqn, recompute=task.phase == _BACKWARD)
        snapshot = self.engine.state_updates.before(module) if self.defer else None
        frames.append((task, snapshot, args, kwargs))

    def post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        frame = _hook_frames.stack.pop()
        if frame is None:
            return
        task, snapshot, args, kwargs = frame
        if snapshot is not None:
            microbatch = task.microbatch if task.phase == _FORWARD else None  # recompute in backward: not again
            self.engine.state_updates.after(module, snapshot, microbatch, args, kwargs)
        if self.keyed:
            self.engine.rng.exit()


def _received_leaves(message: Message) -> list[torch.Tensor]:
    """The received tensors that the sender's graph needs gradients for, made leaves of this stage's graph."""
    return [t.requires_grad_(True) for t, requires_grad in zip(message.tensors, message.requires_grad) if requires_grad]


def _caches_written_back(args: tuple, kwargs: dict, grad_enabled: bool) -> list:
    """The Hugging Face ``Cache`` objects among a call's arguments that its owner sends back, without gradients.

    [Note: caches written back] A remote module works on a copy of each Python object of its arguments, so what it
    changes in place stays on its stage. A Hugging Face cache (``use_cache=True``) is changed in place by every
    attention layer: without gradients (evaluation, generation) a call that passes one waits for its outputs, and
    its owner sends the cache back with them, whose state then replaces the caller's (``__dict__``), so the model
    returns the cache of every layer, as in one process. With gradients (training) the cache is not sent back: the
    calls stay one-way, and the cache the model returns holds the layers of the driver's stage only.
    """
    cache_utils = sys.modules.get("transformers.cache_utils")
    if grad_enabled or cache_utils is None:
        return []
    return [value for value in (*args, *kwargs.values()) if isinstance(value, cache_utils.Cache)]


def _connected(message: Message, outputs: list[torch.Tensor], connected: list[torch.Tensor]) -> Message:
    """``message`` holding the ``connected`` tensors in place of its ``outputs`` (rebuilt if any was replaced)."""
    if all(a is b for a, b in zip(outputs, connected)):
        return message
    replaced = {id(a): b for a, b in zip(outputs, connected)}
    return message.with_tensors([replaced.get(id(t), t) for t in message.tensors])


def _differentiable(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() or tensor.is_complex()


_REMOTE_CLASSES: dict[type, type] = {}


def _remote_call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    fqn, stage, engine = self._smp_remote
    return engine.call_remote(fqn, stage, args, kwargs)


def _release_and_stub(module: nn.Module, fqn: str, stage: int, engine: PipelineEngine) -> None:
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
    module.__class__ = _REMOTE_CLASSES[cls]
    module._smp_remote = (fqn, stage, engine)
    module.forward = MethodType(_remote_call, module)


class PipelineSession:
    """One pipelined step on one rank: receiver threads, in-flight calls, served requests."""

    def __init__(self, engine: PipelineEngine, step: str) -> None:
        self.engine = engine
        self.step = step
        self.transport = engine.transport
        self.peers = [s for s in range(engine.num_stages) if s != engine.stage]
        self.token = ComputeToken(self.raise_if_failed)
        self.token.before_release = self._suspend_rng
        self.token.after_acquire = self._resume_rng
        self.timeline = engine.timeline
        if self.timeline.enabled:
            self.token.on_release = self._record_compute
        self._order = engine.order_transport
        self._grants: dict[tuple, int] = {}
        if self._order is not None:
            publish = self._publish_grant if self._order.rank == 0 else None
            self.token.order = GrantOrder(publish=publish, timeout_s=engine.timeout_s)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when a served request has sent its reply
        self._futures: dict[tuple[int, int], _Future] = {}
        self._saved: dict[tuple[int, int], _SavedCall] = {}
        # [Note: remote handles], owner side: outputs of "call" requests (as ("ok", value) or ("error", text)),
        # the leaves each call made of the caller's data, fetched values (for their backward), and per microbatch
        # what to drop when the driver says it is done.
        self._outputs: dict[tuple[int, int], _Future] = {}
        self._leaves: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._fetches: dict[tuple[int, int], _SavedFetch] = {}
        self._of_microbatch: dict[int, list[tuple[int, int]]] = {}
        self._fetch_counts: dict[int, _FetchCount] = {}
        self._freed: set[int] = set()  # microbatches the driver has finished (their outputs dropped, or about to be)
        # [Note: one microbatch's requests run in arrival order] per (caller stage, microbatch, origin): whether a
        # request of it is being served, and those queued behind it; per microbatch: requests received, not finished
        self._chains: dict[tuple, _Chain] = {}
        self._unfinished: collections.Counter[int] = collections.Counter()
        self._closed = False
        self._done_unsent: dict[int, list[int]] = {}  # driver: finished microbatches to tell each stage
        self._end = _Future()
        self._error: BaseException | None = None
        self._receivers: list[threading.Thread] = []  # every worker and the order thread, to join at close
        # [Note: request workers], per peer under ``_lock``: a worker is the listener, idle followers, their turn
        self._listening: dict[int, bool] = {}
        self._idle_workers: dict[int, int] = {}
        self._turns = {peer: threading.Condition(self._lock) for peer in self.peers}
        self._peer_closed: set[int] = set()
        self._workers_stop = False
        self._finished = False
        self._last_heard = time.monotonic()  # last message from a peer, or last served request finished
        # [Note: intra-op threads of engine threads] torch.set_num_threads(n) reaches OpenMP/MKL only in the thread
        # that calls it; a new thread starts with OpenMP's default (one per core). With n=1 set by the user, a
        # matmul in a fresh thread measured 10x slower than in the main thread on a 2-core machine (16 ms vs 1.5 ms
        # for 128x1536 @ 1536x384). Every compute thread of the engine therefore repeats the caller's setting.
        self._intra_op_threads = torch.get_num_threads()
        self._serving = 0  # served requests in progress on this rank
        self._device = engine.transport.device

    def _enter_thread(self) -> None:
        """Set up an engine thread: intra-op threads, CUDA device, backward on this thread.

        [Note: backward on the calling thread] On CUDA, autograd runs backward of every node on one device thread
        shared by all backwards on that GPU. ``_RemoteBackward`` blocks there for its reply, which would stall every
        other microbatch's backward and deadlock a nested call (stage A -> B -> A: A's server needs that thread
        while A's driver holds it). The per-call hooks (``_CallHooks``: random streams, ordered state) also read the
        engine's thread-local task, which autograd's thread has not. ``set_multithreading_enabled(False)``
        (thread-local) runs backward on the thread that calls it, as on CPU: every engine thread sets it, and every
        ``backward`` call of the engine is wrapped in it (the one-stage path runs on the caller's thread).
        """
        torch.set_num_threads(self._intra_op_threads)  # see [Note: intra-op threads of engine threads]
        if self._device.type == "cuda":  # every thread that issues CUDA work names its device
            torch.cuda.set_device(self._device)
        torch.autograd.set_multithreading_enabled(False)

    # ---- lifecycle -------------------------------------------------------------------------------------------

    def envelope(self, kind: str, call_id: tuple[int, int] | None = None, body: Any = None, microbatch: int = 0) -> _Envelope:
        """A message of this step, naming the served request it is sent from (see ``_enter_chain``)."""
        task = _current_task()
        origin = task.ident if task is not None and task.ident[:1] == ("call",) else None
        return _Envelope(kind, self.step, call_id, body, microbatch, origin=origin)

    def priority(self, task: _Task) -> Priority:
        engine = self.engine
        return _priority(task, engine.schedule, engine.stage, engine.num_stages)

    def grant_key(self, task: _Task) -> tuple | None:
        """The rank-independent name of ``task``'s next grant of the compute token (None when unordered)."""
        if self._order is None:
            return None
        with self._lock:
            count = self._grants[task.ident] = self._grants.get(task.ident, 0) + 1
        return (task.ident, count)

    def _publish_grant(self, key: tuple) -> None:
        for follower in range(1, self._order.size):
            self._order.send(("grant", self.step, key), follower)

    def _order_loop(self) -> None:
        """Follower: feed the leader's grants to the compute token until the leader closes the step."""
        self._enter_thread()
        while True:
            try:
                kind, step, key = self._order.recv(0).obj
            except Exception as err:
                self.fail(PipelineError(f"Lost contact with the order leader of this stage: {err}"))
                return
            if step != self.step:
                self.fail(PipelineError(f"The order leader runs {step!r} while this rank runs {self.step!r}."))
                return
            if kind == "close":
                self.token.leader_done()
                return
            if kind == "error":  # ``key`` is the leader's error
                self.fail(PipelineError(f"The order leader of this stage failed the step: {key}"))
                return
            self.token.decide(key)

    def _suspend_rng(self) -> None:
        task = _current_task()
        if task is not None:
            self.engine.rng.suspend(task.ident)

    def _resume_rng(self) -> None:
        task = _current_task()
        if task is not None:
            phase = "forward" if task.phase == _FORWARD else "backward"
            self.engine.rng.resume(task.ident, task.microbatch, f"{phase}:{task.label}")

    def _record_compute(self, since: float) -> None:
        task = _current_task()
        if task is not None:
            category = "forward" if task.phase == _FORWARD else "backward"
            self.timeline.record(category, task.label, task.microbatch, since)

    def send(self, message: Any, peer: int, microbatch: int = 0, kind: str = "reply") -> None:
        """Send one message (an envelope, or a packed one of ``kind``) to ``peer``, recording it on the timeline and
        counting it in ``engine.messages_sent``."""
        start = time.perf_counter()
        kind = message.kind if isinstance(message, _Envelope) else kind
        with self._lock:
            self.engine.messages_sent[kind] += 1
        if self._done_unsent and isinstance(message, _Envelope):  # no message of its own: it goes with the next
            with self._lock:
                done = self._done_unsent.pop(peer, None)
            if done:
                message = dataclasses.replace(message, done=message.done + tuple(done))
        try:
            self.transport.send(message, peer)
        except TypeError:  # the message itself cannot be sent (``pack`` says why)
            raise
        except Exception as err:  # e.g. the peer died: a one-way "call" learns it here, so name the stage
            raise PipelineError(f"Could not reach {self.engine.describe_stage(peer)}: {err}") from err
        self.timeline.record("send", f"to stage {peer}", microbatch, start)

    def start(self) -> None:
        for peer in self.peers:
            self._listening[peer] = True
            self._spawn_worker(peer)
        if self._order is not None and self._order.rank != 0:
            thread = threading.Thread(target=self._order_loop, daemon=True, name="smp-order")
            thread.start()
            self._receivers.append(thread)

    # [Note: request workers] Each peer has a pool of long-lived worker threads for this step (leader/followers,
    # Schmidt et al. 2000): one, the listener, receives from the peer; when it receives a request it hands the
    # listening role on and serves the request itself (it is already awake, with the request in hand), then goes
    # back to the pool. The role goes to the first worker that is free: an idle follower (one wake-up) or a
    # worker that just finished serving, which takes it without waiting; only when every worker of the peer is
    # busy does a new thread start. So a step starts about as many threads per peer as it has requests in
    # flight at once, instead of one per request (each start is a clone and a wait for the new thread to run).

    def _spawn_worker(self, peer: int) -> None:
        """Start a worker thread of ``peer``'s pool, as its listener (the caller has set ``_listening[peer]``)."""
        thread = threading.Thread(target=self._worker, args=(peer,), daemon=True, name=f"smp-recv-{peer}")
        with self._lock:
            self._receivers.append(thread)
        thread.start()

    def _hand_on_listening(self, peer: int) -> None:
        """The listener of ``peer`` took a request: let a free worker listen (see [Note: request workers])."""
        with self._lock:
            self._listening[peer] = False
            spawn = not self._idle_workers.get(peer, 0)
            if spawn:
                self._listening[peer] = True
            else:
                self._turns[peer].notify()
        if spawn:
            self._spawn_worker(peer)

    def _worker(self, peer: int) -> None:
        """One worker of ``peer``'s pool: listen while it holds the role, serve what it received, wait for the role."""
        self._enter_thread()  # copies out of the wire buffer run torch ops here too
        turn = self._turns[peer]
        while self._receive_loop(peer):  # False: nothing more comes from this peer (it closed the step, or failed)
            with self._lock:
                self._idle_workers[peer] = self._idle_workers.get(peer, 0) + 1
                while self._listening[peer] and not self._workers_stop and peer not in self._peer_closed:
                    turn.wait()
                self._idle_workers[peer] -= 1
                if self._listening[peer]:  # another worker listens, and this one is told to end
                    return
                self._listening[peer] = True  # the role is free: take it (even when told to end)
        with self._lock:
            self._peer_closed.add(peer)
            turn.notify_all()

    def _stop_workers(self) -> None:
        """Idle workers end, and busy ones once they served their request, unless a peer's listening role is free."""
        with self._lock:
            self._workers_stop = True
            for turn in self._turns.values():
                turn.notify_all()

    def fail(self, error: BaseException) -> None:
        """Record the first failure; every waiter on this rank raises it."""
        with self._lock:
            if self._error is None:
                self._error = error

    def raise_if_failed(self) -> None:
        if self._error is not None:
            raise PipelineError(str(self._error)) from self._error

    def abort(self, error: BaseException) -> None:
        """Tell the other stages that this step failed here (driver), so they raise instead of waiting."""
        self.fail(error)
        if self.engine.is_driver and not self._finished:
            self._finished = True
            text = f"{type(error).__name__}: {error}"
            for peer in self.peers:
                self._send_quietly(self.envelope("end", body=("error", text)), peer)

    def close(self) -> None:
        """Finish the step: wait for the requests this rank serves to reply, exchange "close" with every peer,
        then join this step's threads (listeners, which serve the requests they receive, and the order thread).

        After a failure the waits are short (``_POLL_S``): requests queued in a chain are answered with the error
        at once, a request still running replies after "close", and the next step's listener drops such late
        replies (and a late "close") of an earlier step instead of failing as out of step.
        """
        if self._error is not None:
            self._refuse_queued()
        with self._idle:
            self._idle.wait_for(lambda: self._serving == 0, self.engine.timeout_s if self._error is None else _POLL_S)
        for peer in self.peers:
            self._send_quietly(self.envelope("close"), peer)
        if self._order is not None and self._order.rank == 0:
            # A failed leader says so: its followers would otherwise take the grants it never made for divergence.
            last = ("close", self.step, None) if self._error is None else ("error", self.step, str(self._error))
            for follower in range(1, self._order.size):
                try:
                    self._order.send(last, follower)
                except Exception:  # the follower may be gone; its own session fails on its own
                    pass
        self._stop_workers()
        joined = 0
        while joined < len(self._receivers):  # a listener that took a request may have started another worker
            self._receivers[joined].join(self.engine.timeout_s if self._error is None else _POLL_S)
            joined += 1
        with self._lock:
            self._closed = True
            self._outputs.clear()
            self._chains.clear()
            self._leaves.clear()
            self._fetches.clear()
            self._of_microbatch.clear()
            self._fetch_counts.clear()

    def _send_quietly(self, envelope: Any, peer: int, microbatch: int = 0) -> None:
        try:
            self.send(envelope, peer, microbatch)
        except Exception as err:  # the peer may be gone; the step is failing anyway
            if self._error is None:  # ``send`` names the stage already
                self.fail(err)

    # ---- driver ----------------------------------------------------------------------------------------------

    def drive(
        self,
        step_fn: Callable[[Any, int], Any],
        microbatches: Sequence[Any],
        *,
        loss_fn: Callable[[Any], torch.Tensor | None],
        backward: bool,
    ) -> list[Any]:
        """Run ``step_fn(microbatch, index)`` for every microbatch (and backward of ``loss_fn(output)``).

        Returns:
            The step outputs, in microbatch order.

        Raises:
            PipelineError: if any microbatch or any stage fails, naming the stage.
        """
        if not self.engine.is_driver:
            raise RuntimeError("Only pipeline stage 0 drives a step; other stages call `serve()`.")
        outputs: list[Any] = [None] * len(microbatches)
        grad_enabled, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

        def run(index: int, forwards_done: _WaveBarrier | None) -> None:
            forward = _Task(index, _FORWARD, ident=("mb", index, _FORWARD))
            back = _Task(index, _BACKWARD, ident=("mb", index, _BACKWARD))
            with torch.inference_mode(inference), torch.set_grad_enabled(grad_enabled), _as_task(forward):
                self.token.acquire(self.priority(forward), self.grant_key(forward))
                try:
                    outputs[index] = step_fn(microbatches[index], index)
                    loss = loss_fn(outputs[index]) if backward else None
                    if loss is None:
                        outputs[index] = self._finish_microbatch(index, outputs[index])
                        if backward and forwards_done is not None:  # no backward here (num_tokens == 0): the
                            self.token.release()  # wave's other backwards still wait for this forward to arrive
                            forwards_done.arrive_and_wait()
                        return
                    loss = materialize(loss)
                    outputs[index] = materialize(outputs[index])
                    if forwards_done is not None:  # "simple": every forward of the wave first
                        self.token.release()
                        forwards_done.arrive_and_wait()
                        self.raise_if_failed()
                        with _as_task(back):
                            self.token.acquire(self.priority(back), self.grant_key(back))
                    else:  # straight on to the backward unless a better task waits (no release/re-acquire race)
                        self.token.handover(self.priority(back), self.grant_key(back))
                    with _as_task(back):
                        try:
                            self.engine.state_updates.finalize(index)
                            with torch.autograd.set_multithreading_enabled(False):  # [Note: backward on the calling thread]
                                loss.backward()
                            self._finish_microbatch(index, None)
                        finally:
                            self.token.release()
                finally:
                    self.token.release()  # no-op when the backward released it

        if not self.peers:  # one stage: nothing to overlap, run inline
            for index in range(len(microbatches)):
                run(index, None)
            return outputs
        self._run_threads(run, len(microbatches))
        return outputs

    def _run_threads(self, run: Callable[[int, _WaveBarrier | None], None], count: int) -> None:
        """Run microbatches ``0 .. count-1`` on ``active_microbatches`` threads, in order.

        Each thread runs one microbatch after the other: when one finishes, the thread that ran it starts the
        next itself (no hand-off to a starting thread), so at most ``active_microbatches`` are in flight.
        "simple" makes waves of that many, whose forwards all finish before their backwards start.
        """
        cap = max(1, min(self.engine.active_microbatches, count))
        simple = self.engine.schedule == "simple"
        barriers = [_WaveBarrier(min(cap, count - s), self.raise_if_failed) if simple else None for s in range(0, count, cap)]
        work = iter([(index, barriers[index // cap]) for index in range(count)])
        lock = threading.Lock()

        def worker() -> None:
            self._enter_thread()
            while True:
                with lock:
                    item = next(work, None) if self._error is None else None
                if item is None:
                    return
                index, barrier = item
                try:
                    run(index, barrier)
                except BaseException as err:
                    self.fail(err)
                    for wave in barriers:
                        if wave is not None:
                            wave.breaks()

        threads = [threading.Thread(target=worker, daemon=True, name=f"smp-mb-{k}") for k in range(cap)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self.raise_if_failed()

    def finish(self, summary: Any) -> None:
        """Send ``summary`` (e.g. the step's mean loss and logged values) to every other stage."""
        self._finished = True
        for peer in self.peers:
            self.send(self.envelope("end", body=("ok", summary)), peer)

    # ---- server ----------------------------------------------------------------------------------------------

    def serve(self) -> Any:
        """Answer requests until the driver finishes the step; return the driver's summary.

        Raises:
            PipelineError: if the driver failed, or no peer sent anything for the timeout while this rank had no
                request to work on (the driver or a stage it waits on is stuck or gone). A healthy step fails the
                same way when some stretch of it sends nothing to this rank for longer than the timeout (e.g. the
                driver computes locally for that long): the timeout must exceed the longest such stretch.
        """
        message: Message = self._end.wait(float("inf"), self._raise_if_failed_or_silent, "the end of the step")
        status, body = message.obj.body
        if status != "ok":
            raise PipelineError(f"The step failed on {self.engine.describe_stage(0)}: {body}")
        return body

    def _raise_if_failed_or_silent(self) -> None:
        self.raise_if_failed()
        silent_s = time.monotonic() - self._last_heard
        if self._serving == 0 and silent_s > self.engine.timeout_s:
            raise PipelineError(
                f"{self.engine.describe_stage(self.engine.stage)} heard nothing from the other stages for"
                f" {silent_s:.0f} s (timeout {self.engine.timeout_s:.0f} s) while waiting for"
                f" {self.engine.describe_stage(0)} to finish the step: it, or a stage it waits on, is stuck or gone."
                " If a step can legitimately go longer than that without a message to this stage (a long"
                " computation on another stage), raise the timeout."
            )

    def _receive_loop(self, peer: int) -> bool:
        """Receive from ``peer`` until a request came (served here: returns True) or nothing more will (False)."""
        while True:
            _unpacked.refs = refs = []  # references to this stage's outputs met while unpickling
            try:
                message = self.transport.recv(peer)
            except Exception as err:
                self.fail(PipelineError(f"Lost contact with {self.engine.describe_stage(peer)}: {err}"))
                return False
            envelope: _Envelope = message.obj
            self._last_heard = time.monotonic()
            self.timeline.record("recv", f"from stage {peer}", envelope.microbatch, message.arrived_s)
            if envelope.step != self.step and envelope.kind in ("reply", "error", "close") and _earlier(envelope.step, self.step):
                continue  # a late answer of a step that failed here (it closed without waiting): not for this step
            if envelope.step != self.step:
                self.fail(
                    PipelineError(
                        f"Pipeline stages are out of step: this stage ({self.engine.describe_stage(self.engine.stage)})"
                        f" runs {self.step!r} but {self.engine.describe_stage(peer)} sent a message of"
                        f" {envelope.step!r}. Every stage of a pipeline must run the same steps in the same order"
                        " (same number of batches, no rank-dependent skipping)."
                    )
                )
                return False
            for microbatch in envelope.done:
                self._free(microbatch)
            if envelope.kind == "close":
                return False
            if envelope.kind in ("reply", "error"):
                with self._lock:
                    future = self._futures.pop(envelope.call_id, None)
                if future is not None:
                    future.set(message)
                elif envelope.kind == "error":  # a "call" failed: nobody waits for it, the step fails
                    self.fail(PipelineError(envelope.body))
            elif envelope.kind == "end":
                self._end.set(message)
            else:
                # [Note: request workers] another worker listens to this peer, and this one, already awake with
                # the request in hand, serves it (one thread wake-up less on the critical path than handing it over).
                # With remote handles its place in its chain is taken first, before the next request from this
                # peer can arrive; one that must wait for an earlier request of its chain is queued, runs on that
                # one's thread after it, and this worker goes on listening.
                if not self.engine.remote_handles:
                    with self._lock:
                        self._serving += 1
                    self._hand_on_listening(peer)
                    self._serve_request(peer, message, refs)
                    return True
                chain = self._enter_chain(peer, envelope, message, refs)
                if chain is None:
                    continue
                self._hand_on_listening(peer)
                self._serve_chain(peer, chain, message, refs)
                return True

    def _enter_chain(self, peer: int, envelope: _Envelope, message: Message, refs: list) -> _Chain | None:
        """Receiving thread, in arrival order: the request's place in its chain (``None``: queued behind an earlier
        request of it, which is being served), and, for a "call", its output's future (so a later reference finds
        it, or fails at once).

        [Note: one microbatch's requests run in arrival order] A caller sends the requests of one microbatch in its
        program order, and with remote handles it does not wait for one before sending the next. The owner runs
        them in that order: each waits until the previous request of the same (caller stage, microbatch, origin)
        has finished, where the origin is the request the caller was serving when it sent it (None for the
        driver's microbatch code): a nested call (stage 0 -> 1 -> 0 -> 1) must not queue behind the call that is
        waiting for it.
        Otherwise a call with data arguments would overtake an earlier one waiting for a referenced output, and
        per-call random streams ("the n-th call of module F in microbatch m", ``_rng.py``) and deferred buffer
        updates (BatchNorm, ``_state.py``) would follow execution order, not the program's; a fetch would miss an
        earlier call's in-place change of the fetched value. Different microbatches stay unordered: the
        pipeline's overlap is between microbatches. The chain also keeps a microbatch's outputs until its last
        request has run (``_free``), so a call the driver never waited for still finds what it references.
        A request received while an earlier one of its chain is served waits in the chain's queue, and the thread
        serving that one runs it next (a loop over remote blocks then runs on one thread: no hand-off per call).
        """
        key = (peer, envelope.microbatch, envelope.origin)
        with self._lock:
            self._serving += 1
            self._unfinished[envelope.microbatch] += 1
            if envelope.kind == "call" and not self._closed:
                self._outputs[envelope.call_id] = _Future()
                self._of_microbatch.setdefault(envelope.microbatch, []).append(envelope.call_id)
            chain = self._chains.get(key)
            if chain is None:
                chain = self._chains[key] = _Chain()
            if chain.busy:
                chain.queue.append((message, refs))
                return None
            chain.busy = True
        return chain

    def _serve_chain(self, peer: int, chain: _Chain, message: Message, refs: list) -> None:
        """Serve a request, then the requests of its chain that arrived meanwhile, in order."""
        while True:
            self._serve_request(peer, message, refs, chained=True)
            with self._lock:
                if not chain.queue:
                    chain.busy = False
                    return
                message, refs = chain.queue.popleft()

    def _refuse_queued(self) -> None:
        """The step failed: answer every request still queued in a chain with the error now, before "close" (it
        would otherwise run, fail and reply only once the request ahead of it ends, into the next step)."""
        with self._lock:
            queued = [(key[0], message) for key, chain in self._chains.items() for message, _ in chain.queue]
            for chain in self._chains.values():
                chain.queue.clear()
        for peer, message in queued:
            envelope: _Envelope = message.obj
            self._send_quietly(self.envelope("error", envelope.call_id, str(self._error), envelope.microbatch), peer)
            self._leave_chain(envelope.microbatch)
            with self._lock:
                self._serving -= 1
                self._idle.notify_all()

    def _leave_chain(self, microbatch: int) -> None:
        with self._lock:
            self._unfinished[microbatch] -= 1
            idle = self._unfinished[microbatch] == 0
            if idle:
                del self._unfinished[microbatch]
        if idle and microbatch in self._freed:  # the driver finished it while this request ran
            self._drop(microbatch)

    def _serve_request(self, peer: int, message: Message, refs: list | None = None, chained: bool = False) -> None:
        # runs on a request worker, which has entered its thread once ([Note: request workers])
        envelope: _Envelope = message.obj
        reply: Any = None
        try:
            reply = self._serve(message, refs)
        except BaseException as err:  # not a failure of the module (``_serve`` replies those): of the session
            self.fail(err)
            if envelope.kind == "call":
                self._record_output(envelope.call_id, envelope.microbatch, ("error", str(err)))
            reply = self.envelope("error", envelope.call_id, str(err), envelope.microbatch)
        try:
            if chained:
                self._leave_chain(envelope.microbatch)
            if reply is not None:
                self._send_quietly(reply, peer, envelope.microbatch)
        finally:
            with self._lock:
                self._serving -= 1
                self._idle.notify_all()
                self._last_heard = time.monotonic()

    def _serve(self, message: Message, refs: list | None) -> Any:
        """Run one request; return its reply (None for a "call"), or an "error" reply naming the failure."""
        envelope: _Envelope = message.obj
        kind = envelope.kind
        phase = _FORWARD if kind in ("fwd", "call", "get") else _BACKWARD
        fqn = envelope.body[0]
        if kind in ("get", "gbwd"):
            label = envelope.body[2] if kind == "get" else fqn
        else:
            label = _label(fqn, envelope.body[-1] if phase == _FORWARD else None)
        task = _Task(envelope.microbatch, phase, label, ident=("call", envelope.call_id, kind))
        reply: Any = None
        try:
            if kind == "get":  # no compute: sends a value that exists (or waits for it) without the token
                with _as_task(task):
                    reply = self._run_get(envelope)
            else:
                if kind == "call":
                    self._await_outputs([(ref._rv_call_id, ref._rv_microbatch) for ref in refs or ()], label)
                with _as_task(task), self.token.hold(self.priority(task), self.grant_key(task)):
                    if kind == "fwd":
                        reply = self._run_forward(envelope, message)
                    elif kind == "call":
                        self._run_call(envelope, message, refs or [])
                    else:
                        self.engine.state_updates.finalize(envelope.microbatch)
                        reply = self._run_backward(envelope) if kind == "bwd" else self._run_fetch_backward(envelope)
        except BaseException as err:
            where = self.engine.describe_stage(self.engine.stage)
            text = f"{where} failed running {label!r} for microbatch {envelope.microbatch}:\n{traceback.format_exc()}"
            body = str(err) if isinstance(err, PipelineError) else text
            reply = self.envelope("error", envelope.call_id, body, envelope.microbatch)
            if kind == "call":
                self._record_output(envelope.call_id, envelope.microbatch, ("error", body))
        return reply

    def _call_module(self, fqn: str, args: tuple, kwargs: dict, grad_enabled: bool, span: tuple | None) -> Any:
        """Run the requested module (or the ``span`` of a Sequential's children) on this stage."""
        module = self.engine._modules[fqn]
        if span is None and self.engine.stage_of(fqn) != self.engine.stage:
            raise PipelineError(f"Module {fqn!r} was requested from stage {self.engine.stage} but lives elsewhere.")
        with torch.set_grad_enabled(grad_enabled), self.engine.forward_context():
            if span is None:
                return module(*args, **kwargs)
            (output,) = args
            for child in list(module)[span[0] : span[1]]:
                output = child(output)
            return output

    def _run_forward(self, envelope: _Envelope, message: Message) -> _Envelope:
        fqn, args, kwargs, grad_enabled, span = envelope.body
        leaves = _received_leaves(message) if grad_enabled else []
        output = self._call_module(fqn, args, kwargs, grad_enabled, span)
        caches = _caches_written_back(args, kwargs, grad_enabled)
        body = (output, caches) if caches else output  # [Note: caches written back]
        reply = pack(self.envelope("reply", envelope.call_id, body, envelope.microbatch))
        if grad_enabled:
            outputs = [t for t in reply.tensors if t.requires_grad and _differentiable(t)]
            if outputs:
                with self._lock:
                    self._saved[envelope.call_id] = _SavedCall(leaves, outputs, fqn)
        return reply

    def _run_backward(self, envelope: _Envelope) -> _Envelope:
        fqn, grad_outputs = envelope.body
        with self._lock:
            saved = self._saved.pop(envelope.call_id)
        pairs = [(out, ragged_like(grad, out)) for out, grad in zip(saved.outputs, grad_outputs) if grad is not None]
        if pairs:
            with torch.autograd.set_multithreading_enabled(False):  # [Note: backward on the calling thread]
                torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])
        return self.envelope("reply", envelope.call_id, [leaf.grad for leaf in saved.leaves], envelope.microbatch)

    # ---- remote handles, owner side ([Note: remote handles] in _handles.py) -----------------------------------

    def _record_output(self, call_id: tuple[int, int], microbatch: int, result: tuple[str, Any]) -> None:
        with self._lock:
            future = self._outputs.get(call_id)  # registered on receipt (``_enter_chain``); gone once closed
        if future is not None:
            future.set(result)

    def _output_future(self, call_id: tuple[int, int], microbatch: int) -> _Future:
        """The future of this stage's output of ``call_id``, registered when the call arrived.

        Raises:
            PipelineError: at once if this stage has no such output: its microbatch finished (it was dropped), or
                the reference comes from another step.
        """
        with self._lock:
            future = self._outputs.get(call_id)
        if future is not None:
            return future
        where = self.engine.describe_stage(self.engine.stage)
        if microbatch in self._freed:
            raise PipelineError(
                f"The output of a remote call of microbatch {microbatch} was used after that microbatch had"
                f" finished, and {where}, which computed it, has dropped it. Use a microbatch's values within its"
                " own step function, or return them from it."
            )
        raise PipelineError(
            f"{where} has no output of remote call {call_id} in step {self.step!r}: a value from another step was"
            " passed to it. Values of a pipelined step cannot be kept for a later step; return them from the step."
        )

    def _await_outputs(self, call_ids: list[tuple[tuple[int, int], int]], what: str) -> None:
        for call_id, microbatch in call_ids:
            self._output_future(call_id, microbatch).wait(
                self.engine.timeout_s, self.raise_if_failed, f"the output of an earlier call, for {what!r}"
            )

    def _resolve(self, call_id: tuple[int, int], path: tuple, microbatch: int) -> Any:
        """This stage's output of ``call_id``, then ``value[key]`` for each key of ``path``."""
        status, value = self._output_future(call_id, microbatch).wait(
            self.engine.timeout_s, self.raise_if_failed, "the output of an earlier call"
        )
        if status != "ok":
            raise PipelineError(value)
        for key in path:
            value = value[key]
        return value

    def _run_call(self, envelope: _Envelope, message: Message, refs: list) -> None:
        fqn, args, kwargs, grad_enabled, span = envelope.body
        leaves = _received_leaves(message) if grad_enabled else []
        args, kwargs = resolve((args, kwargs), refs, self._resolve)
        output = self._call_module(fqn, args, kwargs, grad_enabled, span)
        if leaves:
            with self._lock:
                self._leaves[envelope.call_id] = leaves
        self._record_output(envelope.call_id, envelope.microbatch, ("ok", output))

    def _run_get(self, envelope: _Envelope) -> Any:
        call_id, path, label = envelope.body
        depth, value = walk_containers(self._resolve(call_id, (), envelope.microbatch), path)
        with _PackingFor(self, None):  # remote values inside it are fetched here and sent as data
            reply = pack(self.envelope("reply", envelope.call_id, (depth, value), envelope.microbatch))
        outputs = [t for t in reply.tensors if t.requires_grad and _differentiable(t)]
        if outputs:
            with self._lock:
                self._fetches[envelope.call_id] = _SavedFetch(outputs, envelope.microbatch)
                self._of_microbatch.setdefault(envelope.microbatch, []).append(envelope.call_id)
                count = self._fetch_counts.setdefault(envelope.microbatch, _FetchCount())
                count.pending += 1
                count.foreign = count.foreign or envelope.call_id[0] != 0
        return reply

    def _run_fetch_backward(self, envelope: _Envelope) -> _Envelope:
        label, grad_outputs, upstream = envelope.body
        with self._lock:
            saved = self._fetches[envelope.call_id]
            count = self._fetch_counts.setdefault(saved.microbatch, _FetchCount())
            if not saved.backed:
                saved.backed = True
                count.pending -= 1
            retain = count.foreign or count.pending > 0
        pairs = [(out, ragged_like(grad, out)) for out, grad in zip(saved.outputs, grad_outputs) if grad is not None]
        if pairs:
            # [Note: backward of fetches] Fetches of one microbatch can share a part of this stage's graph (a value
            # fetched midway through a chain, then the chain's end; two parts of one output fetched apart), so the
            # graph is kept while another fetch of the microbatch awaits its backward. A fetch that a stage other
            # than the driver made can moreover be backed through once per backward of that stage's graph that
            # passes it (its owner gets partial gradients, which add up as one backward would): then the graph is
            # kept until the driver finishes the microbatch (``_free``). The driver runs one backward per
            # microbatch, so each of its fetches is backed through once, and the last frees the graph as it goes.
            # A fetch whose value never reaches the loss (fetched only for a branch, ``if t > 0``) gets no backward:
            # then the graph stays until the microbatch is done (about one message later under 1F1B).
            with torch.autograd.set_multithreading_enabled(False):  # [Note: backward on the calling thread]
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs], retain_graph=retain)
        grads = []
        for call_id in upstream:
            with self._lock:
                leaves = self._leaves.get(call_id, [])
            grads.append([leaf.grad for leaf in leaves])
            for leaf in leaves:
                leaf.grad = None  # what the next fetch of this chain returns is its own share only
        return self.envelope("reply", envelope.call_id, grads, envelope.microbatch)

    def _free(self, microbatch: int) -> None:
        """The driver finished ``microbatch``: drop this stage's outputs, leaves and fetches of it, once the requests
        of it received so far have run (a call nobody waited for may still be queued)."""
        with self._lock:
            self._freed.add(microbatch)
            if self._unfinished.get(microbatch, 0):
                return  # ``_leave_chain`` of its last request drops it
        self._drop(microbatch)

    def _drop(self, microbatch: int) -> None:
        with self._lock:
            for key in [key for key in self._chains if key[1] == microbatch]:
                del self._chains[key]
            for call_id in self._of_microbatch.pop(microbatch, ()):
                self._outputs.pop(call_id, None)
                self._leaves.pop(call_id, None)
                self._fetches.pop(call_id, None)
            self._fetch_counts.pop(microbatch, None)

    # ---- remote handles, caller side ----------------------------------------------------------------------------

    def call_async(self, stage: int, call_id: tuple[int, int], body: tuple, task: _Task) -> RemoteValue:
        """Send a "call" request and return a handle to its output at once ([Note: remote handles])."""
        self.raise_if_failed()
        fqn, _, _, grad_enabled, span = body
        with _PackingFor(self, stage) as packing:
            packed = pack(self.envelope("call", call_id, body, task.microbatch))
        upstream: dict[tuple[int, int], list[torch.Tensor]] = {}
        for ref in packing.refs:
            upstream.update(ref._rv_upstream)
        grad_inputs = [t for t in packed.tensors if t.requires_grad] if grad_enabled else []
        if grad_inputs:
            upstream[call_id] = grad_inputs
        self.send(packed, stage, task.microbatch, kind="call")
        handle = RemoteValue(self, stage, call_id, task.microbatch, upstream=upstream, label=_label(fqn, span))
        handle._rv_grad_enabled = grad_enabled
        return handle

    def check_reference(self, handle: RemoteValue) -> None:
        """Caller side, while packing a request: may ``handle`` go to its owner as a reference?

        Raises:
            PipelineError: at once, naming the module, if the handle comes from another step or its microbatch has
                finished (its owner has dropped the value, or is about to): a reference would wait in vain.
        """
        where = self.engine.describe_stage(handle._rv_stage)
        if handle._rv_session is not self or self._closed:
            raise PipelineError(
                f"The output of {handle._rv_label!r} (computed on {where}) was passed to a call after its pipelined"
                " step ended. Values of a pipelined step cannot be kept for a later step; return them from the step."
            )
        if handle._rv_microbatch in self._freed:
            raise PipelineError(
                f"The output of {handle._rv_label!r} of microbatch {handle._rv_microbatch} was used after that"
                f" microbatch had finished, and {where}, which computed it, has dropped it. Use a microbatch's values"
                " within its own step function, or return them from it."
            )
        task = _current_task()
        if task is not None and task.microbatch != handle._rv_microbatch:
            # whether the other microbatch has finished would depend on timing: refuse it always
            raise PipelineError(
                f"The output of {handle._rv_label!r} of microbatch {handle._rv_microbatch} (on {where}) was used in"
                f" microbatch {task.microbatch}. Values cannot cross microbatches of a pipelined step: use a"
                " microbatch's values within its own step function, or return them from it."
            )

    def fetch(self, handle: RemoteValue) -> Any:
        """Bring the value behind ``handle`` here: one round trip to its owner, connected to autograd."""
        label = handle._rv_label
        if handle._rv_session is not self or self._closed:
            raise PipelineError(
                f"The output of {label!r} (computed on {self.engine.describe_stage(handle._rv_stage)}) was touched"
                " after its pipelined step ended; only values returned by the step are fetched for you."
            )
        self.check_reference(handle)
        task = _current_task() or _Task(handle._rv_microbatch, _FORWARD)
        fetch_id = (self.engine.stage, next(self.engine._call_ids))
        body = (handle._rv_call_id, handle._rv_path, label)
        envelope = self.envelope("get", fetch_id, body, handle._rv_microbatch)
        reply = self.exchange(handle._rv_stage, envelope, task, f"the output of {label!r}")
        outputs = [t for t, rg in zip(reply.tensors, reply.requires_grad) if rg and _differentiable(t)]
        if outputs and handle._rv_grad_enabled and not torch.is_inference_mode_enabled():
            upstream = handle._rv_upstream
            grad_inputs = [t for tensors in upstream.values() for t in tensors]
            call = _FetchBackward(self, handle._rv_stage, fetch_id, handle._rv_microbatch, label,
                                  [(call_id, len(tensors)) for call_id, tensors in upstream.items()])
            with torch.enable_grad():  # the call ran with grad: connect even if touched under no_grad
                reply = _connected(reply, outputs, connect_remote_outputs(call, grad_inputs, outputs))
        return reply.obj.body

    def _finish_microbatch(self, index: int, output: Any) -> Any:
        """Driver: fetch the remote values a step returned, then let every stage drop the microbatch's outputs."""
        output = materialize(output)
        if self.engine.remote_handles:
            with self._lock:
                for peer in self.peers:
                    self._done_unsent.setdefault(peer, []).append(index)
            self._free(index)
        return output

    # ---- caller side -----------------------------------------------------------------------------------------

    def exchange(
        self, stage: int, request: Any, task: _Task, what: str, *, call_id: tuple[int, int] | None = None
    ) -> Message:
        """Send a request to ``stage`` and wait for its reply, giving the compute token away meanwhile."""
        self.raise_if_failed()
        call_id = call_id if call_id is not None else request.call_id
        future = _Future()
        with self._lock:
            self._futures[call_id] = future
        with self.token.paused(self.priority(task), self.grant_key(task)):
            self.send(request, stage, task.microbatch, kind="fwd")
            message: Message = future.wait(
                self.engine.timeout_s, self.raise_if_failed, f"{what} on {self.engine.describe_stage(stage)}"
            )
        if message.obj.kind == "error":
            raise PipelineError(message.obj.body)
        return message


@dataclass
class _Chain:
    """The requests of one (caller stage, microbatch, origin) on their owner ([Note: one microbatch's requests run
    in arrival order]): whether one is being served, and those received meanwhile, to run after it on its thread."""

    busy: bool = False
    queue: collections.deque = dataclasses.field(default_factory=collections.deque)


class _WaveBarrier:
    """All forwards of a wave finish before any of its backwards start (the "simple" / GPipe schedule)."""

    def __init__(self, parties: int, check_failed: Callable[[], None]) -> None:
        self._cv = threading.Condition()
        self._parties = parties
        self._arrived = 0
        self._broken = False
        self._check_failed = check_failed

    def arrive_and_wait(self) -> None:
        with self._cv:
            self._arrived += 1
            self._cv.notify_all()
            while self._arrived < self._parties and not self._broken:
                self._cv.wait(_POLL_S)
                self._check_failed()

    def breaks(self) -> None:
        with self._cv:
            self._broken = True
            self._cv.notify_all()
