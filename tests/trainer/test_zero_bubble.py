"""``pipeline="zero_bubble"`` through ``Trainer.fit`` against one process: pp=2 with activation checkpointing, and
pp2 x dp2 with the data-parallel buckets leaving from the gradient hooks of the deferred weight passes."""

from __future__ import annotations

import torch

import lightning_mp
from lightning_mp.strategy import _reducer
from tests.trainer.test_reducer import _RecordReducer
from tests.trainer.test_strategy import CLIP, _fit

TOL = {"rtol": 1e-5, "atol": 1e-6}


def _assert_params_match(results: list[dict], reference: dict) -> None:
    for result in results:
        for name, value in result["params"].items():
            torch.testing.assert_close(value, reference["params"][name], **TOL, msg=name)


def test_zero_bubble_pp2_with_checkpointing_matches_one_process(tmp_path):
    reference = _fit("branchy", str(tmp_path / "ref"), **CLIP)[0]
    strategy = lightning_mp.SMPStrategy(pipeline_parallel_degree=2, microbatches=4, pipeline="zero_bubble",
                                        start_method="fork")
    checkpointing = lightning_mp.ActivationCheckpointing(["net.block", "net.gate"])
    results = _fit("branchy", str(tmp_path / "smp"), strategy, devices=2, callbacks_extra=[checkpointing], **CLIP)
    torch.testing.assert_close(results[0]["losses"], reference["losses"], **TOL)
    assert sorted(n for r in results for n in r["params"]) == sorted(reference["params"]), "every parameter, once"
    _assert_params_match(results, reference)


def test_zero_bubble_pp2_dp2_buckets_leave_from_weight_passes_and_training_matches_one_process(tmp_path, monkeypatch):
    torch.set_num_threads(1)  # before forking (a forked child can hang in OpenMP otherwise)
    monkeypatch.setattr(_reducer, "FIRST_BUCKET_BYTES", 64)  # fork: the children see the patched module
    monkeypatch.setattr(_reducer, "BUCKET_BYTES", 512)
    (tmp_path / "ref").mkdir()
    (tmp_path / "smp").mkdir()
    reference = _fit("tiedlm", str(tmp_path / "ref"), **CLIP)[0]
    strategy = lightning_mp.SMPStrategy(pipeline_parallel_degree=2, microbatches=4, pipeline="zero_bubble",
                                        start_method="fork")
    results = _fit("tiedlm", str(tmp_path / "smp"), strategy, devices=4,
                   callbacks_extra=[_RecordReducer(str(tmp_path / "smp"))], **CLIP)
    for rank in range(4):
        record = torch.load(tmp_path / "smp" / f"reducer{rank}.pt")
        assert record["enabled"] and record["in_backward"] > 0, (rank, record)
    replicas = [results[r * 2 : (r + 1) * 2] for r in range(2)]
    mean_losses = torch.tensor([replica[0]["losses"] for replica in replicas]).mean(0).tolist()
    torch.testing.assert_close(mean_losses, reference["losses"], **TOL)
    _assert_params_match(results, reference)
