"""Same maths on every layout (issue 12), with models written the way people write them.

``Trainer.fit`` on 2-4 forked CPU processes against plain Lightning on one process:

- token-weighted losses: unmodified Hugging Face ``BertForMaskedLM`` (``labels=-100``) and a padded LM with
  ``ignore_index``, microbatches 2 and 4: loss, logged loss, updated parameters equal one process on the batch;
- random streams: two same-seed runs of a dropout GPT-2 at pp=2 are bitwise equal, and pp=1/2/4 are bitwise equal
  at one microbatch count;
- BatchNorm running statistics (and every parameter) equal one process that chunks the batch the same way
  (gradient accumulation), at microbatches 2 and 4, both schedules;
- the trace follows the training path: ``nn.TransformerEncoder`` with its defaults and a padding mask;
- aliases (``self.lin1 = self.lin0``), auto and manual; a never-called branch module at pp=3;
- errors that point the right way: an unsplittable mask, a remote module called from a callback hook;
- dropout under activation checkpointing at pp=2: the recompute draws the forward's masks (bitwise equal).
"""

from __future__ import annotations

import os
from datetime import timedelta
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
from tests._fit import RecordTraining, fit_and_collect
from tests.models import tiny_gpt2

TOL = {"rtol": 1e-5, "atol": 1e-6}
STEPS = 3


# ---- models nobody here wrote (re-written, not copied) and the way people write them --------------------------


def _bert():
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        vocab_size=48, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    return BertForMaskedLM(config)


def _mlm_batch(n: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Token ids, attention mask and MLM labels: a different number of masked tokens in every row."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 48, (n, 8), generator=g)
    lengths = torch.randint(3, 9, (n,), generator=g)
    attention = (torch.arange(8)[None, :] < lengths[:, None]).long()
    chosen = (torch.rand(n, 8, generator=g) < 0.15 + 0.5 * (torch.arange(n)[:, None] % 3 == 0)) & attention.bool()
    labels = torch.where(chosen, ids, torch.full_like(ids, -100))
    return ids, attention, labels


def _mlm_step(model, batch):
    ids, attention, labels = batch
    out = model(input_ids=ids, attention_mask=attention, labels=labels)
    return {"loss": out.loss, "num_tokens": (labels != -100).sum()}


class PaddedLM(nn.Module):
    """Embedding, residual MLP blocks in a ``ModuleList`` loop, a head; loss over unpadded tokens only."""

    def __init__(self, vocab: int = 24, dim: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.GELU()) for _ in range(depth)])
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)  # (B, T, C)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)  # (B, T, V)


def _padded_batch(n: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 24, (n, 10), generator=g)
    lengths = torch.randint(2, 11, (n,), generator=g)
    targets = torch.where(torch.arange(10)[None, :] < lengths[:, None], torch.roll(ids, -1, 1), -100)
    return ids, targets


def _padded_step(model, batch):
    ids, targets = batch
    loss = F.cross_entropy(model(ids).flatten(0, 1), targets.flatten(), ignore_index=-100)
    return {"loss": loss, "num_tokens": (targets != -100).sum()}


def _gpt2():
    return tiny_gpt2(vocab_size=40, n_layer=4, n_head=2, dropout=0.2)


def _lm_batch(n: int, seed: int) -> tuple[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 40, (n, 12), generator=g),)


def _gpt2_step(model, batch):
    (ids,) = batch
    return model(input_ids=ids, labels=ids).loss


class BNBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.bn(self.conv(x)))


class TinyResNet(nn.Module):
    """A stem, residual conv/BatchNorm blocks in a ``ModuleList`` loop, pooling and a classifier."""

    def __init__(self, channels: int = 4, depth: int = 4, classes: int = 3) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU())
        self.blocks = nn.ModuleList([BNBlock(channels) for _ in range(depth)])
        self.fc = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)  # (B, C, H, W)
        for block in self.blocks:
            h = block(h)
        return self.fc(h.mean((2, 3)))


def _image_batch(n: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 6, 6, generator=g) * 2 + 1, torch.randint(0, 3, (n,), generator=g)


def _classify_step(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


class PaddedEncoder(nn.Module):
    """``nn.TransformerEncoder`` with its defaults (post-norm, ``enable_nested_tensor=True``) and a padding mask."""

    def __init__(self, vocab: int = 20, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=3)
        self.head = nn.Linear(dim, 2)

    def forward(self, ids: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.embed(ids), src_key_padding_mask=padding)  # (B, T, C)
        keep = (~padding).unsqueeze(-1).float()
        return self.head((h * keep).sum(1) / keep.sum(1))


def _encoder_batch(n: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 20, (n, 7), generator=g)
    lengths = torch.randint(2, 8, (n,), generator=g)
    return ids, torch.arange(7)[None, :] >= lengths[:, None], torch.randint(0, 2, (n,), generator=g)


def _encoder_step(model, batch):
    ids, padding, y = batch
    return F.cross_entropy(model(ids, padding), y)


class Aliased(nn.Module):
    """One layer registered under two names (as in PyTorch's own pipelining test models)."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.lin0 = nn.Linear(dim, dim)
        self.lin1 = self.lin0
        self.mid = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin1(torch.tanh(self.lin0(x))))
        return self.out(torch.tanh(self.mid(h))).squeeze(-1)


class RareBranch(nn.Module):
    """A branch module that the traced microbatch never calls (its rows are all positive there)."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.a = nn.Linear(dim, dim)
        self.b = nn.Linear(dim, dim)
        self.rare = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if x.abs().max() > 10:  # every microbatch of a batch decides alike (see _vector_batch)
            h = torch.tanh(self.rare(h))
        return self.out(torch.tanh(self.b(h))).squeeze(-1)


def _vector_batch(n: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    if seed > 0:
        x = 20 * x  # later batches take the rare branch, the first (traced) one does not
    return x, torch.randn(n, generator=g)


def _regress_step(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)


@dataclass(frozen=True)
class Spec:
    build: Callable[[], nn.Module]
    batch: Callable[[int, int], tuple]
    step: Callable[[nn.Module, Any], Any]
    lr: float = 0.1


SPECS = {
    "bert": Spec(_bert, _mlm_batch, _mlm_step),
    "padded": Spec(PaddedLM, _padded_batch, _padded_step),
    "gpt2": Spec(_gpt2, _lm_batch, _gpt2_step),
    "resnet": Spec(TinyResNet, _image_batch, _classify_step),
    "encoder": Spec(PaddedEncoder, _encoder_batch, _encoder_step),
    "aliased": Spec(Aliased, _vector_batch, _regress_step),
    "rare": Spec(RareBranch, _vector_batch, _regress_step),
}


# ---- harness ----------------------------------------------------------------------------------------------------


class Lit(L.LightningModule):
    def __init__(self, name: str, batch: int = 8) -> None:
        super().__init__()
        self.spec, self.batch = SPECS[name], batch
        self.net = self.spec.build()

    def training_step(self, batch, batch_idx):
        out = self.spec.step(self.net, batch)
        self.log("train_loss", out["loss"] if isinstance(out, dict) else out)
        return out

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.spec.lr)

    def train_dataloader(self) -> DataLoader:
        parts = [self.spec.batch(8, step) for step in range(STEPS)]
        return DataLoader(TensorDataset(*(torch.cat(t) for t in zip(*parts))), batch_size=self.batch, shuffle=False)


def fit(out_dir: str, name: str, strategy: Any = "auto", devices: int = 1, batch: int = 8, seed: int = 0,
        callbacks=(), **trainer_kwargs) -> list[dict]:
    # One intra-op thread in this process too: a forked child of a process whose OpenMP pool ran (the reference
    # fit's convolutions) can hang in its first parallel region.
    torch.set_num_threads(1)
    L.seed_everything(seed, verbose=False)
    return fit_and_collect(
        Lit(name, batch), out_dir, devices=devices, strategy=strategy, max_steps=STEPS,
        record=RecordTraining(out_dir, logged=True, weights="state"), callbacks=callbacks,
        use_distributed_sampler=False, **trainer_kwargs,
    )


def smp(pp: int, microbatches: int, **kwargs) -> lightning_mp.SMPStrategy:
    # fork: the children do not import torch and Lightning again. Tied weights co-located: these tests pin bitwise
    # equality across pipeline degrees, which a replicated tie gives up (its copies' sums add in another order).
    kwargs = {"tied_weights": "colocate", **kwargs}
    return lightning_mp.SMPStrategy(pipeline_parallel_degree=pp, microbatches=microbatches, start_method="fork", **kwargs)


def merged_state(results: list[dict]) -> dict[str, torch.Tensor]:
    """Every rank's own entries (a stage holds its parameters and buffers; stateless ones are on all ranks)."""
    state: dict[str, torch.Tensor] = {}
    for result in results:
        state.update(result["state"])
    return state


def assert_state_equal(got: dict, expected: dict, exact: bool = False, **tol) -> None:
    assert sorted(got) == sorted(expected)
    for key, value in got.items():
        if exact:
            assert torch.equal(value, expected[key]), key
        else:
            torch.testing.assert_close(value, expected[key], **(tol or TOL), msg=key)


# ---- 1. token-weighted losses -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "microbatches"), [("bert", 2), ("bert", 4), ("padded", 4)])
def test_token_weighted_loss_equals_one_process_on_the_batch(tmp_path, name, microbatches):
    reference = fit(str(tmp_path / "ref"), name)[0]
    results = fit(str(tmp_path / "smp"), name, smp(2, microbatches), devices=2)
    for result in results:  # every stage returns and logs the batch's true mean
        torch.testing.assert_close(result["losses"], reference["losses"], **TOL)
        torch.testing.assert_close(result["logged"], reference["logged"], **TOL)
    assert all(r["state"] for r in results), "both stages hold part of the model"
    assert_state_equal(merged_state(results), reference["state"])


def test_mean_of_microbatch_means_differs_without_num_tokens(tmp_path):
    """The default (no ``num_tokens``) is the mean of microbatch means: not the batch mean for a masked loss."""
    reference = fit(str(tmp_path / "ref"), "padded")[0]
    spec = SPECS["padded"]
    SPECS["padded"] = Spec(spec.build, spec.batch, lambda m, b: _padded_step(m, b)["loss"])
    try:
        results = fit(str(tmp_path / "smp"), "padded", smp(2, 4), devices=2)
    finally:
        SPECS["padded"] = spec
    assert abs(results[0]["losses"][0] - reference["losses"][0]) > 1e-4


# ---- 2. random streams ------------------------------------------------------------------------------------------


def test_dropout_runs_are_bitwise_reproducible_and_layout_independent(tmp_path, monkeypatch):
    # One intra-op thread in every process: a reduction split over another number of threads sums in another
    # order (by default one process would get 2 threads here and two processes 1 each, as under ddp).
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    first = fit(str(tmp_path / "a"), "gpt2", smp(2, 4), devices=2, seed=7)
    second = fit(str(tmp_path / "b"), "gpt2", smp(2, 4), devices=2, seed=7)
    assert first[0]["losses"] == second[0]["losses"]
    assert_state_equal(merged_state(first), merged_state(second), exact=True)
    four = fit(str(tmp_path / "pp4"), "gpt2", smp(4, 4), devices=4, seed=7)
    assert four[0]["losses"] == first[0]["losses"]
    assert_state_equal(merged_state(four), merged_state(first), exact=True)
    one = fit(str(tmp_path / "pp1"), "gpt2", smp(1, 4), seed=7)[0]
    assert one["losses"] == first[0]["losses"]
    assert_state_equal(one["state"], merged_state(first), exact=True)
    plain = fit(str(tmp_path / "plain"), "gpt2", seed=7)[0]
    assert plain["losses"][0] != first[0]["losses"][0], "dropout is on: the masks differ from one process's"
    other_seed = fit(str(tmp_path / "seed8"), "gpt2", smp(1, 4), seed=8)[0]
    assert other_seed["losses"][0] != first[0]["losses"][0], "another seed draws other masks"


# ---- 3. BatchNorm running statistics ----------------------------------------------------------------------------


@pytest.mark.parametrize(("microbatches", "schedule"), [(2, "interleaved"), (4, "interleaved"), (4, "simple")])
def test_batchnorm_statistics_follow_microbatch_order(tmp_path, microbatches, schedule):
    """One process that chunks each batch the same way (gradient accumulation) is the reference."""
    reference = fit(str(tmp_path / "ref"), "resnet", batch=8 // microbatches, accumulate_grad_batches=microbatches)[0]
    results = fit(str(tmp_path / "smp"), "resnet", smp(2, microbatches, pipeline=schedule), devices=2)
    state = merged_state(results)
    assert any("running_mean" in k for k in results[1]["state"]), "stage 1 holds BatchNorm layers"
    assert_state_equal(state, reference["state"])
    for key in state:  # running statistics: bitwise, as the same ops ran on the same inputs in the same order
        if "running" in key or "num_batches" in key:
            assert torch.equal(state[key], reference["state"][key]), key


# ---- 4. the trace follows the training path ---------------------------------------------------------------------


def test_transformer_encoder_with_defaults_and_padding_mask(tmp_path):
    reference = fit(str(tmp_path / "ref"), "encoder")[0]
    results = fit(str(tmp_path / "smp"), "encoder", smp(2, 2), devices=2)
    torch.testing.assert_close(results[0]["losses"], reference["losses"], **TOL)
    assert_state_equal(merged_state(results), reference["state"])


# ---- 5. partitioning corner cases -------------------------------------------------------------------------------


@pytest.mark.parametrize("manual", [None, {"net.lin1": 1, "net.mid": 0}], ids=["auto", "manual-one-alias"])
def test_aliased_module_is_one_module(tmp_path, manual):
    reference = fit(str(tmp_path / "ref"), "aliased")[0]
    kwargs = {"partition": manual} if manual else {}
    results = fit(str(tmp_path / "smp"), "aliased", smp(2, 2, **kwargs), devices=2)
    if manual:
        assert "net.lin0.weight" in results[1]["state"], "naming one alias places the module"
    torch.testing.assert_close(results[0]["losses"], reference["losses"], **TOL)
    assert_state_equal(merged_state(results), reference["state"])


def test_never_called_branch_at_three_stages(tmp_path):
    reference = fit(str(tmp_path / "ref"), "rare")[0]
    results = fit(str(tmp_path / "smp"), "rare", smp(3, 2), devices=3)
    assert all(any(k.endswith("weight") for k in r["state"]) for r in results), "no stage is empty"
    torch.testing.assert_close(results[0]["losses"], reference["losses"], **TOL)
    assert_state_equal(merged_state(results), reference["state"])


# ---- 6. errors that point the right way -------------------------------------------------------------------------


class SharedMask(L.LightningModule):
    """A (T, T) mask in the batch that every row shares: splitting it along dim 0 breaks the step."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def training_step(self, batch, batch_idx):
        x, mask = batch["x"], batch["mask"]  # (B, T, 4), (T, T)
        h = torch.softmax(self.a(x) @ self.a(x).transpose(1, 2) + mask, -1) @ x
        return self.b(h).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        data = [{"x": torch.randn(4, 4)} for _ in range(8)]
        return DataLoader(data, batch_size=4, collate_fn=lambda rows: {"x": torch.stack([r["x"] for r in rows]),
                                                                       "mask": torch.zeros(4, 4)})


def test_unsplittable_mask_error_names_microbatch_splitting_and_non_split_inputs():
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=smp(2, 2), max_steps=1, logger=False,
                        enable_progress_bar=False, use_distributed_sampler=False)
    with pytest.raises(Exception, match=r"(?s)microbatches=2.*non_split_inputs"):
        trainer.fit(SharedMask())


class CallsRemoteInHook(L.Callback):
    def on_after_backward(self, trainer, pl_module):
        pl_module.net.blocks[-1](torch.zeros(2, 16))


def test_remote_module_called_from_a_callback_hook_is_a_clear_error():
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=smp(2, 2), max_steps=1, logger=False,
                        enable_progress_bar=False, use_distributed_sampler=False, callbacks=[CallsRemoteInHook()])
    with pytest.raises(Exception, match="only be called inside a pipelined step"):
        trainer.fit(Lit("padded"))


# ---- 7. dropout under activation checkpointing ------------------------------------------------------------------


class CountAttentionCalls(L.Callback):
    """Counts the calls of this stage's attention modules (forwards and recomputes) and what was checkpointed."""

    def __init__(self, out_dir: str, checkpointing: L.Callback | None = None) -> None:
        self.out_dir, self.checkpointing, self.calls = out_dir, checkpointing, 0

    def on_fit_start(self, trainer, pl_module):  # after ActivationCheckpointing (earlier in the callback list)
        from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

        engine = trainer.strategy.pipeline_engine
        for fqn, module in pl_module.named_modules():
            if isinstance(module, GPT2Attention) and engine.stage_of(fqn) == engine.stage:
                module.register_forward_pre_hook(self._count)

    def _count(self, module, args):
        self.calls += 1

    def on_train_end(self, trainer, pl_module):
        applied = list(self.checkpointing.applied) if self.checkpointing is not None else []
        torch.save({"calls": self.calls, "applied": applied},
                   os.path.join(self.out_dir, f"calls{trainer.global_rank}.pt"))


def test_dropout_under_activation_checkpointing_recomputes_the_forward_masks(tmp_path):
    """pp=2, 4 microbatches, dropout GPT-2: checkpointing the blocks changes nothing, bitwise.

    Bitwise, not to a tolerance: the recompute runs the same ops on the same inputs with the same masks, so the
    gradients are the same bits, and they are summed in microbatch order either way ([Note: ordered gradient
    accumulation]). Different masks in the recompute would give gradients that do not belong to the forward.
    """
    counts = {}
    results = {}
    for case in ("plain", "checkpointed"):
        out_dir = str(tmp_path / case)
        os.makedirs(out_dir, exist_ok=True)
        checkpointing = lightning_mp.ActivationCheckpointing(["GPT2Block"]) if case == "checkpointed" else None
        callbacks = [checkpointing] if checkpointing is not None else []
        callbacks.append(CountAttentionCalls(out_dir, checkpointing))
        results[case] = fit(out_dir, "gpt2", smp(2, 4), devices=2, seed=7, callbacks=callbacks)
        counts[case] = [torch.load(os.path.join(out_dir, f"calls{r}.pt")) for r in range(2)]
    plain, checkpointed = results["plain"], results["checkpointed"]
    for rank in range(2):  # every stage checkpoints its own blocks, and recomputes each block once per microbatch
        blocks = {k.split(".attn.")[0] for k in checkpointed[rank]["state"] if ".attn." in k}
        assert blocks and sorted(counts["checkpointed"][rank]["applied"]) == sorted(blocks), rank
        assert counts["plain"][rank]["calls"] == STEPS * 4 * len(blocks), rank
        assert counts["checkpointed"][rank]["calls"] == 2 * counts["plain"][rank]["calls"], rank
    assert checkpointed[0]["losses"] == plain[0]["losses"]
    assert checkpointed[0]["logged"] == plain[0]["logged"]
    assert_state_equal(merged_state(checkpointed), merged_state(plain), exact=True)


class SharedDropoutBlock(nn.Module):
    """A residual block whose dropout sits in a keyed child (a child of an ``nn.Sequential`` with parameters)."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.ff = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Dropout(0.3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ff(x)


class SharedBlockNet(nn.Module):
    """One block applied twice per forward (weight sharing, as in ALBERT), then a head."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(8, dim)
        self.shared = SharedDropoutBlock(dim)
        self.other = SharedDropoutBlock(dim)
        self.out = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.shared(self.shared(self.inp(x)))
        return self.out(self.other(h)).squeeze(-1)


SPECS["shared"] = Spec(SharedBlockNet, _vector_batch, _regress_step)


def test_checkpointed_module_called_twice_recomputes_each_call_with_its_own_masks(tmp_path):
    """Backward recomputes the second call of ``shared`` first: it must draw the second forward call's masks."""
    plain = fit(str(tmp_path / "plain"), "shared", smp(2, 2, partition={"net.shared": 0, "net.other": 1}),
                devices=2, seed=3)
    checkpointing = lightning_mp.ActivationCheckpointing(["net.shared", "net.other"])
    checkpointed = fit(str(tmp_path / "ckpt"), "shared", smp(2, 2, partition={"net.shared": 0, "net.other": 1}),
                       devices=2, seed=3, callbacks=[checkpointing])
    assert checkpointed[0]["losses"] == plain[0]["losses"]
    assert_state_equal(merged_state(checkpointed), merged_state(plain), exact=True)


# ---- 8. a microbatch without tokens -----------------------------------------------------------------------------


def _padded_batch_one_empty(n: int, seed: int) -> tuple[torch.Tensor, ...]:
    """As ``_padded_batch``, but rows 2 and 3 (microbatch 1 of 4) have no target: their mean loss is NaN."""
    ids, targets = _padded_batch(n, seed)
    targets[2:4] = -100
    return ids, targets


SPECS["padded_empty"] = Spec(PaddedLM, _padded_batch_one_empty, _padded_step)


@pytest.mark.parametrize("schedule", ["interleaved", "simple"])
def test_a_microbatch_with_no_tokens_counts_for_nothing_in_loss_logs_and_gradients(tmp_path, schedule):
    """``num_tokens == 0``: its loss (a mean over nothing, NaN) must weigh nothing, in the logged value too; and
    under "simple" the wave's other backwards must not wait for its (skipped) backward."""
    reference = fit(str(tmp_path / "ref"), "padded_empty")[0]
    assert all(v == v for v in reference["logged"]), "one process on the batch: finite"
    results = fit(str(tmp_path / "smp"), "padded_empty", smp(2, 4, pipeline=schedule, timeout=timedelta(seconds=60)), devices=2)
    for result in results:
        torch.testing.assert_close(result["losses"], reference["losses"], **TOL)
        torch.testing.assert_close(result["logged"], reference["logged"], **TOL)
    assert_state_equal(merged_state(results), reference["state"])


def test_token_weighted_loss_with_gradient_accumulation_equals_one_process(tmp_path):
    """``accumulate_grad_batches=2``: each batch is normalised by its own token count, as one process does."""
    reference = fit(str(tmp_path / "ref"), "padded", accumulate_grad_batches=2)[0]
    results = fit(str(tmp_path / "smp"), "padded", smp(2, 4), devices=2, accumulate_grad_batches=2)
    torch.testing.assert_close(results[0]["losses"], reference["losses"], **TOL)
    assert_state_equal(merged_state(results), reference["state"])


def test_token_weighted_loss_with_data_parallel_equals_one_process(tmp_path):
    """pp=1 x dp=2, both replicas reading the same batches: each replica divides its gradients by its own token
    count after the step, so they cannot be all-reduced during backward (the first step's buckets are dropped on
    every rank, see [Note: overlapped gradient all-reduce]); all-reduced after it, they are one process's."""
    reference = fit(str(tmp_path / "ref"), "padded")[0]
    results = fit(str(tmp_path / "smp"), "padded", smp(1, 4), devices=2)
    for result in results:
        torch.testing.assert_close(result["losses"], reference["losses"], **TOL)
        assert_state_equal(result["state"], reference["state"])
