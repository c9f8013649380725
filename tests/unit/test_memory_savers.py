"""Activation checkpointing and activation offloading against the same model unchanged, in one process.

Checkpointed modules recompute (counted), give the same loss and bitwise the same gradients (dropout included:
the recompute draws the same masks), keep their FQNs; a stage input without ``requires_grad`` still trains
(non-reentrant mode); the offloader packs/unpacks each saved input once, in reverse order per microbatch, loads
``horizon`` ahead, frees the originals and leaves gradients bitwise unchanged."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from torch import nn

from lightning_mp.memory import ActivationOffloader, is_checkpointed, set_activation_checkpointing


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
