"""Delayed init for models whose step reads tensor values, through ``Trainer.fit``: at pp=2 with delayed init it
equals eager on one process (loss and every parameter); a model that uses a child's weight in its parent's forward
gets one error that names the module, the op and the way out, and no second error from the teardown (popen
launcher, ``tests/scripts/delayed_trace_error.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_mp
from tests._fit import fit_and_collect
from tests.unit.test_delayed_trace import Gated, SEED, STEPS

ROOT = Path(__file__).resolve().parents[2]


class GateOnAChildsWeight(Gated):
    """The parent reads ``alt.weight`` outside ``alt``'s call: cannot be made real module by module
    (``tests/scripts/delayed_trace_error.py``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.alt.weight.sum() > 0:
            x = x * 2
        return super().forward(x)


class Lit(L.LightningModule):
    def __init__(self, model_cls: type[nn.Module] = Gated) -> None:
        super().__init__()
        self.model_cls, self.net = model_cls, None

    def configure_model(self) -> None:
        if self.net is None:
            torch.manual_seed(SEED)
            self.net = self.model_cls()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(2)
        return DataLoader(TensorDataset(torch.randn(8 * STEPS, 8, generator=g), torch.randn(8 * STEPS, generator=g)),
                          batch_size=8)


def _fit(out_dir: Path, strategy="auto", devices: int = 1) -> list[dict]:
    out_dir.mkdir()
    return fit_and_collect(Lit(), out_dir, devices=devices, strategy=strategy, max_steps=STEPS)


def test_data_dependent_model_with_delayed_init_at_pp2_matches_eager_one_process(tmp_path):
    reference = _fit(tmp_path / "ref")[0]
    strategy = lightning_mp.SMPStrategy(
        pipeline_parallel_degree=2, microbatches=1, start_method="fork", delayed_parameter_initialization=True
    )
    results = _fit(tmp_path / "smp", strategy, devices=2)
    assert all(r["params"] for r in results), "both stages hold parameters"
    params = {n: p for r in results for n, p in r["params"].items()}
    assert sorted(params) == sorted(reference["params"])
    for result in results:
        torch.testing.assert_close(result["losses"], reference["losses"], rtol=1e-5, atol=1e-6)
    for name, value in params.items():
        torch.testing.assert_close(value, reference["params"][name], rtol=1e-5, atol=1e-6, msg=name)


def _failed_script_output(script: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "LOCAL_RANK", "MASTER_PORT")}
    result = subprocess.run(
        [sys.executable, f"tests/scripts/{script}"], cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode != 0
    return result.stdout + result.stderr


def test_a_parent_reading_a_childs_weight_is_one_clear_error_and_the_teardown_adds_none():
    output = _failed_script_output("delayed_trace_error.py")
    assert "it failed in module 'net'" in output, output[-4000:]
    assert "Tensor.item() cannot be called on meta tensors" in output, output[-4000:]
    assert "partition_plan=" in output, output[-4000:]
    assert "Cannot copy out of meta tensor" not in output, output[-4000:]


def test_a_model_built_in_two_delayed_blocks_fails_once_and_the_teardown_adds_none():
    output = _failed_script_output("delayed_two_blocks.py")
    assert output.count("ValueError: The model was built in 2 separate") == 1, output[-4000:]
