"""The owner's store of remote outputs ([Note: remote handles] in ``_handles.py``), for one step on one rank.

:class:`OutputStore` keeps what this stage computed for its callers until they are done with it: the output of
every one-way call (a future, as ("ok", value) or ("error", text)), the leaves each call made of the caller's
data, the fetched values awaiting their backward. It runs the four requests that work on that state (a one-way
call, a fetch, the backward of a fetch, a loss's fetch with its backward), resolves references to its outputs,
and drops a microbatch's values once the driver has finished it and every request of it received so far has run.
"""

from __future__ import annotations

import collections
from contextlib import AbstractContextManager as ContextManager, nullcontext
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lightning_mp.comm import Message, pack, ragged_like
from lightning_mp.pipeline._core import SessionCore
from lightning_mp.pipeline._handles import _PackingFor, resolve
from lightning_mp.pipeline._recorded import _Op, follow, walk_containers
from lightning_mp.pipeline._zero_bubble import run_backward
from lightning_mp.pipeline._messages import (
    CallId,
    CallRequest,
    Envelope,
    FetchBackwardRequest,
    Future,
    GetBackwardRequest,
    GetRequest,
    Kind,
    PipelineError,
    differentiable,
    received_leaves,
)

__all__ = ["OutputStore"]


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


class OutputStore:
    """Owner side of remote handles for one step on one rank.

    Args:
        core: the step's shared core (lock, failure, envelopes).
        run_module: runs a requested module here (``Placement.run`` under the engine's forward context).
        backward: runs a fetch's backward (see ``Driver``).
    """

    def __init__(
        self,
        core: SessionCore,
        run_module: Callable[[CallRequest, tuple, dict], Any],
        backward: Callable[..., None] = run_backward,
    ) -> None:
        self.core = core
        self._run_module = run_module
        self.backward = backward
        self._outputs: dict[CallId, Future] = {}
        self._leaves: dict[CallId, list[torch.Tensor]] = {}
        self._fetches: dict[CallId, _SavedFetch] = {}
        self._of_microbatch: dict[int, list[CallId]] = {}  # what to drop when the driver says it is done
        self._fetch_counts: dict[int, _FetchCount] = {}
        self.freed: set[int] = set()  # microbatches the driver has finished (their outputs dropped, or about to be)
        self._unfinished: collections.Counter[int] = collections.Counter()  # requests received, not finished

    # ---- lifetime --------------------------------------------------------------------------------------------

    def received(self, envelope: Envelope) -> None:
        """Receiving thread, in arrival order (lock held): a request of ``envelope.microbatch`` will run; a "call"
        gets its output's future now, so a later reference finds it, or fails at once."""
        self._unfinished[envelope.microbatch] += 1
        if envelope.kind == Kind.CALL and not self.core.closed:
            self._outputs[envelope.call_id] = Future()
            self._of_microbatch.setdefault(envelope.microbatch, []).append(envelope.call_id)

    def finished(self, microbatch: int) -> None:
        """A request counted by ``received`` has run; the microbatch's values go if the driver is done with it."""
        with self.core.lock:
            self._unfinished[microbatch] -= 1
            idle = self._unfinished[microbatch] == 0
            if idle:
                del self._unfinished[microbatch]
        if idle and microbatch in self.freed:  # the driver finished it while this request ran
            self._drop(microbatch)

    def free(self, microbatch: int) -> None:
        """The driver finished ``microbatch``: drop this stage's outputs, leaves and fetches of it, once the requests
        of it received so far have run (a call nobody waited for may still be queued)."""
        with self.core.lock:
            self.freed.add(microbatch)
            if self._unfinished.get(microbatch, 0):
                return  # ``finished`` of its last request drops it
        self._drop(microbatch)

    def _drop(self, microbatch: int) -> None:
        with self.core.lock:
            for call_id in self._of_microbatch.pop(microbatch, ()):
                self._outputs.pop(call_id, None)
                self._leaves.pop(call_id, None)
                self._fetches.pop(call_id, None)
            self._fetch_counts.pop(microbatch, None)

    def clear(self) -> None:
        """The step closed (lock held)."""
        self._outputs.clear()
        self._leaves.clear()
        self._fetches.clear()
        self._of_microbatch.clear()
        self._fetch_counts.clear()

    # ---- outputs ---------------------------------------------------------------------------------------------

    def record(self, call_id: CallId, result: tuple[str, Any]) -> None:
        with self.core.lock:
            future = self._outputs.get(call_id)  # registered on receipt (``received``); gone once closed
        if future is not None:
            future.set(result)

    def _future(self, call_id: CallId, microbatch: int) -> Future:
        """The future of this stage's output of ``call_id``, registered when the call arrived.

        Raises:
            PipelineError: at once if this stage has no such output: its microbatch finished (it was dropped), or
                the reference comes from another step.
        """
        with self.core.lock:
            future = self._outputs.get(call_id)
        if future is not None:
            return future
        where = self.core.describe(self.core.stage)
        if microbatch in self.freed:
            raise PipelineError(
                f"The output of a remote call of microbatch {microbatch} was used after that microbatch had"
                f" finished, and {where}, which computed it, has dropped it. Use a microbatch's values within its"
                " own step function, or return them from it."
            )
        raise PipelineError(
            f"{where} has no output of remote call {call_id} in step {self.core.step!r}: a value from another step"
            " was passed to it. Values of a pipelined step cannot be kept for a later step; return them from the step."
        )

    def await_outputs(self, refs: list, what: str) -> None:
        """Wait until the outputs that the references ``refs`` of a request name have been computed here."""
        for ref in refs:
            self.await_call(ref._rv_call_id, ref._rv_microbatch, what)

    def resolve(self, call_id: CallId, path: tuple, microbatch: int) -> Any:
        """This stage's output of ``call_id``, then each key of ``path`` (an index or a recorded op) applied."""
        status, value = self._future(call_id, microbatch).wait(
            self.core.timeout_s, self.core.raise_if_failed, "the output of an earlier call"
        )
        if status != "ok":
            raise PipelineError(value)
        return follow(value, path)

    # ---- requests on the stored values -----------------------------------------------------------------------

    def run_call(self, envelope: Envelope, message: Message, refs: list) -> None:
        """A one-way call: run its module on its arguments (references resolved here) and keep the output."""
        request: CallRequest = envelope.body
        leaves = received_leaves(message) if request.grad_enabled else []
        args, kwargs = resolve((request.args, request.kwargs), refs, self.resolve)
        output = self._run_module(request, args, kwargs)
        if leaves:
            with self.core.lock:
                self._leaves[envelope.call_id] = leaves
        self.record(envelope.call_id, ("ok", output))

    def run_get(self, envelope: Envelope, compute: Callable[[], ContextManager] = nullcontext) -> Any:
        """A fetch: the packed reply with (part of) a stored output; keep its differentiable tensors for the
        fetch's backward. A path that computes (a recorded loss, [Note: the loss where the logits are]) runs inside
        ``compute()`` (the caller's hold of the compute token), after the output exists: one computation at a time."""
        request: GetRequest = envelope.body
        root = self.resolve(request.call_id, (), envelope.microbatch)
        computes = any(type(key) is _Op and key.kind == "function" for key in request.path)
        with compute() if computes else nullcontext():
            depth, value = walk_containers(root, request.path)
        return self._fetched(envelope, (depth, value))

    def _fetched(self, envelope: Envelope, body: Any) -> Message:
        """The packed reply of a fetch; its differentiable tensors are kept for the fetch's backward."""
        with _PackingFor(None, None):  # remote values inside it are fetched here and sent as data
            reply = pack(self.core.envelope(Kind.REPLY, envelope.call_id, body, envelope.microbatch))
        outputs = [t for t in reply.tensors if t.requires_grad and differentiable(t)]
        if outputs:
            with self.core.lock:
                self._fetches[envelope.call_id] = _SavedFetch(outputs, envelope.microbatch)
                self._of_microbatch.setdefault(envelope.microbatch, []).append(envelope.call_id)
                count = self._fetch_counts.setdefault(envelope.microbatch, _FetchCount())
                count.pending += 1
                count.foreign = count.foreign or envelope.call_id[0] != 0
        return reply

    def await_call(self, call_id: CallId, microbatch: int, what: str) -> None:
        """Wait until this stage's output of ``call_id`` has been computed."""
        self._future(call_id, microbatch).wait(
            self.core.timeout_s, self.core.raise_if_failed, f"the output of an earlier call, for {what!r}"
        )

    def run_get_backward(self, envelope: Envelope) -> Message:
        """A loss's fetch and its backward (holding the compute token; the output exists): the packed reply with the
        values from ``first`` on and the gradients of the upstream calls' leaves. A value that is no scalar needing
        a gradient is fetched as by a GET instead (reply ``(depth, value, None)``), its backward left to the caller.
        """
        request: GetBackwardRequest = envelope.body
        root = self.resolve(request.call_id, (), envelope.microbatch)
        depth, value = walk_containers(root, request.path[: request.first])
        if depth < request.first:  # the owner's walk stops at a non-container: the caller applies the rest
            return self._fetched(envelope, (depth, value, None))
        values = []
        for key in request.path[request.first:]:
            value = key.apply(value, root)
            values.append(value)
        if not (isinstance(value, torch.Tensor) and value.requires_grad and value.numel() == 1
                and differentiable(value)):  # the caller's backward raises as it would on the fetched value
            return self._fetched(envelope, (len(request.path), values, None))
        grads = self._backward_upstream(envelope.microbatch, [value], [torch.ones_like(value)], request.upstream)
        body = (len(request.path), values, grads)
        with _PackingFor(None, None):
            return pack(self.core.envelope(Kind.REPLY, envelope.call_id, body, envelope.microbatch))

    def run_fetch_backward(self, envelope: Envelope) -> Envelope:
        """The backward of a fetch: run it through this stage's graph; reply with the gradients of the leaves of
        every upstream call."""
        request: FetchBackwardRequest = envelope.body
        with self.core.lock:
            saved = self._fetches[envelope.call_id]
            if not saved.backed:
                saved.backed = True
                self._fetch_counts.setdefault(saved.microbatch, _FetchCount()).pending -= 1
        pairs = [(out, ragged_like(g, out)) for out, g in zip(saved.outputs, request.grad_outputs) if g is not None]
        grads = self._backward_upstream(saved.microbatch, [o for o, _ in pairs], [g for _, g in pairs],
                                        request.upstream)
        return self.core.envelope(Kind.REPLY, envelope.call_id, grads, envelope.microbatch)

    def _backward_upstream(self, microbatch: int, outputs: list[torch.Tensor], grad_outputs: list[torch.Tensor],
                           upstream: list[CallId]) -> list[list[torch.Tensor | None]]:
        """Backward from ``outputs`` through this stage's graph; the gradients of the leaves of every call of
        ``upstream``, per call."""
        with self.core.lock:
            count = self._fetch_counts.setdefault(microbatch, _FetchCount())
            retain = count.foreign or count.pending > 0
        if outputs:
            # [Note: backward of fetches] Fetches of one microbatch can share a part of this stage's graph (a value
            # fetched midway through a chain, then the chain's end; two parts of one output fetched apart), so the
            # graph is kept while another fetch of the microbatch awaits its backward. A fetch that a stage other
            # than the driver made can moreover be backed through once per backward of that stage's graph that
            # passes it (its owner gets partial gradients, which add up as one backward would): then the graph is
            # kept until the driver finishes the microbatch (``free``). The driver runs one backward per
            # microbatch, so each of its fetches is backed through once, and the last frees the graph as it goes.
            # A fetch whose value never reaches the loss (fetched only for a branch, ``if t > 0``) gets no backward:
            # then the graph stays until the microbatch is done (about one message later under 1F1B).
            with self.core.lock:
                wanted = [leaf for call_id in upstream for leaf in self._leaves.get(call_id, [])]
            self.backward(outputs, grad_outputs, wanted, retain_graph=retain)
        grads = []
        for call_id in upstream:
            with self.core.lock:
                leaves = self._leaves.get(call_id, [])
            grads.append([leaf.grad for leaf in leaves])
            for leaf in leaves:
                leaf.grad = None  # what the next fetch of this chain returns is its own share only
        return grads
