"""Delayed init for models whose step reads tensor values (data-dependent control flow, issue 21 item 5).

The partitioning trace of a delayed-init model runs on meta, where ``if h[0, 0].item() > 0`` cannot run; it is
traced again on the real sample with each module's weights real during its own call (see [Note: per-call
materialisation] in ``init/_per_call.py``). Tier 1: the module-by-module weights are the eager build's (the gate
takes eager's branch and the output is bitwise eager's), the peak is one module's weights. Tier 2: ``Trainer.fit``
at pp=2 with delayed init equals eager on one process (loss and every parameter); a model that uses a child's
weight in its parent's forward gets one error that names the module, the op and the way out, and no second error
from the teardown (popen launcher, ``tests/scripts/delayed_trace_error.py``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_mp
from lightning_mp.init import delay_param_initialization, materialize_per_call

ROOT = Path(__file__).resolve().parents[1]
SEED, STEPS = 0, 3


class Gated(nn.Module):
    """Residual tanh blocks, then a gate on an activation's value (so on the weights): ``alt`` runs or not."""

    def __init__(self, dim: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(8, dim)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(dim, dim), nn.Tanh()) for _ in range(depth)])
        self.alt = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 8) -> (B,)
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        if h[0, 0].item() > 0:
            h = torch.tanh(self.alt(h))
        return self.out(h).squeeze(-1)


class GateOnAChildsWeight(Gated):
    """The parent reads ``alt.weight`` outside ``alt``'s call: cannot be made real module by module."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.alt.weight.sum() > 0:
            x = x * 2
        return super().forward(x)


def _sample(n: int = 4) -> torch.Tensor:
    return torch.randn(n, 8, generator=torch.Generator().manual_seed(1))


def test_each_call_gets_the_eager_weights_and_only_its_own():
    torch.manual_seed(SEED)
    eager = Gated()
    torch.manual_seed(SEED)
    with delay_param_initialization():
        model = Gated()
    x = _sample()
    h = eager.inp(x)
    for block in eager.blocks:
        h = h + block(h)
    opens = h[0, 0].item() > 0  # the branch eager takes on this sample
    with materialize_per_call(model) as report:
        out = model(x)
    assert torch.equal(out, eager(x)), "the gate took eager's branch and every call had eager's weights"
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()]), "every weight went back to meta"
    own = [sum(p.numel() * p.element_size() for p in m.parameters(recurse=False)) for m in eager.modules()]
    assert report.peak_bytes == max(own) < report.total_bytes / 4, "one module's weights at a time"
    assert report.calls == 6 + opens, "inp, four blocks' linears, out, and alt if the gate opens"


class Lit(L.LightningModule):
    def __init__(self, model_cls: type[nn.Module] = Gated) -> None:
        super().__init__()
        self.model_cls, self.net = model_cls, None

    def configure_model(self) -> None:
        if self.net is None:
            torch.manual_seed(SEED)
            self.net = self.model_cls()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(2)
        return DataLoader(TensorDataset(torch.randn(8 * STEPS, 8, generator=g), torch.randn(8 * STEPS, generator=g)),
                          batch_size=8)


class Record(L.Callback):
    def __init__(self, out_dir: str) -> None:
        self.out_dir, self.losses = out_dir, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer, pl_module):
        params = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
        torch.save({"losses": self.losses, "params": params}, os.path.join(self.out_dir, f"{trainer.global_rank}.pt"))


def _fit(out_dir: Path, strategy="auto", devices: int = 1) -> list[dict]:
    out_dir.mkdir()
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=STEPS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[Record(str(out_dir))],
    )
    trainer.fit(Lit())
    return [torch.load(out_dir / f"{r}.pt") for r in range(devices)]


def test_data_dependent_model_with_delayed_init_at_pp2_matches_eager_one_process(tmp_path):
    reference = _fit(tmp_path / "ref")[0]
    strategy = lightning_mp.SMPStrategy(
        pipeline_parallel_degree=2, microbatches=1, start_method="fork", delayed_parameter_initialization=True
    )
    results = _fit(tmp_path / "smp", strategy, devices=2)
    assert all(r["params"] for r in results), "both stages hold parameters"
    params = {n: p for r in results for n, p in r["params"].items()}
    assert sorted(params) == sorted(reference["params"])
    for result in results:
        torch.testing.assert_close(result["losses"], reference["losses"], rtol=1e-5, atol=1e-6)
    for name, value in params.items():
        torch.testing.assert_close(value, reference["params"][name], rtol=1e-5, atol=1e-6, msg=name)


def _failed_script_output(script: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "LOCAL_RANK", "MASTER_PORT")}
    result = subprocess.run(
        [sys.executable, f"tests/scripts/{script}"], cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode != 0
    return result.stdout + result.stderr


def test_a_parent_reading_a_childs_weight_is_one_clear_error_and_the_teardown_adds_none():
    output = _failed_script_output("delayed_trace_error.py")
    assert "it failed in module 'net'" in output, output[-4000:]
    assert "Tensor.item() cannot be called on meta tensors" in output, output[-4000:]
    assert "partition_plan=" in output, output[-4000:]
    assert "Cannot copy out of meta tensor" not in output, output[-4000:]


class _ReadsValues(nn.Module):
    """A step that needs values in one of the ways torch reports on meta tensors."""

    def __init__(self, read: str):
        super().__init__()
        self.gate, self.read = nn.Linear(8, 4), read

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        if self.read == "bincount":  # an MoE router's tokens per expert: "with Meta tensors"
            return logits * torch.bincount(logits.argmax(-1), minlength=4).float()
        if self.read == "unique":
            return logits * torch.unique(logits.argmax(-1)).numel()
        if self.read == "numpy":  # TypeError: "can't convert meta device type tensor to numpy"
            return logits * float(logits.numpy()[0, 0])
        return logits * logits[0, 0].item()


@pytest.mark.parametrize("read", ["item", "bincount", "unique", "numpy"])
def test_value_reads_on_meta_are_retried_per_call(read):
    from lightning_mp.partition import trace  # noqa: PLC0415
    from lightning_mp.strategy._delayed import MetaInputs, needs_real_values  # noqa: PLC0415

    inputs = MetaInputs(lambda batch: batch)
    with delay_param_initialization():
        model = _ReadsValues(read)
    with pytest.raises(RuntimeError) as failed:
        trace(model, lambda: model(inputs(_sample())))
    assert needs_real_values(inputs, failed.value)


def test_an_error_that_only_mentions_metadata_is_not_retried():
    from lightning_mp.strategy._delayed import MetaInputs, needs_real_values  # noqa: PLC0415

    err = RuntimeError("tracing the model failed: the traced run raised KeyError: 'metadata'")
    assert not needs_real_values(MetaInputs(lambda batch: batch), err)
    assert needs_real_values(MetaInputs(lambda batch: batch), RuntimeError("Tensor.item() on meta tensors"))


def test_a_model_built_in_two_delayed_blocks_fails_once_and_the_teardown_adds_none():
    output = _failed_script_output("delayed_two_blocks.py")
    assert output.count("ValueError: The model was built in 2 separate") == 1, output[-4000:]


class _PositionTable(nn.Module):
    """Learned positions returned as a view of the module's own parameter (GPT/ViT position tables)."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(16, 8))

    def forward(self, length: int) -> torch.Tensor:
        return self.table[:length]


class _ViewsAWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.pos, self.lin = _PositionTable(), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.pos(x.size(0))
        try:  # a module called inside an `except` block that handles an error of the user's own
            raise KeyError("no cache")
        except KeyError:
            return self.lin(h) if h[0, 0].item() > -100 else h


def test_an_output_that_views_its_modules_weight_keeps_it_and_a_handled_error_names_no_module():
    """Per-call materialisation: ``self.table[:T]`` is read after ``pos``'s call (its storage was freed: SIGSEGV
    before), and ``lin`` called inside the user's ``except`` block is not recorded as the failing module."""
    torch.manual_seed(0)
    eager = _ViewsAWeight()
    torch.manual_seed(0)
    with delay_param_initialization():
        model = _ViewsAWeight()
    x = _sample()
    with materialize_per_call(model) as report:
        out = model(x)
    torch.testing.assert_close(out, eager(x), rtol=0, atol=0)
    assert report.failed_in is None
