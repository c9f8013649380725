"""The one owner of an optimizer step's gradients: :class:`StepGradients`.

[Note: pipelined step in Lightning] The engine runs forward *and* backward of every microbatch inside
``SMPStrategy.training_step`` (as DeepSpeed's pipeline engine does in Lightning). Lightning's closure then
calls ``zero_grad`` and ``backward``: so that ``zero_grad`` cannot wipe the pipeline's gradients, the step's
gradient owner (:class:`StepGradients`, through its :class:`GradientStash`) moves them aside during the step and
``SMPStrategy.backward`` adds them back, exactly where an eager ``loss.backward()`` would have accumulated them;
the reductions across ranks then run once per optimizer step (see [Note: a step's reductions] below). Logged
values: see [Note: logging in a pipelined step] in ``_logs.py``.

[Note: a step's reductions] One optimizer step's gradients go through these stages, in this order; each says
whether it sums or averages, and why. A replicated or partial gradient reduced with the wrong one of the two keeps
the loss close to one process's for many steps while a small parameter drifts, so the rule is written here once.

1. *Microbatches, inside a stage* (autograd, ordered by the engine: [Note: ordered gradient accumulation] in
   ``pipeline/_grads.py``): **sum**, in microbatch order. Each microbatch's loss was already multiplied by
   ``1 / (microbatches x accumulate_grad_batches)`` before its backward (token-weighted: by ``n / accumulate``, and
   the step's gradients are divided by the batch's total ``n`` in :meth:`StepGradients.end`, see [Note:
   token-weighted losses] in ``_runner.py``), so the sum is the gradient of the batch's mean loss.
2. *Batches of one accumulation window* (:class:`GradientStash`): **sum** of the window's earlier gradients and
   this batch's, exactly where ``loss.backward()`` would accumulate them.
3. *Tensor parallel* (``tp`` group, only parameters marked ``allreduce_grad``): a replicated parameter that runs
   on sharded activations (per-head q/k norms, LayerNorms under sequence parallelism) holds on each tp rank the
   gradient of its shard's share of the loss: a *partial* gradient, so it is **summed** (transformers'
   ``replicated_with_grad_allreduce``; [Note: partial gradients] in ``nn/_hf.py``); averaging would divide it by
   tp. Every built-in module marks ``"sum"``; ``"mean"`` (offered by ``parameter_creation_scope``) averages, for a
   parameter whose gradient on each tp rank is already a full one. Sharded parameters own their slice's full
   gradient and unmarked replicated ones hold equal full gradients on every tp rank: neither is reduced.
4. *Data parallel* (``dp`` group, every parameter): **average**. Each replica's gradient is that of the mean loss
   over its own batch; replicas hold equal batch sizes, so the mean of their gradients is the gradient of the
   global batch's mean, as under DDP. Bucketed during backward (:class:`~lightning_mp.strategy._reducer.
   GradientReducer`, dp > 1 without tp) or after it (:func:`all_reduce_gradients`): the same sums, then the same
   division. Under sharded data parallelism FSDP2 does it instead, once per optimizer step: a reduce-scatter over
   the shard group (and, for HSDP, an all-reduce across replicas), averaged over dp, into each rank's shard of the
   gradient ([Note: sharded stages] in ``_fsdp.py``); step 5 then runs before it, on the gathered copies.
5. *Replicated tied weights* (``tie`` groups, [Note: replicated tied weights] in ``_tied.py``): **sum**. Each
   stage's copy holds the gradient of that stage's uses only; one process's gradient of a shared parameter is the
   sum over its uses. After step 4, so every copy gets the same bits; under sharded data parallelism before it, on the
   gathered copies: each copy's replicas then reduce-scatter equal sums, so the shards agree as well.
6. *Clipping* (:meth:`StepGradients.clip`): the 2-norm of the whole model counts each logical parameter once: the
   squares of FSDP's gradient shards are **summed** over their shard group first; the squares of sharded gradients
   are **summed** over tp, those of replicated ones are taken once (their sum over
   tp divided by tp: equal on every tp rank), tied copies are counted on their lowest stage only, and the total
   is **summed** over the pipeline stages.

Steps 3 to 5 run once per optimizer step, on the window's last batch (:meth:`StepGradients.finish`), in this order
on every rank, so every group's collectives match.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_mp.strategy._fsdp import ShardedStage, local_tensor
from lightning_mp.strategy._reducer import GradientReducer, naming_peers
from lightning_mp.strategy._tied import TiedWeights
from lightning_mp.topology import ProcessGroups
from lightning_mp.tp import reduce_replicated_grads, shard_spec

if TYPE_CHECKING:
    from lightning_mp.pipeline import PipelineEngine
    from lightning_mp.strategy._logs import StepSummary

__all__ = ["GradientStash", "StepGradients", "all_reduce_gradients", "global_grad_norm"]


class StepGradients:
    """Owner of one optimizer step's gradients: stash, dp reducer, tp, dp and tied reductions, norm and clipping.

    The strategy calls, per training batch, :meth:`begin` before the pipelined step, :meth:`end` after it and
    :meth:`apply` in ``backward``; on the batch that ends an accumulation window, :meth:`finish` (in ``backward``,
    or after the closure when backward did not run) and :meth:`clip` under ``gradient_clip_algorithm="norm"``. The
    reductions and their order are in [Note: a step's reductions].

    Args:
        model: this rank's model (its stage's parameters; the others' are freed).
        groups: the run's process groups (``lightning_mp.topology``); ``groups.reducer`` switches the bucketed
            all-reduce on.
        tied: this rank's replicated tied parameters.
        engine: reports each accumulation into a parameter's gradient to the bucketed all-reduce
            (``PipelineEngine.report_gradients``).
        device: where the gradient norm is reduced.
        launch_in_hooks: see :class:`~lightning_mp.strategy._reducer.GradientReducer`; ``None``: yes, except on a
            GPU with several stages (the hooks would run on engine threads beside the NCCL data plane's).
        sharded: this stage under FSDP2 (``sharded_data_parallel_degree > 1``): step 4 of [Note: a step's
            reductions] is then its reduce-scatter (see [Note: sharded stages] in ``_fsdp.py``); else ``None``.
    """

    def __init__(
        self,
        model: nn.Module,
        groups: ProcessGroups,
        tied: TiedWeights,
        engine: PipelineEngine,
        device: torch.device,
        launch_in_hooks: bool | None = None,
        sharded: ShardedStage | None = None,
    ) -> None:
        if launch_in_hooks is None:
            launch_in_hooks = device.type != "cuda" or groups.topology.pipeline_parallel_degree == 1
        self._model, self._groups, self._tied, self._device = model, groups, tied, device
        self._sharded = sharded
        self._stash = GradientStash()
        self.reducer: GradientReducer | None = None
        """The bucketed dp all-reduce (see [Note: overlapped gradient all-reduce]), or ``None``."""
        if groups.reducer is not None:
            self.reducer = GradientReducer(
                list(model.parameters()),
                groups.reducer,
                groups.topology.data_parallel_degree,
                previous=self._stash.previous,
                launch_in_hooks=launch_in_hooks,
            )
            engine.report_gradients(self.reducer.bucketed_params, self.reducer.accumulated, lambda: self.reducer.armed)
        self._armed = False
        self._final = False  # this optimizer step's gradients are reduced (steps 3 to 5 ran)

    @property
    def syncs(self) -> bool:
        """Whether an optimizer step reduces gradients across ranks (dp > 1, tp > 1 or replicated tied weights)."""
        topology = self._groups.topology
        return topology.data_parallel_degree > 1 or topology.tensor_parallel_degree > 1 or self._tied.active

    def step_parameters(self) -> list[nn.Parameter]:
        """The parameters a training batch's gradients go to: this stage's; under sharded data parallelism
        ``ShardedStage.step_parameters`` (gathered, or per unit the shards FSDP reduce-scatters into)."""
        if self._sharded is not None:
            return self._sharded.step_parameters()
        return list(self._model.parameters())

    def begin(
        self, params: Iterable[nn.Parameter], *, first_in_window: bool, last_in_window: bool, microbatches: int
    ) -> None:
        """Before a training batch's pipelined step: set the window's gradients aside (on its first batch: drop
        them, Lightning's ``zero_grad`` would) and, on its last batch, arm the bucketed all-reduce: its gradients are
        final when backward ends, so buckets go out during it."""
        self._final = False
        self._stash.begin(params, keep_previous=not first_in_window)
        self._armed = self.reducer is not None and last_in_window and self.reducer.arm(microbatches)

    def end(self, summary: StepSummary | None) -> None:
        """After the pipelined step (``summary`` ``None``: it raised): launch the buckets not launched yet, take the
        step's gradients aside and put the window's back, divide the step's by a token-weighted batch's count."""
        try:
            if self._armed and summary is not None:
                assert self.reducer is not None
                if summary.num_tokens is not None:  # divided by the count below, after the buckets went out
                    self.reducer.surprise()
                self.reducer.flush()
        finally:
            self._stash.end()
            if self._sharded is not None:
                self._sharded.end_step()
        if summary is not None and summary.num_tokens is not None and self._sharded and self._sharded.per_unit:
            raise ValueError(
                "A token-weighted loss (the step returned `num_tokens`) with reshard_after_forward='always': FSDP "
                "reduce-scattered each microbatch's gradients before the step could divide by its replica's count, "
                "so the result would not be the average of the replicas' token means. Use "
                "reshard_after_forward='never' (the default)."
            )
        if summary is not None and summary.num_tokens:  # see [Note: token-weighted losses]
            self._stash.scale(1.0 / summary.num_tokens)

    def apply(self) -> None:
        """In ``backward``: accumulate the step's gradients into ``.grad``, as ``loss.backward()`` would have."""
        self._stash.apply()

    def finish(self) -> None:
        """Reduce the window's gradients on every rank, once per optimizer step: tp, then dp, then tied copies
        (steps 3 to 5 of [Note: a step's reductions]). A no-op when they are reduced already or nothing syncs."""
        if self._final or not self.syncs:
            return
        topology = self._groups.topology
        params = list(self._model.parameters())
        if topology.tensor_parallel_degree > 1:
            reduce_replicated_grads(params, self._groups.tp)
        if self._sharded is not None:  # tied copies summed, then FSDP's reduce-scatter (and HSDP all-reduce)
            self._tied.rebind(self._model)  # the gathered copies
            self._tied.reduce_gradients()  # every copy's replicas then average the same sums: the same bits
            self._sharded.reduce_scatter()
            self._tied.rebind(self._model)  # the shards, for the norm
        else:
            if topology.data_parallel_degree > 1 and (self.reducer is None or not self.reducer.finish()):
                all_reduce_gradients(params, self._groups.dp, topology.data_parallel_degree)  # not bucketed: now
            self._tied.reduce_gradients()  # after the dp average, so every copy gets the same bits (_tied.py)
        self._final = True

    def reducing(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        """``closure`` (Lightning's: step, zero_grad, backward), then :meth:`finish`: a no-op when backward reduced
        the gradients, which it does unless it did not run (a step that returned ``None``). ``closure`` itself when
        nothing syncs."""
        if not self.syncs:
            return closure

        def closure_then_reduce() -> Any:
            result = closure()
            self.finish()
            return result

        return closure_then_reduce

    def clip(self, optimizer: Optimizer, clip_val: float | int) -> None:
        """``gradient_clip_algorithm="norm"`` with the whole model's norm (step 6 of [Note: a step's reductions])."""
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        total = global_grad_norm(self._tied.counted_once(params), self._groups, self._device)
        total = total.to(params[0].dtype if params else torch.float32)
        if self._sharded is None:
            torch.nn.utils.clip_grads_with_norm_(params, clip_val, total)
            return
        coefficient = torch.clamp(clip_val / (total + 1e-6), max=1.0)  # clip_grads_with_norm_'s, on the shards
        for p in params:
            local_tensor(p.grad).mul_(coefficient)


class GradientStash:
    """Keep the pipeline's gradients away from Lightning's ``zero_grad`` (see [Note: pipelined step in Lightning]
    above)."""

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
        chunks = [
            p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), dtype=dtype, device=device)
            for p in group_params
        ]
        bucket = torch.cat([*chunks, flags])
        with naming_peers("the data-parallel gradient all-reduce", group):
            dist.all_reduce(bucket, group=group)
        bucket /= size
        offset = 0
        present = bucket[-len(group_params) :].tolist()
        for p, flag in zip(group_params, present):
            reduced = bucket[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
            p.grad = reduced.clone() if flag > 0.0 else None


def global_grad_norm(params: list[nn.Parameter], groups: ProcessGroups, device: torch.device) -> torch.Tensor:
    """The 2-norm of the whole model's gradient, each logical parameter counted once (step 6 of [Note: a step's
    reductions]); ``params`` without the tied copies counted elsewhere. A 0-dim float64 tensor on ``device``."""
    squares = torch.zeros(2, dtype=torch.float64, device=device)  # (tp-sharded, tp-replicated)
    shards = torch.zeros(2, dtype=torch.float64, device=device)  # the same, of FSDP's DTensor shards
    for p in params:
        if p.grad is not None:
            grad = p.grad.detach()
            target = shards if isinstance(grad, DTensor) else squares
            target[0 if shard_spec(p) is not None else 1] += local_tensor(grad).to(torch.float64).pow(2).sum()
    if groups.shard_mesh is not None:  # the squares of one dp_shard group's shards add up to the whole's
        dist.all_reduce(shards, group=groups.shard_mesh.get_group(groups.shard_mesh.ndim - 1))
        squares += shards
    tp_size = dist.get_world_size(groups.tp)
    if tp_size > 1:
        dist.all_reduce(squares, group=groups.tp)
        squares[1] /= tp_size
    total = squares.sum().reshape(1)
    if dist.get_world_size(groups.pp) > 1:
        dist.all_reduce(total, group=groups.pp)
    return total.sqrt().reshape(())
