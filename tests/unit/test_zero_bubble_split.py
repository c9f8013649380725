"""The input / weight split of one backward ([Note: zero-bubble] in ``pipeline/_zero_bubble.py``), in one process:
after the input pass only the wanted gradients exist (and a reused module's bias); after the weight pass every
gradient equals the unsplit backward's bitwise, and each parameter's hooks fired as often as in one backward."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_mp.pipeline._zero_bubble import split_backward


class _Scale(torch.autograd.Function):
    """A Python ``autograd.Function`` between the layers: its W children are cut, it never runs twice."""

    calls = 0

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        _Scale.calls += 1
        x, w = ctx.saved_tensors
        return grad * w, (grad * x).sum(0)


class _Net(nn.Module):
    """A LayerNorm, a Linear called twice, a custom Function, a checkpointed block, a data-dependent branch and a
    head tied to an embedding of the same width. (B, D) received activations + (B,) ids -> (B, V) logits."""

    def __init__(self, dim: int = 8, vocab: int = 11, checkpointed: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.norm = nn.LayerNorm(dim)
        self.shared = nn.Linear(dim, dim)
        self.scale = nn.Parameter(torch.rand(dim) + 0.5)
        self.block = nn.Sequential(nn.Linear(dim, dim), nn.GELU())
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        h = self.norm(x + self.embed(ids))
        h = self.shared(torch.tanh(self.shared(h)))
        h = _Scale.apply(h, self.scale)
        h = checkpoint(self.block, h, use_reentrant=False) if self.checkpointed else self.block(h)
        if h.sum() > 0:
            h = h * 2
        return self.head(h)


def _hooked(model: nn.Module, log: list) -> None:
    for name, param in model.named_parameters():
        param.register_hook(lambda grad, name=name: log.append(("pre", name)))
        param.register_post_accumulate_grad_hook(lambda p, name=name: log.append(("post", name)))


@pytest.mark.parametrize("checkpointed", [False, True])
@pytest.mark.parametrize("as_stage", [True, False], ids=["received-input", "loss-only"])
def test_split_backward_equals_one_backward_bitwise_and_hooks_fire_on_the_weight_pass(checkpointed, as_stage):
    torch.manual_seed(0)
    model = _Net(checkpointed=checkpointed)
    split = copy.deepcopy(model)
    x = torch.randn(6, 8)
    ids = torch.randint(0, 11, (6,))
    whole_log, split_log = [], []
    _hooked(model, whole_log)
    _hooked(split, split_log)

    x_whole = x.clone().requires_grad_(as_stage)
    F.cross_entropy(model(x_whole, ids), ids).backward()

    x_split = x.clone().requires_grad_(as_stage)
    loss = F.cross_entropy(split(x_split, ids), ids)
    calls = _Scale.calls
    weight_pass = split_backward([loss], [None], [x_split] if as_stage else [])
    if as_stage:
        assert torch.equal(x_split.grad, x_whole.grad), "the input gradient is complete after the input pass"
    # only the reused Linear's bias (a W edge of both of its calls: [Note: zero-bubble]) is summed in the input pass
    early = {"shared.bias"} if as_stage else set()
    assert {n for n, p in split.named_parameters() if p.grad is not None} == early
    assert {name for _, name in split_log} == early, "no other parameter's hook fired in the input pass"
    assert weight_pass is not None
    weight_pass.run()
    assert _Scale.calls - calls == 1, "the custom Function's backward ran once"
    for (name, a), b in zip(model.named_parameters(), split.parameters()):
        assert torch.equal(a.grad, b.grad), name
    assert sorted(split_log) == sorted(whole_log), "every hook fired as often as in one backward"
