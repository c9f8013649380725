"""Vocab-parallel embedding and cross-entropy (Megatron's ``VocabParallelEmbedding``, ``vocab_parallel_cross_entropy``).

The vocabulary ``V`` is split in contiguous ranges of ``Vp = ceil(V / tp)`` ids: rank ``r`` owns ids
``[r * Vp, (r + 1) * Vp)``. A vocabulary not divisible by tp is padded with zero rows that no id selects and
whose logits are masked, so every ``V`` works.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn import functional as F

from lightning_mp.nn._base import TPModule
from lightning_mp.tp import ShardSpec, TPGroup, parameter_creation_scope, reduce_from_tp

__all__ = ["DistributedEmbedding", "vocab_parallel_cross_entropy", "vocab_range"]


def vocab_range(vocab_size: int, rank: int, tp_size: int) -> tuple[int, int]:
    """``(start, end)`` of the ids rank ``rank`` owns (``end`` may exceed ``vocab_size`` on the last ranks)."""
    per = -(-vocab_size // tp_size)
    return rank * per, (rank + 1) * per


class DistributedEmbedding(TPModule, nn.Embedding):
    """Vocab-parallel ``nn.Embedding``: ``E`` (``V x D``) split along the vocabulary; keys and full shapes as
    ``nn.Embedding``.

    Rank ``r`` looks up the ids in its range (others read row 0 and are zeroed), then the partial embeddings are
    all-reduced: forward all-reduce, backward identity (:func:`reduce_from_tp`). Input ids ``(*)`` replicated;
    output ``(*, D)`` replicated.

    Args:
        num_embeddings: ``V``, the full vocabulary.
        embedding_dim: ``D``.
        tp: the tensor-parallel group.
        padding_idx: as ``nn.Embedding`` (its row gets no gradient).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        *,
        tp: TPGroup,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ) -> None:
        super().__init__(tp)
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        self.max_norm, self.norm_type, self.scale_grad_by_freq, self.sparse = None, 2.0, False, False
        self.vocab_start, self.vocab_end = vocab_range(num_embeddings, tp.rank, tp.size)
        spec = ShardSpec(0, num_embeddings, padded=True)
        with parameter_creation_scope(spec):
            self.weight = nn.Parameter(torch.empty(spec.local_size(tp.size), embedding_dim, dtype=dtype, device=device))
        nn.init.normal_(self.weight)

    def forward(self, ids: Tensor) -> Tensor:
        """Args: ids: ``(*)`` LongTensor. Returns: ``(*, D)``."""
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)  # (*)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight)  # (*, D)
        if self.padding_idx is not None and self.vocab_start <= self.padding_idx < self.vocab_end:
            keep = (local != self.padding_idx - self.vocab_start) | outside
            out = out * keep.unsqueeze(-1) + (out * ~keep.unsqueeze(-1)).detach()
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.require_group())

    def extra_repr(self) -> str:
        ids = f"[{self.vocab_start}, {self.vocab_end})"
        return f"{self.num_embeddings}, {self.embedding_dim}, ids={ids}, tp={self.tp.size}"


def vocab_parallel_cross_entropy(
    logits: Tensor,
    target: Tensor,
    tp: TPGroup,
    vocab_size: int,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> Tensor:
    """Cross-entropy of vocab-sharded logits; the full logits are never gathered.

    ``loss_i = log sum_v exp(z_iv) - z_{i, y_i}``, computed with three all-reduces over the tp group of
    ``(N,)``-sized tensors: the max (for stability, no gradient), the sum of exponentials and the target logit
    (both forward all-reduce, backward identity: each rank's gradient is that of its own logits).

    Args:
        logits: ``(..., Vp)``, this rank's logits for ids ``[r * Vp, (r + 1) * Vp)``.
        target: ``(...)`` LongTensor of ids in ``[0, V)`` or ``ignore_index``.
        tp: the tensor-parallel group.
        vocab_size: ``V``; logits of padded ids (``>= V``) are masked.
        ignore_index: targets that do not count.
        reduction: ``"mean"`` (over counted targets), ``"sum"`` or ``"none"``.

    Returns:
        The loss, replicated on every tp rank (a scalar, or ``(...)`` for ``"none"``).
    """
    if tp.group is None:
        raise RuntimeError("vocab_parallel_cross_entropy needs a process group.")
    start, end = vocab_range(vocab_size, tp.rank, tp.size)
    z = logits.reshape(-1, logits.size(-1)).float()  # (N, Vp)
    y = target.reshape(-1)  # (N,)
    if end > vocab_size:  # padded ids never win
        pad = torch.arange(start, end, device=z.device) >= vocab_size
        z = z.masked_fill(pad, float("-inf"))
    z_max = z.detach().max(dim=-1).values.clone()  # (N,)
    dist.all_reduce(z_max, op=dist.ReduceOp.MAX, group=tp.group)
    z = z - z_max.unsqueeze(-1)
    sum_exp = reduce_from_tp(z.exp().sum(dim=-1), tp.group)  # (N,)
    mine = (y >= start) & (y < end)
    local_y = (y - start).masked_fill(~mine, 0)
    picked = z.gather(-1, local_y.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)  # (N,)
    target_logit = reduce_from_tp(picked, tp.group)
    loss = sum_exp.log() - target_logit  # (N,)
    counted = y != ignore_index
    loss = loss.masked_fill(~counted, 0.0)
    if reduction == "none":
        return loss.reshape(target.shape).to(logits.dtype)
    if reduction == "sum":
        return loss.sum().to(logits.dtype)
    return (loss.sum() / counted.sum().clamp(min=1)).to(logits.dtype)
