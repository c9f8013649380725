"""A pp2 fit of the tiny GPT on 2 processes (the default popen launcher, or under ``torchrun``), for signals and
restarts.

    python tests/scripts/preempt.py OUT_DIR MAX_STEPS MODE

``MODE``:

* ``signal``: ``fit`` to 2 steps, then ``fit`` again to ``MAX_STEPS`` in the same processes; a test signals the run
  once every rank wrote ``OUT_DIR/ready_RANK`` (after step 3). Each rank writes ``OUT_DIR/counts_RANK.json``:
  threads, open files and child processes after the first ``fit`` and after the second (``how`` it ended), the
  names of the threads alive then, and when (``time.time()``).
* ``slurm``: one ``fit`` to ``MAX_STEPS`` without ``ckpt_path``, started by a test as ``srun`` starts ranks (SLURM's
  variables, one process per rank): Lightning's ``SLURMEnvironment(auto_requeue=True)`` saves ``hpc_ckpt_N.ckpt``
  in ``OUT_DIR`` on SLURM's requeue signal and resumes from the newest one when the job starts again.
* ``resume``: ``fit`` to ``MAX_STEPS`` with ``ckpt_path="last"`` (from scratch when there is none yet). With the
  environment variable ``KILL_RANK1_AT=k``, global rank 1 kills itself (SIGKILL) after step ``k`` of the first
  attempt (``TORCHELASTIC_RESTART_COUNT`` unset or ``0``).

``ModelCheckpoint`` saves ``OUT_DIR/ckpt/last`` after every step; ``OnExceptionCheckpoint`` saves
``OUT_DIR/ckpt/on_exception.ckpt`` when ``fit`` is interrupted (Lightning's way to save on preemption). At the end
of a finished fit every rank saves its parameters, its global step and the step it started from (``started_at``)
in ``OUT_DIR/final_RANK.pt``.
"""

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint

import lightning_mp
from tests.trainer.test_checkpoint_reshard import _GPT


def process_counts() -> dict:
    """This process's threads (Python's and the OS's), open file descriptors and live child processes (``/proc``)."""
    tasks = list(Path("/proc/self/task").iterdir())
    children = [pid for task in tasks for pid in (task / "children").read_text().split()]
    return {"threads": threading.active_count(), "os_threads": len(tasks), "fds": len(os.listdir("/proc/self/fd")),
            "children": len(children)}


class Beacon(L.Callback):
    """``OUT_DIR/ready_RANK`` after step 3; rank 1 killed after step ``kill_at``; the final parameters at the end."""

    def __init__(self, out: Path, kill_at: int | None) -> None:
        self.out, self.kill_at = out, kill_at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 3:
            (self.out / f"ready_{trainer.global_rank}").write_text(str(os.getpid()))
        if trainer.global_step == self.kill_at and trainer.global_rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_start(self, trainer, pl_module):
        self.started_at = trainer.global_step

    def on_train_end(self, trainer, pl_module):
        params = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
        torch.save({"params": params, "step": trainer.global_step, "started_at": self.started_at}, self.out / f"final_{trainer.global_rank}.pt")


def main() -> None:
    out, max_steps, mode = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    kill_at = int(os.environ["KILL_RANK1_AT"]) if "KILL_RANK1_AT" in os.environ and first_attempt else None
    torch.manual_seed(0)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=lightning_mp.SMPStrategy(pipeline_parallel_degree=2, microbatches=2),
        max_steps=2 if mode == "signal" else max_steps, logger=False, enable_progress_bar=False, default_root_dir=out,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False,
        callbacks=[Beacon(out, kill_at), ModelCheckpoint(dirpath=str(out / "ckpt"), save_last=True, every_n_train_steps=1),
                   OnExceptionCheckpoint(dirpath=str(out / "ckpt"))],
    )
    model = _GPT()
    if mode in ("resume", "slurm"):
        trainer.fit(model, ckpt_path="last" if mode == "resume" else None)
        return
    rank = int(os.environ.get("LOCAL_RANK", 0))
    trainer.fit(model)
    record = {"first": process_counts()}
    trainer.fit_loop.epoch_loop.max_steps = max_steps
    how = "returned"
    try:
        trainer.fit(model)
    except BaseException as error:
        how = type(error).__name__
        raise
    finally:
        record.update(second=process_counts(), how=how, names=sorted(t.name for t in threading.enumerate()),
                      at=time.time())
        (out / f"counts_{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
