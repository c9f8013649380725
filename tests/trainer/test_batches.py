"""A shuffling loader gives ``smp`` the batches (and leaves the generators) of its one-device peer.

One replica (``smp`` on one device, pp=2) is the peer of ``strategy="auto"``; two replicas (dp=2) of ``ddp``. Batch
by batch, every rank must see the same samples and the same global generators (torch, numpy, Python ``random``) at
the start of each step; with ``seed_everything(workers=True)`` and a loader worker, also the same worker draws.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, Dataset

import lightning_mp
from tests._fit import fit_and_collect

STEPS, BATCH = 3, 8
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _seed_environment_restored(monkeypatch):
    """``seed_everything`` writes ``PL_GLOBAL_SEED``/``PL_SEED_WORKERS`` into this process's environment; the tests
    that run after these must not inherit them."""
    for name in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS"):
        monkeypatch.delenv(name, raising=False)


class Draws(Dataset):
    """Sample ``i``: ``(i, torch draw, numpy draw, random draw)``; in a worker, the draws show its seeding."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int):
        return i, torch.rand(()), float(np.random.rand()), random.random()


class NoDraws(L.LightningModule):
    """Two linear layers (two stages) and a step that draws from no generator."""

    def __init__(self, num_workers: int) -> None:
        super().__init__()
        self.num_workers = num_workers
        self.first = torch.nn.Linear(3, 3)
        self.second = torch.nn.Linear(3, 1)

    def training_step(self, batch, batch_idx):
        index, draws, _, _ = batch
        x = torch.stack([index.float() / 64, draws, draws.square()], dim=1)  # (B, 3)
        return self.second(self.first(x)).square().mean()

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Draws(), batch_size=BATCH, shuffle=True, num_workers=self.num_workers)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class RecordOrder(L.Callback):
    """Per rank and step: the batch, and the global generators' states when the step starts."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.steps: list[dict] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.steps.append({
            "batch": [torch.as_tensor(entry).clone() for entry in batch],
            "torch": torch.get_rng_state(),
            "numpy": np.random.get_state()[1].copy(),
            "python": random.getstate(),
        })

    def on_train_end(self, trainer, pl_module):
        torch.save(self.steps, os.path.join(self.out_dir, f"{trainer.global_rank}.pt"))


def _fit(out_dir: str, strategy, devices: int, workers: bool) -> list[list[dict]]:
    os.makedirs(out_dir)
    L.seed_everything(42, workers=workers, verbose=False)
    model = NoDraws(num_workers=1 if workers else 0)  # built after seeding: its init draws, as in a user's script
    return fit_and_collect(
        model, out_dir, devices=devices, strategy=strategy, max_steps=STEPS, record=RecordOrder(out_dir)
    )


def _assert_same_steps(got: list[dict], expected: list[dict]) -> None:
    assert len(got) == len(expected) == STEPS
    for step, (mine, theirs) in enumerate(zip(got, expected)):
        for entry, (a, b) in enumerate(zip(mine["batch"], theirs["batch"])):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"step {step}, batch entry {entry}")
        assert torch.equal(mine["torch"], theirs["torch"]), f"torch generator at step {step}"
        assert np.array_equal(mine["numpy"], theirs["numpy"]), f"numpy generator at step {step}"
        assert mine["python"] == theirs["python"], f"Python random at step {step}"


@pytest.mark.parametrize(
    ("pp", "dp", "workers"),
    [(1, 1, False), (2, 1, False), (2, 1, True), (1, 2, True)],
    ids=["one-device", "pp2", "pp2-seed-workers", "dp2-seed-workers"],
)
def test_shuffled_batches_and_generators_match_the_peer_strategy(tmp_path, pp, dp, workers):
    peer = "auto" if dp == 1 else DDPStrategy(start_method="fork")
    expected = _fit(str(tmp_path / "peer"), peer, dp, workers)
    strategy = lightning_mp.SMPStrategy(pipeline_parallel_degree=pp, microbatches=2, start_method="fork")
    got = _fit(str(tmp_path / "smp"), strategy, pp * dp, workers)
    for rank, steps in enumerate(got):  # global rank = dp_rank * pp + pp_rank
        _assert_same_steps(steps, expected[rank // pp])


class Texts(Dataset):
    """Sample ``i``: a text of token ids (tokenised in the step, as with a Hugging Face tokenizer) and a target."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int):
        return " ".join(str((i * k) % 10) for k in range(1, 1 + i % 4 + 1)), float(i % 3)


class TokenisesInTheStep(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.EmbeddingBag(10, 4, mode="mean")
        self.head = torch.nn.Linear(4, 1)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        texts, target = batch  # texts: list of B strings, target: (B,)
        assert len(texts) == target.shape[0], "strings and tensors of one microbatch belong together"
        ids = [torch.tensor([int(t) for t in text.split()]) for text in texts]
        offsets = torch.tensor([0] + [len(i) for i in ids[:-1]]).cumsum(0)
        prediction = self.head(self.embed(torch.cat(ids), offsets)).squeeze(1)  # (B,)
        return torch.nn.functional.mse_loss(prediction, target.float())

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self):
        torch.save({"losses": self.losses, "params": dict(self.named_parameters())}, self.out_file)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Texts(), batch_size=8)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _fit_texts(out_file: str, strategy) -> dict:
    torch.manual_seed(0)
    model = TokenisesInTheStep()
    model.out_file = out_file
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(model)
    return torch.load(out_file, weights_only=False)


def test_a_batch_of_strings_splits_into_microbatches_as_on_one_device(tmp_path):
    expected = _fit_texts(str(tmp_path / "auto.pt"), "auto")
    got = _fit_texts(str(tmp_path / "smp.pt"), lightning_mp.SMPStrategy(microbatches=2, start_method="fork"))
    torch.testing.assert_close(got["losses"], expected["losses"], rtol=1e-5, atol=1e-6)
    assert sorted(got["params"]) == sorted(expected["params"])
    for name, value in got["params"].items():
        torch.testing.assert_close(value, expected["params"][name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("layout", ["dp2", "tp2", "delayed-dp2"])
def test_ranks_start_alike_without_a_seed(tmp_path, layout):
    """Without ``seed_everything`` each popen rank starts from its own OS seed: replicas must still start from one
    model and the ranks of one replica read one batch order (as ``ddp`` broadcasts its module from rank 0)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "LOCAL_RANK", "MASTER_PORT")}
    env.pop("PL_GLOBAL_SEED", None)
    result = subprocess.run(
        [sys.executable, "tests/scripts/unseeded_ranks.py", layout, str(tmp_path)], cwd=ROOT,
        env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    ranks = [torch.load(tmp_path / f"{r}.pt", weights_only=False) for r in range(2)]
    for when in ("initial", "final"):
        for name, value in ranks[0][when].items():
            torch.testing.assert_close(ranks[1][when][name], value, rtol=0, atol=0, msg=f"{when} {name}")
    if layout == "tp2":  # one replica: both ranks read the same shuffled batches
        for a, b in zip(ranks[0]["batches"], ranks[1]["batches"], strict=True):
            assert torch.equal(a, b)
