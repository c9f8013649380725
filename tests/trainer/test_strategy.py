"""``Trainer.fit`` with ``strategy="smp"`` against the same LightningModule on one process.

Every layout (pp x dp, microbatches, schedule) must give the same per-step losses, the same logged values and
the same updated parameters as plain Lightning on one device with the full batch (float32, rtol 1e-5).
"""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lightning_mp
from lightning_mp.strategy._placement import load_plan
from tests._fit import RecordTraining, fit_and_collect
from tests.models import Branchy, MLPStack, PlacedMLP, TinyLM

MODELS = {"mlp": MLPStack, "branchy": Branchy, "tiedlm": TinyLM, "placed": PlacedMLP}
STEPS, GLOBAL_BATCH = 3, 8


class Wrapped(L.LightningModule):
    def __init__(self, model_name: str) -> None:
        super().__init__()
        self.model_name = model_name
        self.net = MODELS[model_name]()

    def training_step(self, batch, batch_idx):
        loss = MODELS[self.model_name].loss(self.net, batch)
        self.log("train_loss", loss)
        # once per step, summed over microbatches and over data-parallel replicas (never over stages)
        self.log("samples", float(batch[0].shape[0]), reduce_fx="sum", on_step=False, on_epoch=True, sync_dist=True)
        self.log_dict({"double_loss": 2 * loss}, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", MODELS[self.model_name].loss(self.net, batch), sync_dist=True)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", MODELS[self.model_name].loss(self.net, batch))

    def predict_step(self, batch, batch_idx):
        return self.net(batch[0])

    def val_dataloader(self) -> DataLoader:
        return self.train_dataloader()

    def test_dataloader(self) -> DataLoader:
        return self.train_dataloader()

    def predict_dataloader(self) -> DataLoader:
        return self.train_dataloader()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        """Shard i of the reference batches, in order (Lightning's own sampler would shuffle)."""
        cls = MODELS[self.model_name]
        parts = [cls.batch(n=GLOBAL_BATCH, seed=step) for step in range(STEPS)]
        dataset = TensorDataset(*(torch.cat(t) for t in zip(*parts)))
        kwargs = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) or {"num_replicas": 1, "rank": 0}
        sampler = DistributedSampler(dataset, shuffle=False, **kwargs)
        return DataLoader(dataset, batch_size=GLOBAL_BATCH // kwargs["num_replicas"], sampler=sampler, drop_last=True)


def record(out_dir: str) -> RecordTraining:
    """Per rank: the loss each step returned, the value logged, the final local parameters and metrics."""
    return RecordTraining(out_dir, logged=True, metrics=True)


def _fit(
    model_name: str, out_dir: str, strategy=None, devices: int = 1, callbacks_extra=(), **trainer_kwargs
) -> list[dict]:
    torch.manual_seed(0)
    return fit_and_collect(
        Wrapped(model_name), out_dir, devices=devices, strategy=strategy, max_steps=STEPS, record=record(out_dir),
        callbacks=callbacks_extra, num_sanity_val_steps=0, use_distributed_sampler=False, **trainer_kwargs,
    )


CLIP = {"gradient_clip_val": 0.05, "gradient_clip_algorithm": "norm"}  # small enough to clip every step


# A hand placement that auto would never choose: every other block on stage 1, the tied embedding/head on 0.
ALTERNATING = {"partition": {"net.blocks.1": 1, "net.blocks.3": 1}, "auto_partition": False}


@pytest.mark.parametrize(
    ("model_name", "pp", "dp", "microbatches", "schedule", "trainer_kwargs", "plan_kwargs"),
    [
        ("mlp", 2, 1, 1, "interleaved", {}, {}),
        ("branchy", 2, 1, 4, "interleaved", CLIP, {}),
        ("tiedlm", 2, 1, 4, "simple", {"accumulate_grad_batches": 2}, {}),
        ("tiedlm", 2, 1, 2, "interleaved", {}, ALTERNATING),
        ("tiedlm", 2, 1, 2, "interleaved", {}, {"optimize": "memory"}),
        ("mlp", 1, 2, 2, "interleaved", {}, {}),
        ("tiedlm", 2, 2, 2, "interleaved", CLIP, {}),
        ("mlp", 2, 2, 4, "interleaved", {}, {"deterministic_order": True}),
        ("branchy", 2, 1, 4, "interleaved", {}, {"_remote_handles": False}),
    ],
    ids=[
        "mlp-pp2-mb1",
        "branchy-pp2-mb4-clipnorm",
        "tiedlm-pp2-mb4-simple-accumulate2",
        "tiedlm-pp2-manual-alternating-plan",
        "tiedlm-pp2-memory-balanced-plan",
        "mlp-dp2-mb2",
        "tiedlm-pp2xdp2-mb2-clipnorm",
        "mlp-pp2xdp2-mb4-deterministic-order",
        "branchy-pp2-mb4-no-remote-handles",
    ],
)
def test_fit_matches_one_process(tmp_path, model_name, pp, dp, microbatches, schedule, trainer_kwargs, plan_kwargs):
    os.makedirs(tmp_path / "ref")
    os.makedirs(tmp_path / "smp")
    reference = _fit(model_name, str(tmp_path / "ref"), **trainer_kwargs)[0]
    strategy = lightning_mp.SMPStrategy(
        pipeline_parallel_degree=pp, microbatches=microbatches, pipeline=schedule, start_method="fork", **plan_kwargs
    )
    results = _fit(model_name, str(tmp_path / "smp"), strategy, devices=pp * dp, **trainer_kwargs)
    if plan_kwargs is ALTERNATING:
        assert "net.blocks.1.1.weight" in results[1]["params"] and "net.blocks.2.1.weight" in results[0]["params"]

    # Global ranks r*pp .. r*pp+pp-1 form data-parallel replica r. Every stage of a replica reports that
    # replica's loss (the mean over its shard of the batch); the mean over replicas is the full-batch loss.
    replicas = [results[r * pp : (r + 1) * pp] for r in range(dp)]
    for stage in range(pp):
        for key in ("losses", "logged"):
            per_replica = torch.tensor([replica[stage][key] for replica in replicas])
            torch.testing.assert_close(per_replica.mean(0).tolist(), reference[key], rtol=1e-5, atol=1e-6)
    for replica in replicas:
        for key in ("losses", "logged"):
            assert all(result[key] == replica[0][key] for result in replica), "stages of a replica agree"
    replica0 = replicas[0]
    for result in results:  # val_loss (sync_dist), samples (sum), double_loss (log_dict): as on one device
        assert sorted(result["metrics"]) == sorted(reference["metrics"])
        for key in ("val_loss", "samples"):
            torch.testing.assert_close(result["metrics"][key], reference["metrics"][key], rtol=1e-5, atol=1e-6, msg=key)
    owned = sorted(name for result in replica0 for name in result["params"])
    assert owned == sorted(reference["params"]), "each parameter lives on exactly one stage of a replica"
    for result in results:
        assert result["params"], "every rank owns parameters"
        for name, value in result["params"].items():
            torch.testing.assert_close(value, reference["params"][name], rtol=1e-5, atol=1e-6, msg=name)


class ProcessWideHooks(L.Callback):
    """Per rank, after fit: are remote handles' process-wide hooks installed in this (spawned, fresh) process?"""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_end(self, trainer, pl_module):
        from torch.nn.modules import module as module_globals

        apply = torch.autograd.Function.__dict__["apply"].__func__
        ours = [h for h in module_globals._global_forward_pre_hooks.values() if h.__module__.startswith("lightning_mp")]
        state = {"apply_wrapped": getattr(apply, "_smp_fetches_handles", False), "global_pre_hooks": len(ours)}
        torch.save(state, os.path.join(self.out_dir, f"hooks{trainer.global_rank}.pt"))


@pytest.mark.parametrize("pp", [1, 2], ids=["pp1-dp2", "pp2"])
def test_process_wide_hooks_only_with_several_stages(tmp_path, pp):
    """A global module forward pre-hook and a wrapped ``torch.autograd.Function.apply`` (remote handles) are
    installed only when the plan has more than one stage; either way the fit matches one process."""
    os.makedirs(tmp_path / "ref")
    os.makedirs(tmp_path / "smp")
    reference = _fit("mlp", str(tmp_path / "ref"))[0]
    strategy = lightning_mp.SMPStrategy(pipeline_parallel_degree=pp, microbatches=2, start_method="spawn")
    hooks = ProcessWideHooks(str(tmp_path / "smp"))
    results = _fit("mlp", str(tmp_path / "smp"), strategy, devices=2, callbacks_extra=(hooks,))
    for rank in range(2):
        state = torch.load(tmp_path / "smp" / f"hooks{rank}.pt")
        assert state == {"apply_wrapped": pp > 1, "global_pre_hooks": int(pp > 1)}, (rank, state)
    replicas = [results[r * pp : (r + 1) * pp] for r in range(2 // pp)]
    losses = torch.tensor([replica[0]["losses"] for replica in replicas]).mean(0)
    torch.testing.assert_close(losses.tolist(), reference["losses"], rtol=1e-5, atol=1e-6)
    for replica in replicas:
        got = {name: value for result in replica for name, value in result["params"].items()}
        assert sorted(got) == sorted(reference["params"])
        for name, value in got.items():
            torch.testing.assert_close(value, reference["params"][name], rtol=1e-5, atol=1e-6, msg=name)


def _fit_with_checkpoint(out_dir: str, ckpt_dir: str, strategy, devices: int, max_steps: int, ckpt_path=None):
    torch.manual_seed(0)
    # monitor: every rank must see the logged value, or ModelCheckpoint raises on the ranks without it
    checkpoint = L.pytorch.callbacks.ModelCheckpoint(dirpath=ckpt_dir, save_last=True, monitor="train_loss", mode="min")
    return fit_and_collect(
        Wrapped("tiedlm"), out_dir, devices=devices, strategy=strategy, max_steps=max_steps, record=record(out_dir),
        callbacks=[checkpoint], ckpt_path=ckpt_path, use_distributed_sampler=False,
    )


@pytest.mark.parametrize("resume_pp", [2, 1], ids=["resume-same-layout", "resume-pp2-as-pp1"])
def test_checkpoint_resume_matches_one_process(tmp_path, capfd, resume_pp):
    """Save after one epoch with pp=2 (parameters and SGD momentum, keyed by FQN), resume for a second epoch.

    The reference is plain Lightning on one device doing the same save and resume.
    """
    for name in ("ref1", "ref2", "first", "second"):
        os.makedirs(tmp_path / name)
    _fit_with_checkpoint(str(tmp_path / "ref1"), str(tmp_path / "ck_ref"), "auto", 1, STEPS)
    reference = _fit_with_checkpoint(
        str(tmp_path / "ref2"), str(tmp_path / "ck_ref2"), "auto", 1, 2 * STEPS,
        ckpt_path=str(tmp_path / "ck_ref" / "last.ckpt"),
    )[0]

    def smp(pp):
        return lightning_mp.SMPStrategy(pipeline_parallel_degree=pp, microbatches=2, start_method="spawn")

    _fit_with_checkpoint(str(tmp_path / "first"), str(tmp_path / "ck"), smp(2), 2, STEPS)
    assert (tmp_path / "ck" / "last" / "meta.pt").is_file(), "a DCP folder (no .ckpt suffix) with Lightning's metadata"
    saved_plan = load_plan(str(tmp_path / "ck" / "last"), Wrapped("tiedlm"), 2)
    assert saved_plan.stage_of["net.embed"] == saved_plan.stage_of["net.head"] == 0
    resumed = _fit_with_checkpoint(
        str(tmp_path / "second"), str(tmp_path / "ck2"), smp(resume_pp), resume_pp, 2 * STEPS,
        ckpt_path=str(tmp_path / "ck" / "last"),
    )
    reused = f"reusing the partition plan from {tmp_path / 'ck' / 'last'}" in "".join(capfd.readouterr())
    assert reused == (resume_pp == 2), "the same layout reuses the saved plan; pp=1 has none to reuse"
    torch.testing.assert_close(resumed[0]["losses"], reference["losses"], rtol=1e-5, atol=1e-6)
    got = {name: value for result in resumed for name, value in result["params"].items()}
    assert sorted(got) == sorted(reference["params"])
    for name, value in got.items():
        torch.testing.assert_close(value, reference["params"][name], rtol=1e-5, atol=1e-6, msg=name)


class SavePredictions(L.Callback):
    """Spawned processes cannot return predictions; each rank writes what ``predict_step`` returned to it."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.outputs: list[torch.Tensor] = []

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.outputs.append(outputs)

    def on_predict_end(self, trainer, pl_module):
        torch.save(torch.cat(self.outputs), os.path.join(self.out_dir, f"pred{trainer.global_rank}.pt"))


def test_validate_test_predict_match_one_process(tmp_path):
    torch.manual_seed(0)
    reference_model = Wrapped("branchy")
    plain = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, use_distributed_sampler=False)
    expected_val = plain.validate(reference_model)[0]
    expected_test = plain.test(reference_model)[0]
    expected_pred = torch.cat(plain.predict(reference_model))

    def trainer():
        strategy = lightning_mp.SMPStrategy(pipeline_parallel_degree=2, microbatches=4, start_method="fork")
        return L.Trainer(
            accelerator="cpu", devices=2, strategy=strategy, logger=False, enable_progress_bar=False,
            use_distributed_sampler=False, callbacks=[SavePredictions(str(tmp_path))],
        )

    torch.manual_seed(0)
    model = Wrapped("branchy")
    got_val = trainer().validate(model)[0]
    got_test = trainer().test(model)[0]
    trainer().predict(model, return_predictions=False)
    got_preds = [torch.load(tmp_path / f"pred{rank}.pt") for rank in range(2)]
    torch.testing.assert_close(got_val["val_loss"], expected_val["val_loss"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_test["test_loss"], expected_test["test_loss"], rtol=1e-5, atol=1e-6)
    for got_pred in got_preds:  # every stage returns the merged predictions of the driver
        torch.testing.assert_close(got_pred, expected_pred, rtol=1e-5, atol=1e-6)


class ManualOptimization(Wrapped):
    def __init__(self) -> None:
        super().__init__("mlp")
        self.automatic_optimization = False


def test_manual_optimization_is_a_clear_error():
    strategy = lightning_mp.SMPStrategy(start_method="spawn")
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=1, logger=False)
    with pytest.raises(Exception, match="manual optimization"):
        trainer.fit(ManualOptimization())


def test_indivisible_training_batch_fails_at_setup_on_every_rank():
    strategy = lightning_mp.SMPStrategy(pipeline_parallel_degree=2, microbatches=3, start_method="fork")
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=1, logger=False, use_distributed_sampler=False
    )
    with pytest.raises(Exception, match=r"Setup failed on global rank 0 while tracing.*MicrobatchSplitError.*into 3 microbatches"):
        trainer.fit(Wrapped("mlp"))


def test_bf16_mixed_matches_one_process(tmp_path):
    """Autocast wraps the driver's step and every served forward, as on one device (bf16 tolerances)."""
    for name in ("ref32", "ref", "smp"):
        os.makedirs(tmp_path / name)
    fp32 = _fit("mlp", str(tmp_path / "ref32"))[0]
    reference = _fit("mlp", str(tmp_path / "ref"), precision="bf16-mixed")[0]
    strategy = lightning_mp.SMPStrategy(pipeline_parallel_degree=2, microbatches=2, start_method="fork")
    results = _fit("mlp", str(tmp_path / "smp"), strategy, devices=2, precision="bf16-mixed")
    # The first loss (before any update) is computed by both stages: it must be the bf16 value, not the fp32 one.
    assert abs(reference["losses"][0] - fp32["losses"][0]) > 1e-5, "bf16 changes the loss of this model"
    torch.testing.assert_close(results[0]["losses"][0], reference["losses"][0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(results[0]["losses"], reference["losses"], rtol=2e-2, atol=1e-2)
    for result in results:
        for name, value in result["params"].items():
            torch.testing.assert_close(value, reference["params"][name], rtol=2e-2, atol=1e-2, msg=name)


def test_manual_placement_summary_and_plan_reuse(tmp_path):
    """`with lightning_mp.partition(k)` marks win over auto; PartitionSummary writes the plan; reusing it places
    every parameter on the same rank; measured-time tracing gives a working plan; results match one process."""
    for name in ("ref", "first", "second"):
        os.makedirs(tmp_path / name)
    reference = _fit("placed", str(tmp_path / "ref"))[0]
    strategy = lightning_mp.SMPStrategy(
        pipeline_parallel_degree=2, microbatches=2, start_method="fork", trace_execution_times=True
    )
    summary = lightning_mp.PartitionSummary()
    first = _fit("placed", str(tmp_path / "first"), strategy, devices=2, callbacks_extra=[summary],
                 default_root_dir=str(tmp_path / "logs"))
    assert "net.layers.1.0.weight" in first[1]["params"], "built inside lightning_mp.partition(1)"
    assert "net.head.weight" in first[0]["params"], "built inside lightning_mp.partition(0)"
    assert (tmp_path / "logs" / "partition.png").stat().st_size > 1000
    plan_file = tmp_path / "logs" / "partition.json"
    reused = lightning_mp.SMPStrategy(
        pipeline_parallel_degree=2, microbatches=2, start_method="fork", partition_plan=str(plan_file)
    )
    second = _fit("placed", str(tmp_path / "second"), reused, devices=2)
    for rank in range(2):
        assert sorted(second[rank]["params"]) == sorted(first[rank]["params"])
    for result in first + second:
        for name, value in result["params"].items():
            torch.testing.assert_close(value, reference["params"][name], rtol=1e-5, atol=1e-6, msg=name)
