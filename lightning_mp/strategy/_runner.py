"""The step runner: a Lightning step hook run per microbatch through the pipeline engine, its outputs merged.

Every rank splits the batch (all stages hold it, so a bad batch fails everywhere before any message); the
driver (pipeline rank 0) runs the hook per microbatch, backward included when training, and sends the step's
summary (merged output, reduced logs, token count) to the other stages, which serve its remote calls meanwhile;
then every rank replays the logs (see [Note: logging in a pipelined step] in ``_logs.py``).

[Note: token-weighted losses] A loss that is a mean over a data-dependent count (tokens with ``labels != -100``
in a masked LM, unpadded positions) is not the mean of its microbatches' means: one process divides the sum over
the batch by the batch's count. A step may therefore return ``{"loss": mean, "num_tokens": n}``, ``mean`` being
the mean over the microbatch's ``n`` counted elements (as Megatron's ``calculate_per_token_loss`` and torchtitan's
global token normalisation). Each microbatch then backpropagates ``mean * n / accumulate_grad_batches`` (its sum),
and once every microbatch is done each stage divides the step's gradients by the batch's total ``n`` (sent to it
with the step summary), so gradients, the returned loss and mean-reduced logged values all weigh microbatches by
``n / sum(n)``: one process's maths on the batch. A microbatch with ``n == 0`` runs no backward. Without
``num_tokens`` the loss is the mean of the microbatch losses. Data-parallel replicas then average their
gradients as under ``ddp`` (each replica's batch is normalised by its own count).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from lightning_mp.pipeline import (
    MicrobatchSplitError,
    PipelineEngine,
    RemoteValue,
    materialize,
    merge_microbatches,
    owner_computes_loss,
    split_batch,
)
from lightning_mp.strategy._logs import LogRecorder, StepSummary, replay_logs
from lightning_mp.strategy._metrics import load_metric_log
from lightning_mp.strategy._precision import loss_scale_of

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import Precision

    from lightning_mp.strategy._gradients import StepGradients

__all__ = ["LossScale", "StepRunner", "steps_optimizer"]


@dataclass(frozen=True)
class LossScale:
    """What a microbatch's loss is multiplied by before its backward (see ``scaled_loss``).

    Attributes:
        microbatches: microbatches per batch.
        accumulate: Lightning's ``accumulate_grad_batches``.
        grad_scale: the GradScaler's scale under ``16-mixed`` (see [Note: GradScaler over stages]), else 1.
    """

    microbatches: int
    accumulate: int
    grad_scale: float = 1.0


class StepRunner:
    """Runs ``training_step`` / ``validation_step`` / ``test_step`` / ``predict_step`` per microbatch.

    Args:
        microbatches: microbatches per batch (``SMPConfig.microbatches``).
        non_split_inputs: batch entries given whole to every microbatch (``SMPConfig.non_split_inputs``).
    """

    def __init__(self, microbatches: int, non_split_inputs: tuple[str | int, ...]) -> None:
        self.microbatches = microbatches
        self.non_split_inputs = non_split_inputs
        self._engine: PipelineEngine | None = None
        self._module: Any = None
        self._num_stages = 1
        self._log_sync_group: Any = None
        self._warned_eval_split = False
        self._warned_replicated = False  # a batch in which nothing splits (see `split`)

    def attach(self, engine: PipelineEngine, module: Any, num_stages: int, log_sync_group: Any | None) -> None:
        """Run steps of ``module`` on ``engine`` (at every setup); ``log_sync_group``: the group over which
        ``sync_dist=True`` reduces logged values (the replicas of this rank, under model parallelism), or ``None``
        for Lightning's default."""
        self._engine, self._module, self._num_stages = engine, module, num_stages
        self._log_sync_group = log_sync_group

    def detach(self) -> None:
        """Let go of the engine, the module and the log group (at exit, see ``SMPStrategy._release_process_groups``)."""
        self._engine, self._module, self._log_sync_group = None, None, None

    def run(
        self, hook: str, context: Callable[[], Any], args: tuple, kwargs: dict, loss_scale: LossScale | None = None
    ) -> StepSummary:
        """Run ``hook`` per microbatch through the pipeline; every rank gets the step's summary.

        A ``loss_scale`` makes it a training step (backward per microbatch).
        """
        engine, module = self._engine, self._module
        assert engine is not None, "attach() runs at setup"
        batch, rest = args[0], args[1:]
        microbatches = self.split(batch, training=loss_scale is not None)
        step = getattr(module, hook)
        recorder = LogRecorder(module)

        def step_fn(microbatch: Any, index: int) -> Any:
            with recorder.microbatch(index), context():
                return step(microbatch, *rest, **kwargs)

        with engine.session(hook, rng_key=_rng_key(module.trainer, hook, rest)) as session:
            if engine.is_driver:
                with recorder:
                    outputs = session.drive(
                        step_fn,
                        microbatches,
                        loss_fn=partial(scaled_loss, scale=loss_scale),
                        backward=loss_scale is not None,
                        on_finish=recorder.fetch_microbatch,
                    )
                summary = _summarize(outputs, recorder, send_metric_states=self._num_stages > 1)
                session.finish(summary)
            else:
                summary = session.serve()
                for state in summary.metric_states:  # see [Note: metrics in a pipelined step]
                    load_metric_log(module, state)
        replay_logs(module, summary.logs, self._log_sync_group)
        return summary

    def train(
        self, trainer: pl.Trainer, gradients: StepGradients, params: list, precision: Precision, args: tuple,
        kwargs: dict,
    ) -> StepSummary:
        """One training batch: its pipelined step (forward and backward of every microbatch) between the gradient
        owner's ``begin`` and ``end`` (see [Note: pipelined step in Lightning] in ``_gradients.py``)."""
        gradients.begin(
            params,
            first_in_window=trainer.fit_loop.epoch_loop.batch_idx % trainer.accumulate_grad_batches == 0,
            last_in_window=steps_optimizer(trainer),
            microbatches=self.microbatches,
        )
        summary = None
        try:
            scale = LossScale(self.microbatches, trainer.accumulate_grad_batches, loss_scale_of(precision))
            summary = self.run("training_step", precision.train_step_context, args, kwargs, loss_scale=scale)
        finally:
            gradients.end(summary)
        return summary

    def split(self, batch: Any, training: bool) -> list[Any]:
        """Split on every rank (all stages hold the batch), so a bad batch fails everywhere before any message.

        Raises:
            MicrobatchSplitError: a training batch that does not split into ``microbatches`` (an evaluation batch
                runs whole, with a warning).
        """
        try:
            split = split_batch(batch, self.microbatches, non_split_inputs=self.non_split_inputs)
        except MicrobatchSplitError:
            if training:
                raise
            if not self._warned_eval_split:
                rank_zero_warn(
                    f"An evaluation batch does not split into `microbatches={self.microbatches}`; running"
                    " such batches as one microbatch (results are the same, only slower). Use `drop_last=True` or a"
                    " divisible batch size to avoid this."
                )
                self._warned_eval_split = True
            return [batch]
        if not split.split_any and self.microbatches > 1 and not self._warned_replicated:
            rank_zero_warn(
                f"Nothing in this batch splits into `microbatches={self.microbatches}`: every microbatch gets"
                f" the whole batch ({', '.join(split.replicated) or 'an empty batch'}), so each one computes it all."
                " Return tensors with the batch on dim 0, or lists/tuples of one value per sample, or use"
                " microbatches=1."
            )
            self._warned_replicated = True
        return split.parts


def steps_optimizer(trainer: pl.Trainer) -> bool:
    """Whether Lightning steps the optimizer after the current training batch (the accumulation window ends)."""
    epoch_loop = trainer.fit_loop.epoch_loop
    should_accumulate = getattr(epoch_loop, "_should_accumulate", None)
    if should_accumulate is None:  # another Lightning version: only without accumulation is it certain
        return trainer.accumulate_grad_batches == 1
    return not should_accumulate()


def _rng_key(trainer: Any, hook: str, rest: tuple) -> tuple:
    """The step's name for its random streams: the same on every rank, layout and run (and after a resume)."""
    return (hook, trainer.current_epoch, trainer.global_step, tuple(a for a in rest if isinstance(a, int)))


def detach_cpu(obj: Any) -> Any:
    """Every tensor in ``obj`` detached and on the CPU (so it can be sent between stages and kept)."""
    return apply_to_collection(obj, torch.Tensor, lambda t: t.detach().cpu())


def _num_tokens(output: Any) -> float | None:
    if isinstance(output, Mapping) and "num_tokens" in output:
        n = output["num_tokens"]
        n = float(n.item() if isinstance(n, Tensor) else n)
        if n < 0:
            raise ValueError(f"A step returned num_tokens={n}; it must count elements, >= 0.")
        return n
    return None


def scaled_loss(output: Any, scale: LossScale | None) -> Tensor | RemoteValue | None:
    """The tensor a microbatch backpropagates: loss x grad_scale / (microbatches x accumulate), or, token-weighted
    (see [Note: token-weighted losses]), loss x n x grad_scale / accumulate; a handle where the loss is one its
    owner computes (the same ops, run there)."""
    if scale is None or output is None:
        return None
    # a loss taken on the logits' stage is a handle ([Note: the loss where the logits are]); one its owner computes is
    # scaled there too and fetched with its backward, in one exchange; any other handle is fetched here
    if owner_computes_loss(output):
        loss, n = output, None
    else:
        output = materialize(output) if type(output) is RemoteValue else output
        loss = output.get("loss") if isinstance(output, Mapping) else output
        loss = loss if owner_computes_loss(loss) else materialize(loss)
        if not owner_computes_loss(loss) and not isinstance(loss, Tensor):  # ``isinstance`` would fetch a handle
            raise TypeError(
                "training_step must return a loss tensor or a dict with 'loss' under the 'smp' strategy, got"
                f" {type(loss).__name__}."
            )
        n = _num_tokens(output)
    if n is None:
        return loss * scale.grad_scale / (scale.microbatches * scale.accumulate)
    return None if n == 0 else loss * (n * scale.grad_scale) / scale.accumulate


def _summarize(outputs: list[Any], recorder: LogRecorder, send_metric_states: bool) -> StepSummary:
    """Merge the microbatch outputs and logged values; token-weighted when the step returns ``num_tokens``.
    ``send_metric_states``: other stages exist, to which the states of unlogged updated metrics go."""
    counts = [_num_tokens(o) for o in outputs]
    states = recorder.unlogged_metric_states() if send_metric_states else []
    if all(n is None for n in counts):
        return StepSummary(merge_microbatches([detach_cpu(o) for o in outputs]), recorder.reduced(), metric_states=states)
    if any(n is None for n in counts):
        raise ValueError(
            "Some microbatches returned `num_tokens` and others did not; a step that weights its loss by tokens must"
            " return {'loss': ..., 'num_tokens': ...} for every microbatch."
        )
    total = sum(counts)
    merged = merge_microbatches([detach_cpu(o) for o in outputs])
    losses = [detach_cpu(o["loss"]).to(torch.float64) for o in outputs]
    if total > 0:
        weighted = sum(loss * n for loss, n in zip(losses, counts) if n > 0) / total
    else:
        weighted = torch.tensor(float("nan"), dtype=torch.float64)
    dtype = outputs[0]["loss"].dtype
    merged["loss"] = weighted.to(dtype if dtype.is_floating_point else torch.float32)
    return StepSummary(merged, recorder.reduced(weights=counts), num_tokens=total, metric_states=states)
