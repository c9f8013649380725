"""Preemption (SIGTERM), SLURM's requeue signal and Ctrl-C (SIGINT) in every rank of an ``smp`` run.

[Note: SIGTERM at a step boundary] Lightning's answer to SIGTERM (what Lightning users expect): every rank stops
at a batch boundary with ``SIGTERMException``, ``on_exception`` runs (``OnExceptionCheckpoint`` saves there: the
way to ask for a checkpoint on preemption) and the process exits with status 0; ``trainer.received_sigterm`` says
it happened. Lightning 2.6 gets there by a ``dist.broadcast`` from inside its SIGTERM handler (a collective at
whatever point the main thread was interrupted) and by a broadcast of global rank 0's flag at each training batch;
its other checks read each rank's own flag. Under a pipeline the handler's broadcast meets the engine's messages
or another collective: measured, a SIGTERM to the launcher of a 2-stage run aborted rank 1 in gloo ("Received
data size doesn't match expected size") and no checkpoint was written. Here the handler only records the signal
(and forwards it to the ranks this process started, as Lightning's does); every training step of every rank first
agrees on it with one all-reduce (MAX) over the world, and on agreement sets ``received_sigterm`` on every rank in
the same step. That step runs to its end; Lightning's own check then raises ``SIGTERMException`` on every rank at
the same boundary (after the training step), where ``on_exception`` can save collectively. A rank that alone
received the signal stops the whole job the same way. Only training steps agree: every rank runs the same training
batches (Lightning itself broadcasts a flag at each one), while evaluation and predict loaders may give replicas
different numbers of batches (predict's sampler does not repeat samples), so a collective there could wait for a
rank that has finished; a SIGTERM during validation is acted on at the next training step, and one during
``validate``/``test``/``predict`` alone is not (Lightning's evaluation loops do not check the flag either).

[Note: SLURM requeue at a step boundary] Under ``SLURMEnvironment(auto_requeue=True)`` (Lightning's default on
SLURM) the requeue signal (SIGUSR1, e.g. ``#SBATCH --signal=USR1@90``) makes Lightning's handler save
``hpc_ckpt_N.ckpt`` from inside the handler and run ``scontrol requeue`` on global rank 0. Under ``smp`` that save is
collective (a DCP folder written by every rank): from inside a handler it would meet the engine's messages as the
SIGTERM broadcast did. Here the handler only records the signal; the same per-step agreement (one all-reduce, now of
two flags) tells every rank in the same training step, and there, before the step runs, every rank calls
Lightning's own handler: the loggers are finalised, ``hpc_ckpt_N.ckpt`` is saved (a complete DCP folder; Lightning
resumes from the newest one when the requeued job starts without ``ckpt_path``), and global rank 0 requeues the job
(``SLURM_JOB_ID``, or ``SLURM_ARRAY_JOB_ID_SLURM_ARRAY_TASK_ID``). Training then goes on until SLURM ends the job:
its SIGTERM is handled as above.

[Note: Ctrl-C exits in bounded time] On SIGINT Lightning runs ``on_exception``, tears down and exits, but a rank
whose main thread waits in a collective for a rank that already left only returns when gloo notices. The first
SIGINT in a rank (while a ``Trainer`` runs) starts a timer: ``INTERRUPT_GRACE_S`` later, a rank still alive kills
the ranks it started (SIGKILL) and leaves with status 130, as a shell reports Ctrl-C. The timer also bounds
``on_exception``: an ``OnExceptionCheckpoint`` save on Ctrl-C that takes longer is cut, and loses nothing already
saved (a DCP save is written under a hidden partial name and committed only when complete; see ``_checkpoint``).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_prefixed_message, rank_zero_info

__all__ = ["INTERRUPT_GRACE_S", "Preemption"]

log = logging.getLogger(__name__)

INTERRUPT_GRACE_S = 5.0
"""Seconds a rank has after Ctrl-C (SIGINT) to end on its own before it kills its ranks and exits (status 130)."""


class Preemption:
    """One process's SIGTERM and SIGINT handling under ``smp`` (see the Notes above)."""

    def __init__(self) -> None:
        self.pending = False  # a SIGTERM reached this process and is not agreed yet
        self.requeue_pending = False  # SLURM's requeue signal reached this process and is not agreed yet
        self._launcher: Any = None
        self._previous_sigint: Any = None

    def install(self, trainer: Any) -> None:
        """Take over Lightning's SIGTERM notifier (before ``Trainer`` registers its handlers, i.e. in ``setup``) and,
        in the main thread, SIGINT while the ``Trainer`` runs (unless the program set its own SIGINT handler)."""
        self._launcher = trainer.strategy.launcher
        connector = trainer._signal_connector
        connector._sigterm_notifier_fn = self._notify_sigterm  # Lightning composes its handler from this attribute
        connector._slurm_sigusr_handler_fn = self._notify_requeue  # and its requeue handler (auto_requeue) from this
        if threading.current_thread() is threading.main_thread() and self._previous_sigint is None:
            if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                self._previous_sigint = signal.signal(signal.SIGINT, self._interrupt)

    def uninstall(self) -> None:
        """Give SIGINT back to the handler it had before :meth:`install` (at the strategy's teardown)."""
        if self._previous_sigint is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self._previous_sigint)
            self._previous_sigint = None

    def agree(self, trainer: Any, device: torch.device) -> None:
        """Whether any rank received SIGTERM or SLURM's requeue signal, agreed by every rank at the start of the same
        step: on a requeue every rank saves the hpc checkpoint and rank 0 requeues, now; on SIGTERM
        ``trainer.received_sigterm`` becomes ``True`` on every rank (Lightning stops after this step). A collective
        over the world group: every rank calls it from the same training step (see the Notes)."""
        if trainer.received_sigterm or not (dist.is_available() and dist.is_initialized()):
            return
        flags = torch.tensor([self.pending, self.requeue_pending], dtype=torch.int32, device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        sigterm, requeue = flags.tolist()
        if requeue:  # see [Note: SLURM requeue at a step boundary]
            self.requeue_pending = False
            rank_zero_info("lightning_mp: SLURM's requeue signal received; every rank saves an hpc checkpoint now.")
            type(trainer._signal_connector)._slurm_sigusr_handler_fn(trainer._signal_connector, signal.SIGUSR1, None)
        if sigterm:
            self.pending = False  # agreed (a SIGTERM between two Trainer runs stays pending for the next one)
            trainer._signal_connector.received_sigterm = True
            rank_zero_info("lightning_mp: SIGTERM received; every rank stops after this step (SIGTERMException).")

    def _notify_sigterm(self, signum: int, _: FrameType | None) -> None:
        log.info(rank_prefixed_message(f"Received SIGTERM: {signum}", int(os.environ.get("LOCAL_RANK", 0))))
        if not self.pending and self._launcher is not None:
            self._launcher.kill(signum)  # the ranks this process started, as Lightning's notifier does
        self.pending = True

    def _notify_requeue(self, signum: int, _: FrameType | None) -> None:
        rank = int(os.environ.get("LOCAL_RANK", 0))
        log.info(rank_prefixed_message(f"Received SLURM's requeue signal: {signum}", rank))
        self.requeue_pending = True

    def _interrupt(self, signum: int, frame: FrameType | None) -> None:
        timer = threading.Timer(INTERRUPT_GRACE_S, _exit_now, args=(self._launcher,))
        timer.daemon = True
        timer.start()
        signal.default_int_handler(signum, frame)  # raises KeyboardInterrupt: Lightning's graceful path


def _exit_now(launcher: Any) -> None:
    """Kill the ranks this process started, then leave at once (status 130)."""
    if launcher is not None and getattr(launcher, "procs", None):
        launcher.kill(signal.SIGKILL)
    print(f"lightning_mp: still running {INTERRUPT_GRACE_S:.0f} s after Ctrl-C; exiting now.", file=sys.stderr,
          flush=True)
    os._exit(130)
