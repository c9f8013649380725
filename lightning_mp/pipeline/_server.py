"""The execution server of one step on one rank: receive from every peer, serve its requests.

:class:`Server` owns the receiving side of a session: one pool of long-lived request workers per peer ([Note:
request workers]), the loop each listener runs (replies go to the core, "end" to :meth:`Server.serve`, requests
are served), the chains that run one microbatch's requests in the order they were sent ([Note: one microbatch's
requests run in arrival order]), and the requests that wait for their outputs (FORWARD and its BACKWARD); the
requests on stored outputs (CALL, GET, FETCH_BACKWARD, GET_BACKWARD) it hands to the :class:`~._outputs.OutputStore`.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from lightning_mp.comm import Bundle, Message, pack, ragged_like
from lightning_mp.pipeline._core import SessionCore
from lightning_mp.pipeline._handles import _unpacked
from lightning_mp.pipeline._messages import (
    POLL_S,
    BackwardRequest,
    CallId,
    CallRequest,
    Envelope,
    Future,
    Kind,
    Phase,
    PipelineError,
    StepEnd,
    Task,
    as_task,
    caches_written_back,
    differentiable,
    received_leaves,
)
from lightning_mp.pipeline._outputs import OutputStore
from lightning_mp.pipeline._state import OrderedStateUpdates
from lightning_mp.pipeline._zero_bubble import run_backward

__all__ = ["Server"]

_FORWARD_KINDS = (Kind.FORWARD, Kind.CALL, Kind.GET)


@dataclass
class _SavedCall:
    """What a server keeps of a FORWARD request until its backward arrives."""

    leaves: list[torch.Tensor]
    outputs: list[torch.Tensor]
    fqn: str


@dataclass
class _Chain:
    """The requests of one (caller stage, microbatch, origin) on their owner ([Note: one microbatch's requests run
    in arrival order]): whether one is being served, and those received meanwhile, to run after it on its thread."""

    busy: bool = False
    queue: collections.deque = dataclasses.field(default_factory=collections.deque)


class Server:
    """Receives from every peer and serves the requests of one step on one rank.

    Args:
        core: the step's shared core.
        store: the owner's store of remote outputs.
        run_module: runs a requested module here (``Placement.run`` under the engine's forward context).
        state_updates: ordered buffer updates, finalised before a backward runs.
        remote_handles: requests may be one-way calls with references ([Note: remote handles]).
        backward: runs a backward (see ``Driver``).
    """

    def __init__(
        self,
        core: SessionCore,
        store: OutputStore,
        run_module: Callable[[CallRequest, tuple, dict], Any],
        state_updates: OrderedStateUpdates,
        remote_handles: bool,
        backward: Callable[..., None] = run_backward,
    ) -> None:
        self.core, self.store, self._run_module = core, store, run_module
        self.backward = backward
        self.state_updates = state_updates
        self.remote_handles = remote_handles
        lock = core.lock
        self._idle = threading.Condition(lock)  # notified when a served request has sent its reply
        self._serving = 0  # served requests in progress on this rank
        self._saved: dict[CallId, _SavedCall] = {}
        self._chains: dict[tuple, _Chain] = {}  # per (caller stage, microbatch, origin): the one being served
        self._end = Future()
        self._last_heard = time.monotonic()  # last message from a peer, or last served request finished
        # [Note: request workers], per peer under the lock: a worker is the listener, idle followers, their turn
        self._listening: dict[int, bool] = {}
        self._idle_workers: dict[int, int] = {}
        self._turns = {peer: threading.Condition(lock) for peer in core.peers}
        self._peer_closed: set[int] = set()
        self._workers_stop = False

    # ---- the driver's end of the step ------------------------------------------------------------------------

    def serve(self) -> Any:
        """Answer requests until the driver finishes the step; return the driver's summary.

        Raises:
            PipelineError: if the driver failed, or no peer sent anything for the timeout while this rank had no
                request to work on (the driver or a stage it waits on is stuck or gone). A healthy step fails the
                same way when some stretch of it sends nothing to this rank for longer than the timeout (e.g. the
                driver computes locally for that long): the timeout must exceed the longest such stretch.
        """
        message: Message = self._end.wait(float("inf"), self._raise_if_failed_or_silent, "the end of the step")
        end: StepEnd = message.obj.body
        if not end.ok:
            raise PipelineError(f"The step failed on {self.core.describe(0)}: {end.value}")
        return end.value

    def _raise_if_failed_or_silent(self) -> None:
        self.core.raise_if_failed()
        silent_s = time.monotonic() - self._last_heard
        timeout_s = self.core.timeout_s
        if self._serving == 0 and silent_s > timeout_s:
            raise PipelineError(
                f"{self.core.describe(self.core.stage)} heard nothing from the other stages for {silent_s:.0f} s"
                f" (timeout {timeout_s:.0f} s) while waiting for {self.core.describe(0)} to finish the step: it, or"
                " a stage it waits on, is stuck or gone. If a step can legitimately go longer than that without a"
                " message to this stage (a long computation on another stage), raise the timeout."
            )

    # ---- workers ---------------------------------------------------------------------------------------------

    # [Note: request workers] Each peer has a pool of long-lived worker threads for this step (leader/followers,
    # Schmidt et al. 2000): one, the listener, receives from the peer; when it receives a request it hands the
    # listening role on and serves the request itself (it is already awake, with the request in hand), then goes
    # back to the pool. The role goes to the first worker that is free: an idle follower (one wake-up) or a
    # worker that just finished serving, which takes it without waiting; only when every worker of the peer is
    # busy does a new thread start. So a step starts about as many threads per peer as it has requests in
    # flight at once, instead of one per request (each start is a clone and a wait for the new thread to run).

    def start(self) -> None:
        """Start one listener per peer."""
        for peer in self.core.peers:
            self._listening[peer] = True
            self._spawn_worker(peer)

    def _spawn_worker(self, peer: int) -> None:
        """Start a worker thread of ``peer``'s pool, as its listener (the caller has set ``_listening[peer]``)."""
        self.core.start_thread(self._worker, f"smp-recv-{peer}", peer)

    def _hand_on_listening(self, peer: int) -> None:
        """The listener of ``peer`` took a request: let a free worker listen (see [Note: request workers])."""
        with self.core.lock:
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
        self.core.enter_thread()  # copies out of the wire buffer run torch ops here too
        turn = self._turns[peer]
        while self._receive_loop(peer):  # False: nothing more comes from this peer (it closed the step, or failed)
            with self.core.lock:
                self._idle_workers[peer] = self._idle_workers.get(peer, 0) + 1
                while self._listening[peer] and not self._workers_stop and peer not in self._peer_closed:
                    turn.wait()
                self._idle_workers[peer] -= 1
                if self._listening[peer]:  # another worker listens, and this one is told to end
                    return
                self._listening[peer] = True  # the role is free: take it (even when told to end)
        with self.core.lock:
            self._peer_closed.add(peer)
            turn.notify_all()

    def stop_workers(self) -> None:
        """Idle workers end, and busy ones once they served their request, unless a peer's listening role is free."""
        with self.core.lock:
            self._workers_stop = True
            for turn in self._turns.values():
                turn.notify_all()

    def wait_idle(self) -> None:
        """Wait for the requests this rank serves to reply (briefly after a failure: ``POLL_S``)."""
        with self._idle:
            self._idle.wait_for(lambda: self._serving == 0, self.core.timeout_s if self.core.error is None else POLL_S)

    def clear(self) -> None:
        """The step closed (lock held)."""
        self._chains.clear()

    # ---- receiving -------------------------------------------------------------------------------------------

    def _receive_loop(self, peer: int) -> bool:
        """Receive from ``peer`` until a request came (served here: returns True) or nothing more will (False).

        A bundle ([Note: coalesced one-way calls] in ``_core.py``) is taken apart here, in order, each part exactly
        as if it had arrived alone (its own unpickling and references, ``OutputStore.received``, place in its chain,
        "done" notices); then this worker serves the first request that may run now, and the others that may (of
        another chain, which is rare: a bundle holds one microbatch's calls and the message that took them along)
        on threads of their own; the rest wait in their chains as any request does.
        """
        while True:
            _unpacked.refs = refs = []  # references to this stage's outputs met while unpickling
            try:
                message = self.core.info.transport.recv(peer)
            except Exception as err:
                self.core.fail(PipelineError(f"Lost contact with {self.core.describe(peer)}: {err}"))
                return False
            self._last_heard = time.monotonic()
            ready: list[tuple[_Chain | None, Message, list]] = []  # requests to serve now, in order
            more = True
            try:  # a bundle's parts are unpacked here, not in ``recv``: a part that fails fails the step at once
                parts = list(_parts(message, refs))
            except Exception as err:
                self.core.fail(PipelineError(f"Lost contact with {self.core.describe(peer)}: a message from it could"
                                             f" not be read: {type(err).__name__}: {err}"))
                return False
            for index, (part, refs) in enumerate(parts):
                envelope: Envelope = part.obj
                if index == 0:
                    self.core.timeline.record("recv", f"from stage {peer}", envelope.microbatch, message.arrived_s)
                if envelope.step != self.core.step:
                    if _late(envelope, self.core.step):
                        continue  # a late answer of a step that failed here (closed without waiting): not this step's
                    self._fail_out_of_step(envelope, peer)
                    more = False
                    break
                for microbatch in envelope.done:
                    self.store.free(microbatch)
                if envelope.kind == Kind.CLOSE:
                    if envelope.body is not None:  # [Note: "close" carries the step's failure] in ``_engine.py``
                        error = PipelineError(f"The step failed on {self.core.describe(peer)}: {envelope.body}")
                        self.core.fail(error, relayed=True)
                    more = False
                    break
                if envelope.kind in (Kind.REPLY, Kind.ERROR):
                    self.core.deliver(part)
                elif envelope.kind == Kind.END:
                    self._end.set(part)
                else:
                    chain = self._admit(peer, envelope, part, refs)
                    if chain is not False:
                        ready.append((chain, part, refs))
            if ready and more:
                self._hand_on_listening(peer)
            for item in ready[1:] if more else ready:
                self.core.start_thread(self._serve_alone, f"smp-serve-{peer}", peer, item)
            if not more:
                return False
            if ready:
                self._serve_item(peer, *ready[0])
                return True

    def _serve_alone(self, peer: int, item: tuple[_Chain | None, Message, list]) -> None:
        """A thread of its own serves a request that came in a bundle behind another one it may run beside."""
        self.core.enter_thread()
        self._serve_item(peer, *item)

    def _serve_item(self, peer: int, chain: _Chain | None, message: Message, refs: list) -> None:
        if chain is None:
            self._serve_request(peer, message, refs)
        else:
            self._serve_chain(peer, chain, message, refs)

    def _fail_out_of_step(self, envelope: Envelope, peer: int) -> None:
        self.core.fail(
            PipelineError(
                f"Pipeline stages are out of step: this stage ({self.core.describe(self.core.stage)}) runs"
                f" {self.core.step!r} but {self.core.describe(peer)} sent a message of {envelope.step!r}. Every"
                " stage of a pipeline must run the same steps in the same order (same number of batches, no"
                " rank-dependent skipping)."
            )
        )

    def _admit(self, peer: int, envelope: Envelope, message: Message, refs: list) -> _Chain | None | bool:
        """A received request, in arrival order: its chain when it may run now (``None`` without chains), or
        ``False`` when it waits in its chain behind an earlier request, which is being served.

        [Note: request workers] another worker then listens to this peer, and this one, already awake with the
        request in hand, serves it (one thread wake-up less on the critical path than handing it over). With remote
        handles its place in its chain is taken first, before the next request from this peer can arrive; one that
        must wait for an earlier request of its chain is queued, runs on that one's thread after it, and this worker
        goes on listening.
        """
        if not self.remote_handles:
            with self.core.lock:
                self._serving += 1
            return None
        chain = self._enter_chain(peer, envelope, message, refs)
        return False if chain is None else chain

    # ---- chains ----------------------------------------------------------------------------------------------

    def _enter_chain(self, peer: int, envelope: Envelope, message: Message, refs: list) -> _Chain | None:
        """Receiving thread, in arrival order: the request's place in its chain (``None``: queued behind an earlier
        request of it, which is being served), and, for a "call", its output's future (``OutputStore.received``).

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
        pipeline's overlap is between microbatches. The store also keeps a microbatch's outputs until its last
        request has run (``OutputStore.finished``), so a call the driver never waited for still finds what it
        references. A request received while an earlier one of its chain is served waits in the chain's queue,
        and the thread serving that one runs it next (a loop over remote blocks then runs on one thread: no
        hand-off per call). A chain with nothing to serve is forgotten.
        """
        key = (peer, envelope.microbatch, envelope.origin)
        with self.core.lock:
            self._serving += 1
            self.store.received(envelope)
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
        envelope: Envelope = message.obj
        key = (peer, envelope.microbatch, envelope.origin)
        while True:
            self._serve_request(peer, message, refs, chained=True)
            with self.core.lock:
                if not chain.queue:
                    chain.busy = False
                    if self._chains.get(key) is chain:
                        del self._chains[key]
                    return
                message, refs = chain.queue.popleft()

    def refuse_queued(self) -> None:
        """The step failed: answer every request still queued in a chain with the error now, before "close" (it
        would otherwise run, fail and reply only once the request ahead of it ends, into the next step)."""
        with self.core.lock:
            queued = [(key[0], message) for key, chain in self._chains.items() for message, _ in chain.queue]
            for chain in self._chains.values():
                chain.queue.clear()
        for peer, message in queued:
            envelope: Envelope = message.obj
            error = self.core.envelope(Kind.ERROR, envelope.call_id, str(self.core.error), envelope.microbatch)
            self.core.send_quietly(error, peer)
            self.store.finished(envelope.microbatch)
            self._served()

    def _served(self) -> None:
        with self.core.lock:
            self._serving -= 1
            self._idle.notify_all()
            self._last_heard = time.monotonic()

    # ---- serving ---------------------------------------------------------------------------------------------

    def _serve_request(self, peer: int, message: Message, refs: list | None = None, chained: bool = False) -> None:
        # runs on a request worker, which has entered its thread once ([Note: request workers])
        envelope: Envelope = message.obj
        reply: Any = None
        try:
            reply = self._serve(message, refs)
        except BaseException as err:  # not a failure of the module (``_serve`` replies those): of the session
            self.core.fail(err)
            if envelope.kind == Kind.CALL:
                self.store.record(envelope.call_id, ("error", str(err)))
            reply = self.core.envelope(Kind.ERROR, envelope.call_id, str(err), envelope.microbatch)
        try:
            if chained:
                self.store.finished(envelope.microbatch)
            if reply is not None:
                self.core.send_quietly(reply, peer, envelope.microbatch)
        finally:
            self._served()

    def _serve(self, message: Message, refs: list | None) -> Any:
        """Run one request; return its reply (None for a "call"), or an "error" reply naming the failure."""
        envelope: Envelope = message.obj
        kind = envelope.kind
        task = Task(envelope.microbatch, _phase(kind), _label(envelope), ident=("call", envelope.call_id, kind))
        reply: Any = None
        try:
            if kind == Kind.GET:  # sends a value that exists (or waits for it) without the token; a recorded loss
                with as_task(task):  # on it is computed holding the token, once the value exists
                    reply = self.store.run_get(
                        envelope, lambda: self.core.token.hold(self.core.priority(task), self.core.grant_key(task))
                    )
            else:
                if kind == Kind.CALL:
                    self.store.await_outputs(refs or [], task.label)
                elif kind == Kind.GET_BACKWARD:  # the loss's output first, without the token (as a GET)
                    self.store.await_call(envelope.body.call_id, envelope.microbatch, task.label)
                with as_task(task), self.core.token.hold(self.core.priority(task), self.core.grant_key(task)):
                    reply = self._compute(envelope, message, refs or [])
        except BaseException as err:
            where = self.core.describe(self.core.stage)
            text = f"{where} failed running {task.label!r} for microbatch {envelope.microbatch}:\n{traceback.format_exc()}"
            body = str(err) if isinstance(err, PipelineError) else text
            reply = self.core.envelope(Kind.ERROR, envelope.call_id, body, envelope.microbatch)
            if kind == Kind.CALL:
                self.store.record(envelope.call_id, ("error", body))
        return reply

    def _compute(self, envelope: Envelope, message: Message, refs: list) -> Any:
        """The part of a request that computes (holding the token)."""
        kind = envelope.kind
        if kind == Kind.FORWARD:
            return self._run_forward(envelope, message)
        if kind == Kind.CALL:
            self.store.run_call(envelope, message, refs)
            return None
        self.state_updates.finalize(envelope.microbatch)
        if kind == Kind.BACKWARD:
            return self._run_backward(envelope)
        if kind == Kind.GET_BACKWARD:
            return self.store.run_get_backward(envelope)
        return self.store.run_fetch_backward(envelope)

    def _run_forward(self, envelope: Envelope, message: Message) -> Any:
        request: CallRequest = envelope.body
        leaves = received_leaves(message) if request.grad_enabled else []
        output = self._run_module(request, request.args, request.kwargs)
        caches = caches_written_back(request.args, request.kwargs, request.grad_enabled)
        body = (output, caches) if caches else output  # [Note: caches written back]
        reply = pack(self.core.envelope(Kind.REPLY, envelope.call_id, body, envelope.microbatch))
        if request.grad_enabled:
            outputs = [t for t in reply.tensors if t.requires_grad and differentiable(t)]
            if outputs:
                with self.core.lock:
                    self._saved[envelope.call_id] = _SavedCall(leaves, outputs, request.fqn)
        return reply

    def _run_backward(self, envelope: Envelope) -> Envelope:
        request: BackwardRequest = envelope.body
        with self.core.lock:
            saved = self._saved.pop(envelope.call_id)
        pairs = [(out, ragged_like(g, out)) for out, g in zip(saved.outputs, request.grad_outputs) if g is not None]
        if pairs:
            self.backward([out for out, _ in pairs], [grad for _, grad in pairs], saved.leaves)
        return self.core.envelope(Kind.REPLY, envelope.call_id, [leaf.grad for leaf in saved.leaves], envelope.microbatch)


def _parts(message: Message, refs: list) -> Iterator[tuple[Message, list]]:
    """``message``, or each part of a bundle unpacked in turn, with the references its unpickling met."""
    if not isinstance(message.obj, Bundle):
        yield message, refs
        return
    parts = message.obj.messages(message.arrived_s)
    while True:
        _unpacked.refs = refs = []
        part = next(parts, None)
        if part is None:
            return
        yield part, refs


def _phase(kind: Kind) -> Phase:
    return Phase.FORWARD if kind in _FORWARD_KINDS else Phase.BACKWARD


def _label(envelope: Envelope) -> str:
    """What a request runs, for errors and the timeline: the module (and span) or the fetched value's label."""
    body = envelope.body
    if envelope.kind == Kind.CALL or envelope.kind == Kind.FORWARD:
        return body.label
    if envelope.kind == Kind.BACKWARD:
        return body.fqn
    return body.label  # GET, FETCH_BACKWARD, GET_BACKWARD


def _late(envelope: Envelope, step: str) -> bool:
    """Is ``envelope`` an answer (or "close") of a session started before ``step`` (``"name#n"``, numbered per
    engine) on the same engine?"""
    if envelope.kind not in (Kind.REPLY, Kind.ERROR, Kind.CLOSE):
        return False
    try:
        return int(envelope.step.rsplit("#", 1)[1]) < int(step.rsplit("#", 1)[1])
    except (IndexError, ValueError):
        return False
