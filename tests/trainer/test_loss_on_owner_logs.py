"""Logging a value that is not the loss at pp=2 through ``Trainer.fit``, the loss computed on the head's stage ([Note:
the loss's fetch and backward in one exchange] in pipeline/_caller.py, [Note: logging in a pipelined step] in
strategy/_logs.py): a handle passed to ``self.log`` (a statistic the head returns beside its logits) stays on stage 1
through the forward and is fetched as its microbatch finishes, the loss still in one exchange with its backward;
``logits.mean()`` instead fetches the logits in the forward (``mean`` is not recorded), and the loss is then computed
here. Either way the logged values, the losses and every parameter after three SGD steps equal one process."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_mp
from tests._fit import RecordTraining, fit_and_collect

STEPS, BATCH, MICROBATCHES, DIM, CLASSES = 3, 8, 2, 8, 4


class _Head(nn.Linear):
    """The logits, and their mean square (a statistic to log)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # (B, D) -> ((B, C), ())
        logits = super().forward(x)
        return logits, logits.pow(2).mean()


class _Classifier(L.LightningModule):
    """``logs="handle"``: logs the head's statistic, a handle at pp=2; ``"mean"``: logs ``logits.mean()``; both log
    the loss as ``train_loss``. On the driver at pp=2, ``gets`` holds the GETs its engine sent during each call of
    ``training_step`` in a pipelined step."""

    def __init__(self, logs: str) -> None:
        super().__init__()
        self.logs = logs
        self.body = nn.Sequential(nn.Linear(DIM, 16), nn.Tanh())
        self.head = _Head(16, CLASSES)
        self.gets: list[int] = []

    def training_step(self, batch, batch_idx):
        engine = getattr(self.trainer.strategy, "pipeline_engine", None)
        engine = engine if engine is not None and engine.in_step else None  # not the trace at setup
        before = engine.messages_sent["get"] if engine is not None else 0
        x, y = batch
        out = self.head(self.body(x))
        logits = out[0]
        if self.logs == "handle":
            self.log("logged", out[1])
        else:
            self.log("logged", logits.mean())
        loss = F.cross_entropy(logits, y)
        self.log("train_loss", loss)
        if engine is not None:
            self.gets.append(engine.messages_sent["get"] - before)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(3)
        x = torch.randn(BATCH * STEPS, DIM, generator=g)
        y = torch.randint(0, CLASSES, (BATCH * STEPS,), generator=g)
        return DataLoader(TensorDataset(x, y), batch_size=BATCH)


class _Record(RecordTraining):
    """Also the logged statistic after each step and, at pp=2, the driver's messages and GETs per forward."""

    def __init__(self, out_dir: str) -> None:
        super().__init__(out_dir, logged=True)
        self.statistic: list[float] = []

    def on_step(self, trainer, pl_module, batch_idx):
        self.statistic.append(float(trainer.callback_metrics["logged"]))

    def extra(self, trainer, pl_module):
        engine = getattr(trainer.strategy, "pipeline_engine", None)
        messages = dict(engine.messages_sent) if engine is not None else {}
        return {"statistic": self.statistic, "messages": messages, "gets": list(pl_module.gets)}


def _module(logs: str) -> _Classifier:
    torch.manual_seed(0)
    return _Classifier(logs)


@pytest.mark.parametrize("logs", ["handle", "mean"])
def test_a_logged_value_that_is_not_the_loss_matches_one_process(tmp_path, logs):
    reference = fit_and_collect(_module(logs), tmp_path / "one", max_steps=STEPS, num_sanity_val_steps=0,
                                record=_Record(str(tmp_path / "one")))[0]
    # one microbatch in flight: a forward that waits for a GET lets no other microbatch's forward send one meanwhile,
    # so each forward's count of GETs is its own
    strategy = lightning_mp.SMPStrategy(pipeline_parallel_degree=2, microbatches=MICROBATCHES, active_microbatches=1,
                                        start_method="fork", partition={"body": 0, "head": 1})
    out = tmp_path / "pp2"
    results = fit_and_collect(_module(logs), out, devices=2, strategy=strategy, max_steps=STEPS,
                              record=_Record(str(out)), num_sanity_val_steps=0, use_distributed_sampler=False)
    held = set()
    for result in results:
        torch.testing.assert_close(result["losses"], reference["losses"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(result["logged"], reference["logged"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(result["statistic"], reference["statistic"], rtol=1e-5, atol=1e-6)
        for name, value in result["params"].items():
            torch.testing.assert_close(value, reference["params"][name], rtol=1e-5, atol=1e-6, msg=name)
            held.add(name)
    assert held == set(reference["params"]), "every parameter is held somewhere"
    assert sorted(results[1]["params"]) == ["head.bias", "head.weight"]
    driver, microbatches = results[0]["messages"], STEPS * MICROBATCHES
    assert len(results[0]["gets"]) == microbatches
    if logs == "handle":
        # nothing fetched in the forward; per microbatch the loss with its backward in one exchange, then, as the
        # microbatch finishes, one GET of the logged statistic (the logged loss came with the exchange)
        assert results[0]["gets"] == [0] * microbatches, results[0]["gets"]
        assert driver.get("getbwd") == microbatches and driver.get("get") == microbatches, driver
        assert "gbwd" not in driver, driver
    else:
        # ``logits.mean()`` fetches the logits (the whole output) in the forward: the loss is then computed here
        # and its backward is a FETCH_BACKWARD; nothing is left to fetch when the microbatch finishes
        assert results[0]["gets"] == [1] * microbatches, results[0]["gets"]
        assert driver.get("get") == microbatches and driver.get("gbwd") == microbatches, driver
        assert "getbwd" not in driver, driver
