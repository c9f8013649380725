"""``Trainer.fit`` under tensor parallelism against the same model on one process: the example GPT
(``examples.gpt_tp.TPGPT``) at tp2, tp2 with sequence parallelism, dp2 x tp2, pp2 x tp2, with an unswappable
block, resumed from a checkpoint; and transformers models: a tied-embedding Llama through its own tp_plan,
GPT-2 and BERT through the built-in translations. Compared:
per-step losses, every gradient of the first step (this rank's shard of the reference gradient), validation
loss, and the updated parameters (full state dict, original keys), rtol 1e-5."""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lightning_mp
from examples.gpt_tp import TPGPT
from lightning_mp.topology import Topology
from lightning_mp.tp import shard, shard_spec
from tests._fit import RecordTraining, fit_and_collect

STEPS, GLOBAL_BATCH, VOCAB, T = 3, 4, 33, 8  # an odd vocabulary: padded vocab-parallel shards


class TinyTPGPT(TPGPT):
    def __init__(self, n_head: int = 4, vocab_size: int = VOCAB) -> None:
        n_embd = 4 * n_head
        super().__init__(
            vocab_size=vocab_size, block_size=T, n_layer=2, n_head=n_head, n_embd=n_embd, learning_rate=1e-2,
            warmup_steps=1,
        )

    def training_step(self, batch, batch_idx):
        # once per step, summed over replicas only (the tp ranks of a replica log the same samples)
        self.log("samples", float(batch[0].shape[0]), reduce_fx="sum", on_step=False, on_epoch=True, sync_dist=True)
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self):
        """The GPT's AdamW groups, with ``eps=1e-4``: the key bias's true gradient is zero (softmax is shift
        invariant), so its gradient is rounding noise that Adam with a tiny eps turns into full-size steps."""
        config = super().configure_optimizers()
        for group in config["optimizer"].param_groups:
            group["eps"] = 1e-4
        return config

    def val_dataloader(self) -> DataLoader:
        return self.train_dataloader()

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        data = torch.randint(0, VOCAB, (STEPS * GLOBAL_BATCH, T + 1), generator=g)
        dataset = TensorDataset(data[:, :-1], data[:, 1:])
        kwargs = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) or {"num_replicas": 1, "rank": 0}
        sampler = DistributedSampler(dataset, shuffle=False, **kwargs)
        return DataLoader(dataset, batch_size=GLOBAL_BATCH // kwargs["num_replicas"], sampler=sampler, drop_last=True)


class Record(RecordTraining):
    """Per rank: losses, the first step's final gradients on this rank's shards, the full state dict, the swapped
    module types, and what the run logged."""

    def __init__(self, out_dir: str) -> None:
        super().__init__(out_dir, weights="state")  # the state dict is collective under tp: full tensors
        self.grads = {}

    def on_step(self, trainer, pl_module, batch_idx):
        self.sequence_parallel = any(getattr(m, "sequence_parallel", False) for m in pl_module.modules())
        if batch_idx == 0:  # after the step: the final (averaged, clipped) gradients, on this rank's shards
            self.grads = {n: (p.grad.clone(), shard_spec(p)) for n, p in pl_module.named_parameters()}

    def extra(self, trainer, pl_module):
        return {
            "grads": self.grads,
            "modules": sorted({type(m).__name__ for m in pl_module.modules()}),
            "n_head": pl_module.hparams.get("n_head"),
            "vocab_size": pl_module.hparams.get("vocab_size"),
            "sequence_parallel": getattr(self, "sequence_parallel", False),
            "val_loss": float(trainer.callback_metrics.get("val_loss", float("nan"))),
            "samples": float(trainer.callback_metrics.get("samples", float("nan"))),
        }


def _fit(
    out_dir: str, strategy=None, devices: int = 1, n_head: int = 4, vocab_size: int = VOCAB, **trainer_kwargs
) -> list[dict]:
    torch.manual_seed(0)
    return fit_and_collect(
        TinyTPGPT(n_head, vocab_size), out_dir, devices=devices, strategy=strategy, max_steps=STEPS, record=Record(out_dir),
        num_sanity_val_steps=0, use_distributed_sampler=False, **trainer_kwargs,
    )


CLIP = {"gradient_clip_val": 0.05, "gradient_clip_algorithm": "norm"}


@pytest.mark.parametrize(
    ("pp", "tp", "dp", "microbatches", "trainer_kwargs", "optimize", "placement"),
    [
        (1, 2, 1, 1, {}, "speed", "cluster"),
        (1, 2, 1, 1, CLIP, "memory", "cluster"),
        (1, 2, 2, 2, CLIP, "speed", "cluster"),
        (1, 2, 2, 1, {}, "speed", "spread"),
        (2, 2, 1, 2, CLIP, "speed", "cluster"),
    ],
    ids=[
        "tp2",
        "tp2-memory-sequence-parallel-clipnorm",
        "dp2xtp2-mb2-clipnorm",
        "dp2xtp2-spread-placement",
        "pp2xtp2-mb2-clipnorm",
    ],
)
def test_gpt_fit_matches_one_process(tmp_path, pp, tp, dp, microbatches, trainer_kwargs, optimize, placement):
    os.makedirs(tmp_path / "ref")
    os.makedirs(tmp_path / "smp")
    reference = _fit(str(tmp_path / "ref"), **trainer_kwargs)[0]
    strategy = lightning_mp.SMPStrategy(
        pipeline_parallel_degree=pp, tensor_parallel_degree=tp, microbatches=microbatches, optimize=optimize,
        placement_strategy=placement, start_method="fork",
    )
    results = _fit(str(tmp_path / "smp"), strategy, devices=pp * tp * dp, **trainer_kwargs)
    assert "DistributedTransformerLayer" in results[0]["modules"] and "Block" not in results[0]["modules"]
    assert results[0]["sequence_parallel"] == (optimize == "memory")
    _check_against_reference(results, reference, tp=tp, dp=dp, pp=pp, placement=placement)


def test_pp2xtp2_automatic_plan_keeps_blocks_whole(tmp_path):
    """A wide vocabulary (256) and width 32: the automatic plan used to cut block h.0 between its column-parallel
    ``c_fc`` and row-parallel ``c_proj`` (stage 0 swapped the block whole, stage 1 got ``c_proj`` alone) and the
    step failed with a shape error; the block is now one piece of the plan."""
    os.makedirs(tmp_path / "ref")
    os.makedirs(tmp_path / "smp")
    reference = _fit(str(tmp_path / "ref"), n_head=8, vocab_size=256)[0]
    strategy = lightning_mp.SMPStrategy(
        pipeline_parallel_degree=2, tensor_parallel_degree=2, microbatches=2, start_method="fork"
    )
    results = _fit(str(tmp_path / "smp"), strategy, devices=4, n_head=8, vocab_size=256)
    assert "DistributedTransformerLayer" in results[0]["modules"] and "Block" not in results[0]["modules"]
    _check_against_reference(results, reference, tp=2, dp=1, pp=2)


def test_unswappable_block_still_trains_unswapped(tmp_path):
    """3 heads do not split over 2 ranks: each Block stays (warned at setup), its Linears are swapped one by one."""
    os.makedirs(tmp_path / "ref")
    os.makedirs(tmp_path / "smp")
    reference = _fit(str(tmp_path / "ref"), n_head=3)[0]
    strategy = lightning_mp.SMPStrategy(tensor_parallel_degree=2, start_method="fork")
    results = _fit(str(tmp_path / "smp"), strategy, devices=2, n_head=3)
    assert "Block" in results[0]["modules"] and "DistributedLinear" in results[0]["modules"]
    _check_against_reference(results, reference, tp=2, dp=1, pp=1)


def _check_against_reference(
    results: list[dict], reference: dict, *, tp: int, dp: int, pp: int, placement: str = "cluster"
) -> None:
    assert "DistributedEmbedding" in results[0]["modules"]
    grid = [Topology(len(results), r, pp, tp, placement) for r in range(len(results))]
    rank_of = {(g.dp_rank, g.pp_rank, g.tp_rank): g.rank for g in grid}
    for rank, result in enumerate(results):
        tp_rank, replica = grid[rank].tp_rank, grid[rank].dp_rank
        replica_losses = torch.tensor([results[rank_of[(d, 0, 0)]]["losses"] for d in range(dp)])
        torch.testing.assert_close(replica_losses.mean(0).tolist(), reference["losses"], rtol=1e-5, atol=1e-6)
        assert result["losses"] == results[rank_of[(replica, 0, 0)]]["losses"], "the ranks of a replica agree"
        if pp == 1:
            assert set(result["grads"]) == set(reference["grads"])
        else:  # the stages of one replica hold every parameter between them, each its own
            stage_states = [results[rank_of[(replica, p, tp_rank)]]["state"] for p in range(pp)]
            assert set(stage_states[0]).isdisjoint(stage_states[1])
            assert set().union(*stage_states) == set(reference["state"])
        assert result["grads"], "gradients were recorded"
        assert result["samples"] == reference["samples"] == STEPS * GLOBAL_BATCH, "sync_dist sums over replicas only"
        if dp == 1:  # validation ran through the same layout (after the last step)
            torch.testing.assert_close(result["val_loss"], reference["val_loss"], rtol=1e-5, atol=1e-6)
        for name, (grad, spec) in result["grads"].items():
            full = reference["grads"][name][0]
            expected = full if spec is None else shard(full, spec, tp_rank, tp)
            torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"grad {n}: {m}")
        for key, value in result["state"].items():
            assert value.shape == reference["state"][key].shape, key
            torch.testing.assert_close(
                value, reference["state"][key], rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}"
            )
    torch.manual_seed(0)
    initial = TinyTPGPT(results[0]["n_head"], results[0]["vocab_size"]).state_dict()
    assert all(not torch.equal(reference["state"][k], initial[k]) for k in ("wte.weight", "h.0.mlp.c_fc.weight"))


class _NoScheduleGPT(TinyTPGPT):
    """A resumed run must not depend on ``max_steps`` through the LR schedule."""

    def configure_optimizers(self):
        return super().configure_optimizers()["optimizer"]


def _fit_resume(
    out_dir: str, ckpt_dir: str, strategy_fn, devices: int, ckpt_path=None, steps: int = STEPS
) -> list[dict]:
    torch.manual_seed(0)
    return fit_and_collect(
        _NoScheduleGPT(), out_dir, devices=devices, strategy=strategy_fn() if strategy_fn else None, max_steps=steps,
        record=Record(out_dir), callbacks=[L.pytorch.callbacks.ModelCheckpoint(dirpath=ckpt_dir, save_last=True)],
        ckpt_path=ckpt_path, num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False,
    )


def test_checkpoint_resume_at_tp2_matches_one_process(tmp_path):
    """Save after 3 steps at tp=2 (full weights under the original keys; AdamW state of each shard under its
    own key), resume for 3 more: the same parameters as the same two runs on one process."""
    finals = {}
    for name, strategy_fn, devices in (
        ("ref", None, 1),
        ("tp2", lambda: lightning_mp.SMPStrategy(tensor_parallel_degree=2, start_method="fork"), 2),
    ):
        ckpt = tmp_path / name / "ckpt"
        for run in ("first", "resumed"):
            os.makedirs(tmp_path / name / run)
        _fit_resume(str(tmp_path / name / "first"), str(ckpt), strategy_fn, devices)
        finals[name] = _fit_resume(
            str(tmp_path / name / "resumed"), str(ckpt), strategy_fn, devices, ckpt_path=str(ckpt / ("last.ckpt" if strategy_fn is None else "last")),  # smp: a DCP folder
            steps=2 * STEPS,
        )
    reference = finals["ref"][0]
    assert len(reference["losses"]) == STEPS, "the resumed run took the remaining steps"
    for result in finals["tp2"]:
        torch.testing.assert_close(result["losses"], reference["losses"], rtol=1e-5, atol=1e-6)
        for key, value in result["state"].items():
            torch.testing.assert_close(
                value, reference["state"][key], rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}"
            )


class TinyHF(L.LightningModule):
    """A tiny transformers model (random init) marked whole for tensor parallelism; next-token CE on its logits."""

    def __init__(self, name: str) -> None:
        super().__init__()
        from tests.unit.test_tp_hf import BUILDERS

        self.model = lightning_mp.set_tensor_parallelism(BUILDERS[name]())

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch))

    def _loss(self, batch):
        x, y = batch
        logits = self.model(input_ids=x).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, eps=1e-4)  # eps: see TinyTPGPT

    train_dataloader = TinyTPGPT.train_dataloader
    val_dataloader = TinyTPGPT.val_dataloader


@pytest.mark.parametrize("name", ["llama", "gpt2", "bert"])
def test_hf_fit_at_tp2_matches_one_process(tmp_path, name):
    """Tied-embedding Llama (its own tp_plan), GPT-2 (Conv1D translation), BERT (MLM translation, padding_idx)."""

    def fit(out_dir, strategy=None, devices=1):
        os.makedirs(out_dir)
        torch.manual_seed(0)
        return fit_and_collect(
            TinyHF(name), out_dir, devices=devices, strategy=strategy, max_steps=STEPS, record=Record(out_dir),
            num_sanity_val_steps=0, use_distributed_sampler=False,
        )

    reference = fit(str(tmp_path / "ref"))[0]
    results = fit(str(tmp_path / "tp2"), lightning_mp.SMPStrategy(tensor_parallel_degree=2, start_method="fork"), 2)
    for tp_rank, result in enumerate(results):
        assert {"DistributedLinear", "DistributedEmbedding"} <= set(result["modules"])
        torch.testing.assert_close(result["losses"], reference["losses"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(result["val_loss"], reference["val_loss"], rtol=1e-5, atol=1e-6)
        assert set(result["grads"]) == set(reference["grads"])
        for n, (grad, spec) in result["grads"].items():
            full = reference["grads"][n][0]
            expected = full if spec is None else shard(full, spec, tp_rank, 2)
            torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"grad {n}: {m}")
        assert set(result["state"]) == set(reference["state"])
        for key, value in result["state"].items():
            torch.testing.assert_close(
                value, reference["state"][key], rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}"
            )
