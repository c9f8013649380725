"""What the stages of one pipelined step say to each other, and what a thread of the engine is computing.

Owns the wire vocabulary of the engine: the message kinds (:class:`Kind`), one body dataclass per request kind,
the :class:`Envelope` every message travels in, and the per-thread :class:`Task` (microbatch, phase) that the
compute token, the random streams and the ordered updates read. Also the small helpers every role uses on
received messages (leaves, differentiable outputs, caches sent back) and the failure type,
:class:`PipelineError`. No threads and no state here besides the thread-local current task.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum, IntEnum
from typing import Any

import torch

from lightning_mp.comm import Message

__all__ = [
    "POLL_S",
    "BackwardRequest",
    "CallId",
    "CallRequest",
    "Envelope",
    "FetchBackwardRequest",
    "Future",
    "GetBackwardRequest",
    "GetRequest",
    "Kind",
    "Phase",
    "PipelineError",
    "StepEnd",
    "Task",
    "as_task",
    "caches_written_back",
    "connected",
    "current_microbatch",
    "current_task",
    "differentiable",
    "received_leaves",
]

POLL_S = 0.5  # how often a waiter re-checks whether the step failed
CallId = tuple[int, int]  # (calling stage, per-engine counter): names a request and its reply on every stage


class PipelineError(RuntimeError):
    """A pipelined step failed on some stage, or a stage stopped answering."""


class Kind(Enum):
    """What a message is. The value is the short name counted in ``PipelineEngine.messages_sent``."""

    FORWARD = "fwd"  # a call that waits for its outputs (body: CallRequest)
    BACKWARD = "bwd"  # the backward of a FORWARD (body: BackwardRequest)
    CALL = "call"  # a one-way call that returns a handle ([Note: remote handles]; body: CallRequest)
    GET = "get"  # fetch (part of) a CALL's output (body: GetRequest)
    FETCH_BACKWARD = "gbwd"  # the backward of a GET (body: FetchBackwardRequest)
    GET_BACKWARD = "getbwd"  # a loss's GET and its backward in one exchange (body: GetBackwardRequest)
    REPLY = "reply"  # the answer to any request but a CALL (body: what it computed)
    ERROR = "error"  # a request failed (body: the error text)
    END = "end"  # the driver finished the step (body: StepEnd)
    CLOSE = "close"  # a stage closes the step: nothing more comes from it


class Phase(IntEnum):
    """The phase component of a task's priority (smaller sorts first in the ``"simple"`` schedule); ``WEIGHT`` is the
    deferred weight-gradient pass of a backward under ``"zero_bubble"`` ([Note: zero-bubble] in ``_zero_bubble.py``)."""

    BACKWARD = 0
    FORWARD = 1
    WEIGHT = 2


@dataclass(frozen=True)
class CallRequest:
    """Run module ``fqn`` (or the children ``span`` of a Sequential, see [Note: sequential runs]) on its owner."""

    fqn: str
    args: tuple
    kwargs: dict
    grad_enabled: bool
    span: tuple[int, int] | None = None

    @property
    def label(self) -> str:
        return label(self.fqn, self.span)


@dataclass(frozen=True)
class BackwardRequest:
    """The output gradients of a FORWARD of ``fqn``; the reply holds the gradients of the leaves it received."""

    fqn: str
    grad_outputs: list[torch.Tensor | None]


@dataclass(frozen=True)
class GetRequest:
    """Send (part ``path`` of) the output of call ``call_id``; ``label`` names it in errors and on the timeline."""

    call_id: CallId
    path: tuple
    label: str


@dataclass(frozen=True)
class FetchBackwardRequest:
    """The output gradients of a GET; the reply holds the gradients of every call of ``upstream``'s leaves."""

    label: str
    grad_outputs: list[torch.Tensor | None]
    upstream: list[CallId]


@dataclass(frozen=True)
class GetBackwardRequest:
    """Compute (part ``path`` of) the output of call ``call_id``, a loss, and run its backward from a gradient of
    ones; the reply holds the values after each key of ``path`` from ``first`` on (the loss, then its scalings) and
    the gradients of every call of ``upstream``'s leaves ([Note: the loss's fetch and backward in one exchange] in
    ``_caller.py``)."""

    call_id: CallId
    path: tuple
    label: str
    first: int
    upstream: list[CallId]


@dataclass(frozen=True)
class StepEnd:
    """The driver's last word: its summary (``ok``) or the text of its failure."""

    ok: bool
    value: Any


@dataclass(frozen=True)
class Envelope:
    """One message of one step between two stages of a pipeline."""

    kind: Kind
    step: str  # which session of which hook, e.g. "training_step#12": stages must agree
    call_id: CallId | None = None
    body: Any = None
    microbatch: int = 0
    done: tuple[int, ...] = ()  # microbatches the driver finished since its last message to this stage ("free")
    origin: tuple | None = None  # the served request the sender sent this from (None: a microbatch's own code)


@dataclass(frozen=True)
class Task:
    """What the current thread is computing: which microbatch, forward, backward or weight pass."""

    microbatch: int
    phase: Phase
    label: str = "step"  # module FQN of a served request, "step" for the driver's microbatch code
    ident: tuple = ()  # rank-independent name: ("mb", microbatch, phase), ("call", call_id, kind), ("w", *backward's)


_current = threading.local()


def current_task() -> Task | None:
    """The task this thread computes for, or ``None`` outside the engine's tasks."""
    return getattr(_current, "task", None)


def current_microbatch() -> int | None:
    """The microbatch this thread computes for, or ``None`` outside the engine's tasks."""
    task = current_task()
    return None if task is None else task.microbatch


def transport_messages(messages_sent: Mapping[str, int]) -> int:
    """How many transport messages ``messages_sent`` (``PipelineEngine.messages_sent``, or a difference of two
    readings) counts: every message, a bundle of several once ([Note: coalesced one-way calls] in ``_core.py``)."""
    counted = sum(n for kind, n in messages_sent.items() if kind not in ("bundle", "bundled"))
    return counted - messages_sent.get("bundled", 0) + messages_sent.get("bundle", 0)


_held = threading.local()  # per thread: how to send the one-way calls this thread last held, see below


def holding_calls(flush: Callable[[], None] | None) -> None:
    """This thread holds one-way calls that ``flush`` sends (``None``: it holds none any more); see [Note: coalesced
    one-way calls] in ``_core.py``."""
    _held.flush = flush


def send_held_calls(module: torch.nn.Module) -> None:
    """Send the one-way calls this thread holds, if any, before ``module`` computes here, if it has parameters.

    Raises:
        PipelineError: the transport failed (e.g. the peer died), naming the stage.
    """
    flush = getattr(_held, "flush", None)
    if flush is None or next(module.parameters(), None) is None:
        return
    _held.flush = None
    flush()


@contextmanager
def as_task(task: Task) -> Iterator[None]:
    """Run the body as ``task`` on this thread."""
    previous = current_task()
    _current.task = task
    try:
        yield
    finally:
        _current.task = previous


class Future:
    """A value set by one thread and waited for by others, re-checking the step's failure meanwhile.

    A later ``set`` replaces the value (as the first, it wakes nobody again). The gate is a plain lock, held until
    the first ``set``: a wait is a C-level ``acquire`` with a timeout, where ``threading.Event`` costs a Python
    ``Condition`` (about ten Python calls per wait and per set, and the engine waits on one per request).
    """

    __slots__ = ("_gate", "_once", "_set", "value")

    def __init__(self) -> None:
        self._gate = threading.Lock()
        self._gate.acquire()  # released by the first ``set``
        self._once = threading.Lock()  # taken by the first ``set``
        self._set = False  # once True, waiters no longer touch the gate (an interrupt between a waiter's acquire and
        self.value: Any = None  # release, e.g. KeyboardInterrupt, cannot then leave it held for the others)

    def set(self, value: Any) -> None:
        self.value = value
        if self._once.acquire(blocking=False):
            self._gate.release()
            self._set = True

    def wait(self, timeout_s: float, check_failed: Callable[[], None], what: str) -> Any:
        """The value, once set.

        Raises:
            PipelineError: after ``timeout_s`` seconds, naming ``what``; or what ``check_failed`` raises.
        """
        if not self._set:
            gate = self._gate
            if not gate.acquire(blocking=False):
                deadline = time.monotonic() + timeout_s
                while not gate.acquire(timeout=POLL_S):
                    check_failed()
                    if time.monotonic() > deadline:
                        raise PipelineError(f"Timed out after {timeout_s:.0f} s waiting for {what}.")
            gate.release()  # open for every other waiter, and for this one again
        check_failed()
        return self.value


def label(fqn: str, span: tuple[int, int] | None) -> str:
    """``fqn``, or ``fqn[start:stop]`` for a run of a Sequential's children."""
    return fqn if span is None else f"{fqn}[{span[0]}:{span[1]}]"


def received_leaves(message: Message) -> list[torch.Tensor]:
    """The received tensors that the sender's graph needs gradients for, made leaves of this stage's graph."""
    return [t.requires_grad_(True) for t, requires_grad in zip(message.tensors, message.requires_grad) if requires_grad]


def differentiable(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() or tensor.is_complex()


def connected(message: Message, outputs: list[torch.Tensor], replacements: list[torch.Tensor]) -> Message:
    """``message`` holding the ``replacements`` tensors in place of its ``outputs`` (rebuilt if any was replaced)."""
    if all(a is b for a, b in zip(outputs, replacements)):
        return message
    replaced = {id(a): b for a, b in zip(outputs, replacements)}
    return message.with_tensors([replaced.get(id(t), t) for t in message.tensors])


def caches_written_back(args: tuple, kwargs: dict, grad_enabled: bool) -> list:
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
