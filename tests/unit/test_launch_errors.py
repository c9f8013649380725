"""Layout errors known before the launch are raised in the launching process, and no process starts."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from torch.utils.data import DataLoader

import lightning_mp
from lightning_mp.strategy._placement import load_plan
from tests.models import MLPStack


class Module(L.LightningModule):
    def __init__(self, batch_size: int = 8) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.net = MLPStack()

    def training_step(self, batch, batch_idx):
        return self.net(batch).square().mean()

    def train_dataloader(self) -> DataLoader:
        return DataLoader(torch.randn(32, 16), batch_size=self.batch_size)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.fixture
def no_process_starts(monkeypatch):
    """Any attempt to start a rank (popen children, spawn/fork workers) fails the test."""

    def started(*args, **kwargs):
        raise AssertionError("a process was started")

    monkeypatch.setattr(_SubprocessScriptLauncher, "_call_children_scripts", started)
    monkeypatch.setattr(torch.multiprocessing, "start_processes", started)


def _fit(devices: int, fit_kwargs: dict | None = None, module: Module | None = None, **strategy_kwargs) -> None:
    strategy = lightning_mp.SMPStrategy(**strategy_kwargs)
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=1, logger=False)
    trainer.fit(module or Module(), **(fit_kwargs or {}))


@pytest.mark.parametrize("start_method", ["popen", "spawn"])
def test_world_size_not_a_multiple_of_pp_x_tp_fails_before_any_process_starts(no_process_starts, start_method):
    with pytest.raises(ValueError, match=r"World size 3 is not divisible by pipeline_parallel_degree \(2\)"):
        _fit(3, pipeline_parallel_degree=2, start_method=start_method)


def test_a_known_batch_size_that_does_not_split_fails_before_any_process_starts(no_process_starts):
    loader = DataLoader(torch.randn(30, 16), batch_size=6)
    with pytest.raises(ValueError, match=r"DataLoader given to `fit` is 6, which does not split into microbatches=4"):
        _fit(2, {"train_dataloaders": loader}, pipeline_parallel_degree=2, microbatches=4)
    with pytest.raises(ValueError, match=r"the model \(its `batch_size`\) is 6.*microbatches=4"):
        _fit(2, module=Module(batch_size=6), pipeline_parallel_degree=2, microbatches=4)


def test_a_corrupted_partition_plan_names_the_file_before_any_process_starts(no_process_starts, tmp_path):
    plan_file = tmp_path / "partition.json"
    plan_file.write_text('{"num_stages": 2, "stage_of": {"net": 0')  # cut off while written
    with pytest.raises(ValueError, match=rf"Cannot read the partition plan '{plan_file}': it is not valid JSON.*Write it again"):
        _fit(2, pipeline_parallel_degree=2, partition_plan=str(plan_file))
    plan_file.write_text('{"stages": 2}')
    with pytest.raises(ValueError, match=r"it holds no partition plan.*drop `partition_plan` to plan anew"):
        load_plan(str(plan_file), MLPStack(), 2)
