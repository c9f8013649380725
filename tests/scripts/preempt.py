"""A long pp2 fit of the tiny GPT with the default (popen) launcher or under ``torchrun``, for signals and restarts.

    python tests/scripts/preempt.py OUT_DIR MAX_STEPS [RESUME]          # RESUME: "last" resumes from OUT_DIR/ckpt

Each rank writes ``OUT_DIR/ready_RANK`` once it finished 2 training steps (a test then sends its signal), and
``OUT_DIR/counts_RANK.json`` at exit: threads, open files and child processes before ``Trainer.fit`` and after it
(returned or raised: ``how``), and the names of the threads alive after it. ``OnExceptionCheckpoint`` saves
``OUT_DIR/ckpt/on_exception`` when ``fit`` is interrupted (Lightning's way to save on preemption);
``ModelCheckpoint`` saves ``OUT_DIR/ckpt/last`` every step. At the end of a finished fit, rank 0 saves the final
parameters of every rank in ``OUT_DIR/final_RANK.pt``.
"""

import json
import os
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
    """This process's threads, open file descriptors and live child processes (Linux ``/proc``)."""
    children = []
    for task in Path("/proc/self/task").iterdir():
        children += (task / "children").read_text().split()
    return {"threads": threading.active_count(), "os_threads": len(list(Path("/proc/self/task").iterdir())),
            "fds": len(os.listdir("/proc/self/fd")), "children": len(children)}


class Beacon(L.Callback):
    """``OUT_DIR/ready_RANK`` after the second training step; the final parameters at the end of a finished fit."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 2 and not (self.out / f"ready_{trainer.global_rank}").exists():
            (self.out / f"ready_{trainer.global_rank}").write_text(str(os.getpid()))

    def on_train_end(self, trainer, pl_module):
        params = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
        torch.save({"params": params, "step": trainer.global_step}, self.out / f"final_{trainer.global_rank}.pt")


if __name__ == "__main__":
    out, max_steps = Path(sys.argv[1]), int(sys.argv[2])
    resume = sys.argv[3] if len(sys.argv) > 3 else None
    torch.manual_seed(0)
    strategy = lightning_mp.SMPStrategy(pipeline_parallel_degree=2, microbatches=2)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=max_steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False,
        callbacks=[Beacon(out), ModelCheckpoint(dirpath=str(out / "ckpt"), save_last=True, every_n_train_steps=1),
                   OnExceptionCheckpoint(dirpath=str(out / "ckpt"))],
    )
    rank = int(os.environ.get("LOCAL_RANK", 0))
    before, how = process_counts(), "returned"
    try:
        trainer.fit(_GPT(), ckpt_path=str(out / "ckpt" / "last") if resume == "last" else None)
    except BaseException as error:
        how = type(error).__name__
        raise
    finally:
        after = process_counts()
        names = sorted(t.name for t in threading.enumerate())
        (out / f"counts_{rank}.json").write_text(json.dumps({"before": before, "after": after, "how": how,
                                                             "threads": names, "at": time.time()}))
