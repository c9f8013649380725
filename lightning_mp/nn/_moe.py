"""Mixture of experts: a dense one-process ``MoE`` and its tensor-parallel counterpart ``DistributedMoE``
(registered, so a marked ``MoE`` is swapped), with the same routing.

Routing (both): ``p = softmax(x W_r)`` over ``E`` experts per token; each token picks its top ``k`` experts
(gates renormalised over them when ``k > 1``, the raw probability when ``k = 1``, as Switch); each expert takes
at most ``capacity = ceil(N * k / E * capacity_factor)`` of the ``N`` tokens, first choices first, then in token
order; the rest are dropped (that slot contributes nothing). Expert ``e`` is ``gelu(x W1_e) W2_e``. The Switch
load-balancing loss ``aux = E * sum_e f_e * P_e`` (``f_e`` the fraction of tokens whose first choice is ``e``,
``P_e`` the mean router probability of ``e``) is returned to the caller, who adds it to the loss with a weight.

[Note: MoE under tp] The experts are spread over the tp group (rank ``r`` holds experts
``[r E / tp, (r + 1) E / tp)``, ``W1``/``W2`` split along dim 0). The ranks of a tp group hold the same tokens
(the strategy gives them the same batch), so each rank routes all ``N`` tokens identically, runs its own experts
on the tokens sent to them and the partial outputs are summed (forward all-reduce, backward identity). An
all-to-all dispatch would only move tokens every rank already has; it pays off when tokens are split over the
group (sequence parallelism), which is not built yet. The router is replicated; its gate gradient passes
``copy_to_tp`` so every rank gets the gradient of all experts' gates.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from lightning_mp.nn._base import TPModule
from lightning_mp.tp import (
    ShardSpec,
    TPGroup,
    check_divisible,
    copy_to_tp,
    parameter_creation_scope,
    reduce_from_tp,
    tp_register_with_module,
)

__all__ = ["DistributedMoE", "MoE", "route"]


def route(probs: Tensor, top_k: int, capacity_factor: float) -> tuple[Tensor, Tensor, Tensor]:
    """Top-k choices with capacity dropping.

    Args:
        probs: ``(N, E)`` router probabilities.
        top_k: ``k``.
        capacity_factor: ``cf``; capacity ``ceil(N * k / E * cf)``.

    Returns:
        ``(experts, gates, kept)``, each ``(N, k)``: expert index, gate weight (with gradient), and whether
        the slot fits in its expert's capacity.
    """
    num_tokens, num_experts = probs.shape
    top_p, experts = probs.topk(top_k, dim=-1)  # (N, k)
    gates = top_p / top_p.sum(-1, keepdim=True) if top_k > 1 else top_p
    capacity = math.ceil(num_tokens * top_k / num_experts * capacity_factor)
    onehot = F.one_hot(experts, num_experts).transpose(0, 1).reshape(top_k * num_tokens, num_experts)  # (k N, E)
    position = (onehot.cumsum(0) - 1).mul(onehot).sum(-1).reshape(top_k, num_tokens).t()  # (N, k)
    return experts, gates, position < capacity


def _aux_loss(probs: Tensor, experts: Tensor) -> Tensor:
    num_experts = probs.size(-1)
    first = F.one_hot(experts[:, 0], num_experts).to(probs.dtype).mean(0)  # f_e, (E,)
    return num_experts * (first * probs.mean(0)).sum()


def _run_experts(
    x: Tensor, w1: Tensor, w2: Tensor, first_expert: int, experts: Tensor, gates: Tensor, kept: Tensor
) -> Tensor:
    """``sum`` over this module's experts of ``gate * expert(x)`` for the kept slots routed to them; ``(N, C)``."""
    out = torch.zeros_like(x)
    for local in range(w1.size(0)):
        token, slot = torch.nonzero((experts == first_expert + local) & kept, as_tuple=True)
        if token.numel() == 0:
            continue
        y = F.gelu(x[token] @ w1[local]) @ w2[local]  # (n_e, C)
        out = out.index_add(0, token, y * gates[token, slot].unsqueeze(-1))
    return out


class MoE(nn.Module):
    """Dense (one-process) mixture of experts; see the module docstring for the routing.

    Args:
        n_embd: ``C``.
        num_experts: ``E``.
        hidden: expert width ``H``.
        top_k: experts per token.
        capacity_factor: ``cf``.
    """

    def __init__(
        self, n_embd: int, num_experts: int, hidden: int, top_k: int = 1, capacity_factor: float = 1.25
    ) -> None:
        super().__init__()
        self.n_embd, self.num_experts, self.hidden = n_embd, num_experts, hidden
        self.top_k, self.capacity_factor = top_k, capacity_factor
        self.router = nn.Linear(n_embd, num_experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(num_experts, n_embd, hidden) / math.sqrt(n_embd))
        self.w2 = nn.Parameter(torch.randn(num_experts, hidden, n_embd) / math.sqrt(hidden))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Args: x: ``(B, T, C)``. Returns: ``(y, aux)``: ``(B, T, C)`` and the scalar load-balancing loss."""
        flat = x.reshape(-1, x.size(-1))  # (N, C)
        probs = self.router(flat).softmax(-1)  # (N, E)
        experts, gates, kept = route(probs, self.top_k, self.capacity_factor)
        y = _run_experts(flat, self.w1, self.w2, 0, experts, gates, kept)
        return y.reshape(x.shape), _aux_loss(probs, experts)


class DistributedMoE(TPModule):
    """:class:`MoE` with its experts spread over the tp group (see [Note: MoE under tp]); same keys and full
    shapes in state dicts.

    Raises:
        TPDivisibilityError: if ``num_experts`` does not divide by the tp degree.
    """

    def __init__(
        self, n_embd: int, num_experts: int, hidden: int, top_k: int = 1, capacity_factor: float = 1.25, *, tp: TPGroup
    ) -> None:
        super().__init__(tp)
        local = check_divisible("num_experts", num_experts, tp.size)
        self.n_embd, self.num_experts, self.hidden = n_embd, num_experts, hidden
        self.top_k, self.capacity_factor = top_k, capacity_factor
        self.first_expert = tp.rank * local
        self.router = nn.Linear(n_embd, num_experts, bias=False)  # replicated
        with parameter_creation_scope(ShardSpec(0, num_experts)):
            self.w1 = nn.Parameter(torch.randn(local, n_embd, hidden) / math.sqrt(n_embd))
            self.w2 = nn.Parameter(torch.randn(local, hidden, n_embd) / math.sqrt(hidden))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Args: x: ``(B, T, C)`` replicated. Returns: ``(y, aux)`` replicated."""
        group = self.require_group()
        flat = x.reshape(-1, x.size(-1))  # (N, C)
        probs = self.router(flat).softmax(-1)  # (N, E), the same on every rank
        experts, gates, kept = route(copy_to_tp(probs, group), self.top_k, self.capacity_factor)
        tokens = copy_to_tp(flat, group)
        partial = _run_experts(tokens, self.w1, self.w2, self.first_expert, experts, gates, kept)
        # A rank whose experts got no token still enters both copies' backward all-reduces (zero expert grads).
        partial = partial + 0.0 * (gates.sum() + tokens.sum() + self.w1.sum() + self.w2.sum())
        return reduce_from_tp(partial, group).reshape(x.shape), _aux_loss(probs, experts)


def _moe_args(module: MoE) -> tuple[tuple, dict]:
    return (module.n_embd, module.num_experts, module.hidden, module.top_k, module.capacity_factor), {}


def register_moe() -> None:
    """Register ``MoE -> DistributedMoE``."""
    tp_register_with_module(MoE, DistributedMoE, init_hook=_moe_args)
