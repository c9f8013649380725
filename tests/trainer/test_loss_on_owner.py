"""``configs/gpt_pp2.yaml``'s model through ``Trainer.fit`` at pp=2 with its head (a replicated copy of the tied
embedding) on stage 1: the loss runs there ([Note: the loss where the logits are] in pipeline/_recorded.py), so
the logits never come back; losses, logged losses and every parameter after two AdamW steps equal one process."""

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


def _gpt(logs: str = "handle") -> L.LightningModule:
    from examples.gpt import GPT

    class StableAdamGPT(GPT):
        def training_step(self, batch, batch_idx):
            """The GPT's step (``logs="handle"``: it logs the loss, a handle, as it is); ``"item"``: it logs
            ``loss.item()``, which fetches the loss in the forward; ``"dict"``: as ``"handle"``, the loss returned
            in a dict; ``"none"``: its loss alone."""
            if logs == "handle":
                return super().training_step(batch, batch_idx)
            if logs == "dict":  # the loss handle logged, and returned in a dict
                return {"loss": super().training_step(batch, batch_idx)}
            loss = self._loss(batch)
            if logs == "item":
                self.log("train_loss", loss.item())
            return loss

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


@pytest.mark.parametrize("logs", ["handle", "dict", "item", "none"])
def test_gpt_pp2_config_model_with_the_loss_on_the_head_stage_matches_one_process(tmp_path, logs):
    logged = logs != "none"
    reference = fit_and_collect(_gpt(logs), tmp_path / "one", max_steps=STEPS, num_sanity_val_steps=0,
                                record=RecordTraining(str(tmp_path / "one"), logged=logged))[0]
    strategy = lightning_mp.SMPStrategy(
        pipeline_parallel_degree=2, microbatches=2, start_method="fork", tied_weights="replicate",
        partition={"h.2": 1, "h.3": 1, "ln_f": 1, "lm_head": 1},
    )
    out = tmp_path / "pp2"
    results = fit_and_collect(_gpt(logs), out, devices=2, strategy=strategy, max_steps=STEPS,
                              record=Record(str(out), logged=logged), num_sanity_val_steps=0,
                              use_distributed_sampler=False)
    names = original_names(_gpt())  # the head's copy of the tied weight, under its name on stage 1
    held = set()
    for result in results:
        torch.testing.assert_close(result["losses"], reference["losses"], rtol=1e-5, atol=1e-6)
        if logged:
            torch.testing.assert_close(result["logged"], reference["logged"], rtol=1e-5, atol=1e-6)
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
    # unless the step fetched it (``loss.item()``), the loss, scaled by the Trainer on stage 1 too, is fetched with
    # its backward in one exchange per microbatch ([Note: the loss's fetch and backward in one exchange] in
    # pipeline/_caller.py): no separate fetch or backward; a logged handle is fetched by that exchange. The one GET
    # per microbatch left is ``logits.size(-1)`` in the loss (the logits' shape, asked of stage 1)
    driver, microbatches = results[0]["messages"], STEPS * 2
    if logs == "item":
        assert driver.get("get") == 2 * microbatches and driver.get("gbwd") == microbatches, driver
        assert "getbwd" not in driver, driver
    else:
        assert driver.get("getbwd") == microbatches and driver.get("get") == microbatches, driver
        assert "gbwd" not in driver, driver
