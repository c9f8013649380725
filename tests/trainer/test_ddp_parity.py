"""``strategy="smp"`` against ``strategy="ddp"``: what a user sees must not change (issue 13).

Each test runs both strategies on the same model, data and seed, and compares what Lightning reports.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_mp
from tests._fit import fit_and_collect
from tests.trainer.test_strategy import STEPS, Wrapped, _fit, record

ROOT = Path(__file__).resolve().parents[2]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "LOCAL_RANK", "MASTER_PORT")}
    return {**env, "PYTHONPATH": str(ROOT), **extra}


def _threads(out_dir: Path, spec: str, external: bool = False) -> list[dict]:
    """Run tests/scripts/threads_per_rank.py with popen (or as two externally created processes, like SLURM)."""
    out_dir.mkdir()
    command = [sys.executable, "tests/scripts/threads_per_rank.py", spec, str(out_dir)]
    if external:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = str(s.getsockname()[1])
        envs = [_env(LOCAL_RANK=str(r), NODE_RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
                for r in range(2)]
        procs = [subprocess.Popen(command, cwd=ROOT, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for e in envs]
        outputs = [p.communicate(timeout=300)[0] for p in procs]
        assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outputs)
    else:
        result = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return [json.loads((out_dir / f"threads_{rank}.json").read_text()) for rank in range(2)]


def test_threads_per_rank_match_ddp(tmp_path):
    """Every rank, however started, runs ddp's thread count in training_step and in every engine thread."""
    reference = _threads(tmp_path / "ddp", "ddp")
    assert all(r["step"] and r["layers"] for r in reference), "ddp ran its steps"
    runs = {"popen-pp2": _threads(tmp_path / "pp2", "smp:2"), "external-pp1": _threads(tmp_path / "ext", "smp:1", True)}
    for name, ranks in runs.items():
        for rank, (got, expected) in enumerate(zip(ranks, reference)):
            assert got["layers"], f"{name}: rank {rank} ran layers"
            assert got["step"] in ([], expected["step"]), f"{name}: rank {rank} training_step threads"
            assert set(got["layers"]) == set(expected["layers"]), f"{name}: rank {rank} layer threads"
            assert got["omp"] == expected["omp"], f"{name}: rank {rank} OMP_NUM_THREADS"
    assert runs["popen-pp2"][0]["step"] and runs["external-pp1"][1]["step"], "drivers ran training_step"


# ---- Trainer runs: one device, ddp, smp --------------------------------------------------------------------

NUM_CLASSES, TRAIN_SIZE, VAL_SIZE, BATCH = 3, 32, 24, 8


class Classifier(L.LightningModule):
    """Logs a torchmetrics Accuracy (on step and epoch) and MeanSquaredError, and a plain tensor with sync_dist;
    computes a MeanAbsoluteError by hand at epoch end."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, NUM_CLASSES))
        self.train_acc = torchmetrics.classification.MulticlassAccuracy(NUM_CLASSES, average="micro")
        self.val_acc = torchmetrics.classification.MulticlassAccuracy(NUM_CLASSES, average="micro")
        self.val_mse = torchmetrics.MeanSquaredError()
        self.val_mae = torchmetrics.MeanAbsoluteError()  # updated per step, never passed to self.log: see below

    def training_step(self, batch, batch_idx):
        x, y, target = batch
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        self.train_acc(logits, y)
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y, target = batch
        logits = self.net(x)
        self.val_acc(logits, y)
        self.val_mse(logits[:, 0], target)
        self.log_dict({"val_acc": self.val_acc, "val_mse": self.val_mse})
        self.val_mae(logits[:, 1], target)

    def on_validation_epoch_end(self):  # computed by hand on every rank: every rank must hold the whole state
        self.log("val_mae", self.val_mae.compute())
        self.val_mae.reset()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)

    @staticmethod
    def _data(n: int, seed: int) -> TensorDataset:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n, 8, generator=g)
        y = torch.randint(0, NUM_CLASSES, (n,), generator=g)
        return TensorDataset(x, y, x[:, 0] + 0.1 * torch.randn(n, generator=g))

    def train_dataloader(self):
        return DataLoader(self._data(TRAIN_SIZE, 0), batch_size=BATCH, shuffle=False)

    def val_dataloader(self):
        return DataLoader(self._data(VAL_SIZE, 1), batch_size=BATCH)


class RecordRun(L.Callback):
    """Per rank: every training batch (as the step got it), each step's loss and logged accuracy, final metrics."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.batches: list[torch.Tensor] = []
        self.losses: list[float] = []
        self.step_acc: list[float] = []
        self.after_backward: list[dict[str, torch.Tensor]] = []

    def on_after_backward(self, trainer, pl_module):  # under ddp: the gradients averaged over replicas
        if len(self.after_backward) < 3:
            self.after_backward.append({n: p.grad.clone() for n, p in pl_module.named_parameters() if p.grad is not None})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batches.append(batch[0].detach().clone())
        self.losses.append(float(outputs["loss"]))
        self.step_acc.append(float(trainer.callback_metrics["train_acc_step"]))

    def on_train_end(self, trainer, pl_module):
        record = {
            "batches": self.batches, "losses": self.losses, "step_acc": self.step_acc, "after_backward": self.after_backward,
            "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
            "params": {n: p.detach().clone() for n, p in pl_module.named_parameters()},
        }
        torch.save(record, os.path.join(self.out_dir, f"{trainer.global_rank}.pt"))


class RecordSummary(L.Callback):
    """What Lightning's ModelSummary callback would print on this rank: totals and per-layer parameter counts."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_fit_start(self, trainer, pl_module):
        (callback,) = [c for c in trainer.callbacks if isinstance(c, L.pytorch.callbacks.ModelSummary)]
        summary = callback._summary(trainer, pl_module)
        record = {"total": summary.total_parameters, "trainable": summary.trainable_parameters,
                  "layers": dict(zip(summary.layer_names, summary.param_nums))}
        torch.save(record, os.path.join(self.out_dir, f"summary{trainer.global_rank}.pt"))


def _fit_classifier(out_dir: Path, strategy: Any, devices: int, **kwargs: Any) -> list[dict]:
    out_dir.mkdir()
    torch.manual_seed(0)
    return fit_and_collect(
        Classifier(), out_dir, devices=devices, strategy=strategy, record=RecordRun(str(out_dir)),
        callbacks=[RecordSummary(str(out_dir))], max_epochs=2, enable_model_summary=True, num_sanity_val_steps=0,
        **kwargs,
    )


def _assert_runs_match(got: dict, expected: dict, what: str) -> None:
    assert len(got["batches"]) == len(expected["batches"]) == 2 * TRAIN_SIZE // BATCH // (2 if "dp2" in what else 1)
    for step, (a, b) in enumerate(zip(got["batches"], expected["batches"])):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"{what}: batch of step {step}")
    for key in ("losses", "step_acc"):
        torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=1e-6, msg=f"{what}: {key}")
    assert len(got["after_backward"]) == len(expected["after_backward"]) == 3, what
    for step, (a, b) in enumerate(zip(got["after_backward"], expected["after_backward"])):
        assert a and set(a) <= set(b), f"{what}: gradients in on_after_backward of step {step}"  # a stage's own
        for name, grad in a.items():
            torch.testing.assert_close(grad, b[name], rtol=1e-5, atol=1e-6, msg=f"{what}: {name} in on_after_backward")
    assert sorted(got["metrics"]) == sorted(expected["metrics"]), what
    for key, value in expected["metrics"].items():  # val_acc, val_mse, val_mae, train_acc_epoch, train_loss_epoch, ...
        torch.testing.assert_close(got["metrics"][key], value, rtol=1e-5, atol=1e-6, msg=f"{what}: {key}")


def test_metrics_losses_and_data_order_match_ddp(tmp_path, capfd):
    """torchmetrics objects, per-step losses, callback_metrics and batches: smp against ddp (dp=2) and against one
    device (pp=2, dp=1, where the user's shuffle=False order must stay as it is). At pp=2 Lightning's model summary
    counts every stage, the partition table leaves the (parameter-less) metrics out, and Lightning's sync_dist
    advice (noise with one replica) is not given."""
    ddp = _fit_classifier(tmp_path / "ddp", "ddp_spawn", 2)
    smp_dp2 = _fit_classifier(tmp_path / "dp2", lightning_mp.SMPStrategy(microbatches=2, start_method="spawn"), 2)
    for rank in range(2):
        _assert_runs_match(smp_dp2[rank], ddp[rank], f"smp-dp2 rank {rank} vs ddp")
    assert ddp[0]["metrics"]["val_acc"] == ddp[1]["metrics"]["val_acc"], "ddp syncs the metric over replicas"

    one = _fit_classifier(tmp_path / "one", "auto", 1)
    capfd.readouterr()
    pp2 = lightning_mp.SMPStrategy(pipeline_parallel_degree=2, microbatches=2, start_method="spawn")
    smp_pp2 = _fit_classifier(tmp_path / "pp2", pp2, 2)
    output = "".join(capfd.readouterr())
    table = output.split("lightning_mp partition plan:")[1].split("\n\n")[0]
    assert "net" in table and "acc" not in table and "mse" not in table, table
    assert "It is recommended to use" not in output
    expected_summary = torch.load(tmp_path / "one" / "summary0.pt")
    assert expected_summary["total"] > 0 and expected_summary["layers"]["net"] == expected_summary["total"]
    assert torch.load(tmp_path / "pp2" / "summary0.pt") == expected_summary, "rank 0 summarizes every stage"
    expected_order = [x for x, _, _ in DataLoader(Classifier._data(TRAIN_SIZE, 0), batch_size=BATCH)]
    for step, batch in enumerate(expected_order):
        torch.testing.assert_close(one[0]["batches"][step], batch, rtol=0, atol=0, msg="one device keeps the order")
    for rank in range(2):
        _assert_runs_match(smp_pp2[rank], one[0], f"smp-pp2 rank {rank} vs one device")
    params = {n: p for result in smp_pp2 for n, p in result["params"].items()}
    assert sorted(params) == sorted(one[0]["params"])
    for name, value in params.items():
        torch.testing.assert_close(value, one[0]["params"][name], rtol=1e-5, atol=1e-6, msg=name)


# ---- checkpoint formats the ecosystem opens -----------------------------------------------------------------


class AdamLM(Wrapped):
    """The tied-embedding LM of tests/trainer/test_strategy.py with Adam (step counts and two moment buffers to carry)."""

    def __init__(self) -> None:
        super().__init__("tiedlm")

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def _fit_lm(out_dir: Path, ckpt_dir: Path, strategy: Any, devices: int, max_steps: int, ckpt_path: Any = None):
    out_dir.mkdir()
    torch.manual_seed(0)
    return fit_and_collect(
        AdamLM(), out_dir, devices=devices, strategy=strategy, max_steps=max_steps, record=record(str(out_dir)),
        callbacks=[L.pytorch.callbacks.ModelCheckpoint(dirpath=ckpt_dir, save_last=True)], ckpt_path=ckpt_path,
        num_sanity_val_steps=0, use_distributed_sampler=False,
    )


@pytest.fixture(scope="module")
def lm_reference(tmp_path_factory) -> dict[str, Any]:
    """One device: STEPS steps saving ``last.ckpt`` (a plain Lightning checkpoint), then a run resumed from it to
    2 x STEPS. Shared by the checkpoint tests below."""
    root = tmp_path_factory.mktemp("lm_reference")
    first = _fit_lm(root / "ref", root / "ck_ref", "auto", 1, STEPS)[0]
    resumed = _fit_lm(root / "ref2", root / "ck_ref2", "auto", 1, 2 * STEPS, ckpt_path=root / "ck_ref" / "last.ckpt")[0]
    assert len(resumed["losses"]) == STEPS, "the reference resumed at step STEPS"
    return {"first": first, "resumed": resumed, "last": root / "ck_ref" / "last.ckpt"}


def _assert_same_checkpoint(got: dict, expected: dict) -> None:
    for key in ("epoch", "global_step"):
        assert got[key] == expected[key], key
    assert sorted(got["state_dict"]) == sorted(expected["state_dict"])
    for name, value in expected["state_dict"].items():
        torch.testing.assert_close(got["state_dict"][name], value, rtol=1e-5, atol=1e-6, msg=name)
    (got_optim,), (expected_optim,) = got["optimizer_states"], expected["optimizer_states"]
    assert got_optim["param_groups"] == expected_optim["param_groups"]
    assert sorted(got_optim["state"]) == sorted(expected_optim["state"])
    for index, state in expected_optim["state"].items():
        for key, value in state.items():
            got_value = got_optim["state"][index][key]
            torch.testing.assert_close(got_value, value, rtol=1e-5, atol=1e-6, msg=f"{index}.{key}")
    assert got["loops"] == expected["loops"]


def _full_file_strategy() -> lightning_mp.SMPStrategy:
    return lightning_mp.SMPStrategy(
        pipeline_parallel_degree=2, microbatches=2, start_method="spawn", save_distributed_checkpoint=False
    )


def test_full_checkpoint_file_at_pp2_is_a_plain_lightning_checkpoint(tmp_path, capfd, lm_reference):
    """save_distributed_checkpoint=False at pp=2 writes the file one device writes; load_from_checkpoint reads it;
    resuming from it (``ckpt_path="last"``) reuses the partition plan saved in it and continues as one device does."""
    capfd.readouterr()
    _fit_lm(tmp_path / "smp", tmp_path / "ck", _full_file_strategy(), 2, STEPS)
    assert "reusing the partition plan" not in "".join(capfd.readouterr()), "a fresh run plans"
    assert (tmp_path / "ck" / "last.ckpt").is_file()
    got, expected = (torch.load(p, weights_only=False) for p in (tmp_path / "ck" / "last.ckpt", lm_reference["last"]))
    _assert_same_checkpoint(got, expected)
    model = AdamLM.load_from_checkpoint(tmp_path / "ck" / "last.ckpt", map_location="cpu")
    for name, value in model.named_parameters():
        torch.testing.assert_close(value, lm_reference["first"]["params"][name], rtol=1e-5, atol=1e-6, msg=name)

    # "last", resolved by Lightning in each process (the path itself is resumed in test_strategy's resume test)
    resumed = _fit_lm(tmp_path / "smp2", tmp_path / "ck", _full_file_strategy(), 2, 2 * STEPS, ckpt_path="last")
    out = "".join(capfd.readouterr())  # Lightning's rank-zero info goes to stderr
    assert f"reusing the partition plan from {tmp_path / 'ck' / 'last.ckpt'}" in out
    for result in resumed:
        torch.testing.assert_close(result["losses"], lm_reference["resumed"]["losses"], rtol=1e-5, atol=1e-6)


def test_full_checkpoint_file_gathers_sharded_optimizer_state(tmp_path, lm_reference):
    """ZeRO-1 at dp=2 with save_distributed_checkpoint=False: the file holds every parameter's Adam state (gathered
    over the data-parallel ranks) as one device writes it, and a ZeRO run resumes from it as one device resumes.
    (Each replica reads its half of the global batch, as in test_strategy: the mean over replicas is one device's.)"""
    strategy = lightning_mp.SMPStrategy(start_method="fork", save_distributed_checkpoint=False, shard_optimizer_state=True)
    _fit_lm(tmp_path / "zero", tmp_path / "ck", strategy, 2, STEPS)
    got, expected = (torch.load(p, weights_only=False) for p in (tmp_path / "ck" / "last.ckpt", lm_reference["last"]))
    _assert_same_checkpoint(got, expected)
    strategy = lightning_mp.SMPStrategy(start_method="fork", save_distributed_checkpoint=False, shard_optimizer_state=True)
    resumed = _fit_lm(tmp_path / "zero2", tmp_path / "ck2", strategy, 2, 2 * STEPS, ckpt_path=tmp_path / "ck" / "last.ckpt")
    reference = lm_reference["resumed"]
    mean_losses = torch.tensor([result["losses"] for result in resumed]).mean(0).tolist()
    torch.testing.assert_close(mean_losses, reference["losses"], rtol=1e-5, atol=1e-6)
    for result in resumed:
        for name, value in result["params"].items():
            torch.testing.assert_close(value, reference["params"][name], rtol=1e-5, atol=1e-6, msg=name)


def test_plain_lightning_checkpoint_resumes_under_smp_pp2(tmp_path, lm_reference):
    """A one-device Lightning checkpoint (weights, Adam state, loops) resumes an smp pp=2 run, as on one device."""
    reference = lm_reference["resumed"]
    strategy = lightning_mp.SMPStrategy(pipeline_parallel_degree=2, microbatches=2, start_method="fork")
    resumed = _fit_lm(tmp_path / "smp", tmp_path / "ck", strategy, 2, 2 * STEPS, ckpt_path=lm_reference["last"])
    for result in resumed:
        torch.testing.assert_close(result["losses"], reference["losses"], rtol=1e-5, atol=1e-6)
    got = {name: value for result in resumed for name, value in result["params"].items()}
    assert sorted(got) == sorted(reference["params"])
    for name, value in got.items():
        torch.testing.assert_close(value, reference["params"][name], rtol=1e-5, atol=1e-6, msg=name)
    assert (tmp_path / "ck" / "last" / "meta.pt").is_file(), "smp's own checkpoints: DCP folders named without .ckpt"


# ---- precision ----------------------------------------------------------------------------------------------


class RecordScale(L.Callback):
    """Per rank: the GradScaler's scale after each step (``None`` without a scaler)."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.scales: list[float | None] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.scales.append(None if scaler is None else float(scaler.get_scale()))

    def on_train_end(self, trainer, pl_module):
        torch.save(self.scales, os.path.join(self.out_dir, f"scales{trainer.global_rank}.pt"))


def _precision_kwargs(precision: str) -> dict[str, Any]:
    if precision == "16-mixed":  # an explicit plugin: on CPU, Trainer(precision="16-mixed") means bf16-mixed
        # growth_interval=1: the scale grows every step until fp16 gradients overflow (step 3 of this model)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=1)
        return {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=scaler)]}
    return {"precision": precision}


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-true"])
def test_precision_matches_one_device(tmp_path, precision):
    """16-mixed (GradScaler: loss scaled inside the pipeline, one skip/scale decision for all ranks) and bf16-true
    at pp=1 and pp=2, against the same precision on one device (tolerances of the 16-bit dtypes)."""
    (tmp_path / "ref").mkdir()
    reference = _fit("mlp", str(tmp_path / "ref"), callbacks_extra=[RecordScale(str(tmp_path / "ref"))],
                     **_precision_kwargs(precision))[0]
    expected_scales = torch.load(tmp_path / "ref" / "scales0.pt")
    if precision == "16-mixed":
        assert expected_scales == [2.0**17, 2.0**18, 2.0**17], "two steps taken, then one skipped on overflow"
    else:
        assert all(p.dtype == torch.bfloat16 for p in reference["params"].values())
    for pp in (1, 2):
        out = tmp_path / f"pp{pp}"
        out.mkdir()
        strategy = lightning_mp.SMPStrategy(pipeline_parallel_degree=pp, microbatches=2, start_method="fork")
        # dp=1: with dp > 1 each replica's loss is the mean over its shard, so fp16 gradients are dp times larger
        # than one device's and overflow at another step (as under ddp); pipelining alone must change nothing.
        results = _fit("mlp", str(out), strategy, devices=pp, callbacks_extra=[RecordScale(str(out))],
                       **_precision_kwargs(precision))
        for rank in range(pp):
            assert torch.load(out / f"scales{rank}.pt") == expected_scales, f"pp={pp} rank {rank}: GradScaler scale"
        for result in results:
            torch.testing.assert_close(result["losses"], reference["losses"], rtol=2e-2, atol=1e-2, msg=f"pp={pp}")
        for result in results:
            for name, value in result["params"].items():
                assert value.dtype == reference["params"][name].dtype, name
                expected = reference["params"][name]
                torch.testing.assert_close(value, expected, rtol=2e-2, atol=1e-2, msg=f"pp={pp} {name}")


def test_setup_error_raised_on_every_rank_prints_once():
    """popen: both ranks fail, rank 0 prints the error, rank 1 one line pointing there."""
    result = subprocess.run([sys.executable, "tests/scripts/setup_error.py"], cwd=ROOT, env=_env(),
                            capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert output.count("Traceback (most recent call last)") == 1, output[-4000:]
    assert output.count("into 3 microbatches") == 1, output[-4000:]
    assert "[global rank 1] ValueError: the same error, printed in full by global rank 0." in output
