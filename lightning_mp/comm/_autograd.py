"""Autograd across ranks: a remote call as one node of the local autograd graph.

[Note: remote autograd] The caller of a remote module gets its outputs from the wire. So that ``backward``
reaches the remote stage, the differentiable outputs are passed through :class:`_RemoteCallFunction`, whose
inputs are the call's input tensors that require grad plus a shared *anchor* leaf (so the node is recorded
even when no input requires grad, e.g. token ids into an embedding on another stage). Its backward sends the
output gradients to the owner of the module, which runs backward of what it computed (accumulating its own
parameter gradients) and returns the input gradients. Forward: send inputs, receive outputs. Backward: send
output gradients, receive input gradients. The same contract as ``torch.distributed.rpc``'s
``SendRpcBackward``/``RecvRpcBackward`` pair, without the RPC framework.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch.autograd.function import once_differentiable

__all__ = ["RemoteBackward", "connect_remote_outputs"]


class RemoteBackward(Protocol):
    """What a remote call must offer for its backward."""

    def run_backward(self, grad_outputs: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Send the gradients of the differentiable outputs; return the gradients of the grad inputs."""
        ...


class _RemoteCallFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, call: RemoteBackward, outputs: list[torch.Tensor], anchor: torch.Tensor, *grad_inputs):
        # `outputs` are not inputs of this node, so autograd keeps their identity (no alias is created).
        ctx.set_materialize_grads(False)
        ctx.call = call
        ctx.num_inputs = len(grad_inputs)
        return tuple(outputs)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grad_outputs: torch.Tensor | None):
        grad_inputs = ctx.call.run_backward(list(grad_outputs))
        if len(grad_inputs) != ctx.num_inputs:
            raise RuntimeError(f"Remote backward returned {len(grad_inputs)} gradients, expected {ctx.num_inputs}.")
        return (None, None, None, *grad_inputs)


_ANCHOR = torch.zeros((), requires_grad=True)


def connect_remote_outputs(
    call: RemoteBackward, grad_inputs: list[torch.Tensor], outputs: list[torch.Tensor]
) -> None:
    """Record ``outputs`` (received, differentiable) as produced from ``grad_inputs`` by a remote call.

    The output tensor objects are kept (their ``grad_fn`` is set in place), so a structure already holding them
    needs no rebuilding.

    Args:
        call: answers :meth:`RemoteBackward.run_backward` for this call.
        grad_inputs: the call's input tensors that require grad, in wire order.
        outputs: received floating-point output tensors that left the remote stage with ``requires_grad=True``.
    """
    if not outputs or not torch.is_grad_enabled():
        return
    connected = _RemoteCallFunction.apply(call, outputs, _ANCHOR, *grad_inputs)
    for original, result in zip(outputs, connected):
        if original is not result:
            raise RuntimeError("internal: autograd did not keep the identity of remote outputs")
