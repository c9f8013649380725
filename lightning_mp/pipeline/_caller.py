"""The caller side of remote calls, for one step on one rank.

:class:`Caller` owns what happens where a stub of a module placed elsewhere is called: the request (a FORWARD
that waits for its outputs, or a one-way CALL that returns a :class:`~._handles.RemoteValue` at once, [Note: which
calls are one-way] in ``_install.py``), the check that a handle may go to its owner as a reference, the fetch of
a handle's value, and the remote autograd nodes whose backward sends the output gradients to the owner
(``_RemoteBackward``, ``_FetchBackward``; [Note: remote autograd] in ``comm/_autograd.py``). It is the
``session`` a :class:`RemoteValue` holds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lightning_mp.comm import connect_remote_outputs, pack
from lightning_mp.pipeline._core import SessionCore
from lightning_mp.pipeline._handles import RemoteValue, _PackingFor
from lightning_mp.pipeline._recorded import owner_path
from lightning_mp.pipeline._install import Placement
from lightning_mp.pipeline._messages import (
    BackwardRequest,
    CallId,
    CallRequest,
    FetchBackwardRequest,
    GetBackwardRequest,
    GetRequest,
    Kind,
    Phase,
    PipelineError,
    Task,
    caches_written_back,
    connected,
    current_task,
    differentiable,
)
from lightning_mp.pipeline._outputs import OutputStore

__all__ = ["Caller"]


@dataclass
class _RemoteBackward:
    """Caller side of a FORWARD's backward (see ``connect_remote_outputs``)."""

    core: SessionCore
    stage: int
    call_id: CallId
    microbatch: int
    fqn: str

    def run_backward(self, grad_outputs: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        # Autograd runs CPU backward in the thread that called backward(), which holds the token as its task.
        task = current_task() or Task(self.microbatch, Phase.BACKWARD)
        body = BackwardRequest(self.fqn, grad_outputs)
        envelope = self.core.envelope(Kind.BACKWARD, self.call_id, body, self.microbatch)
        reply = self.core.exchange(self.stage, envelope, task, f"backward of {self.fqn!r}")
        return list(reply.obj.body)


@dataclass
class _FetchBackward:
    """Caller side of a fetch's backward: output gradients to the owner, gradients of ``upstream`` back."""

    core: SessionCore
    stage: int
    fetch_id: CallId
    microbatch: int
    label: str
    upstream: list[tuple[CallId, int]]  # (call_id, how many caller tensors that call sent as data)

    def run_backward(self, grad_outputs: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        task = current_task() or Task(self.microbatch, Phase.BACKWARD)
        body = FetchBackwardRequest(self.label, grad_outputs, [call_id for call_id, _ in self.upstream])
        envelope = self.core.envelope(Kind.FETCH_BACKWARD, self.fetch_id, body, self.microbatch)
        reply = self.core.exchange(self.stage, envelope, task, f"backward of {self.label!r}")
        return _flat_gradients(self.label, self.upstream, reply.obj.body)


@dataclass
class _ReceivedGradients:
    """Caller side of a loss whose backward ran on its owner in the exchange that fetched it ([Note: the loss's
    fetch and backward in one exchange]): its backward hands back the gradients received then."""

    label: str
    upstream: list[tuple[CallId, int]]  # (call_id, how many caller tensors that call sent as data)
    grads: list[list[torch.Tensor | None]] | None  # per upstream call, from the owner; None once handed back

    def run_backward(self, grad_outputs: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        seeded = [g is not None and torch.equal(g, torch.ones_like(g)) for g in grad_outputs]
        grads, self.grads = self.grads, None  # handed back once: nothing of the backward outlives it here
        if grads is None:
            raise PipelineError(f"The loss {self.label!r} was backpropagated twice; its backward ran on its owner"
                                " stage once, with the pipelined step's own backward.")
        if not seeded[-1] or any(seeded[:-1]):  # the owner ran the backward of ``loss.backward()`` only
            raise PipelineError(f"internal: the loss {self.label!r}, already backpropagated on its owner, got"
                                " another gradient here")
        return _flat_gradients(self.label, self.upstream, grads)


def _flat_gradients(label: str, upstream: list[tuple[CallId, int]], parts: list) -> list[torch.Tensor | None]:
    """The gradients an owner returned per upstream call, checked against what each call sent, in one list."""
    grads: list[torch.Tensor | None] = []
    for (call_id, count), part in zip(upstream, parts):
        if len(part) != count:
            raise PipelineError(f"internal: the owner of {label!r} returned {len(part)} gradients of call"
                                f" {call_id}, expected {count}")
        grads.extend(part)
    return grads


class Caller:
    """Makes this rank's remote calls and fetches for one step.

    Args:
        core: the step's shared core.
        store: this rank's store (which microbatches the driver has finished).
        placement: where every module lives.
        next_call_id: a new id for a request of this rank, unique over the engine's lifetime.
        remote_handles: calls from the driver's microbatch code may return handles ([Note: remote handles]).
    """

    def __init__(
        self,
        core: SessionCore,
        store: OutputStore,
        placement: Placement,
        next_call_id: Callable[[], CallId],
        remote_handles: bool,
    ) -> None:
        self.core, self.store, self.placement = core, store, placement
        self._next_call_id = next_call_id
        self.remote_handles = remote_handles

    def call(self, fqn: str, stage: int, args: tuple, kwargs: dict, span: tuple[int, int] | None, task: Task) -> Any:
        """Run ``fqn`` (its children ``span``) on ``stage`` for ``task``: a handle, or the outputs it waited for."""
        grad_enabled = torch.is_grad_enabled()
        call_id = self._next_call_id()
        request = CallRequest(fqn, args, kwargs, grad_enabled, span)
        caches = caches_written_back(args, kwargs, grad_enabled)
        if (self.remote_handles and task.ident[:1] == ("mb",) and not caches
                and not self.placement.calls_other_stages(fqn, stage, span)):
            return self.call_async(stage, call_id, request, task)
        packed = pack(self.core.envelope(Kind.FORWARD, call_id, request, task.microbatch))
        grad_inputs = [t for t in packed.tensors if t.requires_grad] if grad_enabled else []
        reply = self.core.exchange(stage, packed, task, f"forward of {fqn!r}", call_id=call_id)
        outputs = [t for t, rg in zip(reply.tensors, reply.requires_grad) if rg and differentiable(t)]
        if grad_enabled and outputs:
            handle = _RemoteBackward(self.core, stage, call_id, task.microbatch, request.label)
            reply = connected(reply, outputs, connect_remote_outputs(handle, grad_inputs, outputs))
        if not caches:
            return reply.obj.body
        output, states = reply.obj.body
        for cache, state in zip(caches, states):  # [Note: caches written back]
            cache.__dict__.update(state.__dict__)
        return output

    def call_async(self, stage: int, call_id: CallId, request: CallRequest, task: Task) -> RemoteValue:
        """Send a "call" request and return a handle to its output at once ([Note: remote handles]); the request is
        held to go with this rank's next message ([Note: coalesced one-way calls] in ``_core.py``)."""
        self.core.raise_if_failed()
        with _PackingFor(self, stage) as packing:
            packed = pack(self.core.envelope(Kind.CALL, call_id, request, task.microbatch))
        upstream: dict[CallId, list[torch.Tensor]] = {}
        for ref in packing.refs:
            upstream.update(ref._rv_upstream)
        grad_inputs = [t for t in packed.tensors if t.requires_grad] if request.grad_enabled else []
        if grad_inputs:
            upstream[call_id] = grad_inputs
        self.core.send(packed, stage, task.microbatch, kind=Kind.CALL)
        handle = RemoteValue(self, stage, call_id, task.microbatch, upstream=upstream, label=request.label)
        handle._rv_grad_enabled = request.grad_enabled
        handle._rv_tensor_known = self.placement.returns_tensor(request.fqn, request.span)
        return handle

    def check_reference(self, handle: RemoteValue) -> None:
        """Caller side, while packing a request: may ``handle`` go to its owner as a reference?

        Raises:
            PipelineError: at once, naming the module, if the handle comes from another step or its microbatch has
                finished (its owner has dropped the value, or is about to): a reference would wait in vain.
        """
        where = self.core.describe(handle._rv_stage)
        if handle._rv_session is not self or self.core.closed:
            raise PipelineError(
                f"The output of {handle._rv_label!r} (computed on {where}) was passed to a call after its pipelined"
                " step ended. Values of a pipelined step cannot be kept for a later step; return them from the step."
            )
        if handle._rv_microbatch in self.store.freed:
            raise PipelineError(
                f"The output of {handle._rv_label!r} of microbatch {handle._rv_microbatch} was used after that"
                f" microbatch had finished, and {where}, which computed it, has dropped it. Use a microbatch's values"
                " within its own step function, or return them from it."
            )
        task = current_task()
        if task is not None and task.microbatch != handle._rv_microbatch:
            # whether the other microbatch has finished would depend on timing: refuse it always
            raise PipelineError(
                f"The output of {handle._rv_label!r} of microbatch {handle._rv_microbatch} (on {where}) was used in"
                f" microbatch {task.microbatch}. Values cannot cross microbatches of a pipelined step: use a"
                " microbatch's values within its own step function, or return them from it."
            )

    def fetch(self, handle: RemoteValue) -> Any:
        """Bring the value behind ``handle`` here: one round trip to its owner, connected to autograd.

        Returns:
            ``(how many keys of the handle's path the owner walked, the value reached)``.
        """
        label = self._check_fetch(handle)
        task = current_task() or Task(handle._rv_microbatch, Phase.FORWARD)
        fetch_id = self._next_call_id()
        request = GetRequest(handle._rv_call_id, owner_path(handle._rv_path), label)
        envelope = self.core.envelope(Kind.GET, fetch_id, request, handle._rv_microbatch)
        reply = self.core.exchange(handle._rv_stage, envelope, task, f"the output of {label!r}")
        return self._connect_fetch(handle, fetch_id, reply).obj.body

    def _check_fetch(self, handle: RemoteValue) -> str:
        """``handle``'s label, once it may be fetched (see ``check_reference``)."""
        if handle._rv_session is not self or self.core.closed:
            raise PipelineError(
                f"The output of {handle._rv_label!r} (computed on {self.core.describe(handle._rv_stage)}) was"
                " touched after its pipelined step ended; only values returned by the step are fetched for you."
            )
        self.check_reference(handle)
        return handle._rv_label

    def _connect_fetch(self, handle: RemoteValue, fetch_id: CallId, reply: Any) -> Any:
        """``reply`` to a fetch of ``handle``, its differentiable tensors connected to autograd by a remote node
        whose backward is a FETCH_BACKWARD."""
        outputs = [t for t, rg in zip(reply.tensors, reply.requires_grad) if rg and differentiable(t)]
        if outputs and handle._rv_grad_enabled and not torch.is_inference_mode_enabled():
            upstream = handle._rv_upstream
            grad_inputs = [t for tensors in upstream.values() for t in tensors]
            call = _FetchBackward(self.core, handle._rv_stage, fetch_id, handle._rv_microbatch, handle._rv_label,
                                  [(call_id, len(tensors)) for call_id, tensors in upstream.items()])
            with torch.enable_grad():  # the call ran with grad: connect even if touched under no_grad
                reply = connected(reply, outputs, connect_remote_outputs(call, grad_inputs, outputs))
        return reply

    def fetch_with_backward(self, chain: list[RemoteValue]) -> Any:
        """Fetch the loss ``chain[-1]`` (``RemoteValue._rv_loss_chain``) and run its backward on its owner, in one
        exchange; every handle of ``chain`` then holds its value.

        [Note: the loss's fetch and backward in one exchange] A loss recorded on a handle ([Note: the loss where the
        logits are] in ``_recorded.py``) is computed on the stage that holds the logits. Fetched in the forward, it
        cost the driver a GET and, in the backward, a FETCH_BACKWARD carrying the gradient ``1`` that
        ``loss.backward()`` starts from: two round trips per microbatch. So the driver keeps such a loss
        unfetched through the forward, and its backward task sends one GET_BACKWARD: the owner computes the loss
        (and the scalings recorded on it, ``loss / microbatches``), runs its backward from a gradient of ones under
        that backward task (the same roots, gradients and hooks as the FETCH_BACKWARD did: ordered accumulation,
        the reducer, the zero-bubble split), and replies with the values and the gradients of the driver's tensors
        upstream. Here the values are connected to autograd by one remote node whose backward hands back those
        gradients, so ``loss.backward()`` runs as before with no message; the step's outputs are fetched after,
        and the handles they hold have their values already. Where the owner's value is no scalar that needs a
        gradient, it answers as a GET, and the backward here raises or sends a FETCH_BACKWARD as it would have.
        Messages per microbatch where the last stage holds the loss (an ``nn.Sequential`` cut in two): the driver's
        one-way CALL and GET_BACKWARD, the owner's one REPLY; 3 where they were 5 (CALL, GET, FETCH_BACKWARD, two
        REPLYs), and torch's 1F1B sends 2 (the activation, its gradient).

        Returns:
            The loss, a tensor of this stage's autograd graph.
        """
        handle = chain[-1]
        label = self._check_fetch(handle)
        task = current_task() or Task(handle._rv_microbatch, Phase.BACKWARD)
        fetch_id = self._next_call_id()
        upstream = handle._rv_upstream
        first = len(chain[0]._rv_path) - 1
        body = GetBackwardRequest(handle._rv_call_id, owner_path(handle._rv_path), label, first, list(upstream))
        envelope = self.core.envelope(Kind.GET_BACKWARD, fetch_id, body, handle._rv_microbatch)
        reply = self.core.exchange(handle._rv_stage, envelope, task, f"the loss {label!r} and its backward")
        depth, values, grads = reply.obj.body
        with handle._rv_lock:
            if grads is None:  # no backward ran there: a plain fetch
                depth, values, _ = self._connect_fetch(handle, fetch_id, reply).obj.body
                if depth < len(handle._rv_path):
                    handle._rv_take(depth, values)
                    return handle._rv_value
            else:
                received = _ReceivedGradients(label, [(call_id, len(tensors)) for call_id, tensors in upstream.items()],
                                              grads)
                grad_inputs = [t for tensors in upstream.values() for t in tensors]
                outputs = [t for t, rg in zip(reply.tensors, reply.requires_grad) if rg and differentiable(t)]
                with torch.enable_grad():
                    reply = connected(reply, outputs, connect_remote_outputs(received, grad_inputs, outputs))
                values = reply.obj.body[1]
            for link, value in zip(chain, values):
                link._rv_take(len(link._rv_path), value)
        return handle._rv_value
