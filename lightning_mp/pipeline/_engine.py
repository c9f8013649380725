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
requests are received and served by a pool of long-lived workers ([Note: request workers] in ``_server.py``);
every one of them computes only while holding the rank's compute token ([Note: one compute token per rank] in
``_scheduler.py``).

This module owns the engine (what lives across steps: placement, call ids, random streams, ordered updates and
gradients, timeline, message counts) and :class:`PipelineSession`, one step, composed of its roles over one
:class:`~._core.SessionCore`: the driver (``_driver.py``), the server (``_server.py``), the owner's store of
remote outputs (``_outputs.py``) and the caller side (``_caller.py``); messages and tasks are in
``_messages.py``, install-time stubs and hooks in ``_install.py``. One pipelined step::

    with engine.session() as session:
        if engine.is_driver:
            outputs = session.drive(step_fn, microbatches, loss_fn=..., backward=True)
            session.finish(summary)            # sent to every other stage
        else:
            summary = session.serve()          # answer requests until the driver finishes
"""

from __future__ import annotations

import collections
import functools
import itertools
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from lightning_mp.comm import Transport
from lightning_mp.pipeline._caller import Caller
from lightning_mp.pipeline._core import SessionCore, StageInfo
from lightning_mp.pipeline._driver import Driver
from lightning_mp.pipeline._grads import OrderedGradients
from lightning_mp.pipeline._handles import materialize_module_inputs
from lightning_mp.pipeline._install import Placement
from lightning_mp.pipeline._messages import CallId, Kind, PipelineError, current_microbatch, current_task
from lightning_mp.pipeline._outputs import OutputStore
from lightning_mp.pipeline._rng import MicrobatchRNG
from lightning_mp.pipeline._server import Server
from lightning_mp.pipeline._state import OrderedStateUpdates
from lightning_mp.pipeline._timeline import TimelineRecorder
from lightning_mp.pipeline._zero_bubble import WeightPasses, run_backward

__all__ = ["PipelineEngine", "PipelineError", "PipelineSession"]

ORDER_NOTICE_S = 5.0
"""Seconds :meth:`PipelineEngine.close` waits for failed order leaders' notices still being sent."""


class PipelineEngine:
    """Runs one pipeline replica's steps: places modules, serves requests, drives microbatches.

    The process-wide hooks that make remote handles behave as values in local code (a global module forward
    pre-hook and ``torch.autograd.Function.apply``, see ``materialize_module_inputs`` in ``_handles.py``) are
    installed only with more than one stage: with one, no call is remote and no handle exists.

    Args:
        transport: framed messages over this replica's pipeline process group (group rank = stage).
        num_stages: pipeline_parallel_degree.
        schedule: ``"interleaved"`` (1F1B priorities, work-conserving: [Note: 1F1B priorities] in
            ``_scheduler.py``), ``"zero_bubble"`` (the same, each backward's weight pass deferred into the bubbles:
            [Note: zero-bubble] in ``_zero_bubble.py``) or ``"simple"`` (GPipe: all forwards of a wave of
            microbatches, then all backwards).
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
        if remote_handles and num_stages > 1:
            materialize_module_inputs()
        self.order_transport = order_transport if order_transport is not None and order_transport.size > 1 else None
        self.stage = transport.rank
        self.num_stages = num_stages
        self.schedule = schedule
        self.active_microbatches = active_microbatches
        self.timeout_s = timeout_s
        self.forward_context = forward_context
        self.global_ranks = list(global_ranks) if global_ranks is not None else list(range(num_stages))
        self.placement = Placement(self.stage, num_stages)
        self._session: PipelineSession | None = None
        self._call_ids = itertools.count()
        self._sessions = itertools.count()
        self._order_notices: list[threading.Thread] = []  # failed leaders' notices still being sent (see close)
        self._step_names: dict[str, int] = {}
        self.rng = MicrobatchRNG(torch.initial_seed() if seed is None else seed)
        self.state_updates = OrderedStateUpdates(forward_context)
        self.gradients = OrderedGradients(current_microbatch)
        self.messages_sent: collections.Counter[str] = collections.Counter()
        """Messages this rank sent, by kind ("call", "get", "gbwd", "getbwd", "fwd", "bwd", "reply", ...), over its
        lifetime. Messages sent together as one transport message (one-way calls held until the next message,
        [Note: coalesced one-way calls] in ``_core.py``) count each under its kind, and the bundle once under
        "bundle" and its parts under "bundled": ``transport_messages(messages_sent)`` is how many went on the wire."""
        self.bytes_sent: collections.Counter[str] = collections.Counter()
        """Bytes (pickle and tensor data) this rank sent, by message kind, over its lifetime."""
        self.timeline = TimelineRecorder()
        """Off by default; ``timeline.start()`` records every compute span and message (see ``_timeline.py``)."""

    @property
    def is_driver(self) -> bool:
        return self.stage == 0

    @property
    def in_step(self) -> bool:
        """Is a pipelined step running on this rank?"""
        return self._session is not None

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
        self.placement.install(model, stage_of, ordered_state, call_remote=self.call_remote, hooks=self)

    def stage_of(self, fqn: str) -> int:
        return self.placement.stage_of(fqn)

    def order_gradients(self, model: nn.Module | Iterable[nn.Parameter]) -> None:
        """Sum this stage's gradients in microbatch order ([Note: ordered gradient accumulation] in ``_grads.py``).

        Call once the local parameters are final (after ``install`` and after materialising delayed parameters);
        ``model``'s parameters, or the parameters themselves (an FSDP unit's gathered ones).
        """
        params = model.parameters() if isinstance(model, nn.Module) else model
        if self.num_stages > 1:  # one stage runs its microbatches one after the other anyway
            self.gradients.register(p for p in params if p is not None)

    def report_gradients(
        self,
        params: Iterable[nn.Parameter],
        on_accumulated: Callable[[nn.Parameter, int], None],
        wanted: Callable[[], bool] = lambda: True,
    ) -> None:
        """Tell the gradients' owner, after each accumulation into a parameter's ``.grad``, how many microbatches (from
        0 on) are summed into it: ``on_accumulated(param, summed)``, while ``wanted()`` (see
        ``OrderedGradients.report``). Call after :meth:`order_gradients`."""
        self.gradients.report(params, on_accumulated, wanted)

    def close(self) -> None:
        """Stop the transports' threads (a pair data plane's communication thread, after its sends in flight), at
        the end of the process: no step runs after it. Safe to call twice. A failed order leader's notice still
        being sent gets up to ``ORDER_NOTICE_S`` first (its gloo send must not outlive the groups)."""
        deadline = time.monotonic() + ORDER_NOTICE_S
        for notice in self._order_notices:
            notice.join(max(0.0, deadline - time.monotonic()))
        self._order_notices = []
        for transport in (self.transport, self.order_transport):
            if transport is not None:
                transport.close()

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

        Raises:
            RuntimeError: a step is already running on this rank.
            PipelineError: the step failed on some stage.
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
                if session.error is None:
                    self.state_updates.end_step()
                    self.gradients.end_step()
            finally:
                self._session = None
                self.rng.end_step()
                notice = session.core.order_notice
                self._order_notices = [t for t in self._order_notices if t.is_alive()] + ([notice] if notice else [])
        if session.error is not None:  # e.g. a remote call whose output nobody touched failed after the step
            raise PipelineError(str(session.error)) from session.error

    def call_remote(self, fqn: str, stage: int, args: tuple, kwargs: dict, span: tuple[int, int] | None = None) -> Any:
        """Run module ``fqn`` on ``stage`` with ``args``/``kwargs``; the stub of every remote module calls this.

        With ``span=(start, stop)``, ``fqn`` is an ``nn.Sequential`` and the owner runs its children
        ``start .. stop-1`` one after the other on ``args[0]`` (see [Note: sequential runs] in ``_install.py``).

        Raises:
            RuntimeError: called outside a pipelined step (e.g. from a hook or callback).
        """
        session, task = self._session, current_task()
        if session is None or task is None:
            raise RuntimeError(
                f"Module {fqn!r} lives on pipeline stage {stage}, not on this rank (stage {self.stage}); it can only"
                " be called inside a pipelined step (training_step, validation_step, test_step, predict_step)."
                " Call the model from those steps, not from hooks or callbacks."
            )
        return session.caller.call(fqn, stage, args, kwargs, span, task)

    def _next_call_id(self) -> CallId:
        return (self.stage, next(self._call_ids))

    def _stage_info(self) -> StageInfo:
        return StageInfo(
            self.transport, self.stage, self.num_stages, self.schedule, self.timeout_s, self.global_ranks,
            self.order_transport, self.rng, self.timeline, self.messages_sent, self.bytes_sent,
        )


class PipelineSession:
    """One pipelined step on one rank, composed of its roles over one shared core.

    ``drive`` / ``finish`` run on the driver (stage 0), ``serve`` on every other stage; every stage serves the
    requests its peers send (a nested call reaches the driver too). Made by :meth:`PipelineEngine.session`.
    """

    def __init__(self, engine: PipelineEngine, step: str) -> None:
        self.step = step
        self.is_driver = engine.is_driver
        self.core = SessionCore(engine._stage_info(), step)
        run_module = functools.partial(engine.placement.run, context=engine.forward_context)
        split = engine.schedule == "zero_bubble" and engine.num_stages > 1
        self.weights = WeightPasses(self.core) if split else None  # [Note: zero-bubble] in _zero_bubble.py
        backward = self.weights.backward if self.weights is not None else run_backward
        self.store = OutputStore(self.core, run_module, backward)
        self.server = Server(self.core, self.store, run_module, engine.state_updates, engine.remote_handles, backward)
        self.caller = Caller(self.core, self.store, engine.placement, engine._next_call_id, engine.remote_handles)
        self.driver = Driver(self.core, self.store, engine.state_updates, schedule=engine.schedule,
                             active_microbatches=engine.active_microbatches, remote_handles=engine.remote_handles,
                             backward=backward)

    @property
    def error(self) -> BaseException | None:
        """The step's first failure on this rank, if any."""
        return self.core.error

    def start(self) -> None:
        """Start listening to every peer (and, as a follower of a grant order, to its leader)."""
        self.server.start()
        self.core.start_order_follower()

    def drive(
        self,
        step_fn: Callable[[Any, int], Any],
        microbatches: Sequence[Any],
        *,
        loss_fn: Callable[[Any], torch.Tensor | None],
        backward: bool,
        on_finish: Callable[[int], None] | None = None,
    ) -> list[Any]:
        """Run ``step_fn(microbatch, index)`` for every microbatch (and backward of ``loss_fn(output)``), and
        ``on_finish(index)`` as microbatch ``index`` finishes, before the other stages drop its outputs.

        Returns:
            The step outputs, in microbatch order.

        Raises:
            RuntimeError: on a stage other than 0.
            PipelineError: if any microbatch or any stage fails, naming the stage.
        """
        if not self.is_driver:
            raise RuntimeError("Only pipeline stage 0 drives a step; other stages call `serve()`.")
        return self.driver.drive(step_fn, microbatches, loss_fn=loss_fn, backward=backward, on_finish=on_finish)

    def finish(self, summary: Any) -> None:
        """Send ``summary`` (e.g. the step's mean loss and logged values) to every other stage."""
        self.driver.finish(summary)

    def serve(self) -> Any:
        """Answer requests until the driver finishes the step; return the driver's summary (see ``Server.serve``)."""
        return self.server.serve()

    def abort(self, error: BaseException) -> None:
        """Tell the other stages that this step failed here (driver), so they raise instead of waiting."""
        self.core.abort(error)

    def close(self) -> None:
        """Finish the step: wait for the requests this rank serves to reply, exchange "close" with every peer,
        then join this step's threads (listeners, which serve the requests they receive, and the order thread).

        After a failure the waits are short (``POLL_S``): requests queued in a chain are answered with the error
        at once, a request still running replies after "close", and the next step's listener drops such late
        replies (and a late "close") of an earlier step instead of failing as out of step.
        """
        core = self.core
        if core.error is not None:
            self.server.refuse_queued()
        self.server.wait_idle()  # a backward still being served defers its weight pass: before the drain
        if self.weights is not None:  # this rank's deferred weight passes complete its gradients
            try:
                self.weights.drain()
            except PipelineError:
                self.weights.stop()
        # [Note: "close" carries the step's failure] A stage can fail after its last answer: a weight pass that
        # "zero_bubble" deferred past the exchange that replied, or anything in the drain above. No request of the
        # driver waits for an answer then, so "close" says it, and every peer's session fails with it (the driver's
        # before its optimizer steps: ``session`` raises after ``close``). A failure learnt from another stage's "close"
        # is not said again: with 3 stages a healthy one would otherwise be named as the cause.
        failure = None if core.error is None or core.error_relayed else f"{type(core.error).__name__}: {core.error}"
        for peer in core.peers:
            core.send_quietly(core.envelope(Kind.CLOSE, body=failure), peer)
        core.close_order()
        self.server.stop_workers()
        core.join_threads()
        with core.lock:
            core.closed = True
            self.store.clear()
            self.server.clear()
