"""fit, then validate, with one Trainer and the default (popen) launcher: the second call reuses the processes,
groups, plan and placement of the first. Prints each rank's validation loss."""

import lightning as L
import torch

import lightning_mp
from tests.trainer.test_strategy import Wrapped

if __name__ == "__main__":
    torch.manual_seed(0)
    strategy = lightning_mp.SMPStrategy(pipeline_parallel_degree=2, microbatches=2)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=2, logger=False, enable_progress_bar=False,
        use_distributed_sampler=False, enable_checkpointing=False, num_sanity_val_steps=0,
    )
    model = Wrapped("mlp")
    trainer.fit(model)
    result = trainer.validate(model)
    print(f"RANK {trainer.global_rank} VAL_LOSS {result[0]['val_loss']:.6f}", flush=True)
