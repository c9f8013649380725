"""``configs/gpt_pp2.yaml``'s model through ``Trainer.fit`` at pp=2 with its head (a replicated copy of the tied
embedding) on stage 1: the loss runs there ([Note: the loss where the logits are] in pipeline/_recorded.py), so
the logits never come back; losses and every parameter after two AdamW steps equal one process."""

from __future__ import annotations

import pathlib

import lightning as L
import pytest
import torch
import yaml
from torch.utils.data import DataLoader, TensorDataset

import lightning_mp
from lightning_mp.strategy._tied import original_names
from tests._fit import RecordTraining, fit_and_collect

STEPS, BATCH, T = 2, 4, 32
CONFIG = pathlib.Path(__file__).parents[2] / "configs" / "gpt_pp2.yaml"


def _gpt(logs_loss: bool = True) -> L.LightningModule:
    from examples.gpt import GPT

    class StableAdamGPT(GPT):
        def training_step(self, batch, batch_idx):
            """The GPT's step, or (``logs_loss=False``) its loss alone: logging fetches it in the forward."""
            return super().training_step(batch, batch_idx) if logs_loss else self._loss(batch)

        def configure_optimizers(self):
            """The GPT's AdamW with ``eps=1e-4``: the attention key bias's true gradient is zero, so its gradient
            is rounding noise that differs between layouts, which Adam with a tiny eps turns into full steps."""
            config = super().configure_optimizers()
            for group in config["optimizer"].param_groups:
                group["eps"] = 1e-4
            return config

        def train_dataloader(self) -> DataLoader:
            g = torch.Generator().manual_seed(3)
            x = torch.randint(0, self.hparams.vocab_size, (BATCH * STEPS, T + 1), generator=g)
            return DataLoader(TensorDataset(x[:, :-1], x[:, 1:]), batch_size=BATCH)

    init_args = yaml.safe_load(CONFIG.read_text())["model"]["init_args"]
    torch.manual_seed(0)
    return StableAdamGPT(**init_args)


class Record(RecordTraining):
    """Also the bytes and messages this rank's pipeline engine sent over the run."""

    def extra(self, trainer, pl_module):
        engine = getattr(trainer.strategy, "pipeline_engine", None)
        if engine is None:
            return {"bytes": {}, "messages": {}}
        return {"bytes": dict(engine.bytes_sent), "messages": dict(engine.messages_sent)}


@pytest.mark.parametrize("logs_loss", [True, False])
def test_gpt_pp2_config_model_with_the_loss_on_the_head_stage_matches_one_process(tmp_path, logs_loss):
    reference = fit_and_collect(_gpt(logs_loss), tmp_path / "one", max_steps=STEPS, num_sanity_val_steps=0)[0]
    strategy = lightning_mp.SMPStrategy(
        pipeline_parallel_degree=2, microbatches=2, start_method="fork", tied_weights="replicate",
        partition={"h.2": 1, "h.3": 1, "ln_f": 1, "lm_head": 1},
    )
    out = tmp_path / "pp2"
    results = fit_and_collect(_gpt(logs_loss), out, devices=2, strategy=strategy, max_steps=STEPS, record=Record(str(out)),
                              num_sanity_val_steps=0, use_distributed_sampler=False)
    names = original_names(_gpt())  # the head's copy of the tied weight, under its name on stage 1
    held = set()
    for result in results:
        torch.testing.assert_close(result["losses"], reference["losses"], rtol=1e-5, atol=1e-6)
        for name, value in result["params"].items():
            original = names.get(name, name)
            torch.testing.assert_close(value, reference["params"][original], rtol=1e-5, atol=1e-6, msg=name)
            held.add(original)
    assert held == set(reference["params"]), "every parameter is held somewhere"
    # Each stage sends one boundary's hidden states (stage 0) or their gradient (stage 1) per microbatch, plus
    # pickles; the logits (vocab 256 = 2 x n_embd) or their gradient would add twice as much again.
    hparams = _gpt().hparams
    hidden_nbytes = STEPS * BATCH * T * hparams.n_embd * 4
    for rank, result in enumerate(results):
        assert sum(result["bytes"].values()) < 1.5 * hidden_nbytes, (rank, result["bytes"], hidden_nbytes)
    # unless the step fetched it (``self.log``), the loss, scaled by the Trainer on stage 1 too, is fetched with its
    # backward in one exchange per microbatch ([Note: the loss's fetch and backward in one exchange] in
    # pipeline/_caller.py): no separate fetch or backward
    driver = results[0]["messages"]
    if not logs_loss:
        assert driver.get("getbwd") == STEPS * 2 and "gbwd" not in driver, driver
