"""The tensor-parallel configs through ``lightning-mp fit``, a few steps each (small and bounded)."""

from __future__ import annotations

import csv
import math

import pytest

from tests.cli.test_cli import _run, warnings_of_ours


@pytest.mark.parametrize("config", ["gpt_tp2", "llama_tp2"])
def test_tp_config_short_fit(tmp_path, config):
    result = _run(
        [
            "fit",
            "--config", f"configs/{config}.yaml",
            "--trainer.max_steps", "4",
            "--trainer.val_check_interval", "4",
            "--trainer.limit_val_batches", "1",
            "--trainer.log_every_n_steps", "1",
            "--trainer.default_root_dir", str(tmp_path),
            "--trainer.logger", "lightning.pytorch.loggers.CSVLogger",
            "--trainer.logger.save_dir", str(tmp_path),
            "--data.init_args.batch_size", "4",
            "--data.init_args.max_bytes", "200000",
        ]
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert not warnings_of_ours(result.stdout + result.stderr), warnings_of_ours(result.stdout + result.stderr)
    (metrics,) = list(tmp_path.rglob("metrics.csv"))
    rows = list(csv.DictReader(metrics.open()))
    train = [float(r["train_loss"]) for r in rows if r.get("train_loss")]
    val = [float(r["val_loss"]) for r in rows if r.get("val_loss")]
    assert len(train) == 4 and len(val) == 1
    assert all(math.isfinite(x) and 0.0 < x < 7.0 for x in train + val)
