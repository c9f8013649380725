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
        grads: list[torch.Tensor | None] = []
        for (call_id, count), part in zip(self.upstream, reply.obj.body):
            if len(part) != count:
                raise PipelineError(f"internal: the owner of {self.label!r} returned {len(part)} gradients of call"
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
        """Send a "call" request and return a handle to its output at once ([Note: remote handles])."""
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
        label = handle._rv_label
        if handle._rv_session is not self or self.core.closed:
            raise PipelineError(
                f"The output of {label!r} (computed on {self.core.describe(handle._rv_stage)}) was touched"
                " after its pipelined step ended; only values returned by the step are fetched for you."
            )
        self.check_reference(handle)
        task = current_task() or Task(handle._rv_microbatch, Phase.FORWARD)
        fetch_id = self._next_call_id()
        request = GetRequest(handle._rv_call_id, owner_path(handle._rv_path), label)
        envelope = self.core.envelope(Kind.GET, fetch_id, request, handle._rv_microbatch)
        reply = self.core.exchange(handle._rv_stage, envelope, task, f"the output of {label!r}")
        outputs = [t for t, rg in zip(reply.tensors, reply.requires_grad) if rg and differentiable(t)]
        if outputs and handle._rv_grad_enabled and not torch.is_inference_mode_enabled():
            upstream = handle._rv_upstream
            grad_inputs = [t for tensors in upstream.values() for t in tensors]
            call = _FetchBackward(self.core, handle._rv_stage, fetch_id, handle._rv_microbatch, label,
                                  [(call_id, len(tensors)) for call_id, tensors in upstream.items()])
            with torch.enable_grad():  # the call ran with grad: connect even if touched under no_grad
                reply = connected(reply, outputs, connect_remote_outputs(call, grad_inputs, outputs))
        return reply.obj.body
