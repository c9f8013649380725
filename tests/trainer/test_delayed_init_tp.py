"""Delayed parameter initialisation under tensor parallelism through ``Trainer.fit`` (fork): the example GPT at
tp=2 and pp2 x tp2 and the tied Llama at tp=2, initial weights per rank and training against one process."""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch

import lightning_mp
from lightning_mp.tp import shard, shard_spec
from tests._fit import fit_and_collect
from tests.unit.test_delayed_init import _tensors

pytestmark = pytest.mark.filterwarnings("ignore:.*copying from a non-meta parameter")


class Initial(L.Callback):
    """Per rank at fit start: the local tensors and whether each storage is exactly its own size."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_fit_start(self, trainer, pl_module):
        local = {k: v.detach().clone() for k, v in _tensors(pl_module).items()}
        specs = {k: shard_spec(v) for k, v in _tensors(pl_module).items()}
        sized = {k: v.untyped_storage().nbytes() == v.numel() * v.element_size() for k, v in _tensors(pl_module).items()}
        grid = trainer.strategy.topology
        torch.save(
            {"local": local, "specs": specs, "sized": sized, "tp_rank": grid.tp_rank, "pp_rank": grid.pp_rank},
            os.path.join(self.out_dir, f"init{trainer.global_rank}.pt"),
        )


def _check_initial(out_dir: str, devices: int, full: dict[str, torch.Tensor], pp: int) -> None:
    results = [torch.load(os.path.join(out_dir, f"init{r}.pt"), weights_only=False) for r in range(devices)]
    per_tp: dict[int, set[str]] = {}
    for result in results:
        assert result["local"], "rank holds tensors"
        for fqn, value in result["local"].items():
            spec = result["specs"][fqn]
            expected = full[fqn] if spec is None else shard(full[fqn], spec, result["tp_rank"], 2)
            assert torch.equal(value, expected), f"rank {result['tp_rank']}: {fqn} differs from eager"
            assert result["sized"][fqn], f"{fqn}: storage is not its own size"
        assert any(s is not None for s in result["specs"].values()), "shards were made"
        per_tp.setdefault(result["tp_rank"], set()).update(result["local"])
        if pp > 1:
            assert len(result["local"]) < len(full), "a stage holds only its own tensors"
    assert all(names == set(full) for names in per_tp.values()), "each tp rank's stages hold every tensor"


@pytest.mark.parametrize(("pp", "microbatches"), [(1, 1), (2, 2)], ids=["tp2", "pp2xtp2"])
def test_gpt_fit_delayed_at_tp2_matches_one_process(tmp_path, pp, microbatches):
    from tests.trainer.test_tp_trainer import CLIP, STEPS, Record, TinyTPGPT, _check_against_reference, _fit

    os.makedirs(tmp_path / "ref")
    os.makedirs(tmp_path / "smp")
    torch.manual_seed(0)
    full = {k: v.detach().clone() for k, v in _tensors(TinyTPGPT()).items()}
    reference = _fit(str(tmp_path / "ref"), **CLIP)[0]

    strategy = lightning_mp.SMPStrategy(
        pipeline_parallel_degree=pp, tensor_parallel_degree=2, microbatches=microbatches, start_method="fork"
    )
    torch.manual_seed(0)
    trainer = L.Trainer(
        accelerator="cpu", devices=2 * pp, strategy=strategy, max_steps=STEPS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[Record(str(tmp_path / "smp")), Initial(str(tmp_path / "smp"))], use_distributed_sampler=False,
        **CLIP,
    )
    with trainer.init_module(empty_init=True):
        model = TinyTPGPT()
    assert all(p.is_meta for p in model.parameters())
    trainer.fit(model)
    _check_initial(str(tmp_path / "smp"), 2 * pp, full, pp)
    results = [torch.load(tmp_path / "smp" / f"{r}.pt", weights_only=False) for r in range(2 * pp)]
    _check_against_reference(results, reference, tp=2, dp=1, pp=pp)


def test_tied_llama_delayed_through_the_callback_at_tp2(tmp_path):
    """``configure_model`` + ``DelayedParameterInit``: a transformers model with its own tp_plan, tied embeddings
    and rotary buffers; initial shards bitwise, then training equal to the same model on one process."""
    from tests.unit.test_tp_hf import BUILDERS
    from tests.trainer.test_tp_trainer import STEPS, Record, TinyHF

    class Configured(TinyHF):
        def __init__(self) -> None:
            L.LightningModule.__init__(self)
            self.model = None

        def configure_model(self) -> None:
            if self.model is None:
                torch.manual_seed(5)
                self.model = lightning_mp.set_tensor_parallelism(BUILDERS["llama"]())

    def fit(out_dir, strategy=None, devices=1, callbacks=()):
        os.makedirs(out_dir)
        return fit_and_collect(
            Configured(), out_dir, devices=devices, strategy=strategy, max_steps=STEPS, record=Record(out_dir),
            callbacks=callbacks, num_sanity_val_steps=0, use_distributed_sampler=False,
        )

    torch.manual_seed(5)
    full = {f"model.{k}": v.detach().clone() for k, v in _tensors(BUILDERS["llama"]()).items()}
    reference = fit(str(tmp_path / "ref"))[0]
    strategy = lightning_mp.SMPStrategy(tensor_parallel_degree=2, start_method="fork")
    results = fit(
        str(tmp_path / "tp2"), strategy, 2, [lightning_mp.DelayedParameterInit(), Initial(str(tmp_path / "tp2"))]
    )
    _check_initial(str(tmp_path / "tp2"), 2, full, pp=1)
    for result in results:
        torch.testing.assert_close(result["losses"], reference["losses"], rtol=1e-5, atol=1e-6)
        assert set(result["state"]) == set(reference["state"])
        for key, value in result["state"].items():
            torch.testing.assert_close(value, reference["state"][key], rtol=1e-5, atol=1e-6, msg=key)
