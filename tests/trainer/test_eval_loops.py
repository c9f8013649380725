"""Every Lightning loop under the pipeline, for models whose eval path differs from their training path.

One ``Trainer`` at pp=2 runs ``fit`` (sanity check and a validation epoch included), then ``validate``, ``test`` and
``predict`` in the same processes (``tests/scripts/eval_loops.py``, the popen launcher), against the same script on
one process without the strategy: every output of every loop, the validation metrics, and every parameter and
buffer after ``fit``. ``nn.TransformerEncoder`` takes its fast path in eval without gradients and hands nested
tensors from layer to layer, across the stage boundary; BatchNorm uses its running statistics; dropout is off."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

ROOT = Path(__file__).resolve().parents[2]
VOCAB, SEQ, BATCH, STEPS = 11, 8, 4, 3
PAD = 0


class PaddedEncoder(nn.Module):
    """Token ids (B, T) with padding -> logits (B, T, V) through ``nn.TransformerEncoder`` (defaults, batch first)."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        layer = nn.TransformerEncoderLayer(dim, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(ids), src_key_padding_mask=ids == PAD))

    @staticmethod
    def data(seed: int) -> TensorDataset:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(1, VOCAB, (STEPS * BATCH, SEQ), generator=g)
        lengths = torch.randint(3, SEQ + 1, (STEPS * BATCH,), generator=g)
        ids[torch.arange(SEQ) >= lengths[:, None]] = PAD  # right padding
        return TensorDataset(ids)

    @staticmethod
    def losses(model: nn.Module, batch: list) -> torch.Tensor:
        """Per sequence: mean next-token cross-entropy over its real tokens. (B,)"""
        (ids,) = batch
        logits = model(ids)[:, :-1]
        per_token = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], ignore_index=PAD, reduction="none")
        return per_token.sum(1) / (ids[:, 1:] != PAD).sum(1)


class NormedMLP(nn.Module):
    """(B, 8) -> (B,) through Linear / BatchNorm1d / ReLU blocks, with dropout when ``dropout`` > 0."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.blocks = nn.Sequential(
            *[nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(dropout)) for _ in range(4)]
        )
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x)).squeeze(-1)

    @staticmethod
    def data(seed: int) -> TensorDataset:
        g = torch.Generator().manual_seed(seed)
        return TensorDataset(3 * torch.randn(STEPS * BATCH, 8, generator=g) + 1, torch.randn(STEPS * BATCH, generator=g))

    @staticmethod
    def losses(model: nn.Module, batch: list) -> torch.Tensor:
        x, y = batch
        return (model(x) - y) ** 2


MODELS = {"encoder": PaddedEncoder, "batchnorm": NormedMLP, "dropout": lambda: NormedMLP(dropout=0.5)}


class EvalModule(L.LightningModule):
    """Each step returns per-example values, so a pipelined step's merged output equals one process's."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.net = MODELS[name]()
        self.kind = type(self.net)

    def training_step(self, batch, batch_idx):
        return self.kind.losses(self.net, batch).mean()

    def validation_step(self, batch, batch_idx):
        losses = self.kind.losses(self.net, batch)
        self.log("val_loss", losses.mean())
        return losses

    def test_step(self, batch, batch_idx):
        losses = self.kind.losses(self.net, batch)
        self.log("test_loss", losses.mean())
        return losses

    def predict_step(self, batch, batch_idx):
        return self.net(batch[0])

    def _loader(self, seed: int) -> DataLoader:
        return DataLoader(self.kind.data(seed), batch_size=BATCH, shuffle=False)

    def train_dataloader(self) -> DataLoader:
        return self._loader(0)

    def val_dataloader(self) -> DataLoader:
        return self._loader(1)

    def test_dataloader(self) -> DataLoader:
        return self._loader(2)

    def predict_dataloader(self) -> DataLoader:
        return self._loader(3)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class RecordLoops(L.Callback):
    """Every output of every loop, by loop: sanity check, validation during fit, validate, test, predict."""

    def __init__(self) -> None:
        self.outputs: dict[str, list[torch.Tensor]] = {}

    def _add(self, trainer: L.Trainer, loop: str, outputs: torch.Tensor) -> None:
        if trainer.sanity_checking:
            loop = "sanity"
        elif loop == "validation":
            loop = "fit_validation" if trainer.state.fn == "fit" else "validate"
        self.outputs.setdefault(loop, []).append(outputs.detach().clone())

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self._add(trainer, "validation", outputs)

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self._add(trainer, "test", outputs)

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self._add(trainer, "predict", outputs)


def run_loops(name: str, out_dir: str, pp: int, fit: bool, inference_mode: bool) -> None:
    """``fit`` (if asked), then ``validate``, ``test`` and ``predict`` with one Trainer; saves ``out_dir/<rank>.pt``."""
    import lightning_mp

    torch.manual_seed(0)
    # BatchNorm's training statistics are per microbatch: one microbatch keeps fit comparable to one process
    microbatches = 1 if fit and name == "batchnorm" else 2
    strategy = lightning_mp.SMPStrategy(pipeline_parallel_degree=pp, microbatches=microbatches) if pp > 1 else "auto"
    record = RecordLoops()
    trainer = L.Trainer(
        accelerator="cpu", devices=pp, strategy=strategy, max_epochs=1, num_sanity_val_steps=1,
        inference_mode=inference_mode, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, callbacks=[record],
    )
    model = EvalModule(name)
    if fit:
        trainer.fit(model)
    metrics = {"validate": trainer.validate(model)[0], "test": trainer.test(model)[0]}
    trainer.predict(model, return_predictions=False)
    state = {n: t.detach().clone() for n, t in [*model.named_parameters(), *model.named_buffers()]}
    result = {"outputs": record.outputs, "metrics": metrics, "state": state}
    torch.save(result, os.path.join(out_dir, f"{trainer.global_rank}.pt"))


@pytest.mark.parametrize(
    ("name", "fit", "inference_mode"),
    [("encoder", True, True), ("batchnorm", True, False), ("dropout", False, True)],
    ids=["transformer-encoder-fast-path-inference-mode", "batchnorm-fit-no-grad", "dropout-batchnorm-eval-only"],
)
def test_every_loop_at_pp2_matches_one_process(tmp_path, name, fit, inference_mode):
    os.makedirs(tmp_path / "ref")
    os.makedirs(tmp_path / "smp")
    run_loops(name, str(tmp_path / "ref"), 1, fit, inference_mode)
    reference = torch.load(tmp_path / "ref" / "0.pt")
    script = "tests/scripts/eval_loops.py"
    command = [sys.executable, script, name, str(tmp_path / "smp"), str(int(fit)), str(int(inference_mode))]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    results = [torch.load(tmp_path / "smp" / f"{rank}.pt") for rank in range(2)]
    loops = ["validate", "test", "predict"] + (["sanity", "fit_validation"] if fit else [])
    assert sorted(reference["outputs"]) == sorted(loops)
    for result in results:  # every stage gets the merged outputs of the driver
        assert sorted(result["outputs"]) == sorted(loops)
        for loop in loops:
            assert len(result["outputs"][loop]) == len(reference["outputs"][loop]), loop
            for got, expected in zip(result["outputs"][loop], reference["outputs"][loop]):
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=loop)
        for key, metric in (("validate", "val_loss"), ("test", "test_loss")):
            got, expected = result["metrics"][key][metric], reference["metrics"][key][metric]
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    owned = sorted(n for result in results for n in result["state"])
    assert owned == sorted(reference["state"]), "each parameter and buffer lives on exactly one stage"
    for result in results:
        for key, value in result["state"].items():
            torch.testing.assert_close(value, reference["state"][key], rtol=1e-5, atol=1e-6, msg=key)
