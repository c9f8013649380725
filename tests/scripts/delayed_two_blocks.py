"""A model built in two separate ``delay_param_initialization()`` blocks (one process): setup fails with one
error naming the two blocks, and the teardown of the still-meta model adds none."""

import lightning as L
import torch
from torch import nn

import lightning_mp
from lightning_mp.init import delay_param_initialization


class TwoBlocks(L.LightningModule):
    def __init__(self):
        super().__init__()
        with delay_param_initialization():
            self.a = nn.Linear(4, 4)
        with delay_param_initialization():
            self.b = nn.Linear(4, 4)

    def training_step(self, batch, batch_idx):
        return self.b(self.a(batch[0])).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=4)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=lightning_mp.SMPStrategy(), max_steps=1, logger=False,
                        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(TwoBlocks(), data)
