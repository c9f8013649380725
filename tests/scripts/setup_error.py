"""A fit whose setup fails on every rank (a batch of 8 does not split into 3 microbatches), default popen launcher."""

import lightning as L
import torch

import lightning_mp
from tests.trainer.test_strategy import Wrapped

if __name__ == "__main__":
    torch.manual_seed(0)
    strategy = lightning_mp.SMPStrategy(pipeline_parallel_degree=2, microbatches=3)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=1, logger=False,
                        enable_progress_bar=False, use_distributed_sampler=False)
    trainer.fit(Wrapped("mlp"))
