"""Activation checkpointing, activation offloading and optimizer-state sharding through ``Trainer.fit`` (fork):
each switch alone and all together with delayed init at pp2 x dp2 match one process; a sharded optimizer saves
through DCP and resumes; the switches' arguments are validated and the callbacks need ``smp``."""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_mp
from tests._fit import RecordTraining, fit_and_collect
from tests.unit.test_memory_savers import Block, Net


STEPS, BATCH, SEED = 3, 8, 11


class NetModule(L.LightningModule):
    """``Net`` without dropout (microbatches of a pipeline draw other masks than one process), AdamW."""

    def __init__(self, in_configure_model: bool = False) -> None:
        super().__init__()
        self.net = None if in_configure_model else self._build()

    @staticmethod
    def _build() -> Net:
        torch.manual_seed(SEED)
        net = Net(depth=4)
        for block in net.blocks:
            block.drop.p = 0.0
        return net

    def configure_model(self) -> None:
        if self.net is None:
            self.net = self._build()

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = (self.net(x) - y).pow(2).mean()
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.05, weight_decay=0.1)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(1)
        dataset = TensorDataset(torch.randn(BATCH * STEPS, 8, generator=g), torch.randn(BATCH * STEPS, 1, generator=g))
        kwargs = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) or {"num_replicas": 1, "rank": 0}
        sampler = torch.utils.data.DistributedSampler(dataset, shuffle=False, **kwargs)
        return DataLoader(dataset, batch_size=BATCH // kwargs["num_replicas"], sampler=sampler, drop_last=True)


class Record(RecordTraining):
    """Per rank: final parameters, the losses, and evidence that each switch ran."""

    def __init__(self, out_dir: str, offloading: lightning_mp.ActivationOffloading | None = None) -> None:
        super().__init__(out_dir)
        self.offloading = offloading
        self.packs = 0

    def on_step(self, trainer, pl_module, batch_idx):
        if self.offloading is not None:
            self.packs = self.offloading.offloader.stats.packs

    def extra(self, trainer, pl_module):
        from torch.distributed.optim import ZeroRedundancyOptimizer

        optimizer = trainer.optimizers[0]
        local = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
        return {
            "checkpointed": sorted(f for f, _ in lightning_mp.memory.checkpointed_modules(pl_module)),
            "packs": self.packs,
            "sharded": isinstance(optimizer, ZeroRedundancyOptimizer),
            "state_params": len(local.state),
        }


def _fit(out_dir: str, strategy="auto", devices: int = 1, callbacks=(), model=None, max_steps=STEPS, ckpt_path=None,
         checkpoint_dir=None) -> list[dict]:
    offloading = next((c for c in callbacks if isinstance(c, lightning_mp.ActivationOffloading)), None)
    extra = [] if checkpoint_dir is None else [L.pytorch.callbacks.ModelCheckpoint(dirpath=checkpoint_dir, save_last=True)]
    return fit_and_collect(
        model if model is not None else NetModule(), out_dir, devices=devices, strategy=strategy, max_steps=max_steps,
        record=Record(out_dir, offloading), callbacks=[*callbacks, *extra], ckpt_path=ckpt_path,
        use_distributed_sampler=False,
    )


def _assert_matches(results: list[dict], reference: dict, pp: int, dp: int) -> None:
    for stage in range(pp):
        per_replica = torch.tensor([results[r * pp + stage]["losses"] for r in range(dp)])
        torch.testing.assert_close(per_replica.mean(0).tolist(), reference["losses"], rtol=1e-5, atol=1e-6)
    owned = sorted(n for result in results[:pp] for n in result["params"])
    assert owned == sorted(reference["params"])
    for result in results:
        for name, value in result["params"].items():
            torch.testing.assert_close(value, reference["params"][name], rtol=1e-5, atol=1e-6, msg=name)


CASES = {
    "checkpointing-pp2": dict(pp=2, dp=1, callbacks=lambda: [lightning_mp.ActivationCheckpointing([Block])]),
    "checkpointing-offloading-pp2": dict(
        pp=2, dp=1,
        callbacks=lambda: [lightning_mp.ActivationCheckpointing(["net.blocks.*"]), lightning_mp.ActivationOffloading(2)],
    ),
    "sharding-dp2": dict(pp=1, dp=2, shard=True),
    "all-with-delayed-init-release-host-memory-pp2xdp2": dict(
        pp=2, dp=2, shard=True, delayed=True, release=True,
        callbacks=lambda: [
            lightning_mp.ActivationCheckpointing(["net.blocks"], strategy="group_2"),
            lightning_mp.ActivationOffloading(4),
            lightning_mp.DelayedParameterInit(),
        ],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_switches_alone_and_together_match_one_process(tmp_path, case):
    spec = CASES[case]
    pp, dp = spec["pp"], spec["dp"]
    os.makedirs(tmp_path / "ref")
    os.makedirs(tmp_path / "smp")
    reference = _fit(str(tmp_path / "ref"))[0]
    strategy = lightning_mp.SMPStrategy(
        pipeline_parallel_degree=pp, microbatches=2, start_method="fork", shard_optimizer_state=spec.get("shard", False),
        release_host_memory=spec.get("release", False),
    )
    callbacks = spec.get("callbacks", list)()
    results = _fit(str(tmp_path / "smp"), strategy, pp * dp, callbacks, model=NetModule(spec.get("delayed", False)))
    _assert_matches(results, reference, pp, dp)
    for result in results:
        if any(isinstance(c, lightning_mp.ActivationCheckpointing) for c in callbacks):
            assert result["checkpointed"], "every stage checkpoints its blocks"
            assert all(f.startswith("net.blocks") for f in result["checkpointed"])
        if any(isinstance(c, lightning_mp.ActivationOffloading) for c in callbacks):
            assert result["packs"] > 0, "saved inputs were offloaded"
        assert result["sharded"] == spec.get("shard", False)
    if spec.get("shard"):
        for stage in range(pp):
            counts = [results[r * pp + stage]["state_params"] for r in range(dp)]
            assert all(0 < c < sum(counts) for c in counts), f"optimizer state split over dp ranks: {counts}"


@pytest.mark.parametrize(("pp", "dp"), [(1, 2), (2, 2)], ids=["dp2", "pp2xdp2"])
def test_sharded_optimizer_saves_through_dcp_and_resumes(tmp_path, pp, dp):
    """ZeRO-1: every rank of every stage saves its shard (keyed by FQN); a resumed run continues as one process."""
    from torch.distributed.checkpoint import FileSystemReader

    for name in ("ref1", "ref2", "first", "second"):
        os.makedirs(tmp_path / name)
    _fit(str(tmp_path / "ref1"), checkpoint_dir=str(tmp_path / "ck_ref"))
    reference = _fit(str(tmp_path / "ref2"), max_steps=2 * STEPS, ckpt_path=str(tmp_path / "ck_ref" / "last.ckpt"))[0]

    def smp():
        return lightning_mp.SMPStrategy(
            pipeline_parallel_degree=pp, microbatches=2, start_method="fork", shard_optimizer_state=True
        )

    first = _fit(str(tmp_path / "first"), smp(), pp * dp, checkpoint_dir=str(tmp_path / "ck"))
    assert all(r["sharded"] and 0 < r["state_params"] < len(r["params"]) for r in first)
    keys = FileSystemReader(str(tmp_path / "ck" / "last")).read_metadata().state_dict_metadata
    for name in reference["params"]:  # every stage's and every shard's state was saved
        fqn = name.removeprefix("net.")
        assert any(k.startswith("optimizer_0.state.") and fqn in k and k.endswith("exp_avg") for k in keys), fqn
    ckpt = str(tmp_path / "ck" / "last")
    resumed = _fit(str(tmp_path / "second"), smp(), pp * dp, max_steps=2 * STEPS, ckpt_path=ckpt)
    _assert_matches(resumed, reference, pp, dp)


def test_switch_arguments_are_validated_and_the_callbacks_need_smp():
    with pytest.raises(ValueError, match="`shard_optimizer_state` must be True or False, got 'yes'"):
        lightning_mp.SMPConfig(shard_optimizer_state="yes")
    with pytest.raises(ValueError, match="at least one module"):
        lightning_mp.ActivationCheckpointing([])
    with pytest.raises(ValueError, match="'every' is not one of"):
        lightning_mp.ActivationCheckpointing([Block], strategy="every")
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False,
                        callbacks=[lightning_mp.DelayedParameterInit()])
    with pytest.raises(ValueError, match="DelayedParameterInit needs strategy='smp', got SingleDeviceStrategy"):
        trainer.fit(NetModule())
