"""Lightning's model summary counts the model the user wrote (full sizes) under tensor parallelism."""

from __future__ import annotations

import lightning as L
import torch

import lightning_mp
from tests.trainer.test_ddp_parity import RecordSummary
from tests.trainer.test_tp_trainer import TinyTPGPT


def _summary(out_dir, strategy, devices: int) -> list[dict]:
    out_dir.mkdir()
    torch.manual_seed(0)
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False,
        callbacks=[RecordSummary(str(out_dir))],
    )
    trainer.fit(TinyTPGPT())
    return [torch.load(out_dir / f"summary{rank}.pt") for rank in range(devices)]


def test_summary_counts_logical_parameters_under_tensor_parallelism(tmp_path):
    (expected,) = _summary(tmp_path / "one", "auto", 1)
    assert expected["total"] == sum(p.numel() for p in TinyTPGPT().parameters())
    strategy = lightning_mp.SMPStrategy(tensor_parallel_degree=2, start_method="fork")
    for rank, got in enumerate(_summary(tmp_path / "tp2", strategy, 2)):
        assert got == expected, f"rank {rank}: {got} != {expected}"
