"""Models people did not write for us: torch's pipelining test models and the ``nn`` building blocks in common use.

The first group re-writes (tiny, not copied) the model zoo of PyTorch's own pipelining tests,
``test/distributed/pipelining/model_registry.py`` in github.com/pytorch/pytorch (BSD-3-Clause, Meta Platforms):
``ExampleCode`` (the root's own parameters and a buffer used in the root's forward, a value without grad crossing
the split), ``ModelWithKwargs`` (a tensor keyword argument), ``ModelWithParamAlias`` (one ``Parameter`` and one
``nn.Linear`` under two names each), ``MultiMLP`` / ``MultiMLPKwargs`` (a ``ModuleList`` loop, an unused keyword
argument), ``MultiInterMediateModel`` (a custom autograd ``Function`` with two outputs) and ``MultiMLPWithDw`` (a
custom ``Function`` computing the weight gradients itself). ``pipe_split()`` markers are left out: the planner
finds the split. Added here: a DDP-style wrapper (``self.module``) and blocks whose extra outputs go unused.

The second group: ``nn.TransformerEncoder`` / ``nn.TransformerDecoder`` / ``nn.Transformer`` with masks, LSTM and
GRU (also over a ``PackedSequence``), a ``MultiheadAttention`` block, BatchNorm (with and without affine
parameters) and GroupNorm CNNs, embeddings with ``padding_idx`` and ``max_norm``, ``EmbeddingBag`` and a sparse
``Embedding``, weight-norm and spectral-norm parametrizations.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

DIM = 8  # every model's width: d_hid of torch's registry, scaled down


# ---- torch's pipelining model registry (re-written) ---------------------------------------------------------------


class ExampleCode(nn.Module):
    """Root parameters ``mm_param0/1`` and buffer ``cval`` used by the root; ``lin1`` only with ``splits > 2``."""

    def __init__(self, splits: int = 2) -> None:
        super().__init__()
        self.splits = splits
        self.mm_param0 = nn.Parameter(torch.randn(DIM, DIM) / DIM**0.5)
        self.mm_param1 = nn.Parameter(torch.randn(DIM, DIM) / DIM**0.5)
        self.cval = nn.Buffer(torch.randn(DIM))
        self.lin0 = nn.Linear(DIM, DIM)
        self.lin1 = nn.Linear(DIM, DIM)
        self.lin2 = nn.Linear(DIM, DIM)  # never called at these depths: stays with the root

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, D) -> (B, D)
        x = torch.relu(torch.mm(x, self.mm_param0))
        a_constant = self.cval.clone()  # no grad; crosses the split
        x = self.lin0(x)
        x = torch.relu(x) + a_constant
        x = torch.mm(x, self.mm_param1)
        if self.splits > 2:
            x = torch.relu(self.lin1(x))
        return x


class ModelWithKwargs(nn.Module):
    """A keyword tensor argument ``y`` added after the first matmul."""

    def __init__(self, splits: int = 2) -> None:
        super().__init__()
        self.splits = splits
        self.mm_param0 = nn.Parameter(torch.randn(DIM, DIM) / DIM**0.5)
        self.mm_param1 = nn.Parameter(torch.randn(DIM, DIM) / DIM**0.5)
        self.lin0 = nn.Linear(DIM, DIM)
        self.lin1 = nn.Linear(DIM, DIM)
        self.lin2 = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:  # (B, D), (B, D)
        x = torch.mm(x, self.mm_param0)
        x = x + (y if y is not None else torch.zeros_like(x))
        x = torch.relu(self.lin0(x))
        x = torch.mm(x, self.mm_param1)
        x = torch.relu(self.lin1(x))
        if self.splits > 2:
            x = torch.relu(self.lin2(x))
        return x


class ModelWithParamAlias(nn.Module):
    """``self.mm_param1 = self.mm_param0 = Parameter``, ``self.lin1 = self.lin0 = Linear``; each used twice."""

    def __init__(self) -> None:
        super().__init__()
        self.mm_param1 = self.mm_param0 = nn.Parameter(torch.randn(DIM, DIM) / DIM**0.5)
        self.lin1 = self.lin0 = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # (B, D), (B, D)
        x = torch.mm(x, self.mm_param0) + y
        x = torch.relu(self.lin0(x))
        x = torch.mm(x, self.mm_param1)
        return torch.relu(self.lin1(x))


class MLPModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(DIM, DIM)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, unused_kwarg: torch.Tensor | None = None) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


class MultiMLP(nn.Module):
    """``n_layers`` MLPs in a ``ModuleList`` loop; ``MultiMLPKwargs`` of torch's registry when given ``unused``."""

    def __init__(self, n_layers: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList([MLPModule() for _ in range(n_layers)])

    def forward(self, x: torch.Tensor, unused_kwarg: torch.Tensor | None = None) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, unused_kwarg=unused_kwarg) if unused_kwarg is not None else layer(x)
        return x


class TwoInputOutputOp(torch.autograd.Function):
    """Identity on two tensors with a hand-written backward."""

    @staticmethod
    def forward(ctx, input: torch.Tensor, weight: torch.Tensor):  # noqa: A002 - torch's argument name
        return input, weight

    @staticmethod
    def backward(ctx, grad_input, grad_weight):
        return grad_input, grad_weight


class MultiInterMediateModel(nn.Module):
    """Splits its input in two, runs one half through ``TwoInputOutputOp`` with its weight: (B, 2D) -> (B, D)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(DIM, DIM) / DIM**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = torch.split(x, [DIM, DIM], dim=1)
        a, w = TwoInputOutputOp.apply(a, self.w)
        return torch.matmul(a, w) * b


class InterMediateStack(nn.Module):
    """Linear (B, D) -> (B, 2D), a ``MultiInterMediateModel`` per stage, linears between them."""

    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        self.widen = nn.ModuleList([nn.Linear(DIM, 2 * DIM) for _ in range(depth)])
        self.inter = nn.ModuleList([MultiInterMediateModel() for _ in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for widen, inter in zip(self.widen, self.inter):
            x = torch.tanh(inter(widen(x)))
        return x


class CustomLinearDxDw(torch.autograd.Function):
    """``x @ W.T + b`` whose backward computes dx, dW and db by hand."""

    @staticmethod
    def forward(ctx, input_val, weight, bias):
        ctx.save_for_backward(input_val, weight)
        return input_val.mm(weight.t()) + bias

    @staticmethod
    def backward(ctx, grad_output):
        input_val, weight = ctx.saved_tensors
        return grad_output.mm(weight), grad_output.t().mm(input_val), grad_output.sum(0)


class MLPModuleWithDw(nn.Module):
    """Two ``CustomLinearDxDw`` layers with bare parameters; keeps its hidden activation as an attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1_weight = nn.Parameter(torch.empty(DIM, DIM).uniform_(-0.3, 0.3))
        self.fc1_bias = nn.Parameter(torch.empty(DIM).uniform_(-0.3, 0.3))
        self.fc2_weight = nn.Parameter(torch.empty(DIM, DIM).uniform_(-0.3, 0.3))
        self.fc2_bias = nn.Parameter(torch.empty(DIM).uniform_(-0.3, 0.3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.hidden = F.relu(CustomLinearDxDw.apply(x, self.fc1_weight, self.fc1_bias))
        return CustomLinearDxDw.apply(self.hidden, self.fc2_weight, self.fc2_bias)


class MultiMLPWithDw(nn.Module):
    def __init__(self, n_layers: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList([MLPModuleWithDw() for _ in range(n_layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class DDPStyle(nn.Module):
    """The model under ``self.module``, as ``DistributedDataParallel`` and ``DataParallel`` hold it."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


class WithAux(nn.Module):
    """Returns ``(out, aux, stats)``; callers use ``out`` only."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.aux = nn.Linear(DIM, 2)

    def forward(self, x: torch.Tensor):
        h = torch.tanh(self.lin(x))
        return h, self.aux(h), {"norm": h.norm(dim=-1), "note": "unused"}


class UnusedOutputs(nn.Module):
    """Blocks with extra outputs nobody reads (their ``aux`` heads get no gradient, as in one process)."""

    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([WithAux() for _ in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x, _, _ = block(x)
        return x


# ---- nn building blocks ---------------------------------------------------------------------------------------------


class EncoderClassifier(nn.Module):
    """``nn.TransformerEncoder`` (defaults: post-norm, nested tensors enabled) with a padding mask. (B, T) -> (B, 2)."""

    def __init__(self, vocab: int = 20, layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, DIM)
        layer = nn.TransformerEncoderLayer(DIM, nhead=2, dim_feedforward=16, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=layers)
        self.head = nn.Linear(DIM, 2)

    def forward(self, ids: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.embed(ids), src_key_padding_mask=padding)  # (B, T, D)
        keep = (~padding).unsqueeze(-1).float()
        return self.head((h * keep).sum(1) / keep.sum(1))


class DecoderLM(nn.Module):
    """``nn.TransformerDecoder`` with a causal ``tgt_mask`` over an encoded memory with a padding mask."""

    def __init__(self, vocab: int = 20, layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, DIM)
        self.memory = nn.Linear(DIM, DIM)
        layer = nn.TransformerDecoderLayer(DIM, nhead=2, dim_feedforward=16, dropout=0.0, batch_first=True)
        self.decoder = nn.TransformerDecoder(layer, num_layers=layers)
        self.head = nn.Linear(DIM, vocab)

    def forward(self, ids: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, V)
        x = self.embed(ids)
        causal = nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
        h = self.decoder(x, torch.tanh(self.memory(x)), tgt_mask=causal, tgt_is_causal=True,
                         memory_key_padding_mask=padding)
        return self.head(h)


class Recurrent(nn.Module):
    """Embedding, a 2-layer LSTM, a GRU and a head; the recurrent states (unused outputs) are dropped."""

    def __init__(self, vocab: int = 20) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, DIM)
        self.lstm = nn.LSTM(DIM, DIM, num_layers=2, batch_first=True)
        self.gru = nn.GRU(DIM, DIM, batch_first=True)
        self.head = nn.Linear(DIM, 2)

    def forward(self, ids: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        h, (_, _) = self.lstm(self.embed(ids))  # (B, T, D)
        h, _ = self.gru(h)
        return self.head(h[:, -1])


class AttentionBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(DIM, num_heads=2, batch_first=True)
        self.norm = nn.LayerNorm(DIM)

    def forward(self, x: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        out, _weights = self.attn(x, x, x, key_padding_mask=padding, need_weights=True)  # weights: unused
        return self.norm(x + out)


class AttentionStack(nn.Module):
    """``nn.MultiheadAttention`` blocks with a key padding mask. (B, T) -> (B, 2)."""

    def __init__(self, vocab: int = 20, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, DIM)
        self.blocks = nn.ModuleList([AttentionBlock() for _ in range(depth)])
        self.head = nn.Linear(DIM, 2)

    def forward(self, ids: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h, padding)
        return self.head(h[:, 0])


class NormCNN(nn.Module):
    """Conv / norm / ReLU blocks, pooling, a classifier. (B, 1, H, W) -> (B, 3).

    ``norm``: ``"batch"``, ``"batch-no-affine"`` (running statistics, no parameters) or ``"group"``.
    """

    def __init__(self, norm: str, depth: int = 3, channels: int = 4) -> None:
        super().__init__()

        def make_norm() -> nn.Module:
            if norm == "group":
                return nn.GroupNorm(2, channels)
            return nn.BatchNorm2d(channels, affine=norm == "batch")

        self.stem = nn.Sequential(nn.Conv2d(1, channels, 3, padding=1), make_norm(), nn.ReLU())
        self.blocks = nn.ModuleList(
            [nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1, bias=False), make_norm(), nn.ReLU())
             for _ in range(depth)]
        )
        self.fc = nn.Linear(channels, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = h + block(h)
        return self.fc(h.mean((2, 3)))


class BagOfEmbeddings(nn.Module):
    """``nn.Embedding`` with ``padding_idx=0`` and one with ``max_norm`` (renormalises its rows in forward)."""

    def __init__(self, vocab: int = 20) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, DIM, padding_idx=0)
        self.mix = nn.Linear(DIM, DIM)
        self.positions = nn.Embedding(vocab, DIM, max_norm=1.0)
        self.head = nn.Linear(DIM, 2)

    def forward(self, ids: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mix(self.tokens(ids.masked_fill(padding, 0))))  # (B, T, D)
        h = h + self.positions(torch.arange(ids.shape[1]).expand_as(ids))
        return self.head(h.mean(1))


class PackedRecurrent(nn.Module):
    """An LSTM over a ``PackedSequence`` (lengths from the padding mask), the packed output crossing stages."""

    def __init__(self, vocab: int = 20) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, DIM)
        self.lstm = nn.LSTM(DIM, DIM, batch_first=True)
        self.gru = nn.GRU(DIM, DIM, batch_first=True)
        self.head = nn.Linear(DIM, 2)

    def forward(self, ids: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        lengths = (~padding).sum(1)
        packed = nn.utils.rnn.pack_padded_sequence(self.embed(ids), lengths, batch_first=True, enforce_sorted=False)
        packed, _ = self.lstm(packed)
        _, h = self.gru(packed)  # h: (1, B, D)
        return self.head(h[0])


class FullTransformer(nn.Module):
    """``nn.Transformer`` (encoder and decoder) with a causal target mask and padding masks."""

    def __init__(self, vocab: int = 20) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, DIM)
        self.transformer = nn.Transformer(DIM, nhead=2, num_encoder_layers=2, num_decoder_layers=2,
                                          dim_feedforward=16, dropout=0.0, batch_first=True)
        self.head = nn.Linear(DIM, vocab)

    def forward(self, ids: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        causal = nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
        h = self.transformer(x, x, tgt_mask=causal, src_key_padding_mask=padding, memory_key_padding_mask=padding)
        return self.head(h)


class NormedLayers(nn.Module):
    """Weight-normed and spectral-normed layers (parametrizations; spectral norm updates buffers in forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.utils.parametrizations.weight_norm(nn.Linear(DIM, DIM))
        self.b = nn.utils.parametrizations.spectral_norm(nn.Linear(DIM, DIM))
        self.c = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


class Bags(nn.Module):
    """``nn.EmbeddingBag`` (mean) with per-sample weights, and an ``nn.Embedding(sparse=True)``."""

    def __init__(self, vocab: int = 20) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(vocab, DIM, mode="sum")
        self.sparse = nn.Embedding(vocab, DIM, sparse=True)
        self.head = nn.Linear(DIM, 2)

    def forward(self, ids: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        weights = (~padding).float()
        h = self.bag(ids, per_sample_weights=weights) + self.sparse(ids).mean(1)
        return self.head(torch.tanh(h))
