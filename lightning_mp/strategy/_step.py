"""Per-step gradients between Lightning and the pipeline engine.

[Note: pipelined step in Lightning] The engine runs forward *and* backward of every microbatch inside
``SMPStrategy.training_step`` (as DeepSpeed's pipeline engine does in Lightning). Lightning's closure then
calls ``zero_grad`` and ``backward``: so that ``zero_grad`` cannot wipe the pipeline's gradients,
:class:`GradientStash` moves them aside during the step and ``SMPStrategy.backward`` adds them back, exactly
where an eager ``loss.backward()`` would have accumulated them. The data-parallel all-reduce runs once per
optimizer step (on the last accumulated batch): in buckets launched during that batch's backward and waited for in
``SMPStrategy.optimizer_step`` (see [Note: overlapped gradient all-reduce] in ``_reducer.py``), or, when that is not
possible, there after backward (:func:`all_reduce_gradients`). Logged values: see [Note: logging in a pipelined
step] in ``_logs.py``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["GradientStash", "all_reduce_gradients"]


class GradientStash:
    """Keep the pipeline's gradients away from Lightning's ``zero_grad`` (see the Note above)."""

    def __init__(self) -> None:
        self._previous: dict[nn.Parameter, torch.Tensor | None] = {}
        self._pipeline: dict[nn.Parameter, torch.Tensor] = {}

    def begin(self, params: Iterable[nn.Parameter], keep_previous: bool = True) -> None:
        """Before the pipelined step: set gradients aside so the step's own gradients start from zero.

        ``keep_previous=False`` (the first batch of an accumulation window, whose old gradients Lightning's
        ``zero_grad`` is about to drop anyway) frees them now instead, so they do not stay alive through the step.
        """
        self._previous = {p: p.grad if keep_previous else None for p in params}
        self._pipeline = {}
        for p in self._previous:
            p.grad = None

    def previous(self, param: nn.Parameter) -> torch.Tensor | None:
        """During the pipelined step: the gradient ``param`` had before it (the accumulation window's so far)."""
        return self._previous.get(param)

    def end(self) -> None:
        """After the pipelined step: take its gradients and put back the ones from before."""
        for p, previous in self._previous.items():
            if p.grad is not None:
                self._pipeline[p] = p.grad
            p.grad = previous
        self._previous = {}

    def scale(self, factor: float) -> None:
        """Multiply the step's gradients (not the ones from before it) by ``factor``, in place."""
        for grad in self._pipeline.values():
            grad.mul_(factor)

    def apply(self) -> None:
        """Accumulate the step's gradients into ``.grad``, as ``loss.backward()`` would have."""
        for p, grad in self._pipeline.items():
            p.grad = grad if p.grad is None else p.grad + grad
        self._pipeline = {}


def all_reduce_gradients(params: list[nn.Parameter], group: dist.ProcessGroup, size: int) -> None:
    """Average ``p.grad`` over the data-parallel ``group`` in place, in one flat bucket per dtype.

    Every replica passes the same ``params`` (same stage, same plan). A parameter with no gradient on a replica
    counts as zeros there; it gets a gradient afterwards only if some replica had one, like DDP.
    """
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for p in params:
        by_dtype.setdefault(p.dtype, []).append(p)
    for dtype, group_params in by_dtype.items():
        device = group_params[0].device
        flags = torch.tensor([float(p.grad is not None) for p in group_params], dtype=dtype, device=device)
        chunks = [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), dtype=dtype, device=device) for p in group_params]
        bucket = torch.cat([*chunks, flags])
        dist.all_reduce(bucket, group=group)
        bucket /= size
        offset = 0
        present = bucket[-len(group_params) :].tolist()
        for p, flag in zip(group_params, present):
            reduced = bucket[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
            p.grad = reduced.clone() if flag > 0.0 else None
