"""A fit without ``seed_everything`` on 2 ranks with the default popen launcher (each rank re-runs this script
from its own OS seed): ``python tests/scripts/unseeded_ranks.py {dp2,tp2,delayed-dp2} OUT_DIR``. Each rank writes
its weights at the start and end of training and its batches to ``OUT_DIR/<rank>.pt`` (see [Note: ranks start
alike] in ``lightning_mp/strategy/_replicas.py``)."""

import os
import sys

import lightning as L
import torch
from torch.utils.data import DataLoader

import lightning_mp


class Net(L.LightningModule):
    def __init__(self, out_dir: str) -> None:
        super().__init__()
        self.out_dir = out_dir
        self.first = torch.nn.Linear(4, 8)
        self.second = torch.nn.Linear(8, 1)
        self.batches: list[torch.Tensor] = []
        self.initial: dict[str, torch.Tensor] = {}

    def on_train_start(self) -> None:
        self.initial = {n: p.detach().clone() for n, p in self.named_parameters()}

    def training_step(self, batch, batch_idx):
        self.batches.append(batch.clone())
        x = torch.stack([batch.float() / 64, (batch % 7).float(), (batch % 3).float(), torch.ones_like(batch, dtype=torch.float)], 1)
        return self.second(torch.relu(self.first(x))).square().mean()  # (B, 4) -> scalar

    def on_train_end(self) -> None:
        final = {n: p.detach().clone() for n, p in self.named_parameters()}
        torch.save({"initial": self.initial, "final": final, "batches": self.batches},
                   os.path.join(self.out_dir, f"{self.global_rank}.pt"))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(torch.arange(64), batch_size=8, shuffle=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    layout, out_dir = sys.argv[1], sys.argv[2]
    strategy = lightning_mp.SMPStrategy(
        tensor_parallel_degree=2 if layout == "tp2" else 1,
        delayed_parameter_initialization=layout.startswith("delayed"),
    )
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=3, logger=False,
                        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)
    if layout.startswith("delayed"):
        with trainer.init_module(empty_init=True):
            model = Net(out_dir)
    else:
        model = Net(out_dir)
    trainer.fit(model)
