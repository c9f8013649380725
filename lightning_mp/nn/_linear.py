"""``DistributedLinear``: column- and row-parallel linear layers (Megatron's ``ColumnParallelLinear`` /
``RowParallelLinear``)."""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from lightning_mp.nn._base import TPModule
from lightning_mp.tp import (
    ShardSpec,
    TPGroup,
    all_gather_along,
    check_divisible,
    copy_to_tp,
    gather_from_tp,
    mark,
    parameter_creation_scope,
    reduce_from_tp,
    reduce_scatter_along,
    register_parallel_linear,
    scatter_to_tp,
)

__all__ = ["DistributedLinear"]


class DistributedLinear(TPModule, nn.Linear):
    """``Y = X A^T + b`` with ``A`` (``out x in``) split over the tp group; keys and full shapes as ``nn.Linear``.

    ``parallel="column"``: ``A`` is split along its rows (output features), ``A = [A_1; ...; A_tp]``; rank ``r``
    computes ``Y_r = X A_r^T + b_r``. Input replicated ``(..., in)``; the input passes :func:`copy_to_tp`
    (forward identity, backward all-reduce). Output ``(..., out / tp)`` sharded on the last dim, or, with
    ``gather_output=True``, all-gathered to ``(..., out)`` replicated (backward: split), the bias then
    replicated and added after the gather.
    ``vocab_padded=True`` pads ``out`` to a multiple of tp (uneven vocabularies; the padding rows are zero and
    cut from a gathered output). ``parts=k`` treats ``A`` as ``k`` fused blocks (e.g. ``[A_q; A_k; A_v]``),
    each split separately, so rank ``r`` holds ``[A_q^r; A_k^r; A_v^r]``.

    ``parallel="row"``: ``A`` is split along its columns (input features), ``A = [A_1, ..., A_tp]``; rank ``r``
    computes ``X_r A_r^T`` from its input shard ``X_r`` ``(..., in / tp)`` (``input_is_parallel=True``) or from
    a replicated input it splits itself (forward split, backward all-gather); the partial sums are all-reduced
    (:func:`reduce_from_tp`: forward all-reduce, backward identity) and the replicated bias ``b`` is added.
    Output ``(..., out)`` replicated.

    Args:
        in_features: full input size.
        out_features: full output size.
        bias: add a bias.
        tp: the tensor-parallel group.
        parallel: ``"column"`` or ``"row"``.
        gather_output: column only: all-gather the output.
        input_is_parallel: row only: the input is already split along its last dim.
        parts: column only: number of fused blocks along the output dim.
        vocab_padded: column only: pad ``out_features`` instead of requiring divisibility.
        transposed: store the weight as ``(in, out)`` like transformers' ``Conv1D`` (GPT-2), so state dicts keep
            its layout; the maths is the same.
        sequence_parallel: ``optimize="memory"``: activations outside the layer are split along the sequence
            (dim 1). Column: the input ``(B, T / tp, in)`` is all-gathered along dim 1 (backward:
            reduce-scatter) instead of :func:`copy_to_tp`. Row: the partial sums are reduce-scattered along
            dim 1 to ``(B, T / tp, out)`` (backward: all-gather) instead of all-reduced; the bias then sees only
            this rank's tokens, so its gradient is summed over the tp group (``allreduce_grad="sum"``).

    Raises:
        TPDivisibilityError: if the split size does not divide by the tp degree (and is not padded).
        ValueError: for an unknown ``parallel`` or an option that does not apply to it.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        tp: TPGroup,
        parallel: Literal["column", "row"] = "column",
        gather_output: bool = False,
        input_is_parallel: bool = True,
        parts: int = 1,
        vocab_padded: bool = False,
        transposed: bool = False,
        sequence_parallel: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ) -> None:
        super().__init__(tp)
        if parallel not in ("column", "row"):
            raise ValueError(f"`parallel` must be 'column' or 'row', got {parallel!r}.")
        if parallel == "row" and (parts != 1 or vocab_padded or gather_output):
            raise ValueError("`parts`, `vocab_padded` and `gather_output` apply to parallel='column' only.")
        if sequence_parallel and (gather_output or not input_is_parallel):
            raise ValueError(
                "sequence_parallel=True takes and gives sequence-split activations: no gather_output, no split input."
            )
        if gather_output and parts != 1:
            raise ValueError(
                f"gather_output=True with parts={parts} would interleave the fused blocks; gather them yourself."
            )
        self.in_features, self.out_features = in_features, out_features
        self.parallel, self.gather_output, self.input_is_parallel = parallel, gather_output, input_is_parallel
        self.transposed, self.sequence_parallel = transposed, sequence_parallel
        w_dim = {"column": 1, "row": 0}[parallel] if transposed else {"column": 0, "row": 1}[parallel]
        factory = {"dtype": dtype, "device": device}
        if parallel == "column":
            spec = ShardSpec(0, out_features, parts=parts, padded=vocab_padded)
            if not vocab_padded:
                check_divisible("out_features / parts", out_features // parts, tp.size)
            local_out = spec.local_size(tp.size)
            with parameter_creation_scope(ShardSpec(w_dim, out_features, parts=parts, padded=vocab_padded)):
                self.weight = nn.Parameter(torch.empty(*_shape(local_out, in_features, transposed), **factory))
            if gather_output:  # replicated, added to the gathered output (so a tie with another bias can stay)
                bias_param = nn.Parameter(torch.empty(out_features, **factory)) if bias else None
            else:
                bias_param = mark(nn.Parameter(torch.empty(local_out, **factory)), spec) if bias else None
        else:
            local_in = check_divisible("in_features", in_features, tp.size)
            with parameter_creation_scope(ShardSpec(w_dim, in_features)):
                self.weight = nn.Parameter(torch.empty(*_shape(out_features, local_in, transposed), **factory))
            bias_param = nn.Parameter(torch.empty(out_features, **factory)) if bias else None  # replicated
            if bias_param is not None and sequence_parallel:
                mark(bias_param, allreduce_grad="sum")
        self.register_parameter("bias", bias_param)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s init with the full fan-in (weights are usually loaded from the original module)."""
        bound = 1.0 / math.sqrt(self.in_features)
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: Tensor) -> Tensor:
        """Args: x: ``(..., in)`` (column, or row with ``input_is_parallel=False``) or ``(..., in / tp)``.

        Returns:
            ``(..., out / tp)`` (column) or ``(..., out)`` (row, or column with ``gather_output``).
        """
        group = self.require_group()
        weight = self.weight.t() if self.transposed else self.weight  # (out or out / tp, in or in / tp)
        if self.parallel == "column":
            if self.sequence_parallel:
                return F.linear(all_gather_along(x, group, dim=1), weight, self.bias)  # (B, T, out / tp)
            if not self.gather_output:
                return F.linear(copy_to_tp(x, group), weight, self.bias)  # (..., out / tp)
            y = gather_from_tp(F.linear(copy_to_tp(x, group), weight), group, dim=-1)  # (..., padded out)
            if y.size(-1) != self.out_features:
                y = y.narrow(-1, 0, self.out_features)
            return y if self.bias is None else y + self.bias
        if not self.input_is_parallel:
            x = scatter_to_tp(x, group, dim=-1)  # (..., in / tp)
        if self.sequence_parallel:
            y = reduce_scatter_along(F.linear(x, weight), group, dim=1)  # (B, T / tp, out)
        else:
            y = reduce_from_tp(F.linear(x, weight), group)  # (..., out)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, parallel={self.parallel},"
            f" tp={self.tp.rank}/{self.tp.size}, local_weight={tuple(self.weight.shape)}"
        )


def _shape(out_features: int, in_features: int, transposed: bool) -> tuple[int, int]:
    return (in_features, out_features) if transposed else (out_features, in_features)


register_parallel_linear(DistributedLinear)  # sharded-random regions form around its column/row instances
