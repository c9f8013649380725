"""Activation checkpointing, activation offloading and optimizer-state sharding against the same model unchanged.

Tier 1 (one process): checkpointed modules recompute (counted), give the same loss and bitwise the same gradients
(dropout included: the recompute draws the same masks), keep their FQNs; a stage input without ``requires_grad``
still trains (non-reentrant mode); the offloader packs/unpacks each saved input once, in reverse order per
microbatch, loads ``horizon`` ahead, frees the originals and leaves gradients bitwise unchanged.
Tier 2 (``Trainer.fit``, fork): each switch alone and all together with delayed init at pp2 x dp2 match one
process; a sharded optimizer saves through DCP and resumes.
"""

from __future__ import annotations

import copy
import gc
import os
import weakref

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_mp
from lightning_mp.memory import ActivationOffloader, glibc, is_checkpointed, set_activation_checkpointing


class Block(nn.Module):
    """A residual MLP block with dropout that counts its forward calls."""

    def __init__(self, dim: int = 8, p: float = 0.2) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.drop = nn.Dropout(p)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, dim)
        self.calls += 1
        return x + self.drop(torch.tanh(self.fc(x)))


class Net(nn.Module):
    def __init__(self, depth: int = 4, dim: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.Sequential(*[Block(dim) for _ in range(depth)])
        self.out = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(self.inp(x)))


def _step(model: nn.Module, x: torch.Tensor, seed: int = 5) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(seed)
    loss = model(x).pow(2).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _pair(depth: int = 4) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    reference = Net(depth)
    return reference, copy.deepcopy(reference)


def _calls(model: Net) -> list[int]:
    return [block.calls for block in model.blocks]


@pytest.mark.parametrize(
    ("strategy", "target", "expected_calls"),
    [
        ("each", "blocks", [2, 2, 2, 2]),
        ("contiguous", "blocks", [2, 2, 2, 2]),
        ("group_2", "blocks", [2, 2, 2, 2]),
        ("each", "blocks.1", [1, 2, 1, 1]),
    ],
)
def test_checkpointing_recomputes_and_gives_bitwise_the_same_loss_and_grads_with_dropout(strategy, target, expected_calls):
    reference, model = _pair()
    x = torch.randn(6, 8)
    keys = list(model.state_dict())
    set_activation_checkpointing(model.get_submodule(target), strategy=strategy)
    expected_loss, expected_grads = _step(reference, x)
    loss, grads = _step(model, x)
    assert _calls(model) == expected_calls, "checkpointed blocks ran twice (forward + recompute)"
    assert _calls(reference) == [1, 1, 1, 1]
    assert torch.equal(loss, expected_loss)
    for name, grad in grads.items():
        assert torch.equal(grad, expected_grads[name]), name
    assert list(model.state_dict()) == keys, "FQNs unchanged"


def test_recompute_without_preserved_rng_draws_other_dropout_masks():
    """The control for the test above: dropout is live, so equal grads come from the restored random state."""
    reference, model = _pair()
    x = torch.randn(6, 8)
    set_activation_checkpointing(model.blocks, strategy="each", preserve_rng_state=False)
    _, expected = _step(reference, x)
    _, grads = _step(model, x)
    assert not all(torch.equal(grads[n], expected[n]) for n in grads)


def test_a_stage_input_without_requires_grad_still_trains_the_checkpointed_module():
    """Non-reentrant mode: the first module of a stage gets an input that does not require grad."""
    torch.manual_seed(0)
    block = Block(p=0.0)
    reference = copy.deepcopy(block)
    set_activation_checkpointing(block)
    x = torch.randn(4, 8)  # requires_grad=False, as a received activation
    block(x).sum().backward()
    reference(x).sum().backward()
    assert block.calls == 2 and block.fc.weight.grad is not None
    assert torch.equal(block.fc.weight.grad, reference.fc.weight.grad)


def test_checkpointing_errors_name_the_fix():
    with pytest.raises(ValueError, match=r"'group_0'.*'each', 'contiguous', 'group_N'"):
        set_activation_checkpointing(Net().blocks, strategy="group_0")
    block = Block()
    set_activation_checkpointing(block)
    assert is_checkpointed(block)
    with pytest.raises(ValueError, match="already checkpointed"):
        set_activation_checkpointing(block)
    with pytest.raises(ValueError, match="does not run wholly on this rank"):
        set_activation_checkpointing(Block(), is_local=lambda m: False)


def test_offloading_moves_each_saved_input_once_reverse_order_per_microbatch_horizon_ahead_grads_bitwise():
    reference, model = _pair(depth=6)
    set_activation_checkpointing(model.blocks, strategy="each")
    current = {"mb": 0}
    offloader = ActivationOffloader(horizon=2, microbatch_fn=lambda: current["mb"])
    for block in model.blocks:
        block.__dict__["_lightning_mp_offloader"] = offloader
    originals: list[weakref.ref] = []
    pack = offloader._pack
    offloader._pack = lambda t: (originals.append(weakref.ref(t)), pack(t))[1]

    xs = [torch.randn(3, 8), torch.randn(3, 8)]
    losses = []
    for mb, x in enumerate(xs):  # two microbatches' forwards, then their backwards in the other order
        current["mb"] = mb
        torch.manual_seed(10 + mb)
        losses.append(model(x).pow(2).mean())
    gc.collect()
    assert offloader.stats.packs == 12 and offloader.stats.unpacks == 0, "one saved input per block and microbatch"
    alive = [r for r in originals if r() is not None]
    assert len(alive) == 0, f"{len(alive)} offloaded activations are still alive on the device"
    assert offloader.stats.host_bytes == 12 * 3 * 8 * 4
    for mb in (1, 0):
        current["mb"] = mb
        losses[mb].backward()
    assert offloader.stats.unpacks == 12
    order = offloader.stats.unpack_order
    assert order == [(1, i) for i in reversed(range(6))] + [(0, i) for i in reversed(range(6))]
    assert offloader.stats.prefetches == 2 * 5, "every entry but the last of a microbatch is loaded ahead"
    assert offloader.stats.host_bytes == 0

    for mb, x in enumerate(xs):
        torch.manual_seed(10 + mb)
        reference(x).pow(2).mean().backward()
    for name, param in model.named_parameters():
        assert torch.equal(param.grad, dict(reference.named_parameters())[name].grad), name


class TwoInputs(nn.Module):
    """A checkpointed call that saves two inputs (one task of two entries)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * y


def test_offloading_loads_horizon_checkpointed_calls_ahead():
    """SMP's horizon counts tasks (module executions), not tensors: the first unpack loads the rest of its call
    and both inputs of each of the next ``horizon`` calls."""
    torch.manual_seed(0)
    reference = nn.ModuleList(TwoInputs() for _ in range(4))
    model = copy.deepcopy(reference)
    offloader = ActivationOffloader(horizon=2)
    for block in model:
        set_activation_checkpointing(block)
        block.__dict__["_lightning_mp_offloader"] = offloader
    after_each_unpack: list[int] = []
    unpack = offloader._unpack
    offloader._unpack = lambda packed: (unpack(packed), after_each_unpack.append(offloader.stats.prefetches))[0]
    x0, y = torch.randn(3, 8, requires_grad=True), torch.randn(3, 8, requires_grad=True)
    outputs = []
    for net in (reference, model):
        x = x0
        for block in net:
            x = block(x, y)
        outputs.append(x.pow(2).sum())
    assert offloader.stats.packs == 8, "two saved inputs per checkpointed call"
    outputs[1].backward()
    assert after_each_unpack[0] == 1 + 2 * 2, "its call's other input and both inputs of the next 2 calls"
    assert offloader.stats.prefetches == 7 and offloader.stats.unpacks == 8 and offloader.stats.host_bytes == 0
    ref_grads = torch.autograd.grad(outputs[0], list(reference.parameters()))
    for (name, param), expected in zip(model.named_parameters(), ref_grads):
        assert torch.equal(param.grad, expected), name


def test_offloader_rejects_a_bad_horizon():
    with pytest.raises(ValueError, match="`horizon` must be an integer >= 1, got 0"):
        ActivationOffloader(horizon=0)


# ---- tier 2: Trainer(strategy="smp"), fork -------------------------------------------------------------------

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


class Record(L.Callback):
    """Per rank: final parameters, the losses, and evidence that each switch ran."""

    def __init__(self, out_dir: str, offloading: lightning_mp.ActivationOffloading | None = None) -> None:
        self.out_dir, self.offloading = out_dir, offloading
        self.losses: list[float] = []
        self.packs = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))
        if self.offloading is not None:
            self.packs = self.offloading.offloader.stats.packs

    def on_train_end(self, trainer, pl_module):
        from torch.distributed.optim import ZeroRedundancyOptimizer

        optimizer = trainer.optimizers[0]
        local = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
        torch.save(
            {
                "losses": self.losses,
                "params": {n: p.detach().clone() for n, p in pl_module.named_parameters()},
                "checkpointed": sorted(f for f, _ in lightning_mp.memory.checkpointed_modules(pl_module)),
                "packs": self.packs,
                "sharded": isinstance(optimizer, ZeroRedundancyOptimizer),
                "state_params": len(local.state),
            },
            os.path.join(self.out_dir, f"{trainer.global_rank}.pt"),
        )


def _fit(out_dir: str, strategy="auto", devices: int = 1, callbacks=(), model=None, max_steps=STEPS, ckpt_path=None,
         checkpoint_dir=None) -> list[dict]:
    offloading = next((c for c in callbacks if isinstance(c, lightning_mp.ActivationOffloading)), None)
    extra = [] if checkpoint_dir is None else [L.pytorch.callbacks.ModelCheckpoint(dirpath=checkpoint_dir, save_last=True)]
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=max_steps, logger=False,
        enable_checkpointing=checkpoint_dir is not None, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[Record(out_dir, offloading), *callbacks, *extra], use_distributed_sampler=False,
    )
    trainer.fit(model if model is not None else NetModule(), ckpt_path=ckpt_path)
    return [torch.load(os.path.join(out_dir, f"{r}.pt"), weights_only=False) for r in range(devices)]


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


_RELEASE_PROBE = """
import sys, threading, torch
from lightning_mp.memory._host import fix_mmap_threshold
def rss():
    return int(next(l for l in open('/proc/self/status') if l.startswith('VmRSS')).split()[1]) * 1024
if sys.argv[1] == 'release':
    assert fix_mmap_threshold()
def churn():  # 4 MiB tensors from a non-main thread's arena, as the engine threads allocate gradients
    for _ in range(3):
        kept = [torch.ones(1 << 20) for _ in range(48)]
        del kept
before = rss()
thread = threading.Thread(target=churn); thread.start(); thread.join()
print((rss() - before) >> 20)
"""


@pytest.mark.skipif(not glibc(), reason="glibc only")
def test_release_host_memory_gives_freed_tensors_back_and_glibc_default_keeps_them():
    """[Note: freed tensors stay resident under glibc]: 192 MiB allocated and freed in a thread."""
    import subprocess
    import sys

    def retained(mode: str) -> int:
        env = {**os.environ, "PYTHONPATH": os.getcwd()}
        env.pop("MALLOC_MMAP_THRESHOLD_", None)
        done = subprocess.run([sys.executable, "-c", _RELEASE_PROBE, mode], capture_output=True, text=True, env=env,
                              timeout=120, check=True)
        return int(done.stdout.split()[-1])

    assert retained("release") < 16
    assert retained("default") > 64, "glibc's dynamic threshold keeps them (else this test shows nothing)"
    with pytest.raises(ValueError, match="`release_host_memory` must be True or False"):
        lightning_mp.SMPConfig(release_host_memory=1)


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


def test_memory_savers_config_trains_through_the_cli(tmp_path):
    """Tier 3: configs/gpt_memory_savers.yaml (every switch from YAML; run at pp=2 on 2 processes) via the CLI.

    The GPT builds its layers in ``__init__``; ``DelayedParameterInit`` in the config makes the CLI instantiate
    it under delayed init, so each rank materialises only its own stage.
    """
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    args = [
        sys.executable, "-m", "lightning_mp.cli", "fit", "--config", "configs/gpt_memory_savers.yaml",
        "--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1",
        "--trainer.default_root_dir", str(tmp_path),  # the config's ModelCheckpoint writes there
        "--data.init_args.max_bytes", "200000", "--model.init_args.n_layer", "2",
        "--trainer.devices", "2",  # pp=2 only: two processes keep the test short (sharding is tested above)
    ]
    env = {**os.environ, "PYTHONPATH": str(root)}
    result = subprocess.run(args, cwd=root, capture_output=True, text=True, timeout=420, env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "delayed init materialised stage 0" in output
    assert "activation checkpointing on" in output
    assert "shard_optimizer_state=True has no effect with one data-parallel replica" in output


@pytest.mark.parametrize(("strategy", "segments"), [("each", 4), ("group_2", 2), ("group_3", 2), ("contiguous", 1)])
def test_grouping_strategies_make_one_checkpoint_per_group(strategy, segments):
    """Each checkpoint saves one input: counted by an offloader on every checkpointed module."""
    reference, model = _pair()
    set_activation_checkpointing(model.blocks, strategy=strategy)
    offloader = ActivationOffloader(horizon=1)
    for module in [model.blocks, *model.blocks]:
        module.__dict__["_lightning_mp_offloader"] = offloader
    x = torch.randn(6, 8)
    _, grads = _step(model, x)
    _, expected = _step(reference, x)
    assert offloader.stats.packs == offloader.stats.unpacks == segments
    for name, grad in grads.items():
        assert torch.equal(grad, expected[name]), name
