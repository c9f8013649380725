"""Delayed parameter initialisation through ``Trainer.fit`` with ``strategy="smp"`` (fork): the initial weights
are bitwise those of an eager one-process build at pp=2, pp=4 and dp=2 through
``trainer.init_module(empty_init=True)``, ``configure_model`` with the strategy argument or the
``DelayedParameterInit`` callback, and the context manager; training with delayed init matches one process; the
meta trace runs in a child process and its errors reach the user."""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_mp
from lightning_mp.strategy._tied import original_names
from tests.unit.test_delayed_init import BATCH, BUILDS, SEED, STEPS, _assert_bitwise, _eager, _tensors


def _token_batches(vocab: int = 64, t: int = 8) -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, vocab, (BATCH * STEPS, t), generator=g)
    return TensorDataset(x, torch.roll(x, -1, dims=1))


class Wrapped(L.LightningModule):
    """One of ``BUILDS`` as a LightningModule, built in ``__init__`` or in ``configure_model`` (seeded there)."""

    def __init__(self, name: str, in_configure_model: bool = False) -> None:
        super().__init__()
        self.name = name
        self.net = None if in_configure_model else BUILDS[name]()

    def configure_model(self) -> None:
        if self.net is None:
            torch.manual_seed(SEED)
            self.net = BUILDS[self.name]()

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.name == "custom":
            return self.net(x.float()[:, :1].repeat(1, 16) / 64).pow(2).mean()
        logits = self.net(input_ids=x).logits
        return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_token_batches(), batch_size=BATCH)


class Snapshot(L.Callback):
    """Per rank, after setup: the local tensors and their storage sizes; after training: the parameters."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.initial: dict[str, torch.Tensor] = {}
        self.storage_ok: dict[str, bool] = {}

    def on_fit_start(self, trainer, pl_module):
        for fqn, tensor in _tensors(pl_module).items():
            self.initial[fqn] = tensor.detach().clone()
            self.storage_ok[fqn] = tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()

    def on_train_end(self, trainer, pl_module):
        final = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
        torch.save(
            {"initial": self.initial, "storage_ok": self.storage_ok, "final": final},
            os.path.join(self.out_dir, f"{trainer.global_rank}.pt"),
        )


def _trainer(out_dir: str, devices: int, strategy, callbacks=()) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=STEPS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[Snapshot(out_dir), *callbacks], use_distributed_sampler=False,
    )


def _results(out_dir: str, devices: int) -> list[dict]:
    return [torch.load(os.path.join(out_dir, f"{r}.pt"), weights_only=False) for r in range(devices)]


def _check_ranks(results: list[dict], expected: dict[str, torch.Tensor], pp: int, tied: frozenset = frozenset()) -> None:
    """Bitwise initial tensors per rank; each storage its own size; one replica's stages hold everything once, but
    the copies of a replicated tied weight (``tied``: every name of a tied parameter; ``tied_weights="auto"``)."""
    for result in results:
        _assert_bitwise(result["initial"], expected)
        assert all(result["storage_ok"].values()), [k for k, ok in result["storage_ok"].items() if not ok]
    replica = [set(r["initial"]) for r in results[:pp]]
    assert set().union(*replica) == set(expected), "the stages of a replica hold every tensor"
    params = [n for r in results[:pp] for n in r["final"]]
    assert {n for n in params if params.count(n) > 1} <= tied, "no parameter on two stages, but tied copies"
    if pp > 1:
        assert all(len(names) < len(expected) for names in replica), "no rank allocates another stage's tensors"


def test_gpt_init_module_empty_init_pp2_bitwise_and_training_matches_one_process(tmp_path):
    """`trainer.init_module(empty_init=True)` builds on meta; pp=2 ranks get eager's weights; 2 AdamW steps match."""
    from examples.gpt import GPT

    class StableAdamGPT(GPT):
        def configure_optimizers(self):
            """The GPT's AdamW with ``eps=1e-4``: the attention key bias's true gradient is zero (softmax is shift
            invariant), so its gradient is rounding noise (another on one process than on two) that Adam with a
            tiny eps turns into full-size steps."""
            config = super().configure_optimizers()
            for group in config["optimizer"].param_groups:
                group["eps"] = 1e-4
            return config

    def build():
        return StableAdamGPT(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=32, dropout=0.0, warmup_steps=1)

    def data():
        return DataLoader(_token_batches(), batch_size=BATCH)

    os.makedirs(tmp_path / "ref")
    os.makedirs(tmp_path / "smp")
    reference = _trainer(str(tmp_path / "ref"), 1, "auto")
    torch.manual_seed(SEED)
    eager = build()
    expected = {k: v.detach().clone() for k, v in _tensors(eager).items()}
    reference.fit(eager, train_dataloaders=data())
    ref_final = _results(str(tmp_path / "ref"), 1)[0]["final"]

    strategy = lightning_mp.SMPStrategy(pipeline_parallel_degree=2, microbatches=2, start_method="fork")
    trainer = _trainer(str(tmp_path / "smp"), 2, strategy)
    torch.manual_seed(SEED)
    with trainer.init_module(empty_init=True):
        model = build()
    assert all(p.is_meta for p in model.parameters())
    trainer.fit(model, train_dataloaders=data())
    results = _results(str(tmp_path / "smp"), 2)
    _check_ranks(results, expected, pp=2, tied=_tied_names(eager))
    for result in results:
        for fqn, value in result["final"].items():
            torch.testing.assert_close(value, ref_final[fqn], rtol=1e-5, atol=1e-6, msg=fqn)


@pytest.mark.parametrize(
    ("name", "pp", "dp", "how"),
    [("custom", 1, 2, "strategy-arg"), ("llama", 2, 2, "callback"), ("gpt2", 4, 1, "context")],
    ids=["custom-dp2-strategy-arg", "tied-llama-pp2xdp2-callback", "gpt2-pp4-context-manager"],
)
def test_every_layout_gets_the_eager_weights_bitwise(tmp_path, name, pp, dp, how):
    eager = _eager(name, SEED)[0]
    expected = {f"net.{k}": v for k, v in _tensors(eager).items()}
    strategy = lightning_mp.SMPStrategy(
        pipeline_parallel_degree=pp, microbatches=2, start_method="fork",
        delayed_parameter_initialization=how == "strategy-arg",
    )
    callbacks = [lightning_mp.DelayedParameterInit()] if how == "callback" else []
    trainer = _trainer(str(tmp_path), pp * dp, strategy, callbacks)
    if how == "context":
        torch.manual_seed(SEED)
        with lightning_mp.delay_param_initialization():
            model = Wrapped(name)
    else:
        model = Wrapped(name, in_configure_model=True)
    trainer.fit(model)
    _check_ranks(_results(str(tmp_path), pp * dp), expected, pp, tied=_tied_names(eager, prefix="net."))


def _tied_names(model: torch.nn.Module, prefix: str = "") -> frozenset:
    names = original_names(model)
    return frozenset(prefix + n for n in {*names, *names.values()})


class CountingSteps(Wrapped):
    """``Wrapped`` that counts its ``training_step`` calls per process and writes the count and the plan at the end;
    ``fail_in_trace`` makes the first call (the partitioning trace) raise."""

    def __init__(self, name: str, out_dir: str, fail_in_trace: bool = False) -> None:
        super().__init__(name, in_configure_model=True)
        self.out_dir, self.fail_in_trace, self.calls = out_dir, fail_in_trace, 0

    def training_step(self, batch, batch_idx):
        self.calls += 1
        if self.fail_in_trace and self.calls == 1:
            raise ValueError("the step failed while being traced")
        return super().training_step(batch, batch_idx)

    def train_dataloader(self) -> DataLoader:  # shuffles: iterating it draws from the global generator
        return DataLoader(_token_batches(), batch_size=BATCH, shuffle=True)

    def on_fit_start(self) -> None:
        self.rng_at_fit_start = torch.rand(4)

    def on_train_end(self) -> None:
        plan = self.trainer.strategy.partition_plan.to_dict()
        torch.save({"calls": self.calls, "plan": plan, "rng": self.rng_at_fit_start},
                   os.path.join(self.out_dir, f"calls{self.global_rank}.pt"))


def test_the_meta_trace_runs_in_a_child_process_and_plans_as_in_process(tmp_path, monkeypatch):
    """See [Note: the meta trace runs in a child process]: rank 0's module never runs the trace's step itself (its
    step count is the training steps' microbatches only), and the plan equals the in-process trace's."""
    results = {}
    for in_child in (True, False):
        if not in_child:
            monkeypatch.setattr(lightning_mp.strategy._stages, "trace_in_child", lambda is_meta: False)
        out = tmp_path / str(in_child)
        out.mkdir()
        strategy = lightning_mp.SMPStrategy(
            pipeline_parallel_degree=2, microbatches=2, start_method="fork", delayed_parameter_initialization=True
        )
        torch.manual_seed(0)
        _trainer(str(out), 2, strategy).fit(CountingSteps("gpt2", str(out)))
        results[in_child] = torch.load(out / "calls0.pt", weights_only=False)
    assert results[True]["calls"] == STEPS * 2  # 2 microbatches per step; the trace ran in the child
    assert results[False]["calls"] == STEPS * 2 + 1  # + the trace, in-process
    assert results[True]["plan"] == results[False]["plan"]
    # the first batch, fetched in the parent for the child (a shuffling sampler draws), leaves the generator as is
    assert torch.equal(results[True]["rng"], results[False]["rng"])


def test_an_error_in_the_child_trace_reaches_the_user_with_its_message(tmp_path):
    strategy = lightning_mp.SMPStrategy(
        pipeline_parallel_degree=2, microbatches=2, start_method="fork", delayed_parameter_initialization=True
    )
    with pytest.raises(Exception, match=r"Setup failed on global rank 0 while tracing.*ValueError: the step failed"):
        _trainer(str(tmp_path), 2, strategy).fit(CountingSteps("gpt2", str(tmp_path), fail_in_trace=True))
