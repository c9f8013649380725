"""Checkpoints move between layouts: a run saved after 3 steps at one (pp, tp, dp) layout resumes at another, and
the 3 steps after the resume give the losses and final parameters of the uninterrupted 6-step run on one process
(a loader Lightning can resume mid-epoch, so the data goes on as in the uninterrupted run)
(AdamW, float32 tolerance). Model and optimizer state are resharded on load: pp 1 -> 2, 2 -> 1, 2 -> 4;
tp 1 -> 2, 2 -> 1; (pp2, tp2) <-> (pp1, tp1); dp 2 -> 1 with a sharded optimizer (ZeRO-1); sharded data
parallelism (FSDP2, sdp2) -> dp1, pp2, tp2 and pp2, tp2 -> sdp2; tp2 x sdp2 -> one process. The example GPT
(fused q/k/v and a padded vocabulary under tp) and a transformers GPT-2 (Conv1D translation). Resuming at the
same layout gives bitwise the per-step losses of the uninterrupted run at that layout."""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lightning_mp
from tests._fit import _whole, fit_and_collect
from tests.trainer.test_tp_trainer import GLOBAL_BATCH, STEPS, T, VOCAB, Record, TinyHF, TinyTPGPT


class ResumableLoader(DataLoader):
    """A loader Lightning saves and restores (``state_dict``/``load_state_dict``): a run resumed mid-epoch goes
    on with the next batch, as the uninterrupted run does (a plain loader would restart the epoch)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._skip = self._yielded = 0

    def __iter__(self):
        skip, self._skip = self._skip, 0
        self._yielded = skip
        for index, batch in enumerate(super().__iter__()):
            if index >= skip:
                self._yielded += 1
                yield batch

    def state_dict(self):
        return {"yielded": self._yielded}

    def load_state_dict(self, state):
        self._skip = state["yielded"]


def _loader(self) -> DataLoader:
    """``2 * STEPS`` batches of ``GLOBAL_BATCH`` in one epoch, sharded over data-parallel replicas."""
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, VOCAB, (2 * STEPS * GLOBAL_BATCH, T + 1), generator=g)
    dataset = TensorDataset(data[:, :-1], data[:, 1:])
    kwargs = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) or {"num_replicas": 1, "rank": 0}
    sampler = DistributedSampler(dataset, shuffle=False, **kwargs)
    return ResumableLoader(dataset, batch_size=GLOBAL_BATCH // kwargs["num_replicas"], sampler=sampler, drop_last=True)


class _GPT(TinyTPGPT):
    """The tp test GPT with a constant learning rate (a resumed run must not depend on ``max_steps``)."""

    def __init__(self) -> None:
        super().__init__(n_head=4)

    def configure_optimizers(self):
        optimizer = super().configure_optimizers()["optimizer"]
        for group in optimizer.param_groups:  # the schedule set lr from max_steps at construction: undo it
            group["lr"] = self.hparams.learning_rate
        return optimizer

    train_dataloader = _loader


class _GPT2(TinyHF):
    def __init__(self) -> None:
        super().__init__("gpt2")

    train_dataloader = _loader


def _strategy(pp: int = 1, tp: int = 1, **kwargs):
    return lightning_mp.SMPStrategy(
        pipeline_parallel_degree=pp, tensor_parallel_degree=tp, microbatches=2 if pp > 1 else 1,
        start_method="fork", **kwargs,
    )


class _Record(Record):
    """``Record`` with the state dict's sharded-data-parallel shards (DTensors) gathered whole (a collective)."""

    def extra(self, trainer, pl_module):
        state = pl_module.state_dict()
        return {**super().extra(trainer, pl_module), "state": {k: _whole(v) for k, v in state.items()}}


def _fit(model_cls, out_dir, devices: int, strategy=None, steps: int = STEPS, ckpt_dir=None, ckpt_path=None):
    """Fit ``steps`` steps; returns each rank's record. ``ckpt_dir``: save ``last`` there every ``STEPS`` steps."""
    # before forking: one intra-op thread here and in the children (a forked child raised to more threads, as the
    # ddp thread policy does for a one-process run, hangs in libgomp once this process has used its OpenMP pool)
    torch.set_num_threads(1)
    previous = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        return _fit_in(model_cls, out_dir, devices, strategy, steps, ckpt_dir, ckpt_path)
    finally:
        if previous is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = previous


def _fit_in(model_cls, out_dir, devices, strategy, steps, ckpt_dir, ckpt_path):
    torch.manual_seed(0)
    callbacks = []
    if ckpt_dir is not None:
        callbacks.append(
            L.pytorch.callbacks.ModelCheckpoint(dirpath=str(ckpt_dir), save_last=True, every_n_train_steps=STEPS)
        )
    return fit_and_collect(
        model_cls(), out_dir, devices=devices, strategy=strategy, max_steps=steps, record=_Record(str(out_dir)),
        callbacks=callbacks, ckpt_path=str(ckpt_path) if ckpt_path else None, num_sanity_val_steps=0,
        limit_val_batches=0, use_distributed_sampler=False,
    )


def _check(results, reference, what: str, replicas: int = 1) -> None:
    """``replicas`` > 1: the ranks are data-parallel replicas (pp = tp = 1), each recording the loss of its part of
    the batch; their mean is the one-process loss."""
    losses = [r["losses"] for r in results]
    if replicas > 1:
        assert replicas == len(results), "only replicas at pp = tp = 1"
        losses = [torch.tensor(losses).mean(0).tolist()] * len(results)
    for rank, result in enumerate(results):
        torch.testing.assert_close(
            losses[rank], reference["losses"][STEPS:], rtol=1e-5, atol=1e-6, msg=lambda m: f"{what} r{rank}: {m}"
        )
        assert result["state"], "every rank recorded its (full) parameters"
        for key, value in result["state"].items():
            torch.testing.assert_close(
                value, reference["state"][key], rtol=1e-5, atol=1e-5, msg=lambda m, k=key: f"{what} r{rank} {k}: {m}"
            )


_SDP2 = {"sharded_data_parallel_degree": 2}
# (saved at, resumed at), as (pp, tp, extra strategy kwargs, devices)
_GPT_CASES = {
    "pp1tp1": ((1, 1, {}, 1), [(2, 1, {}, 2), (1, 2, {}, 2), (2, 2, {}, 4)]),
    "pp2tp2": ((2, 2, {}, 4), [(1, 1, {}, 1)]),
    "tp2": ((1, 2, {}, 2), [(1, 1, {}, 1), (1, 1, _SDP2, 2)]),
    "pp2": ((2, 1, {}, 2), [(4, 1, {}, 4), (1, 1, {}, 1), (1, 1, _SDP2, 2)]),
    "dp2-zero1": ((1, 1, {"shard_optimizer_state": True}, 2), [(1, 1, {}, 1)]),
    "sdp2": ((1, 1, _SDP2, 2), [(1, 1, {}, 1), (2, 1, {}, 2), (1, 2, {}, 2)]),
    "sdp2tp2": ((1, 2, _SDP2, 4), [(1, 1, {}, 1)]),
}


@pytest.fixture(scope="module")
def gpt_reference(tmp_path_factory):
    return _fit(_GPT, tmp_path_factory.mktemp("ref"), 1, steps=2 * STEPS)[0]


@pytest.mark.parametrize("saved", list(_GPT_CASES))
def test_gpt_resumes_at_other_layouts(tmp_path, gpt_reference, saved):
    (pp, tp, kwargs, devices), targets = _GPT_CASES[saved]
    ckpt = tmp_path / "ckpt"
    _fit(_GPT, tmp_path / "first", devices, _strategy(pp, tp, **kwargs), ckpt_dir=ckpt)
    assert (ckpt / "last" / "meta.pt").is_file()
    for pp2, tp2, kwargs2, devices2 in targets:
        name = f"pp{pp2}tp{tp2}" + "".join(f"-{k}{v}" for k, v in kwargs2.items())
        results = _fit(
            _GPT, tmp_path / name, devices2, _strategy(pp2, tp2, **kwargs2), steps=2 * STEPS, ckpt_path=ckpt / "last"
        )
        _check(results, gpt_reference, f"{saved} -> {name}", replicas=devices2 // (pp2 * tp2))


def test_hf_gpt2_resumes_at_other_layouts(tmp_path):
    """GPT-2's fused c_attn (Conv1D, q/k/v blocks) saved at tp=2, read back at tp=1 and at pp=2."""
    reference = _fit(_GPT2, tmp_path / "ref", 1, steps=2 * STEPS)[0]
    ckpt = tmp_path / "ckpt"
    _fit(_GPT2, tmp_path / "first", 2, _strategy(1, 2), ckpt_dir=ckpt)
    _check(_fit(_GPT2, tmp_path / "tp1", 1, _strategy(), steps=2 * STEPS, ckpt_path=ckpt / "last"), reference, "tp2->1")
    _check(_fit(_GPT2, tmp_path / "pp2", 2, _strategy(2, 1), steps=2 * STEPS, ckpt_path=ckpt / "last"), reference, "tp2->pp2")


def test_resume_at_the_same_layout_is_exact(tmp_path):
    """pp2 x tp2 is not needed for exactness; pp2 with 2 microbatches, stopped after 3 steps and resumed: the losses
    of steps 4-6 and the final parameters are bitwise those of the uninterrupted pp2 run."""
    uninterrupted = _fit(_GPT, tmp_path / "whole", 2, _strategy(2, 1), steps=2 * STEPS)
    ckpt = tmp_path / "ckpt"
    _fit(_GPT, tmp_path / "first", 2, _strategy(2, 1), ckpt_dir=ckpt)
    resumed = _fit(_GPT, tmp_path / "resumed", 2, _strategy(2, 1), steps=2 * STEPS, ckpt_path=ckpt / "last")
    for whole, part in zip(uninterrupted, resumed):
        assert part["losses"] == whole["losses"][STEPS:]
        assert part["state"].keys() == whole["state"].keys()
        for key in whole["state"]:
            assert torch.equal(part["state"][key], whole["state"][key]), key


@pytest.mark.parametrize(("tp", "kwargs"), [(2, {}), (1, _SDP2)], ids=["tp2", "sdp2"])
def test_full_file_is_one_devices_file_and_resumes(tmp_path, gpt_reference, tp, kwargs):
    """``save_distributed_checkpoint=False`` at tp=2 (and at sdp=2): the shards (fused q/k/v, padded vocabulary;
    FSDP's rows) and their Adam state are gathered into the file one device writes; the same layout resumes from
    that file as the uninterrupted run goes on."""
    _fit(_GPT, tmp_path / "ref", 1, ckpt_dir=tmp_path / "ck_ref")
    options = {"save_distributed_checkpoint": False, **kwargs}
    _fit(_GPT, tmp_path / "first", 2, _strategy(1, tp, **options), ckpt_dir=tmp_path / "ck")
    got, expected = (torch.load(p / "last.ckpt", weights_only=False) for p in (tmp_path / "ck", tmp_path / "ck_ref"))
    assert got["global_step"] == expected["global_step"] == STEPS
    assert sorted(got["state_dict"]) == sorted(expected["state_dict"])
    for key, value in expected["state_dict"].items():
        torch.testing.assert_close(got["state_dict"][key], value, rtol=1e-5, atol=1e-6, msg=key)
    (got_optim,), (expected_optim,) = got["optimizer_states"], expected["optimizer_states"]
    assert got_optim["param_groups"] == expected_optim["param_groups"]
    assert sorted(got_optim["state"]) == sorted(expected_optim["state"])
    for index, state in expected_optim["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(got_optim["state"][index][key], value, rtol=1e-5, atol=1e-6, msg=f"{index}.{key}")
    file = tmp_path / "ck" / "last.ckpt"
    results = _fit(_GPT, tmp_path / "resumed", 2, _strategy(1, tp, **options), steps=2 * STEPS, ckpt_path=file)
    _check(results, gpt_reference, "file -> same layout", replicas=2 // tp)
