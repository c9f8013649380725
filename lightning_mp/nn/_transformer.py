"""Distributed transformer blocks (GPT-2 / nanoGPT layout and parameter names, Megatron's placements).

Placements, with ``tp`` ranks and activations ``(B, T, C)`` replicated between blocks (``optimize="speed"``):

* attention: the fused ``c_attn`` (``3C x C``) is column-parallel over heads, rank ``r`` holding
  ``[W_q^r; W_k^r; W_v^r]`` for heads ``[r * nh / tp, (r + 1) * nh / tp)``; attention runs on the local heads;
  ``c_proj`` is row-parallel and all-reduces. One all-reduce forward (``c_proj``) and one backward (the input
  of ``c_attn``) per attention.
* MLP: ``c_fc`` column-parallel, the activation on the local ``4C / tp`` features, ``c_proj`` row-parallel.
* LayerNorms, position embeddings and row biases are replicated; their gradients are equal on every tp rank
  because their inputs and output gradients are.

Parameter names equal those of ``examples.gpt`` (``ln_1``, ``attn.c_attn``, ``attn.c_proj``, ``ln_2``,
``mlp.c_fc``, ``mlp.c_proj``; ``wte``, ``wpe``, ``h``, ``ln_f``, ``lm_head``) so a swap loads the original
weights by key, and state dicts keep those keys with full shapes (see [Note: full state dicts]).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from lightning_mp.nn._base import TPModule
from lightning_mp.nn._embedding import DistributedEmbedding, vocab_parallel_cross_entropy
from lightning_mp.nn._linear import DistributedLinear
from lightning_mp.tp._collectives import gather_from_tp
from lightning_mp.tp._sharding import TPGroup, check_divisible

__all__ = [
    "DistributedAttention",
    "DistributedMLP",
    "DistributedTransformer",
    "DistributedTransformerLMHead",
    "DistributedTransformerLayer",
]


class DistributedAttention(TPModule):
    """Multi-head self-attention with the heads split over the tp group.

    Args:
        n_embd: ``C``.
        n_head: ``nh``; must divide by the tp degree.
        tp: the tensor-parallel group.
        dropout: on the attention weights (drawn per rank on its own heads) and the output.
        causal: mask future positions.
        bias: biases in the projections.

    Raises:
        TPDivisibilityError: if ``n_head`` does not divide by the tp degree.
    """

    def __init__(
        self, n_embd: int, n_head: int, *, tp: TPGroup, dropout: float = 0.0, causal: bool = True, bias: bool = True
    ) -> None:
        super().__init__(tp)
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} must be divisible by n_head={n_head}.")
        self.local_heads = check_divisible("n_head", n_head, tp.size)
        self.head_size, self.dropout, self.causal = n_embd // n_head, dropout, causal
        self.c_attn = DistributedLinear(n_embd, 3 * n_embd, bias, tp=tp, parallel="column", parts=3)
        self.c_proj = DistributedLinear(n_embd, n_embd, bias, tp=tp, parallel="row")
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        """Args: x: ``(B, T, C)`` replicated. Returns: ``(B, T, C)`` replicated."""
        B, T, _ = x.shape
        local = self.local_heads * self.head_size  # C / tp
        q, k, v = self.c_attn(x).split(local, dim=2)  # 3 x (B, T, C / tp)
        q, k, v = (t.view(B, T, self.local_heads, self.head_size).transpose(1, 2) for t in (q, k, v))  # (B, nh/tp, T, hs)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=self.causal
        )  # (B, nh/tp, T, hs)
        y = y.transpose(1, 2).reshape(B, T, local)  # (B, T, C / tp)
        return self.resid_dropout(self.c_proj(y))  # (B, T, C)


class DistributedMLP(TPModule):
    """``c_proj(act(c_fc(x)))`` with the hidden features split: ``c_fc`` column-, ``c_proj`` row-parallel.

    Args:
        n_embd: ``C``.
        tp: the tensor-parallel group.
        hidden: hidden width (default ``4C``); must divide by the tp degree.
        dropout: on the output.
        activation: elementwise activation, applied to the local hidden features.
    """

    def __init__(
        self, n_embd: int, *, tp: TPGroup, hidden: int | None = None, dropout: float = 0.0, activation: nn.Module | None = None
    ) -> None:
        super().__init__(tp)
        hidden = 4 * n_embd if hidden is None else hidden
        check_divisible("hidden", hidden, tp.size)
        self.c_fc = DistributedLinear(n_embd, hidden, tp=tp, parallel="column")
        self.gelu = activation if activation is not None else nn.GELU()
        self.c_proj = DistributedLinear(hidden, n_embd, tp=tp, parallel="row")
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        """Args: x: ``(B, T, C)`` replicated. Returns: ``(B, T, C)`` replicated."""
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))  # (B, T, C / tp hidden) -> (B, T, C)


class DistributedTransformerLayer(TPModule):
    """A pre-LayerNorm block ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``; LayerNorms replicated.

    Args:
        n_embd: ``C``.
        n_head: ``nh``.
        tp: the tensor-parallel group.
        dropout: attention and residual dropout.
        hidden: MLP hidden width (default ``4C``).
    """

    def __init__(self, n_embd: int, n_head: int, *, tp: TPGroup, dropout: float = 0.0, hidden: int | None = None) -> None:
        super().__init__(tp)
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = DistributedAttention(n_embd, n_head, tp=tp, dropout=dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = DistributedMLP(n_embd, tp=tp, hidden=hidden, dropout=dropout)

    def forward(self, x: Tensor) -> Tensor:
        """Args: x: ``(B, T, C)``. Returns: ``(B, T, C)``."""
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class DistributedTransformer(nn.Sequential):
    """``n_layer`` :class:`DistributedTransformerLayer` in an ``nn.Sequential`` (keys ``0.ln_1...``, as a
    Sequential of blocks).

    Args:
        n_layer: number of blocks.
        n_embd: ``C``.
        n_head: ``nh``.
        tp: the tensor-parallel group.
        dropout: dropout of every block.
    """

    def __init__(self, n_layer: int, n_embd: int, n_head: int, *, tp: TPGroup, dropout: float = 0.0) -> None:
        super().__init__(*[DistributedTransformerLayer(n_embd, n_head, tp=tp, dropout=dropout) for _ in range(n_layer)])


class DistributedTransformerLMHead(TPModule):
    """A GPT language model: vocab-parallel token embedding tied to a vocab-parallel output head.

    ``wte`` (:class:`DistributedEmbedding`) and ``lm_head`` (column-parallel, padded vocabulary) share one
    ``(ceil(V / tp), C)`` shard. ``forward(idx)`` returns the gathered logits ``(B, T, V)``;
    ``forward(idx, targets)`` returns the mean cross-entropy from the sharded logits
    (:func:`vocab_parallel_cross_entropy`), never gathering them.

    Args:
        vocab_size: ``V`` (any size: padded to a multiple of tp).
        block_size: maximum ``T`` (position table, replicated).
        n_layer, n_head, n_embd: the transformer's sizes.
        tp: the tensor-parallel group.
        dropout: embedding and block dropout.
    """

    def __init__(
        self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int, *, tp: TPGroup, dropout: float = 0.0
    ) -> None:
        super().__init__(tp)
        self.vocab_size = vocab_size
        self.wte = DistributedEmbedding(vocab_size, n_embd, tp=tp)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.h = DistributedTransformer(n_layer, n_embd, n_head, tp=tp, dropout=dropout)
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = DistributedLinear(n_embd, vocab_size, bias=False, tp=tp, vocab_padded=True)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> Tensor:
        """Args: idx: ``(B, T)`` ids; targets: ``(B, T)`` ids or None.

        Returns:
            The scalar loss if ``targets`` is given, else logits ``(B, T, V)`` replicated.
        """
        pos = torch.arange(idx.size(1), device=idx.device)  # (T,)
        x = self.ln_f(self.h(self.drop(self.wte(idx) + self.wpe(pos))))  # (B, T, C)
        logits = self.lm_head(x)  # (B, T, ceil(V / tp))
        if targets is None:
            return gather_from_tp(logits, self.require_group(), dim=-1)[..., : self.vocab_size]  # (B, T, V)
        return vocab_parallel_cross_entropy(logits, targets, self.tp, self.vocab_size)
