"""The bucketed data-parallel all-reduce launched from gradient hooks (``strategy/_reducer.py``) gives the gradients
that the all-reduce after backward (``all_reduce_gradients``) gives, bitwise at dp=2, and falls back on every rank
when one rank's gradients do not arrive once per parameter."""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_mp
from lightning_mp.strategy import _reducer
from lightning_mp.strategy._reducer import GradientReducer, _make_buckets
from lightning_mp.pipeline._grads import OrderedGradients
from lightning_mp.strategy._gradients import GradientStash, all_reduce_gradients
from tests._dist import run_distributed
from tests.test_strategy import CLIP, _fit


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 16)
        self.b = nn.Linear(16, 16)
        self.unused_on_rank1 = nn.Linear(16, 16)  # a branch only rank 0 takes: no gradient on rank 1
        self.frozen = nn.Linear(16, 16).requires_grad_(False)
        self.c = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, branch: bool, twice: bool) -> torch.Tensor:
        h = torch.tanh(self.b(torch.tanh(self.a(x))))
        if branch:
            h = h + self.unused_on_rank1(h)
        return self.c(self.frozen(h)) + (self.c(h) if twice else 0)


def _steps(rank: int, world: int, bucketed: bool, microbatches: int, accumulate: int, twice_on_rank: int | None,
           token_weighted_on_rank: int | None, launch_in_hooks: bool = True) -> dict:
    """Two optimizer windows of ``accumulate`` batches of ``microbatches`` backwards each, as the strategy runs
    them: gradients set aside per batch (GradientStash), the reducer armed on a window's last batch."""
    torch.manual_seed(0)
    net = _Net()
    params = list(net.parameters())
    group = torch.distributed.group.WORLD
    stash = GradientStash()
    current: list[int | None] = [None]
    reducer = GradientReducer(
        params, group, world, previous=stash.previous,
        first_bucket_bytes=200, bucket_bytes=1200,  # several buckets, one parameter over the cap alone
        launch_in_hooks=launch_in_hooks,
    ) if bucketed else None
    if reducer is not None:  # as the engine reports accumulations at one stage (``PipelineEngine.report_gradients``)
        OrderedGradients(lambda: current[0]).report(reducer.bucketed_params, reducer.accumulated)
    generator = torch.Generator().manual_seed(100 + rank)
    results, fell_back, in_backward = [], [], []
    for window in range(2):
        for batch in range(accumulate):
            last = batch == accumulate - 1
            stash.begin(params, keep_previous=batch > 0)
            armed = reducer is not None and last and reducer.arm(microbatches)
            for mb in range(microbatches):
                current[0] = mb
                x = torch.randn(4, 6, generator=generator)
                twice = twice_on_rank == rank and mb == microbatches - 1 and window == 0
                out = net(x, branch=rank == 0, twice=False)
                (out.pow(2).mean() / (microbatches * accumulate)).backward()
                if twice:  # a second backward call reaching `c` after its last contribution was sent
                    net(x, branch=False, twice=True).sum().mul(1e-3).backward()
            current[0] = None
            if armed:
                in_backward.append(reducer._launched)  # buckets that went out during backward
                if token_weighted_on_rank == rank and window == 0:
                    reducer.surprise()
                reducer.flush()
            stash.end()
            if batch == 0:
                for p in params:
                    p.grad = None  # Lightning's zero_grad at the window's first batch
            stash.apply()
        if reducer is None or not reducer.finish():
            fell_back.append(window)
            all_reduce_gradients(params, group, world)
        results.append({n: None if p.grad is None else p.grad.clone() for n, p in net.named_parameters()})
        for p in params:
            p.grad = None
    return {"grads": results, "fell_back": fell_back, "enabled": reducer.enabled if reducer else None,
            "buckets": reducer.num_buckets if reducer else 0, "in_backward": in_backward}


def _compare(world: int, microbatches: int, accumulate: int, twice_on_rank=None, token_weighted_on_rank=None,
             launch_in_hooks=True):
    args = (microbatches, accumulate, twice_on_rank, token_weighted_on_rank)
    bucketed = run_distributed(_steps, world, True, *args, launch_in_hooks, start_method="fork")
    flat = run_distributed(_steps, world, False, *args, start_method="fork")
    for rank in range(world):
        for window, (got, want) in enumerate(zip(bucketed[rank]["grads"], flat[rank]["grads"])):
            assert got.keys() == want.keys()
            for name in want:
                if want[name] is None:
                    assert got[name] is None, (rank, window, name)
                else:  # the same sums of the same per-rank gradients, then the same division
                    assert torch.equal(got[name], want[name]), (rank, window, name)
    return bucketed


@pytest.mark.parametrize(("microbatches", "accumulate"), [(1, 1), (3, 2)])
def test_bucketed_all_reduce_equals_the_all_reduce_after_backward(microbatches, accumulate):
    torch.set_num_threads(1)
    results = _compare(2, microbatches, accumulate)
    for result in results:
        assert result["fell_back"] == [] and result["enabled"] and result["buckets"] > 2
        assert all(0 < n < result["buckets"] for n in result["in_backward"]), "some, not all, before flush"
        grads = result["grads"][0]
        assert grads["frozen.weight"] is None
        # rank 1 never reaches `unused_on_rank1`: its bucket is flushed after backward; the average is rank 0's half
        assert grads["unused_on_rank1.weight"] is not None


def test_buckets_held_to_flush_give_the_same_gradients():
    """`launch_in_hooks=False` (CUDA at pp > 1: no NCCL call from engine threads): nothing goes out during
    backward, and the gradients are those of the all-reduce after backward."""
    torch.set_num_threads(1)
    for result in _compare(2, 3, 2, launch_in_hooks=False):
        assert result["fell_back"] == [] and result["enabled"]
        assert result["in_backward"] == [0, 0]


@pytest.mark.parametrize("surprise", ["second-backward", "token-weighted"])
def test_a_surprise_on_one_rank_falls_back_on_every_rank(surprise):
    """A gradient after the parameter's bucket went out (or a token-weighted step) on rank 1 only: both ranks drop
    the buckets for the all-reduce after backward, then stay on it."""
    torch.set_num_threads(1)
    kwargs = {"twice_on_rank": 1} if surprise == "second-backward" else {"token_weighted_on_rank": 1}
    results = _compare(2, 2, 1, **kwargs)
    for result in results:
        assert result["fell_back"] == [0, 1] and result["enabled"] is False


def test_buckets_follow_ddp_reverse_order_and_caps():
    params = [nn.Parameter(torch.zeros(n)) for n in (10, 300, 20, 5)] + [nn.Parameter(torch.zeros(4, dtype=torch.float64))]
    buckets = _make_buckets(params, first_bytes=100, cap_bytes=1210)
    as_sizes = [[p.numel() for p in b.params] for b in buckets]
    # reverse order, one dtype per bucket, a first bucket per dtype: 5+20 floats fill the first 100 bytes, 300 + 10
    # floats are over the 1210-byte cap
    assert as_sizes == [[4], [5, 20], [300], [10]]


class _RecordReducer(L.Callback):
    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_train_end(self, trainer, pl_module):
        reducer = trainer.strategy._gradients.reducer
        torch.save({"enabled": reducer.enabled, "in_backward": reducer.launched_during_backward},
                   os.path.join(self.out_dir, f"reducer{trainer.global_rank}.pt"))


def test_pp2_dp2_buckets_go_out_during_backward_and_training_matches_one_process(tmp_path, monkeypatch):
    """Small buckets, so most of them leave from the gradient hooks of both stages (the tied embedding's after its
    ordered accumulation of 4 microbatches), with gradient accumulation over 2 batches and norm clipping after the
    wait: losses and parameters as one device's."""
    torch.set_num_threads(1)  # before forking (a forked child can hang in OpenMP otherwise)
    monkeypatch.setattr(_reducer, "FIRST_BUCKET_BYTES", 64)  # fork: the children see the patched module
    monkeypatch.setattr(_reducer, "BUCKET_BYTES", 512)
    kwargs = {"accumulate_grad_batches": 2, **CLIP}
    (tmp_path / "ref").mkdir()
    (tmp_path / "smp").mkdir()
    reference = _fit("tiedlm", str(tmp_path / "ref"), **kwargs)[0]
    strategy = lightning_mp.SMPStrategy(pipeline_parallel_degree=2, microbatches=4, start_method="fork")
    results = _fit("tiedlm", str(tmp_path / "smp"), strategy, devices=4,
                   callbacks_extra=[_RecordReducer(str(tmp_path / "smp"))], **kwargs)
    for rank in range(4):
        record = torch.load(tmp_path / "smp" / f"reducer{rank}.pt")
        assert record["enabled"] and record["in_backward"] > 0, (rank, record)
    pp = 2
    replicas = [results[r * pp : (r + 1) * pp] for r in range(2)]
    mean_losses = torch.tensor([replica[0]["losses"] for replica in replicas]).mean(0).tolist()
    torch.testing.assert_close(mean_losses, reference["losses"], rtol=1e-5, atol=1e-6)
    for result in results:
        for name, value in result["params"].items():
            torch.testing.assert_close(value, reference["params"][name], rtol=1e-5, atol=1e-6, msg=name)


# ---- regressions found in review: collectives between the buckets, parameters unfrozen after setup ----------

class _Stage1(nn.Module):
    """``b`` runs only where ``use_b`` (one replica): that replica's stage sends more buckets from its hooks."""

    def __init__(self) -> None:
        super().__init__()
        self.c, self.b, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1)
        self.use_b = True

    def forward(self, h):
        h = torch.relu(self.c(h))
        if self.use_b:
            h = h + self.b(h)
        return self.head(h)


class _BranchyLogged(L.LightningModule):
    def __init__(self, unfreeze_at: int | None = None) -> None:
        super().__init__()
        self.l0, self.s1 = nn.Linear(8, 8), _Stage1()
        self.unfreeze_at = unfreeze_at
        if unfreeze_at is not None:  # as Lightning's BaseFinetuning.freeze_before_training
            self.l0.requires_grad_(False)

    def on_fit_start(self) -> None:
        self.s1.use_b = self.trainer.strategy.topology.dp_rank == 0

    def on_train_batch_start(self, batch, batch_idx) -> None:
        if batch_idx == self.unfreeze_at:
            self.l0.requires_grad_(True)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = ((self.s1(torch.relu(self.l0(x))) - y) ** 2).mean()
        self.log("train_loss", loss, sync_dist=True, on_step=True)  # a collective on the dp group mid-step
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
        return torch.utils.data.DataLoader(data, batch_size=8)


class _SaveParams(L.Callback):
    def __init__(self, out) -> None:
        self.out = out

    def on_train_end(self, trainer, pl_module) -> None:
        reducer = trainer.strategy._gradients.reducer
        torch.save(
            {"enabled": reducer.enabled, "params": {n: p.detach().clone() for n, p in pl_module.named_parameters()}},
            self.out / f"{trainer.global_rank}.pt",
        )


def _replicas_after_fit(tmp_path, pp: int, unfreeze_at: int | None) -> list[dict]:
    from datetime import timedelta

    torch.set_num_threads(1)  # before forking
    strategy = lightning_mp.SMPStrategy(
        pipeline_parallel_degree=pp, microbatches=2, start_method="fork", timeout=timedelta(seconds=60),
        partition={"l0": 0, "s1": pp - 1},
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=2 * pp, strategy=strategy, max_steps=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[_SaveParams(tmp_path)],
    )
    trainer.fit(_BranchyLogged(unfreeze_at))
    return [torch.load(tmp_path / f"{r}.pt") for r in range(2 * pp)]


@pytest.mark.parametrize("pp", [1, 2])
def test_a_parameter_unused_on_one_replica_with_sync_dist_logs_neither_hangs_nor_diverges(tmp_path, monkeypatch, pp):
    """One replica sends more buckets from its hooks than the other while `self.log(sync_dist=True)` reduces on the
    dp group mid-step: on a shared group the collectives paired up wrongly (pp=1 crashed, pp=2 hung until the
    timeout). The reducer's own group keeps them apart; replicas stay bitwise equal."""
    monkeypatch.setattr(_reducer, "FIRST_BUCKET_BYTES", 64)  # several buckets (fork: the children see it)
    monkeypatch.setattr(_reducer, "BUCKET_BYTES", 128)
    ranks = _replicas_after_fit(tmp_path, pp, None)
    replicas = [(r, r + pp) for r in range(pp)]  # global rank = dp_rank * pp + pp_rank
    for a, b in replicas:
        assert ranks[a]["enabled"] and ranks[b]["enabled"]
        for name, value in ranks[a]["params"].items():
            if value.numel():
                assert torch.equal(value, ranks[b]["params"][name]), name


def test_a_parameter_unfrozen_after_setup_is_still_averaged(tmp_path):
    """A layer frozen at setup has no bucket; unfrozen at batch 1 (as BaseFinetuning does) it must still be
    all-reduced: the reducer falls back on every replica and the replicas stay equal."""
    ranks = _replicas_after_fit(tmp_path, 1, unfreeze_at=1)
    assert not ranks[0]["enabled"] and not ranks[1]["enabled"]
    for name, value in ranks[0]["params"].items():
        assert torch.equal(value, ranks[1]["params"][name]), name


def test_replicas_stay_equal_when_optimizer_step_runs_only_the_closure_on_some_batches(tmp_path):
    """Lightning's documented `optimizer_step` pattern: `optimizer_closure()` without a step on odd batches. The
    gradients made final in that batch's backward must not count as final for the next window."""
    class SkipOddSteps(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return (self.net(x) - y).pow(2).mean()

        def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
            if batch_idx % 2 == 0:
                optimizer.step(closure=optimizer_closure)
            else:
                optimizer_closure()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            g = torch.Generator().manual_seed(1)
            return DataLoader(TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g)), batch_size=8)

        def on_train_end(self):
            params = {n: p.detach().clone() for n, p in self.named_parameters()}
            torch.save(params, os.path.join(str(tmp_path), f"{self.global_rank}.pt"))

    torch.set_num_threads(1)
    L.Trainer(
        accelerator="cpu", devices=2, strategy=lightning_mp.SMPStrategy(start_method="fork"), max_steps=4,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    ).fit(SkipOddSteps())
    a, b = (torch.load(tmp_path / f"{r}.pt") for r in range(2))
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs between the dp replicas"
