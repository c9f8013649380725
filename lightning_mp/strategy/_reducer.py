"""Data-parallel gradient all-reduce in buckets, launched during the pipeline's backward (as DDP's ``Reducer``).

[Note: overlapped gradient all-reduce] Under ``ddp`` the gradients of a step are averaged over the replicas while
backward still runs: ``DistributedDataParallel`` groups the parameters into buckets (the first ~1 MiB, then ~25 MiB
each, in reverse parameter order, i.e. roughly the order backward produces their gradients) and starts an
asynchronous all-reduce of a bucket as soon as every parameter in it has its gradient (Li et al., "PyTorch
Distributed", VLDB 2020, section 3.2.3). :class:`GradientReducer` does the same for one pipeline stage's
parameters, with two differences that the pipeline brings:

* A stage's parameter is final only once *every* microbatch has added its gradient, and (with gradient
  accumulation) only on the last batch of the accumulation window: the strategy arms the reducer for that batch
  alone (``arm``), and a parameter is ready when the engine reports that all microbatches are summed into it
  (:meth:`GradientReducer.accumulated`, the callback the step's gradient owner hands to
  ``PipelineEngine.report_gradients``: the last microbatch at one stage; the ordered accumulation's prefix at
  several, so a contribution kept aside holds the parameter back until it is added). What is summed is what the
  optimizer would see: the gradients of the window's earlier batches (``previous``) plus this batch's.
* A parameter that no microbatch reaches in a step never becomes ready: when the step ends, ``flush`` launches every
  bucket not launched yet. Buckets are launched in one fixed order on every rank (a bucket waits for all buckets
  before it), so the replicas' collectives match whatever order their gradients arrived in. The last bucket is
  always launched by ``flush`` and carries one more number: how many surprises this rank saw (a gradient arriving
  for a parameter already sent, e.g. a module called twice per microbatch in two separate backward calls, or a
  step that turned out to weight its loss by tokens, whose gradients are divided by the batch's count only after
  the step). If any rank saw one, every rank drops the bucketed results and the step falls back to
  :func:`~lightning_mp.strategy._gradients.all_reduce_gradients` after backward, and the reducer stays disarmed from
  then on; all ranks decide this from the same all-reduced number, so they always agree.

Each bucket is one flat tensor (the gradients, then one presence flag per parameter, as in
``all_reduce_gradients``): summed over the group, divided by its size, and the averaged gradients are views into it
(DDP's ``gradient_as_bucket_view``), so no copy is made after the all-reduce. The values are those of
``all_reduce_gradients``: the same sums of the same per-rank gradients, then the same division, and a parameter with
no gradient on any replica keeps none.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from lightning_mp.strategy._roll_call import naming_failed_ranks

__all__ = ["GradientReducer", "naming_peers"]

FIRST_BUCKET_BYTES = dist._DEFAULT_FIRST_BUCKET_BYTES  # 1 MiB, DDP's first bucket: the last layers start early
BUCKET_BYTES = 25 * 1024 * 1024  # DDP's default ``bucket_cap_mb=25``


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    pending: int = 0  # parameters not ready yet in this step
    flat: torch.Tensor | None = None
    work: dist.Work | None = None
    extra: int = 0  # trailing elements after the presence flags (the surprise count, last bucket only)
    ready: set[int] = field(default_factory=set)


class GradientReducer:
    """Bucketed asynchronous all-reduce of one stage's gradients over the data-parallel group (see the Note).

    Args:
        params: this rank's parameters that get gradients, in the model's order; every replica passes the same
            (same stage, same plan).
        group: the data-parallel process group; ``size`` its number of ranks.
        previous: ``previous(param)``: the gradient of the accumulation window's earlier batches, set aside during
            the step (``GradientStash.previous``), or ``None``.
        first_bucket_bytes, bucket_bytes: bucket capacities (``None``: ``FIRST_BUCKET_BYTES``, ``BUCKET_BYTES``, DDP's
            1 MiB and 25 MiB).
        launch_in_hooks: ``False``: every bucket goes out in ``flush`` on the step's thread (no overlap). For
            CUDA at pp > 1, where the hooks run on engine threads while the NCCL data plane's communication thread
            issues on other communicators of the same GPU, which NCCL does not allow from several threads at once.
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        group: dist.ProcessGroup,
        size: int,
        previous: Callable[[nn.Parameter], torch.Tensor | None],
        first_bucket_bytes: int | None = None,
        bucket_bytes: int | None = None,
        launch_in_hooks: bool = True,
    ) -> None:
        self._group, self._size = group, size
        self._previous = previous
        self._lock = threading.Lock()
        self._launch_in_hooks = launch_in_hooks
        self._params = list(params)
        self._buckets = _make_buckets(
            [p for p in params if p.requires_grad],
            FIRST_BUCKET_BYTES if first_bucket_bytes is None else first_bucket_bytes,
            BUCKET_BYTES if bucket_bytes is None else bucket_bytes,
        )
        self._bucket_of = {p: i for i, b in enumerate(self._buckets) for p in b.params}
        self._microbatches = 0
        self._armed = False
        self._enabled = bool(self._buckets)
        self._launched = 0  # buckets 0.._launched-1 are in flight this step
        self._surprises = 0
        self.launched_during_backward = 0
        """How many buckets went out from gradient hooks (before ``flush``) since construction: a diagnostic."""

    @property
    def enabled(self) -> bool:
        """``False`` once a step fell back (the model's gradients do not arrive once per parameter and step)."""
        return self._enabled

    @property
    def bucketed_params(self) -> list[nn.Parameter]:
        """The parameters in buckets (those requiring gradients at construction): report their accumulations."""
        return list(self._bucket_of)

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    def arm(self, microbatches: int) -> bool:
        """Before a step whose gradients are final when its backward ends (the last batch of an accumulation
        window): launch buckets from the gradient hooks. Returns whether it armed (not after a fallback)."""
        self.reset()
        if self._enabled and any(p.requires_grad and p not in self._bucket_of for p in self._params):
            # A parameter unfrozen after setup (e.g. Lightning's BaseFinetuning) has no bucket: every replica
            # unfreezes alike, so every one falls back to the all-reduce after backward, which covers it.
            self._enabled = False
        self._armed = self._enabled
        self._microbatches = microbatches
        return self._armed

    def surprise(self) -> None:
        """This rank found the armed step's gradients unfit for the buckets (e.g. token-weighted): fall back."""
        with self._lock:
            self._surprises += 1

    def flush(self) -> None:
        """After the step's backward, on every rank: launch the buckets not launched yet (the last one always)."""
        if not self._armed:
            return
        with self._lock:
            self._armed = False  # late hooks from here on are not this step's
            while self._launched < len(self._buckets):
                self._launch(self._launched)

    def finish(self) -> bool:
        """Where the data-parallel all-reduce runs: wait for the buckets and put the averaged gradients in
        ``.grad``. Returns ``False`` when nothing was launched or some rank fell back (then the caller
        all-reduces the gradients as they are, and this reducer stays off)."""
        if self._launched == 0:
            return False
        if self._armed:  # `flush` was not called (the step failed): do not use a part of the step
            self.flush()
        with naming_peers("the data-parallel gradient all-reduce", self._group):
            for bucket in self._buckets:
                assert bucket.work is not None
                bucket.work.wait()
        last = self._buckets[-1]
        assert last.flat is not None
        if last.flat[-1].item() > 0:  # some rank was surprised: every rank falls back, from now on
            self._enabled = False
            self.reset()
            return False
        for bucket in self._buckets:
            flat = bucket.flat
            assert flat is not None
            flat /= self._size
            n = len(bucket.params)
            end = flat.numel() - bucket.extra
            present = flat[end - n : end].tolist()
            offset = 0
            for param, flag in zip(bucket.params, present):
                param.grad = flat[offset : offset + param.numel()].view_as(param) if flag > 0.0 else None
                offset += param.numel()
        self.reset()
        return True

    def reset(self) -> None:
        """Drop this step's buckets (waiting for any in flight, so every rank's collectives stay matched)."""
        for bucket in self._buckets:
            if bucket.work is not None:
                bucket.work.wait()
            bucket.work, bucket.flat = None, None
            bucket.pending = len(bucket.params)
            bucket.ready = set()
        self._armed = False
        self._launched = 0
        self._surprises = 0

    @property
    def armed(self) -> bool:
        """Whether this batch's gradients are to go out in buckets (between :meth:`arm` and the step's end)."""
        return self._armed

    def accumulated(self, param: nn.Parameter, summed: int) -> None:
        """A gradient was accumulated into ``param.grad`` (a gradient hook): ``summed`` microbatches, from 0 on, are in
        it. Marks ``param`` ready once all of the armed step's are, and launches the buckets that are complete."""
        if not self._armed:
            return
        index = self._bucket_of[param]
        with self._lock:
            if not self._armed:
                return
            bucket = self._buckets[index]
            if id(param) in bucket.ready or index < self._launched:
                self._surprises += 1  # a gradient after the parameter was sent
                return
            if summed < self._microbatches:
                return
            bucket.ready.add(id(param))
            bucket.pending -= 1
            last = len(self._buckets) - 1  # launched by `flush`, with the surprise count
            while self._launch_in_hooks and self._launched < last and self._buckets[self._launched].pending == 0:
                self._launch(self._launched)
                self.launched_during_backward += 1

    def _launch(self, index: int) -> None:
        """Start bucket ``index``'s all-reduce (the lock is held): gradients so far, presence flags, [surprises]."""
        bucket = self._buckets[index]
        params = bucket.params
        dtype, device = params[0].dtype, params[0].device
        chunks, flags = [], []
        for param in params:
            grad = _window_gradient(param.grad, self._previous(param))
            flags.append(float(grad is not None))
            chunks.append(grad.reshape(-1) if grad is not None else torch.zeros(param.numel(), dtype=dtype, device=device))
        bucket.extra = 1 if index == len(self._buckets) - 1 else 0
        if bucket.extra:
            flags.append(float(self._surprises))
        bucket.flat = torch.cat([*chunks, torch.tensor(flags, dtype=dtype, device=device)])
        bucket.work = dist.all_reduce(bucket.flat, group=self._group, async_op=True)
        self._launched = index + 1


def naming_peers(what: str, group: dist.ProcessGroup) -> contextlib.AbstractContextManager[None]:
    """Re-raise a collective over ``group`` that failed as an error naming the global ranks that died or stopped
    answering, found by a roll call (see [Note: roll call after a failed collective] in ``_roll_call.py``).

    Raises:
        RankFailedError: ``what`` over ``group`` failed on this rank, naming the ranks of ``group`` that did not
            answer (every other rank of ``group`` where the process answers no roll calls), from the backend's error.
    """
    return naming_failed_ranks(what, dist.get_process_group_ranks(group))


def _window_gradient(grad: torch.Tensor | None, previous: torch.Tensor | None) -> torch.Tensor | None:
    """What ``GradientStash.apply`` will leave in ``.grad``: the window's earlier gradient plus this step's."""
    if previous is None:
        return grad
    return previous if grad is None else previous + grad


def _make_buckets(params: list[nn.Parameter], first_bytes: int, cap_bytes: int) -> list[_Bucket]:
    """Reverse parameter order, one dtype and device per bucket; per dtype and device the first bucket holds up to
    ``first_bytes``, the next ones ``cap_bytes`` (a parameter larger than the cap gets a bucket of its own), as DDP's
    ``compute_bucket_assignment_by_size``."""
    buckets: list[_Bucket] = []
    open_buckets: dict[tuple, tuple[_Bucket, int, int]] = {}  # key -> (bucket, bytes, cap)
    for param in reversed(params):
        key = (param.dtype, param.device)
        nbytes = param.numel() * param.element_size()
        bucket, size, cap = open_buckets.get(key, (None, 0, first_bytes))
        if bucket is not None and size + nbytes > cap:
            bucket, cap = None, cap_bytes
        if bucket is None:
            bucket, size = _Bucket([]), 0
            buckets.append(bucket)
        bucket.params.append(param)
        open_buckets[key] = (bucket, size + nbytes, cap)
    for bucket in buckets:
        bucket.pending = len(bucket.params)
    return buckets
