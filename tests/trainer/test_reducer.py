"""The bucketed data-parallel all-reduce through ``Trainer.fit``: buckets go out during backward at pp2 x dp2 and
training matches one process; unused, late-unfrozen and closure-only parameters neither hang nor diverge."""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_mp
from lightning_mp.strategy import _reducer
from tests.trainer.test_strategy import CLIP, _fit


class _RecordReducer(L.Callback):
    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_end(self, trainer, pl_module):
        reducer = trainer.strategy._gradients.reducer
        torch.save({"enabled": reducer.enabled, "in_backward": reducer.launched_during_backward},
                   os.path.join(self.out_dir, f"reducer{trainer.global_rank}.pt"))


def test_pp2_dp2_buckets_go_out_during_backward_and_training_matches_one_process(tmp_path, monkeypatch):
    """Small buckets, so most of them leave from the gradient hooks of both stages (the tied embedding's after its
    ordered accumulation of 4 microbatches), with gradient accumulation over 2 batches and norm clipping after the
    wait: losses and parameters as one device's."""
    torch.set_num_threads(1)  # before forking (a forked child can hang in OpenMP otherwise)
    monkeypatch.setattr(_reducer, "FIRST_BUCKET_BYTES", 64)  # fork: the children see the patched module
    monkeypatch.setattr(_reducer, "BUCKET_BYTES", 512)
    kwargs = {"accumulate_grad_batches": 2, **CLIP}
    (tmp_path / "ref").mkdir()
    (tmp_path / "smp").mkdir()
    reference = _fit("tiedlm", str(tmp_path / "ref"), **kwargs)[0]
    strategy = lightning_mp.SMPStrategy(pipeline_parallel_degree=2, microbatches=4, start_method="fork")
    results = _fit("tiedlm", str(tmp_path / "smp"), strategy, devices=4,
                   callbacks_extra=[_RecordReducer(str(tmp_path / "smp"))], **kwargs)
    for rank in range(4):
        record = torch.load(tmp_path / "smp" / f"reducer{rank}.pt")
        assert record["enabled"] and record["in_backward"] > 0, (rank, record)
    pp = 2
    replicas = [results[r * pp : (r + 1) * pp] for r in range(2)]
    mean_losses = torch.tensor([replica[0]["losses"] for replica in replicas]).mean(0).tolist()
    torch.testing.assert_close(mean_losses, reference["losses"], rtol=1e-5, atol=1e-6)
    for result in results:
        for name, value in result["params"].items():
            torch.testing.assert_close(value, reference["params"][name], rtol=1e-5, atol=1e-6, msg=name)


# ---- regressions found in review: collectives between the buckets, parameters unfrozen after setup ----------

class _Stage1(nn.Module):
    """``b`` runs only where ``use_b`` (one replica): that replica's stage sends more buckets from its hooks."""

    def __init__(self) -> None:
        super().__init__()
        self.c, self.b, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1)
        self.use_b = True

    def forward(self, h):
        h = torch.relu(self.c(h))
        if self.use_b:
            h = h + self.b(h)
        return self.head(h)


class _BranchyLogged(L.LightningModule):
    def __init__(self, unfreeze_at: int | None = None) -> None:
        super().__init__()
        self.l0, self.s1 = nn.Linear(8, 8), _Stage1()
        self.unfreeze_at = unfreeze_at
        if unfreeze_at is not None:  # as Lightning's BaseFinetuning.freeze_before_training
            self.l0.requires_grad_(False)

    def on_fit_start(self) -> None:
        self.s1.use_b = self.trainer.strategy.topology.dp_rank == 0

    def on_train_batch_start(self, batch, batch_idx) -> None:
        if batch_idx == self.unfreeze_at:
            self.l0.requires_grad_(True)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = ((self.s1(torch.relu(self.l0(x))) - y) ** 2).mean()
        self.log("train_loss", loss, sync_dist=True, on_step=True)  # a collective on the dp group mid-step
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
        return torch.utils.data.DataLoader(data, batch_size=8)


class _SaveParams(L.Callback):
    def __init__(self, out) -> None:
        self.out = out

    def on_train_end(self, trainer, pl_module) -> None:
        reducer = trainer.strategy._gradients.reducer
        torch.save(
            {"enabled": reducer.enabled, "params": {n: p.detach().clone() for n, p in pl_module.named_parameters()}},
            self.out / f"{trainer.global_rank}.pt",
        )


def _replicas_after_fit(tmp_path, pp: int, unfreeze_at: int | None) -> list[dict]:
    from datetime import timedelta

    torch.set_num_threads(1)  # before forking
    strategy = lightning_mp.SMPStrategy(
        pipeline_parallel_degree=pp, microbatches=2, start_method="fork", timeout=timedelta(seconds=60),
        partition={"l0": 0, "s1": pp - 1},
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=2 * pp, strategy=strategy, max_steps=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[_SaveParams(tmp_path)],
    )
    trainer.fit(_BranchyLogged(unfreeze_at))
    return [torch.load(tmp_path / f"{r}.pt") for r in range(2 * pp)]


@pytest.mark.parametrize("pp", [1, 2])
def test_a_parameter_unused_on_one_replica_with_sync_dist_logs_neither_hangs_nor_diverges(tmp_path, monkeypatch, pp):
    """One replica sends more buckets from its hooks than the other while `self.log(sync_dist=True)` reduces on the
    dp group mid-step: on a shared group the collectives paired up wrongly (pp=1 crashed, pp=2 hung until the
    timeout). The reducer's own group keeps them apart; replicas stay bitwise equal."""
    monkeypatch.setattr(_reducer, "FIRST_BUCKET_BYTES", 64)  # several buckets (fork: the children see it)
    monkeypatch.setattr(_reducer, "BUCKET_BYTES", 128)
    ranks = _replicas_after_fit(tmp_path, pp, None)
    replicas = [(r, r + pp) for r in range(pp)]  # global rank = dp_rank * pp + pp_rank
    for a, b in replicas:
        assert ranks[a]["enabled"] and ranks[b]["enabled"]
        for name, value in ranks[a]["params"].items():
            if value.numel():
                assert torch.equal(value, ranks[b]["params"][name]), name


def test_a_parameter_unfrozen_after_setup_is_still_averaged(tmp_path):
    """A layer frozen at setup has no bucket; unfrozen at batch 1 (as BaseFinetuning does) it must still be
    all-reduced: the reducer falls back on every replica and the replicas stay equal."""
    ranks = _replicas_after_fit(tmp_path, 1, unfreeze_at=1)
    assert not ranks[0]["enabled"] and not ranks[1]["enabled"]
    for name, value in ranks[0]["params"].items():
        assert torch.equal(value, ranks[1]["params"][name]), name


def test_replicas_stay_equal_when_optimizer_step_runs_only_the_closure_on_some_batches(tmp_path):
    """Lightning's documented `optimizer_step` pattern: `optimizer_closure()` without a step on odd batches. The
    gradients made final in that batch's backward must not count as final for the next window."""
    class SkipOddSteps(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return (self.net(x) - y).pow(2).mean()

        def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
            if batch_idx % 2 == 0:
                optimizer.step(closure=optimizer_closure)
            else:
                optimizer_closure()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            g = torch.Generator().manual_seed(1)
            return DataLoader(TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g)), batch_size=8)

        def on_train_end(self):
            params = {n: p.detach().clone() for n, p in self.named_parameters()}
            torch.save(params, os.path.join(str(tmp_path), f"{self.global_rank}.pt"))

    torch.set_num_threads(1)
    L.Trainer(
        accelerator="cpu", devices=2, strategy=lightning_mp.SMPStrategy(start_method="fork"), max_steps=4,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    ).fit(SkipOddSteps())
    a, b = (torch.load(tmp_path / f"{r}.pt") for r in range(2))
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs between the dp replicas"
