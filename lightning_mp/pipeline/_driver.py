"""The driver of one step: pipeline stage 0 runs the user's step once per microbatch.

:class:`Driver` owns the microbatch side of a session on stage 0: the microbatch threads (at most
``active_microbatches`` in flight), each running a microbatch's forward (the user's step function) and then its
backward under the compute token with the priorities of the schedule (``_scheduler.py``), the waves of the
``"simple"`` (GPipe) schedule, telling the other stages when a microbatch is done, and the summary that ends the
step everywhere.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_mp.pipeline._core import SessionCore
from lightning_mp.pipeline._handles import RemoteValue, materialize, recording_loss_scalings
from lightning_mp.pipeline._messages import POLL_S, Kind, Phase, StepEnd, Task, as_task
from lightning_mp.pipeline._outputs import OutputStore
from lightning_mp.pipeline._state import OrderedStateUpdates
from lightning_mp.pipeline._zero_bubble import run_backward

__all__ = ["Driver"]


@dataclass(frozen=True)
class _Step:
    """What every microbatch of one ``drive`` runs, and the grad mode it runs in."""

    step_fn: Callable[[Any, int], Any]
    microbatches: Sequence[Any]
    loss_fn: Callable[[Any], torch.Tensor | None]
    backward: bool
    outputs: list[Any]
    grad_enabled: bool
    inference: bool
    on_finish: Callable[[int], None] | None


class Driver:
    """Runs the microbatches of one step on stage 0.

    Args:
        core: the step's shared core.
        store: this rank's store of remote outputs (a finished microbatch's are dropped).
        state_updates: ordered buffer updates, finalised before a microbatch's backward.
        schedule: ``"interleaved"``, ``"zero_bubble"`` or ``"simple"``.
        active_microbatches: at most this many microbatches in flight.
        remote_handles: other stages keep values of a microbatch until told it is done.
        backward: runs a backward (``_zero_bubble.run_backward``, or ``WeightPasses.backward`` under
            ``"zero_bubble"``, which defers its weight pass).
    """

    def __init__(
        self,
        core: SessionCore,
        store: OutputStore,
        state_updates: OrderedStateUpdates,
        *,
        schedule: str,
        active_microbatches: int,
        remote_handles: bool,
        backward: Callable[..., None] = run_backward,
    ) -> None:
        self.core, self.store, self.state_updates = core, store, state_updates
        self.backward = backward
        self.schedule = schedule
        self.active_microbatches = active_microbatches
        self.remote_handles = remote_handles

    def drive(
        self,
        step_fn: Callable[[Any, int], Any],
        microbatches: Sequence[Any],
        *,
        loss_fn: Callable[[Any], torch.Tensor | None],
        backward: bool,
        on_finish: Callable[[int], None] | None = None,
    ) -> list[Any]:
        """Run ``step_fn(microbatch, index)`` for every microbatch (and backward of ``loss_fn(output)``).

        ``on_finish(index)`` runs when microbatch ``index`` has finished (after its backward), while the other
        stages still hold its outputs: the last moment its handles can be fetched.

        Returns:
            The step outputs, in microbatch order.

        Raises:
            PipelineError: if any microbatch or any stage fails, naming the stage.
        """
        step = _Step(step_fn, microbatches, loss_fn, backward, [None] * len(microbatches),
                     torch.is_grad_enabled(), torch.is_inference_mode_enabled(), on_finish)
        if not self.core.peers:  # one stage: nothing to overlap, run inline
            for index in range(len(microbatches)):
                self._run(step, index, None)
            return step.outputs
        self._run_threads(step, len(microbatches))
        return step.outputs

    def finish(self, summary: Any) -> None:
        """Send ``summary`` (e.g. the step's mean loss and logged values) to every other stage."""
        self.core.finished = True
        for peer in self.core.peers:
            self.core.send(self.core.envelope(Kind.END, body=StepEnd(ok=True, value=summary)), peer)

    def _run(self, step: _Step, index: int, wave: _WaveBarrier | None) -> None:
        """One microbatch: its forward, then (if it has a loss) its backward, each holding the compute token."""
        token = self.core.token
        forward = Task(index, Phase.FORWARD, ident=("mb", index, Phase.FORWARD))
        with torch.inference_mode(step.inference), torch.set_grad_enabled(step.grad_enabled), as_task(forward):
            token.acquire(self.core.priority(forward), self.core.grant_key(forward))
            try:
                forward_result = self._forward(step, index, wave)
                if forward_result is not None:
                    self._backward(step, index, *forward_result, wave)
            except BaseException as err:
                # failed before the release sends the calls this microbatch held ([Note: coalesced one-way calls]
                # in ``_core.py``): the microbatch that takes the token next must not start sending its own
                self.core.fail(err)
                raise
            finally:
                token.release()  # no-op when the backward released it

    def _forward(self, step: _Step, index: int, wave: _WaveBarrier | None) -> tuple[Any, list | None] | None:
        """The step function and the loss, with the handles its backward's exchange fetches (``None`` where it is
        fetched here); ``None`` (the microbatch finished) when there is no backward to run."""
        step.outputs[index] = step.step_fn(step.microbatches[index], index)
        with recording_loss_scalings():
            loss = step.loss_fn(step.outputs[index]) if step.backward else None
        if loss is None:
            step.outputs[index] = self._finish_microbatch(step, index, step.outputs[index])
            if step.backward and wave is not None:  # no backward here (num_tokens == 0): the wave's other
                self.core.token.release()  # backwards still wait for this forward to arrive
                wave.arrive_and_wait()
            return None
        chain = _loss_chain(loss, step)
        if chain is not None:  # fetched with its backward ([Note: the loss's fetch and backward in one exchange] in
            return loss, chain  # ``_caller.py``); so are the outputs, after it
        loss = materialize(loss)
        step.outputs[index] = materialize(step.outputs[index])
        return loss, None

    def _backward(self, step: _Step, index: int, loss: Any, chain: list | None, wave: _WaveBarrier | None) -> None:
        token, back = self.core.token, Task(index, Phase.BACKWARD, ident=("mb", index, Phase.BACKWARD))
        if wave is not None:  # "simple": every forward of the wave first
            token.release()
            wave.arrive_and_wait()
            self.core.raise_if_failed()
            with as_task(back):
                token.acquire(self.core.priority(back), self.core.grant_key(back))
        else:  # straight on to the backward unless a better task waits (no release/re-acquire race)
            token.handover(self.core.priority(back), self.core.grant_key(back))
        with as_task(back):
            try:
                self.state_updates.finalize(index)
                if chain is not None:
                    loss = loss._rv_session.fetch_with_backward(chain)
                    step.outputs[index] = materialize(step.outputs[index])
                self.backward([loss], [None])
                self._finish_microbatch(step, index, None)
            finally:
                token.release()

    def _run_threads(self, step: _Step, count: int) -> None:
        """Run microbatches ``0 .. count-1`` on ``active_microbatches`` threads, in order.

        Each thread runs one microbatch after the other: when one finishes, the thread that ran it starts the
        next itself (no hand-off to a starting thread), so at most ``active_microbatches`` are in flight.
        "simple" makes waves of that many, whose forwards all finish before their backwards start.
        """
        cap = max(1, min(self.active_microbatches, count))
        simple = self.schedule == "simple"
        check = self.core.raise_if_failed
        waves = [_WaveBarrier(min(cap, count - s), check) if simple else None for s in range(0, count, cap)]
        work = iter([(index, waves[index // cap]) for index in range(count)])
        lock = threading.Lock()

        def worker() -> None:
            self.core.enter_thread()
            while True:
                with lock:
                    item = next(work, None) if self.core.error is None else None
                if item is None:
                    return
                index, wave = item
                try:
                    self._run(step, index, wave)
                except BaseException as err:
                    self.core.fail(err)
                    for barrier in waves:
                        if barrier is not None:
                            barrier.breaks()

        threads = [threading.Thread(target=worker, daemon=True, name=f"smp-mb-{k}") for k in range(cap)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self.core.raise_if_failed()

    def _finish_microbatch(self, step: _Step, index: int, output: Any) -> Any:
        """Fetch the remote values a step returned, run ``on_finish``, then let every stage drop the microbatch's
        outputs."""
        output = materialize(output)
        if step.on_finish is not None:
            step.on_finish(index)
        if self.remote_handles:
            self.core.tell_done(index)
            self.store.free(index)
        return output


def _loss_chain(loss: Any, step: _Step) -> list[RemoteValue] | None:
    """The handles a training step's loss is fetched with in its backward's exchange, or ``None`` (no such loss)."""
    if type(loss) is not RemoteValue or step.inference or not step.grad_enabled:
        return None
    return loss._rv_loss_chain()


class _WaveBarrier:
    """All forwards of a wave finish before any of its backwards start (the "simple" / GPipe schedule)."""

    def __init__(self, parties: int, check_failed: Callable[[], None]) -> None:
        self._cv = threading.Condition()
        self._parties = parties
        self._arrived = 0
        self._broken = False
        self._check_failed = check_failed

    def arrive_and_wait(self) -> None:
        with self._cv:
            self._arrived += 1
            self._cv.notify_all()
            while self._arrived < self._parties and not self._broken:
                self._cv.wait(POLL_S)
                self._check_failed()

    def breaks(self) -> None:
        with self._cv:
            self._broken = True
            self._cv.notify_all()
