"""The core of one pipelined step that every role of the session shares.

:class:`SessionCore` owns what the driver, the server, the owner's store and the caller side all need and nothing
else: the step's name, the lock, the first failure (``fail`` / ``raise_if_failed`` / ``abort``), sending a message
(timeline, message counts, the driver's "done" notices riding along), a request's round trip (``exchange``, whose
reply a receiving thread delivers), the compute token with its 1F1B priorities and, across the ranks that share an
execution order, the grant order (leader publishes, followers follow; [Note: deterministic order] in
``_scheduler.py``), the one-way calls held to go with the next message ([Note: coalesced one-way calls]), and the
set-up of every engine thread. The roles hold a core; the core holds no role.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from lightning_mp.comm import Message, Packed, Transport, bundle, pack
from lightning_mp.pipeline._messages import (
    POLL_S,
    CallId,
    Envelope,
    Future,
    Kind,
    Phase,
    PipelineError,
    StepEnd,
    Task,
    current_task,
    holding_calls,
)
from lightning_mp.pipeline._rng import MicrobatchRNG
from lightning_mp.pipeline._scheduler import ComputeToken, GrantOrder, Priority, priority
from lightning_mp.pipeline._timeline import TimelineRecorder

__all__ = ["SessionCore", "StageInfo"]

_CATEGORIES = {Phase.FORWARD: "forward", Phase.BACKWARD: "backward", Phase.WEIGHT: "weight"}  # timeline spans


@dataclasses.dataclass(frozen=True)
class StageInfo:
    """What a session needs to know of its engine: this rank's place, its channels and its policies."""

    transport: Transport
    stage: int
    num_stages: int
    schedule: str
    timeout_s: float
    global_ranks: list[int]
    order_transport: Transport | None
    rng: MicrobatchRNG
    timeline: TimelineRecorder
    messages_sent: collections.Counter[str]
    bytes_sent: collections.Counter[str]

    def describe(self, stage: int) -> str:
        return f"pipeline stage {stage} (global rank {self.global_ranks[stage]})"


class SessionCore:
    """Failure, sending, round trips, compute token and grant order of one step on one rank.

    Args:
        info: the engine's side of the step.
        step: the step's name, ``"hook#n"``; every message carries it and a stage refuses another step's.
    """

    def __init__(self, info: StageInfo, step: str) -> None:
        self.info = info
        self.step = step
        self.order_notice: threading.Thread | None = None  # a failed leader's notice, joined by PipelineEngine.close
        self.stage = info.stage
        self.peers = [s for s in range(info.num_stages) if s != info.stage]
        self.timeout_s = info.timeout_s
        self.timeline = info.timeline
        self.lock = threading.Lock()
        self.error: BaseException | None = None
        self.error_relayed = False  # the first failure came from another stage's "close"
        self.closed = False  # the step is over here: its values are gone
        self.finished = False  # driver: it has sent "end" (its summary or its failure) to every stage
        self.threads: list[threading.Thread] = []  # every worker and the order thread, to join at close
        self._futures: dict[CallId, Future] = {}  # replies awaited by ``exchange``
        self._done_unsent: dict[int, list[int]] = {}  # driver: finished microbatches to tell each stage
        # [Note: coalesced one-way calls]: the held calls (packed, microbatch), all to ``_outbox_peer``
        self._outbox: list[tuple[Packed, int]] = []
        self._outbox_peer: int | None = None
        self._outbox_thread: int | None = None  # the thread that held them: the token's holder
        self._send_locks = {peer: threading.Lock() for peer in self.peers}  # a peer's outbox and sends, in order
        self.token = ComputeToken(self.raise_if_failed)
        self.token.before_release = self._suspend_rng
        self.token.after_acquire = self._resume_rng
        self.token.flush = lambda release: self.flush(release, quietly=True)
        if self.timeline.enabled:
            self.token.on_release = self._record_compute
        self._order = info.order_transport
        self._grants: dict[tuple, int] = {}
        if self._order is not None:
            publish = self._publish_grant if self._order.rank == 0 else None
            self.token.order = GrantOrder(publish=publish, timeout_s=info.timeout_s)
        # [Note: intra-op threads of engine threads] torch.set_num_threads(n) reaches OpenMP/MKL only in the thread
        # that calls it; a new thread starts with OpenMP's default (one per core). With n=1 set by the user, a
        # matmul in a fresh thread measured 10x slower than in the main thread on a 2-core machine (16 ms vs 1.5 ms
        # for 128x1536 @ 1536x384). Every compute thread of the engine therefore repeats the caller's setting.
        self._intra_op_threads = torch.get_num_threads()
        self._device = info.transport.device

    def describe(self, stage: int) -> str:
        return self.info.describe(stage)

    def enter_thread(self) -> None:
        """Set up an engine thread: intra-op threads, CUDA device, backward on this thread.

        [Note: backward on the calling thread] On CUDA, autograd runs backward of every node on one device thread
        shared by all backwards on that GPU. A remote call's backward blocks there for its reply, which would stall
        every other microbatch's backward and deadlock a nested call (stage A -> B -> A: A's server needs that
        thread while A's driver holds it). The per-call hooks (random streams, ordered state) also read the
        engine's thread-local task, which autograd's thread has not. ``set_multithreading_enabled(False)``
        (thread-local) runs backward on the thread that calls it, as on CPU: every engine thread sets it, and every
        ``backward`` call of the engine is wrapped in it (the one-stage path runs on the caller's thread).

        Memory: engine threads are new every step and allocate from glibc malloc; pipelined ranks share one arena
        that keeps freed memory (see [Note: engine threads and glibc malloc] in ``memory/_host.py``).
        """
        torch.set_num_threads(self._intra_op_threads)  # see [Note: intra-op threads of engine threads]
        if self._device.type == "cuda":  # every thread that issues CUDA work names its device
            torch.cuda.set_device(self._device)
        torch.autograd.set_multithreading_enabled(False)

    def start_thread(self, target: Any, name: str, *args: Any) -> None:
        """Start a daemon thread of this step, joined at close."""
        thread = threading.Thread(target=target, args=args, daemon=True, name=name)
        with self.lock:
            self.threads.append(thread)
        thread.start()

    def join_threads(self) -> None:
        joined = 0
        while joined < len(self.threads):  # a listener that took a request may have started another worker
            self.threads[joined].join(self.timeout_s if self.error is None else POLL_S)
            joined += 1

    # ---- failure ---------------------------------------------------------------------------------------------

    def fail(self, error: BaseException, relayed: bool = False) -> None:
        """Record the first failure; every waiter on this rank raises it. ``relayed``: another stage failed and said
        so ("close"), so this rank's "close" does not say it again ([Note: "close" carries the step's failure] in
        ``_engine.py``)."""
        with self.lock:
            if self.error is None:
                self.error = error
                self.error_relayed = relayed

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise PipelineError(str(self.error)) from self.error

    def abort(self, error: BaseException) -> None:
        """Tell the other stages that this step failed here (driver), so they raise instead of waiting."""
        self.fail(error)
        if self.stage == 0 and not self.finished:
            self.finished = True
            text = f"{type(error).__name__}: {error}"
            for peer in self.peers:
                self.send_quietly(self.envelope(Kind.END, body=StepEnd(ok=False, value=text)), peer)

    # ---- messages --------------------------------------------------------------------------------------------

    def envelope(self, kind: Kind, call_id: CallId | None = None, body: Any = None, microbatch: int = 0) -> Envelope:
        """A message of this step, naming the served request it is sent from (see [Note: one microbatch's requests
        run in arrival order] in ``_server.py``)."""
        task = current_task()
        origin = task.ident if task is not None and task.ident[:1] == ("call",) else None
        return Envelope(kind, self.step, call_id, body, microbatch, origin=origin)

    def tell_done(self, microbatch: int) -> None:
        """Driver: every other stage may drop ``microbatch``'s values; said with the next message to each."""
        with self.lock:
            for peer in self.peers:
                self._done_unsent.setdefault(peer, []).append(microbatch)

    # [Note: coalesced one-way calls] A one-way CALL (``Caller.call_async``) needs no answer, so ``send`` holds it,
    # packed, in an outbox instead of sending it, and the next message this rank sends to the same stage takes the
    # held calls along as one transport message, a bundle ([Note: bundles on the wire] in ``comm/_wire.py``; the
    # receiver takes it apart in order, ``Server._receive_loop``). Per message the sender, gloo's TCP loop thread on
    # both sides, the listener and a worker each wake up: a loop over remote blocks (``for block in self.h``) sent
    # one CALL per block, and a CALL followed by a GET of the same microbatch (``logits.size(-1)``) two messages.
    # Held calls go out, in the program's order:
    # - with the next message to the same stage (a GET, a GET_BACKWARD, a reply, "end", "close", ...), in one bundle;
    # - alone or as a bundle, before any message to another stage, and before a CALL to another stage is held (the
    #   outbox holds calls to one stage): nothing this rank sends overtakes a held call (a nested call, a
    #   reference to a held call's output, a later step's message);
    # - when the holder of the compute token releases it or hands it over (``ComputeToken.flush``: the end of a
    #   microbatch's forward, the wave barrier of "simple", an error), so no held call waits on another task's
    #   compute and none is left when a task ends or fails. The calls are taken under the stage's send lock, the
    #   token is given up, then they go: another task computes while they are sent, and which calls go together
    #   does not depend on what it does (an exchange likewise takes the held calls into its request, releases,
    #   then sends);
    # - when a local module with parameters starts on the thread that held them (``send_held_calls`` in the
    #   global forward pre-hook of ``_handles.py``): its compute would otherwise delay the remote stage.
    # Only the token holder (the driver's microbatch code) makes one-way calls, so the outbox holds the calls of one
    # hold of the token: the loop's calls of one forward go as one message, and its GET_BACKWARD separately. Only
    # that thread takes them: a message of another thread (a served request's reply, sent after its release) goes
    # alone, so it never carries held calls that the holder's next message to another stage could overtake. A held
    # call keeps a copy of its tensors' bytes taken at the call (as eager code reads its arguments there): the
    # caller may change an argument in place before the call goes. (On CUDA the copy runs on the holder's current
    # stream; never run on a GPU.)
    # Cost: a held call waits at most until the holder's next message, release or local module with parameters;
    # between those the driver runs only calls to other stages and code outside modules with parameters. Where that
    # code is heavy (a functional op on a local weight, ``x @ model.wte.weight.T``, or a module without parameters
    # doing real work), the owner starts later than it would have. Counted: every message's kind in
    # ``messages_sent`` as before, and per bundle one "bundle" and its parts in "bundled", so the transport messages
    # are ``transport_messages(messages_sent)``.

    def send(
        self,
        message: Any,
        peer: int,
        microbatch: int = 0,
        kind: Kind = Kind.REPLY,
        then: Callable[[], Any] | None = None,
    ) -> None:
        """Send one message (an envelope, or a packed one of ``kind``) to ``peer``, recording it on the timeline and
        counting it in ``messages_sent`` and its pickle and tensor bytes in ``bytes_sent``. A one-way CALL is held
        and goes with the next message ([Note: coalesced one-way calls]); any other message takes the calls held
        for ``peer`` along (one transport message), after sending those held for another stage. ``then`` (the
        compute token's release, by ``exchange``) runs once those are taken, before the message goes.

        Raises:
            TypeError: the message itself cannot be sent (``pack`` says why).
            PipelineError: the transport failed (e.g. the peer died), naming the stage.
        """
        start = time.perf_counter()
        kind = message.kind if isinstance(message, Envelope) else kind
        with self.lock:
            self.info.messages_sent[kind.value] += 1
        if self._done_unsent and isinstance(message, Envelope):  # no message of its own: it goes with the next
            with self.lock:
                done = self._done_unsent.pop(peer, None)
            if done:
                message = dataclasses.replace(message, done=message.done + tuple(done))
        packed = message if isinstance(message, Packed) else pack(message)
        with self.lock:
            self.info.bytes_sent[kind.value] += len(packed.payload) + packed.data_nbytes
        mine = self._outbox_thread == threading.get_ident()  # another thread's message goes alone (see the Note)
        if mine and self._outbox_peer not in (None, peer):
            self.flush()
        if kind == Kind.CALL:
            # the data as it is now: eager code reads the arguments at the call, and the caller may change them in
            # place before the held call goes (a reused buffer, ``x.mul_()``, ``nn.ReLU(inplace=True)``)
            packed = dataclasses.replace(packed, sources=[source.clone() for source in packed.sources])
            with self.lock:
                self._outbox.append((packed, microbatch))
                self._outbox_peer = peer
                self._outbox_thread = threading.get_ident()
            holding_calls(self.flush)
            if then is not None:
                then()
            return
        with self._send_locks[peer]:
            with self.lock:
                parts = self._take_outbox(peer) if mine else []
            if then is not None:
                then()
            self._transmit([*parts, (packed, microbatch)], peer, start)

    def flush(self, then: Callable[[], Any] | None = None, quietly: bool = False) -> None:
        """Send the one-way calls held ([Note: coalesced one-way calls]), if any: cheap when none is. ``then`` (the
        compute token's release) runs once the calls are taken, before they are sent, and also when none is held.

        Raises:
            PipelineError: the transport failed (e.g. the peer died), naming the stage; recorded as the step's
                failure instead with ``quietly`` (the token's release must not raise).
        """
        peer = self._outbox_peer
        if peer is None or self._outbox_thread != threading.get_ident():
            if then is not None:
                then()
            return
        start = time.perf_counter()
        with self._send_locks[peer]:  # taken and sent under the lock: a later message to ``peer`` waits for them
            with self.lock:
                parts = self._take_outbox(peer)
            if then is not None:
                then()
            if not parts:
                return
            try:
                self._transmit(parts, peer, start)
            except Exception as err:
                if not quietly:
                    raise
                self.fail(err)

    def _take_outbox(self, peer: int) -> list[tuple[Packed, int]]:
        """The calls held for ``peer``, now out of the outbox (lock held)."""
        if self._outbox_peer != peer:
            return []
        parts, self._outbox, self._outbox_peer, self._outbox_thread = self._outbox, [], None, None
        return parts

    def _transmit(self, parts: list[tuple[Packed, int]], peer: int, start: float) -> None:
        """Send ``parts`` to ``peer`` as one transport message (a bundle if several), under ``peer``'s send lock."""
        packed, microbatch = parts[-1]
        if len(parts) > 1:
            packed = bundle([part for part, _ in parts])
            overhead = len(packed.payload) + packed.data_nbytes - sum(len(p.payload) + p.data_nbytes for p, _ in parts)
            with self.lock:
                self.info.messages_sent["bundle"] += 1
                self.info.messages_sent["bundled"] += len(parts)
                self.info.bytes_sent["bundle"] += overhead
        try:
            self.info.transport.send(packed, peer)
        except TypeError:
            raise
        except Exception as err:  # e.g. the peer died: a one-way "call" learns it here, so name the stage
            raise PipelineError(f"Could not reach {self.describe(peer)}: {err}") from err
        self.timeline.record("send", f"to stage {peer}", microbatch, start)

    def send_quietly(self, envelope: Any, peer: int, microbatch: int = 0) -> None:
        """``send``, recording a failure instead of raising it (the peer may be gone; the step is failing anyway)."""
        try:
            self.send(envelope, peer, microbatch)
        except Exception as err:
            if self.error is None:  # ``send`` names the stage already
                self.fail(err)

    def exchange(self, stage: int, request: Any, task: Task, what: str, *, call_id: CallId | None = None) -> Message:
        """Send a request to ``stage`` and wait for its reply, giving the compute token away meanwhile.

        Raises:
            PipelineError: the request failed on ``stage`` (its error text), the step failed, or no reply came
                within the timeout.
        """
        self.raise_if_failed()
        call_id = call_id if call_id is not None else request.call_id
        future = Future()
        with self.lock:
            self._futures[call_id] = future
        # the token is given away once the request has taken the calls held for ``stage`` along, before it is sent
        # ([Note: coalesced one-way calls]): which calls go with it does not depend on what another task does then
        priority, key = self.priority(task), self.grant_key(task)
        released: list[bool] = []
        try:
            self.send(request, stage, task.microbatch, kind=Kind.FORWARD,
                      then=lambda: released.append(self.token.release(flush=False)))
            message: Message = future.wait(self.timeout_s, self.raise_if_failed, f"{what} on {self.describe(stage)}")
        finally:
            if released and released[0]:
                self.token.acquire(priority, key)
        if message.obj.kind == Kind.ERROR:
            raise PipelineError(message.obj.body)
        return message

    def deliver(self, message: Message) -> None:
        """A reply or error arrived: wake its ``exchange``; an error nobody waits for (a one-way call's) fails the
        step."""
        envelope: Envelope = message.obj
        with self.lock:
            future = self._futures.pop(envelope.call_id, None)
        if future is not None:
            future.set(message)
        elif envelope.kind == Kind.ERROR:
            self.fail(PipelineError(envelope.body))

    # ---- compute token and grant order -----------------------------------------------------------------------

    def priority(self, task: Task) -> Priority:
        info = self.info
        return priority(task, info.schedule, info.stage, info.num_stages)

    def grant_key(self, task: Task) -> tuple | None:
        """The rank-independent name of ``task``'s next grant of the compute token (None when unordered)."""
        if self._order is None:
            return None
        with self.lock:
            count = self._grants[task.ident] = self._grants.get(task.ident, 0) + 1
        return (task.ident, count)

    def start_order_follower(self) -> None:
        """A follower of the grant order listens to its leader for this step."""
        if self._order is not None and self._order.rank != 0:
            self.start_thread(self._order_loop, "smp-order")

    def _publish_grant(self, key: tuple) -> None:
        for follower in range(1, self._order.size):
            self._order.send(("grant", self.step, key), follower)

    def close_order(self) -> None:
        """Leader: the step is over here. A failed leader says so: its followers would otherwise take the grants it
        never made for divergence."""
        if self._order is None or self._order.rank != 0:
            return
        if self.error is None:
            self._notify_followers(("close", self.step, None))
            return
        # gloo's send waits for the receiver to post its receive, and a follower
        # whose own step failed has stopped receiving (it is tearing down, or waiting in a collective for this
        # rank): a plain send would hold this rank for the whole timeout (measured: 120 s with timeout 120 s, every
        # rank held, by scripts/fault_harness.py). The notice goes from a daemon thread, waited for briefly.
        notice = threading.Thread(
            target=self._notify_followers, args=(("error", self.step, str(self.error)),), daemon=True,
            name="smp-order-error",
        )
        notice.start()
        notice.join(POLL_S)
        self.order_notice = notice

    def _notify_followers(self, last: tuple) -> None:
        for follower in range(1, self._order.size):
            try:
                self._order.send(last, follower)
            except Exception:  # the follower may be gone; its own session fails on its own
                pass

    def _order_loop(self) -> None:
        """Follower: feed the leader's grants to the compute token until the leader closes the step."""
        self.enter_thread()
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
        task = current_task()
        if task is not None:
            self.info.rng.suspend(task.ident)

    def _resume_rng(self) -> None:
        task = current_task()
        if task is not None:
            phase = "forward" if task.phase == Phase.FORWARD else "backward"
            self.info.rng.resume(task.ident, task.microbatch, f"{phase}:{task.label}")

    def _record_compute(self, since: float) -> None:
        task = current_task()
        if task is not None:
            category = _CATEGORIES[task.phase]
            self.timeline.record(category, task.label, task.microbatch, since)

