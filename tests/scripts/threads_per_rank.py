"""Fit a tiny MLP on 2 CPU processes and write, per rank, the intra-op thread counts it ran with.

    python tests/scripts/threads_per_rank.py STRATEGY OUT_DIR      # STRATEGY: "ddp" or "smp:PP"

Each rank writes OUT_DIR/threads_RANK.json: ``torch.get_num_threads()`` in ``training_step`` (the driver's
thread under smp) and in the forward of every layer that ran on that rank (engine server threads under smp).
"""

import json
import os
import sys

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_mp


class Probe(nn.Linear):
    """A linear layer that records the thread count of the thread that runs its forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = [*getattr(self, "seen", []), torch.get_num_threads()]
        return super().forward(x)


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(Probe(8, 8), nn.Tanh(), Probe(8, 8), nn.Tanh(), Probe(8, 1))
        self.step_threads: list[int] = []

    def training_step(self, batch, batch_idx):
        self.step_threads.append(torch.get_num_threads())
        x, y = batch
        return nn.functional.mse_loss(self.net(x).squeeze(-1), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(32, 8, generator=g), torch.randn(32, generator=g)), batch_size=4)

    def on_train_end(self) -> None:
        layers = sorted({t for m in self.net.modules() for t in getattr(m, "seen", [])})
        record = {"step": sorted(set(self.step_threads)), "layers": layers, "omp": os.environ.get("OMP_NUM_THREADS")}
        with open(os.path.join(sys.argv[2], f"threads_{self.global_rank}.json"), "w") as f:
            json.dump(record, f)


if __name__ == "__main__":
    spec, out_dir = sys.argv[1], sys.argv[2]
    if spec == "ddp":
        strategy = "ddp"
    else:
        strategy = lightning_mp.SMPStrategy(pipeline_parallel_degree=int(spec.split(":")[1]), microbatches=2)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=3, logger=False, enable_progress_bar=False,
        enable_checkpointing=False, enable_model_summary=False,
    )
    trainer.fit(Model())
