"""Every tensor kind torch has crosses stages intact, on every CPU data plane ([Note: tensor kinds on the wire] in
``comm/_kinds.py``), and gradients flow across stages through each kind that supports autograd, against one process."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.testing._internal.two_tensor import TwoTensor

from lightning_mp.pipeline import PipelineEngine
from tests._dist import PLANES, make_transport, run_distributed
from tests.models import expand_placement


def _kinds() -> dict:
    """One value of each kind, the same on every rank (seeded); views of one storage included."""
    torch.manual_seed(0)
    base = torch.randn(4, 6)
    big = torch.randn(64, 64)
    jagged = torch.nested.nested_tensor_from_jagged(torch.randn(5, 3), torch.tensor([0, 2, 5]))
    return {
        "views": (base[:, :3], base[:, 3:], base.t()),  # one storage, three strided views
        "apart": (big[:, 0], big[:, -1]),  # two columns of a 16 KiB storage: compact copies (rpc's rule)
        "expanded": torch.randn(3, 1).expand(3, 5),
        "complex64": torch.randn(3, 2, dtype=torch.complex64),
        "complex128_conj": torch.randn(4, dtype=torch.complex128).conj(),
        "bool": torch.rand(7) > 0.5,
        "uint8": torch.randint(0, 255, (3, 3), dtype=torch.uint8),
        "float8": torch.randn(5).to(torch.float8_e4m3fn),
        "grad_mix": [torch.randn(2, requires_grad=True), torch.arange(3), torch.randn(2)],
        "coo": torch.randn(4, 5).relu().to_sparse(),
        "coo_uncoalesced": torch.sparse_coo_tensor(torch.tensor([[0, 0, 1], [1, 1, 2]]), torch.randn(3), (2, 3)),
        "csr": torch.randn(4, 5).relu().to_sparse_csr(),
        "csc": torch.randn(4, 5).relu().to_sparse_csc(),
        "bsr": torch.randn(4, 4).relu().to_sparse_bsr((2, 2)),
        "nested_strided": torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)]),
        "jagged": (jagged, jagged + 1),  # sharing offsets: one ragged size, so they add as in one process
        "subclass": TwoTensor(torch.randn(3), torch.randn(3)),
        "local_view": AsyncCollectiveTensor(torch.randn(3, 2)),  # what DTensor.to_local() may return
        "quantized": torch.quantize_per_tensor(torch.randn(4), 0.1, 2, torch.qint8),
        "quantized_per_channel": torch.quantize_per_channel(
            torch.randn(2, 4), torch.tensor([0.1, 0.2]), torch.tensor([0, 1]), 0, torch.quint8
        ),
        "empty": torch.empty(0, 4),
    }


def _send_kinds(rank: int, world_size: int, plane: str) -> dict:
    transport = make_transport([0, 1], plane)
    kinds = _kinds()
    if rank == 0:
        transport.send(kinds, 1)
        transport.close()
        return {}
    message = transport.recv(0)
    got = message.obj
    return {
        "got": got,
        "flags": message.requires_grad,
        "same_storage": [
            [t.untyped_storage().data_ptr() for t in got["views"]],
            [t.untyped_storage().data_ptr() for t in got["apart"]],
        ],
        "jagged_sum": got["jagged"][0] + got["jagged"][1],
    }


def _assert_same(got: torch.Tensor, sent: torch.Tensor, name: str) -> None:
    assert type(got) is type(sent), name
    assert (got.layout, got.dtype, got.is_conj()) == (sent.layout, sent.dtype, sent.is_conj()), name
    if sent.is_nested:
        assert [t.shape for t in got.unbind()] == [t.shape for t in sent.unbind()], name
        for a, b in zip(got.unbind(), sent.unbind()):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
        return
    assert got.shape == sent.shape, name
    if sent.layout != torch.strided:
        torch.testing.assert_close(got.to_dense(), sent.to_dense(), rtol=0, atol=0, msg=name)
    elif sent.is_quantized:
        assert got.qscheme() == sent.qscheme(), name
        torch.testing.assert_close(got.dequantize(), sent.dequantize(), rtol=0, atol=0, msg=name)
        torch.testing.assert_close(got.int_repr(), sent.int_repr(), rtol=0, atol=0, msg=name)
    elif sent.dtype == torch.float8_e4m3fn:
        assert torch.equal(got.view(torch.uint8), sent.view(torch.uint8)), name
    elif type(sent) is not torch.Tensor:  # a subclass: its inner tensors
        for inner in sent.__tensor_flatten__()[0]:
            assert torch.equal(getattr(got, inner), getattr(sent, inner)), name
    else:
        compacted = name == "apart"  # strides of a compact copy
        assert got.stride() == (sent.contiguous().stride() if compacted else sent.stride()), name
        torch.testing.assert_close(got, sent.detach(), rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("plane", PLANES)
def test_every_tensor_kind_crosses_intact(plane):
    result = run_distributed(_send_kinds, 2, plane, start_method="fork")[1]
    sent, got = _kinds(), result["got"]
    assert sorted(got) == sorted(sent)
    for name, value in sent.items():
        pairs = zip(got[name], value) if isinstance(value, (tuple, list)) else [(got[name], value)]
        for received, original in pairs:
            _assert_same(received, original, name)
    views, apart = result["same_storage"]
    assert len(set(views)) == 1, "views of one storage arrive as views of one storage"
    assert len(set(apart)) == 2, "a sparse selection of a large storage travels as compact copies"
    assert got["coo_uncoalesced"].is_coalesced() is False and got["coo"].is_coalesced()
    assert result["jagged_sum"].values().shape == (5, 3)
    # grad_mix is the only structure with requires_grad=True tensors: the flags come back per tensor, in order
    assert sum(result["flags"]) == 1


# ---- autograd across stages, per kind ---------------------------------------------------------------------------


class Producer(nn.Module):
    """On stage 1: turns its input into each differentiable kind (and some that are not) for stage 0."""

    def __init__(self, dim: int = 4) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, h: torch.Tensor, jagged: torch.Tensor) -> dict:
        y = self.lin(h)  # (5, dim)
        return {
            "views": (y[:, :2], y[:, 2:]),
            "complex": torch.view_as_complex(y.reshape(5, 2, 2)),
            "coo": y.to_sparse(),
            "csr": (2 * y).to_sparse_csr(),
            "nested_strided": torch.nested.as_nested_tensor([y[:2], y[2:]]),
            "jagged": self.lin(jagged),
            "no_grad": (y > 0, y.detach(), torch.arange(3), y.detach().to(torch.float8_e4m3fn)),
        }


class Doubler(nn.Module):
    """On stage 1: a subclass in, a subclass out."""

    def forward(self, pair: TwoTensor) -> TwoTensor:
        return pair * 2 + pair.sin()


class KindsNet(nn.Module):
    def __init__(self, dim: int = 4) -> None:
        super().__init__()
        self.pre = nn.Linear(dim, dim)
        self.producer = Producer(dim)
        self.doubler = Doubler()

    def pair_loss(self, pair: TwoTensor) -> TwoTensor:
        """A subclass loss (its gradients are subclasses too): a step of its own, as it would be in one process."""
        return self.doubler(pair).sum()

    def loss(self, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
        h = self.pre(x)
        jagged = torch.nested.nested_tensor_from_jagged(h, torch.tensor([0, 2, 5]))
        out = self.producer(h, jagged)
        left, right = out["views"]
        loss = (
            F.mse_loss(left, right)
            + out["complex"].abs().sum()
            + out["coo"].to_dense().pow(2).sum()
            + out["csr"].to_dense().pow(3).sum()
            + sum(t.pow(2).sum() for t in out["nested_strided"].unbind())
            + out["jagged"].values().tanh().sum()
        )
        seen = {
            "views_share_storage": left.untyped_storage().data_ptr() == right.untyped_storage().data_ptr(),
            "layouts": [out[k].layout for k in ("coo", "csr", "nested_strided", "jagged")],
            "no_grad": [(t.dtype, t.requires_grad) for t in out["no_grad"]],
        }
        return loss, seen


def _inputs() -> tuple[torch.Tensor, TwoTensor]:
    g = torch.Generator().manual_seed(3)
    pair = TwoTensor(torch.randn(5, generator=g), torch.randn(5, generator=g)).requires_grad_()
    return torch.randn(5, 4, generator=g), pair


def _grads(model: nn.Module, pair: TwoTensor) -> dict:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    grads["pair.a"], grads["pair.b"] = pair.grad.a.clone(), pair.grad.b.clone()
    return grads


def _pipelined_kinds(rank: int, world_size: int, plane: str, remote_handles: bool) -> dict:
    torch.manual_seed(0)
    model = KindsNet()
    engine = PipelineEngine(make_transport([0, 1], plane), 2, timeout_s=60, remote_handles=remote_handles)
    engine.install(model, expand_placement(model, {"producer": 1, "doubler": 1}))
    found: dict = {}
    x, pair = _inputs()

    def step(x, index):
        loss, found["seen"] = model.loss(x)
        found["loss"] = loss.detach().clone()
        return loss

    for step_fn, batch in ((step, x), (lambda pair, index: model.pair_loss(pair), pair)):
        with engine.session() as session:
            if engine.is_driver:
                session.drive(step_fn, [batch], loss_fn=lambda loss: loss, backward=True)
                session.finish(None)
            else:
                session.serve()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    if engine.is_driver:
        grads["pair.a"], grads["pair.b"] = pair.grad.a.clone(), pair.grad.b.clone()
    return {"grads": grads, **found}


@pytest.mark.parametrize(("plane", "remote_handles"), [("gloo", True), ("strict_mock", False)])
def test_gradients_flow_through_every_differentiable_kind_as_in_one_process(plane, remote_handles):
    results = run_distributed(_pipelined_kinds, 2, plane, remote_handles, start_method="fork")
    torch.manual_seed(0)
    reference = KindsNet()
    x, pair = _inputs()
    loss, seen = reference.loss(x)
    loss.backward()
    reference.pair_loss(pair).backward()
    expected = _grads(reference, pair)
    driver = results[0]
    torch.testing.assert_close(driver["loss"], loss.detach(), rtol=1e-6, atol=1e-6)
    assert driver["seen"] == seen
    assert sorted(n for r in results for n in r["grads"]) == sorted(expected)
    for result in results:
        for name, grad in result["grads"].items():
            torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-6, msg=name)
