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

from dataclasses import dataclass
from typing import Protocol

import torch
from torch.autograd.function import once_differentiable

__all__ = ["REMOTE_ANCHOR", "RemoteBackward", "connect_remote_outputs", "ragged_like"]


class RemoteBackward(Protocol):
    """What a remote call must offer for its backward."""

    def run_backward(self, grad_outputs: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Send the gradients of the differentiable outputs; return the gradients of the grad inputs."""
        ...


class _RemoteCallFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, call: RemoteBackward, outputs: list[torch.Tensor], nested: list, anchor: torch.Tensor, *grad_inputs
    ):
        # `outputs` are not inputs of this node, so autograd keeps their identity (no alias is created).
        ctx.set_materialize_grads(False)
        ctx.call = call
        ctx.nested = nested  # per output: None, or the nested view's metadata (its buffer is the output here)
        ctx.num_inputs = len(grad_inputs)
        ctx.jagged = [_JaggedShape.of(t) for t in grad_inputs]
        return tuple(outputs)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grad_outputs: torch.Tensor | None):
        grads = [
            grad if meta is None or grad is None else torch._nested_view_from_buffer(grad.contiguous(), *meta)
            for grad, meta in zip(grad_outputs, ctx.nested)
        ]
        grad_inputs = ctx.call.run_backward(grads)
        if len(grad_inputs) != ctx.num_inputs:
            raise RuntimeError(f"Remote backward returned {len(grad_inputs)} gradients, expected {ctx.num_inputs}.")
        grad_inputs = [g if shape is None or g is None else shape.apply(g) for g, shape in zip(grad_inputs, ctx.jagged)]
        return (None, None, None, None, *grad_inputs)


_ANCHOR = torch.zeros((), requires_grad=True)
REMOTE_ANCHOR = _ANCHOR  # every remote call's node leads to this leaf: a backward that must reach them asks for it


def connect_remote_outputs(
    call: RemoteBackward, grad_inputs: list[torch.Tensor], outputs: list[torch.Tensor]
) -> list[torch.Tensor]:
    """Record ``outputs`` (received, differentiable) as produced from ``grad_inputs`` by a remote call.

    The output tensor objects are kept (their ``grad_fn`` is set in place), so a structure already holding them
    needs no rebuilding; except nested tensors of the strided layout, whose history autograd cannot set in place:
    their buffer is connected instead and a new nested view of it is returned in their place (the gradient that
    goes back is nested again, as the sender's output).

    Args:
        call: answers :meth:`RemoteBackward.run_backward` for this call.
        grad_inputs: the call's input tensors that require grad, in wire order.
        outputs: received floating-point output tensors that left the remote stage with ``requires_grad=True``.

    Returns:
        The tensors to use for ``outputs``, in their order: the same objects but for strided nested tensors.
    """
    if not outputs or not torch.is_grad_enabled():
        return outputs
    nested = [_nested_meta(t) if _strided_nested(t) else None for t in outputs]
    connected = [t.values().detach() if meta is not None else t for t, meta in zip(outputs, nested)]
    results = _RemoteCallFunction.apply(call, connected, nested, _ANCHOR, *grad_inputs)
    for original, result in zip(connected, results):
        if original is not result:
            raise RuntimeError("internal: autograd did not keep the identity of remote outputs")
    return [
        t if meta is None else torch._nested_view_from_buffer(buffer, *meta)
        for t, buffer, meta in zip(outputs, connected, nested)
    ]


@dataclass(frozen=True)
class _JaggedShape:
    """The ragged structure of a jagged nested tensor: its offsets tensor is what names its ragged size (``j0``)."""

    offsets: torch.Tensor
    lengths: torch.Tensor | None
    ragged_idx: int

    @staticmethod
    def of(tensor: torch.Tensor) -> _JaggedShape | None:
        if not (tensor.is_nested and tensor.layout == torch.jagged):
            return None
        return _JaggedShape(tensor.offsets(), tensor.lengths(), tensor._ragged_idx)

    def apply(self, grad: torch.Tensor) -> torch.Tensor:
        if not (grad.is_nested and grad.layout == torch.jagged) or grad.offsets() is self.offsets:
            return grad
        return torch.nested.nested_tensor_from_jagged(
            grad.values(), self.offsets, lengths=self.lengths, jagged_dim=self.ragged_idx
        )


def ragged_like(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
    """``grad`` with the ragged size of ``like`` where both are jagged nested tensors, else ``grad`` itself.

    A jagged tensor's ragged size is named by its offsets tensor: a gradient that crossed stages has new offsets (of
    equal values), and autograd would refuse it for ``like`` (``Mismatch in shape: [2, j1, 4] and [2, j0, 4]``).
    """
    shape = _JaggedShape.of(like)
    return grad if shape is None or grad is None else shape.apply(grad)


def _strided_nested(tensor: torch.Tensor) -> bool:
    return tensor.is_nested and tensor.layout == torch.strided


def _nested_meta(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What ``torch._nested_view_from_buffer`` needs besides the buffer (``tensor`` is contiguous)."""
    return (tensor._nested_tensor_size(), tensor._nested_tensor_strides(), tensor._nested_tensor_storage_offsets())
