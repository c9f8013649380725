"""Distributed transformer blocks (GPT-2 / nanoGPT layout and parameter names, Megatron's placements).

Placements, with ``tp`` ranks and activations ``(B, T, C)`` replicated between blocks (``optimize="speed"``):

* attention: the fused ``c_attn`` (``3C x C``) is column-parallel over heads, rank ``r`` holding
  ``[W_q^r; W_k^r; W_v^r]`` for heads ``[r * nh / tp, (r + 1) * nh / tp)``; attention runs on the local heads;
  ``c_proj`` is row-parallel and all-reduces. One all-reduce forward (``c_proj``) and one backward (the input
  of ``c_attn``) per attention.
* MLP: ``c_fc`` column-parallel, the activation on the local ``4C / tp`` features, ``c_proj`` row-parallel.
* LayerNorms, position embeddings and row biases are replicated; their gradients are equal on every tp rank
  because their inputs and output gradients are.

``optimize="memory"`` (sequence parallelism, Megatron's): between the tensor-parallel regions the activations
are split along the sequence, ``(B, T / tp, C)``, so LayerNorms, residuals and dropout hold ``1 / tp`` of them;
each region starts with an all-gather along the sequence (backward: reduce-scatter) and ends with a
reduce-scatter (backward: all-gather), the same bytes as the all-reduce they replace. LayerNorm parameters
and row biases then see only this rank's tokens: their gradients are summed over the tp group by the
strategy (``allreduce_grad="sum"``). A layer (or stack) takes and returns replicated ``(B, T, C)``: it splits
the sequence on entry and gathers it on exit, zero-padding ``T`` to a multiple of tp (exact for causal
attention, the only kind that pads; non-causal attention with an indivisible ``T`` raises).

Parameter names equal those of ``examples.gpt`` (``ln_1``, ``attn.c_attn``, ``attn.c_proj``, ``ln_2``,
``mlp.c_fc``, ``mlp.c_proj``; ``wte``, ``wpe``, ``h``, ``ln_f``, ``lm_head``) so a swap loads the original
weights by key, and state dicts keep those keys with full shapes (see [Note: full state dicts]).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from lightning_mp.nn._base import TPModule
from lightning_mp.nn._embedding import DistributedEmbedding, vocab_parallel_cross_entropy
from lightning_mp.nn._linear import DistributedLinear
from lightning_mp.tp import TPGroup, check_divisible, gather_from_tp, mark, scatter_to_tp

Optimize = Literal["speed", "memory"]

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
        dropout: on the attention weights (one process's mask, sliced to this rank's heads) and the output.
        causal: mask future positions.
        bias: biases in the projections.
        optimize: ``"speed"`` (replicated input/output) or ``"memory"`` (sequence-split ``(B, T / tp, C)``).

    Raises:
        TPDivisibilityError: if ``n_head`` does not divide by the tp degree.
    """

    def __init__(
        self,
        n_embd: int,
        n_head: int,
        *,
        tp: TPGroup,
        dropout: float = 0.0,
        causal: bool = True,
        bias: bool = True,
        optimize: Optimize = "speed",
    ) -> None:
        super().__init__(tp)
        sp = _sequence_parallel(optimize)
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} must be divisible by n_head={n_head}.")
        self.local_heads = check_divisible("n_head", n_head, tp.size)
        self.head_size, self.dropout, self.causal = n_embd // n_head, dropout, causal
        self.c_attn = DistributedLinear(
            n_embd, 3 * n_embd, bias, tp=tp, parallel="column", parts=3, sequence_parallel=sp
        )
        self.c_proj = DistributedLinear(n_embd, n_embd, bias, tp=tp, parallel="row", sequence_parallel=sp)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        """Args: x: ``(B, T, C)`` replicated, or ``(B, T / tp, C)`` with ``optimize="memory"``. Returns: the same."""
        local = self.local_heads * self.head_size  # C / tp
        qkv = self.c_attn(x)  # (B, T, 3C / tp), the whole sequence in both modes
        B, T, _ = qkv.shape
        q, k, v = qkv.split(local, dim=2)  # 3 x (B, T, C / tp)
        heads = (B, T, self.local_heads, self.head_size)
        q, k, v = (t.view(heads).transpose(1, 2) for t in (q, k, v))  # (B, nh/tp, T, hs)
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
        optimize: ``"speed"`` (replicated input/output) or ``"memory"`` (sequence-split).
    """

    def __init__(
        self,
        n_embd: int,
        *,
        tp: TPGroup,
        hidden: int | None = None,
        dropout: float = 0.0,
        activation: nn.Module | None = None,
        optimize: Optimize = "speed",
    ) -> None:
        super().__init__(tp)
        sp = _sequence_parallel(optimize)
        hidden = 4 * n_embd if hidden is None else hidden
        check_divisible("hidden", hidden, tp.size)
        self.c_fc = DistributedLinear(n_embd, hidden, tp=tp, parallel="column", sequence_parallel=sp)
        self.gelu = activation if activation is not None else nn.GELU()
        self.c_proj = DistributedLinear(hidden, n_embd, tp=tp, parallel="row", sequence_parallel=sp)
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
        optimize: ``"speed"`` or ``"memory"`` (sequence parallelism inside; see the module docstring).
    """

    def __init__(
        self,
        n_embd: int,
        n_head: int,
        *,
        tp: TPGroup,
        dropout: float = 0.0,
        hidden: int | None = None,
        optimize: Optimize = "speed",
    ) -> None:
        super().__init__(tp)
        self.sequence_parallel = _sequence_parallel(optimize)
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = DistributedAttention(n_embd, n_head, tp=tp, dropout=dropout, optimize=optimize)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = DistributedMLP(n_embd, tp=tp, hidden=hidden, dropout=dropout, optimize=optimize)
        if self.sequence_parallel:
            for ln in (self.ln_1, self.ln_2):
                for param in ln.parameters():
                    mark(param, allreduce_grad="sum")

    def forward(self, x: Tensor) -> Tensor:
        """Args: x: ``(B, T, C)`` replicated. Returns: ``(B, T, C)`` replicated."""
        if not self.sequence_parallel:
            return self.forward_sharded(x)
        return leave_sequence_parallel(self.forward_sharded(enter_sequence_parallel(x, self)), x.size(1), self)

    def forward_sharded(self, x: Tensor) -> Tensor:
        """The block on activations as they are between blocks: ``(B, T, C)`` or ``(B, T / tp, C)`` (memory)."""
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def enter_sequence_parallel(x: Tensor, module: TPModule) -> Tensor:
    """``(B, T, C)`` replicated -> this rank's ``(B, ceil(T / tp), C)`` (zero-padded; backward all-gather)."""
    tp = module.tp.size
    pad = -x.size(1) % tp
    if pad:
        if not all(getattr(m, "causal", True) for m in module.modules() if isinstance(m, DistributedAttention)):
            raise ValueError(
                f"Sequence length {x.size(1)} is not divisible by tensor_parallel_degree={tp} and the attention is"
                f" not causal, so it cannot be padded: use a length that is a multiple of {tp}, or optimize='speed'."
            )
        x = torch.cat([x, x.new_zeros(x.size(0), pad, *x.shape[2:])], dim=1)
    return scatter_to_tp(x, module.require_group(), dim=1)


def leave_sequence_parallel(x: Tensor, length: int, module: TPModule) -> Tensor:
    """This rank's ``(B, T' / tp, C)`` -> ``(B, length, C)`` replicated (all-gather; backward split)."""
    return gather_from_tp(x, module.require_group(), dim=1)[:, :length]


class DistributedTransformer(nn.Sequential):
    """``n_layer`` :class:`DistributedTransformerLayer` in an ``nn.Sequential`` (keys ``0.ln_1...``, as a
    Sequential of blocks). With ``optimize="memory"`` the sequence is split once on entry and gathered once on
    exit; the activations between the layers stay split.

    Args:
        n_layer: number of blocks.
        n_embd: ``C``.
        n_head: ``nh``.
        tp: the tensor-parallel group.
        dropout: dropout of every block.
        optimize: ``"speed"`` or ``"memory"``.
    """

    def __init__(
        self, n_layer: int, n_embd: int, n_head: int, *, tp: TPGroup, dropout: float = 0.0, optimize: Optimize = "speed"
    ) -> None:
        options = {"tp": tp, "dropout": dropout, "optimize": optimize}
        super().__init__(*(DistributedTransformerLayer(n_embd, n_head, **options) for _ in range(n_layer)))
        self.sequence_parallel = _sequence_parallel(optimize)

    def forward(self, x: Tensor) -> Tensor:
        """Args: x: ``(B, T, C)`` replicated. Returns: ``(B, T, C)`` replicated."""
        if not self.sequence_parallel or len(self) == 0:
            return super().forward(x)
        first = self[0]
        h = enter_sequence_parallel(x, first)
        for layer in self:
            h = layer.forward_sharded(h)
        return leave_sequence_parallel(h, x.size(1), first)


def _sequence_parallel(optimize: str) -> bool:
    if optimize not in ("speed", "memory"):
        raise ValueError(f"`optimize` must be 'speed' or 'memory', got {optimize!r}.")
    return optimize == "memory"


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
        optimize: ``"speed"`` or ``"memory"`` for the transformer stack.
    """

    def __init__(
        self,
        vocab_size: int,
        block_size: int,
        n_layer: int,
        n_head: int,
        n_embd: int,
        *,
        tp: TPGroup,
        dropout: float = 0.0,
        optimize: Optimize = "speed",
    ) -> None:
        super().__init__(tp)
        self.vocab_size = vocab_size
        self.wte = DistributedEmbedding(vocab_size, n_embd, tp=tp)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.h = DistributedTransformer(n_layer, n_embd, n_head, tp=tp, dropout=dropout, optimize=optimize)
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
