"""``start_method="fork"`` with 1 device after this process ran a parallel region on 2 intra-op threads.

libgomp is not fork-safe: a forked rank that runs a parallel region on more than one thread waited forever for
the parent's pool threads. Prints ``forked rank threads: N`` (the rank's intra-op threads) when the fit finished.
"""

import lightning as L
import torch

import lightning_mp
from tests.trainer.test_checkpoint_reshard import _GPT


class Threads(L.Callback):
    def on_train_end(self, trainer, pl_module):
        print(f"forked rank threads: {torch.get_num_threads()}", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(2)
    a = torch.randn(512, 512)
    for _ in range(20):  # the parent's OpenMP pool runs
        a @ a
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=lightning_mp.SMPStrategy(start_method="fork"), max_steps=2,
        logger=False, enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[Threads()],
    )
    trainer.fit(_GPT())
