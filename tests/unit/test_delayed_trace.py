"""Delayed init for models whose step reads tensor values (data-dependent control flow, issue 21 item 5).

The partitioning trace of a delayed-init model runs on meta, where ``if h[0, 0].item() > 0`` cannot run; it is
traced again on the real sample with each module's weights real during its own call (see [Note: per-call
materialisation] in ``init/_per_call.py``). The module-by-module weights are the eager build's (the gate takes
eager's branch and the output is bitwise eager's), the peak is one module's weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_mp.init import delay_param_initialization, materialize_per_call

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
