"""Models nobody here wrote, through every loop (issue 27): torch's pipelining model registry and ``nn`` blocks.

Each model of ``tests/registry_models.py`` runs ``Trainer.fit`` (a few SGD steps), then
``trainer.validate`` and ``trainer.predict`` with the same ``Trainer``, at pp=2 and (where it has the modules)
pp=3, against the unmodified ``LightningModule`` on one process: every parameter and buffer after ``fit``, the
validation metrics, every prediction. To stay CI-affordable, all models of one pipeline degree run one after the
other in one group of forked processes (one ``Trainer`` each, joined to the existing process group as under
``torchrun``), and the one-process references run once in the test process; both are module-scoped fixtures.

TransformerEncoder's eval fast path hands nested tensors between its layers: where its layers are split (pp=2, and
``nn.Transformer`` at pp=3) those cross stages, so those rows also test the transport's nested-tensor kinds.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_mp
from tests import registry_models as zoo
from tests._dist import run_distributed

STEPS, BATCH, VAL_BATCHES = 2, 8, 2
TOL = {"rtol": 1e-4, "atol": 1e-5}
ENTRIES = ("fit", "validate", "predict")


# ---- batches, forwards and losses ---------------------------------------------------------------------------------


def _vectors(n: int, seed: int, width: int = zoo.DIM) -> tuple[torch.Tensor, ...]:
    """Input (n, width), a second input (n, D) for keyword arguments, a regression target (n, D)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, width, generator=g), torch.randn(n, zoo.DIM, generator=g), torch.randn(n, zoo.DIM, generator=g)


def _tokens(n: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Token ids (n, 7), a padding mask (n, 7) (True = pad, every row keeps 2 or more), class labels (n,)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 20, (n, 7), generator=g)
    lengths = torch.randint(2, 8, (n,), generator=g)
    return ids, torch.arange(7)[None, :] >= lengths[:, None], torch.randint(0, 2, (n,), generator=g)


def _images(n: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 6, 6, generator=g) * 2 + 1, torch.randint(0, 3, (n,), generator=g)


def _regression(output: torch.Tensor, batch: tuple) -> torch.Tensor:
    return F.mse_loss(output, batch[-1])


def _classification(output: torch.Tensor, batch: tuple) -> torch.Tensor:
    return F.cross_entropy(output, batch[-1])


def _next_token(output: torch.Tensor, batch: tuple) -> torch.Tensor:
    ids, padding, _ = batch
    targets = torch.roll(ids, -1, 1).masked_fill(padding, -100)
    # over every position, padded ones counting 0: equal microbatches then average to the batch's value (a mean
    # over unpadded tokens only needs {"loss", "num_tokens"}, tested in test_same_maths.py)
    return F.cross_entropy(output.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum") / ids.numel()


@dataclass(frozen=True)
class Spec:
    """How to build, feed and score one model; ``stages``: the pipeline degrees it is tested at."""

    build: Callable[[int], nn.Module]  # pipeline degree -> model
    batch: Callable[[int, int], tuple]
    forward: Callable[[nn.Module, tuple], torch.Tensor]
    loss: Callable[[torch.Tensor, tuple], torch.Tensor]
    stages: tuple[int, ...] = (2, 3)
    microbatches: int = 2
    lr: float = 0.05


def _x(model, batch):
    return model(batch[0])


def _ids(model, batch):
    return model(batch[0], batch[1])


SPECS: dict[str, Spec] = {
    "ExampleCode": Spec(lambda pp: zoo.ExampleCode(splits=pp), _vectors, _x, _regression),
    "ModelWithKwargs": Spec(lambda pp: zoo.ModelWithKwargs(splits=pp), _vectors,
                            lambda m, b: m(b[0], y=b[1]), _regression),
    "ModelWithParamAlias": Spec(lambda pp: zoo.ModelWithParamAlias(), _vectors, lambda m, b: m(b[0], b[1]),
                                _regression, stages=(2,)),
    "MultiMLP": Spec(lambda pp: zoo.MultiMLP(), _vectors, _x, _regression),
    "MultiMLPKwargs": Spec(lambda pp: zoo.MultiMLP(), _vectors, lambda m, b: m(b[0], unused_kwarg=b[1]), _regression),
    "MultiInterMediateModel": Spec(lambda pp: zoo.InterMediateStack(), _vectors, _x, _regression),
    "MultiMLPWithDw": Spec(lambda pp: zoo.MultiMLPWithDw(), _vectors, _x, _regression),
    "DDP-style wrapper": Spec(lambda pp: zoo.DDPStyle(zoo.MultiMLP()), _vectors, _x, _regression),
    "unused outputs": Spec(lambda pp: zoo.UnusedOutputs(), _vectors, _x, _regression),
    "TransformerEncoder": Spec(lambda pp: zoo.EncoderClassifier(), _tokens, _ids, _classification),
    "TransformerDecoder": Spec(lambda pp: zoo.DecoderLM(), _tokens, _ids, _next_token),
    "LSTM + GRU": Spec(lambda pp: zoo.Recurrent(), _tokens, _ids, _classification),
    "MultiheadAttention": Spec(lambda pp: zoo.AttentionStack(), _tokens, _ids, _classification),
    # one microbatch: BatchNorm's training statistics are those of the batch, as on one process
    "BatchNorm CNN": Spec(lambda pp: zoo.NormCNN("batch"), _images, _x, _classification, microbatches=1),
    "BatchNorm(affine=False) CNN": Spec(lambda pp: zoo.NormCNN("batch-no-affine"), _images, _x, _classification,
                                        microbatches=1),
    "GroupNorm CNN": Spec(lambda pp: zoo.NormCNN("group"), _images, _x, _classification),
    "Embedding padding_idx/max_norm": Spec(lambda pp: zoo.BagOfEmbeddings(), _tokens, _ids, _classification),
    "packed LSTM": Spec(lambda pp: zoo.PackedRecurrent(), _tokens, _ids, _classification),
    "Transformer": Spec(lambda pp: zoo.FullTransformer(), _tokens, _ids, _next_token),
    # one microbatch: spectral norm's power iteration runs once per forward call, as BatchNorm updates its statistics
    "weight/spectral norm": Spec(lambda pp: zoo.NormedLayers(), _vectors, _x, _regression, microbatches=1),
    "EmbeddingBag + sparse": Spec(lambda pp: zoo.Bags(), _tokens, _ids, _classification),
}


# ---- harness ------------------------------------------------------------------------------------------------------


class Lit(L.LightningModule):
    def __init__(self, name: str, stages: int) -> None:
        super().__init__()
        self.spec = SPECS[name]
        self.net = self.spec.build(stages)

    def training_step(self, batch, batch_idx):
        loss = self.spec.loss(self.spec.forward(self.net, batch), batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        output = self.spec.forward(self.net, batch)
        self.log("val_loss", self.spec.loss(output, batch))
        self.log("val_output_mean", output.float().mean())

    def predict_step(self, batch, batch_idx):
        return self.spec.forward(self.net, batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.spec.lr)


def _loader(spec: Spec, first_seed: int, num_batches: int) -> DataLoader:
    parts = [spec.batch(BATCH, first_seed + i) for i in range(num_batches)]
    return DataLoader(TensorDataset(*(torch.cat(t) for t in zip(*parts))), batch_size=BATCH, shuffle=False)


class _KeepState(L.Callback):
    def on_train_end(self, trainer, pl_module):
        self.state = {n: t.detach().clone() for n, t in pl_module.state_dict().items()}


def run_all_loops(name: str, stages: int, strategy: Any = "auto", devices: int = 1) -> dict[str, Any]:
    """fit, validate, predict with one Trainer; per entry its result or the error (type, message, traceback)."""
    spec = SPECS[name]
    L.seed_everything(0, verbose=False)
    model = Lit(name, stages)
    keep = _KeepState()
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=STEPS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, num_sanity_val_steps=0, callbacks=[keep],
    )
    calls = {
        "fit": lambda: trainer.fit(model, train_dataloaders=_loader(spec, 0, STEPS)) or keep.state,
        "validate": lambda: {k: float(v) for k, v in trainer.validate(model, _loader(spec, 100, VAL_BATCHES),
                                                                       verbose=False)[0].items()},
        "predict": lambda: trainer.predict(model, _loader(spec, 100, VAL_BATCHES)),
    }
    results: dict[str, Any] = {}
    for entry, call in calls.items():
        try:
            results[entry] = ("ok", call())
        except Exception as err:  # noqa: BLE001 - reported per entry by the tests
            results[entry] = ("error", f"{type(err).__name__}: {err}\n{traceback.format_exc()[-3000:]}")
            if entry == "fit":
                break
    return results


def _join_as_torchrun(rank: int, world_size: int) -> None:
    """What ``torchrun`` tells a process: Lightning then starts no processes and joins the group already there
    (initialised by ``run_distributed`` through a file, so no address or port is needed)."""
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size))


def _pipelined_worker(rank: int, world_size: int, names: list[str]) -> dict[str, dict[str, Any]]:
    results = {}
    for name in names:
        _join_as_torchrun(rank, world_size)  # the strategy's teardown clears WORLD_SIZE
        strategy = lightning_mp.SMPStrategy(
            pipeline_parallel_degree=world_size, microbatches=SPECS[name].microbatches, start_method="popen"
        )
        results[name] = run_all_loops(name, world_size, strategy, devices=world_size)
    return results


def _names_at(stages: int) -> list[str]:
    return [name for name, spec in SPECS.items() if stages in spec.stages]


@pytest.fixture(scope="module")
def references() -> dict[tuple[str, int], dict[str, Any]]:
    torch.set_num_threads(1)
    return {(name, pp): run_all_loops(name, pp) for pp in (2, 3) for name in _names_at(pp)}


@pytest.fixture(scope="module")
def pipelined() -> dict[int, list[dict[str, dict[str, Any]]]]:
    """pp -> per rank: model name -> entry -> result."""
    return {pp: run_distributed(_pipelined_worker, pp, _names_at(pp), start_method="fork") for pp in (2, 3)}


def _merged(per_rank: list[dict[str, Any]], name: str, entry: str) -> Any:
    outcomes = [ranks[name].get(entry, ("error", "not run: fit failed")) for ranks in per_rank]
    failures = [f"rank {r}: {value}" for r, (status, value) in enumerate(outcomes) if status == "error"]
    if failures:
        pytest.fail(f"{name} {entry}: " + "\n".join(failures), pytrace=False)
    return [value for _, value in outcomes]


def _params(case: tuple[str, str, int]):
    return pytest.param(*case, id=f"{case[0]}-{case[1]}-pp{case[2]}")


CASES = [_params((name, entry, pp)) for pp in (2, 3) for name in _names_at(pp) for entry in ENTRIES]


@pytest.mark.parametrize(("name", "entry", "stages"), CASES)
def test_model_matches_one_process(references, pipelined, name, entry, stages):
    expected = references[(name, stages)][entry]
    assert expected[0] == "ok", f"the one-process reference failed: {expected[1]}"
    got = _merged(pipelined[stages], name, entry)
    if entry == "fit":
        state: dict[str, torch.Tensor] = {}
        for rank_state in got:  # each stage holds its own parameters and buffers
            state.update(rank_state)
        assert sorted(state) == sorted(expected[1])
        assert all(rank_state for rank_state in got), "every stage holds part of the model"
        for key, value in state.items():
            torch.testing.assert_close(value, expected[1][key], **TOL, msg=key)
    elif entry == "validate":
        for metrics in got:  # every rank reports the same metrics
            torch.testing.assert_close(metrics, expected[1], **TOL)
    else:
        predictions = got[0]  # the driver (stage 0) runs predict_step
        assert len(predictions) == len(expected[1]) == VAL_BATCHES
        torch.testing.assert_close(torch.cat(predictions), torch.cat(expected[1]), **TOL)
