"""Generality (issue 4) with Lightning: ``non_split_inputs`` through ``Trainer.fit`` and ``trainer.predict``
keeps the batch order."""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import lightning_mp
from tests.models import MLPStack

STEPS, LR = 3, 0.1
TOL = {"rtol": 1e-5, "atol": 1e-6}


ROWS, BATCH, DIM, TABLE_ROWS = 24, 8, 8, 5


def _table() -> torch.Tensor:
    return torch.randn(TABLE_ROWS, DIM, generator=torch.Generator().manual_seed(7))


def _collate_with_table(samples: list[dict]) -> dict:
    batch = torch.utils.data.default_collate(samples)
    batch["table"] = _table()  # (TABLE_ROWS, DIM): the same whole table for every microbatch
    return batch


class TableModule(L.LightningModule):
    """Each row adds its entry of a lookup table that comes whole with every batch (5 rows: not splittable)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = MLPStack(dim=DIM, depth=4)

    def _predict(self, batch: dict) -> torch.Tensor:
        assert batch["table"].shape == (TABLE_ROWS, DIM), "the table arrives whole"
        return self.net(batch["x"] + batch["table"][batch["row"]])

    def training_step(self, batch, batch_idx):
        loss = F.mse_loss(self._predict(batch), batch["y"])
        self.log("train_loss", loss)
        return loss

    def predict_step(self, batch, batch_idx):
        return {"index": batch["index"], "y": self._predict(batch)}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)

    def _loader(self) -> DataLoader:
        g = torch.Generator().manual_seed(8)
        x, y = torch.randn(ROWS, DIM, generator=g), torch.randn(ROWS, generator=g)
        rows = torch.randint(0, TABLE_ROWS, (ROWS,), generator=g)
        samples = [{"index": i, "x": x[i], "row": rows[i], "y": y[i]} for i in range(ROWS)]
        return DataLoader(samples, batch_size=BATCH, shuffle=False, collate_fn=_collate_with_table, drop_last=True)

    def train_dataloader(self) -> DataLoader:
        return self._loader()

    def predict_dataloader(self) -> DataLoader:
        return self._loader()


class RecordTable(L.Callback):
    """Per rank: each step's loss, the final local parameters, and what predict returned per batch."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.losses: list[float] = []
        self.predictions: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer, pl_module):
        params = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
        torch.save({"losses": self.losses, "params": params}, os.path.join(self.out_dir, f"fit{trainer.global_rank}.pt"))

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.predictions.append(outputs)

    def on_predict_end(self, trainer, pl_module):
        torch.save(self.predictions, os.path.join(self.out_dir, f"pred{trainer.global_rank}.pt"))


def _table_trainer(out_dir: str, strategy: Any = "auto", devices: int = 1) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=ROWS // BATCH, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[RecordTable(out_dir)], use_distributed_sampler=False,
    )


def test_non_split_inputs_through_the_trainer_and_predict_keeps_batch_order(tmp_path):
    """pp=2, 4 microbatches, a dict batch whose ``table`` (5 rows) is given whole to every microbatch: the same
    losses and parameters as one process; ``trainer.predict`` returns every row once, in dataset order."""
    for name in ("ref", "smp"):
        os.makedirs(tmp_path / name)
    torch.manual_seed(0)
    _table_trainer(str(tmp_path / "ref")).fit(TableModule())
    reference = torch.load(tmp_path / "ref" / "fit0.pt")
    reference_model = TableModule()
    reference_model.load_state_dict(reference["params"])
    expected = _table_trainer(str(tmp_path / "ref")).predict(reference_model)

    def smp_trainer() -> L.Trainer:
        # fork: the children do not import Lightning again (about 7 s for both runs instead of 23 s with spawn)
        strategy = lightning_mp.SMPStrategy(
            pipeline_parallel_degree=2, microbatches=4, non_split_inputs=["table"], start_method="fork"
        )
        return _table_trainer(str(tmp_path / "smp"), strategy, devices=2)

    torch.manual_seed(0)
    model = TableModule()
    smp_trainer().fit(model)
    fitted = [torch.load(tmp_path / "smp" / f"fit{rank}.pt") for rank in range(2)]
    assert all(result["params"] for result in fitted), "both stages own parameters"
    assert sorted(n for r in fitted for n in r["params"]) == sorted(reference["params"])
    for result in fitted:
        torch.testing.assert_close(result["losses"], reference["losses"], **TOL)
        for name, value in result["params"].items():
            torch.testing.assert_close(value, reference["params"][name], **TOL, msg=name)

    trained = TableModule()
    trained.load_state_dict({n: v for r in fitted for n, v in r["params"].items()})
    smp_trainer().predict(trained, return_predictions=False)
    for rank in range(2):
        predictions = torch.load(tmp_path / "smp" / f"pred{rank}.pt")
        assert len(predictions) == len(expected) == ROWS // BATCH
        indices = torch.cat([p["index"] for p in predictions])
        assert torch.equal(indices, torch.arange(ROWS)), "merged microbatches and batches in dataset order"
        got = torch.cat([p["y"] for p in predictions])
        torch.testing.assert_close(got, torch.cat([e["y"] for e in expected]), **TOL)
