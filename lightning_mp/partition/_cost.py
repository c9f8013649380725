"""The cost model of the planner: per-subtree compute and memory as shares of the model's totals.

A node's cost is ``(1 - memory_weight)`` x its share of the compute (FLOPs, or measured time) plus ``memory_weight``
x its share of the memory (parameter bytes x ``optimizer_state_factor`` + the output bytes of leaf modules), as
SMP's cost model (paper section 3.1). [Note: partition algorithm] and [Note: tied weights] are in ``_plan.py``.
"""

from __future__ import annotations

from collections.abc import Mapping

from lightning_mp.partition._checks import _ROOT
from lightning_mp.partition._trace import ModelTrace

__all__ = ["stage_costs"]


_Item = tuple[str, bool]  # (module FQN, is_residual); a subtree node when is_residual is False


class _CostModel:
    """Per-subtree FLOPs, bytes, call order and shared-group membership of a trace."""

    def __init__(
        self,
        trace: ModelTrace,
        memory_weight: float,
        optimizer_state_factor: float = 3.0,
        replicate: bool = False,
        whole: frozenset[str] = frozenset(),
    ) -> None:
        self.trace = trace
        self.replicate = replicate
        self.whole = whole  # never expanded: see [Note: partition algorithm]
        self.memory_weight = memory_weight
        self.optimizer_state_factor = optimizer_state_factor
        records = trace.modules
        # [Note: aliased modules] A module object registered under several FQNs (``self.lin1 = self.lin0``) is one
        # placement unit: its hooks fire under its first FQN only, so its other names (and their submodules) would
        # look like never-called children of their parents and be pulled into the parents' residuals (and, through
        # the parameters they share, merge those parents into one node). They are left out of the tree here and
        # travel with the first name instead.
        self.aliases: dict[str, list[str]] = {}  # first FQN -> its other FQNs
        for group in trace.alias_groups:
            self.aliases[group[0]] = group[1:]
        other_names = {fqn for names in self.aliases.values() for fqn in names}
        self.children = {fqn: [c for c in record.children if c not in other_names] for fqn, record in records.items()}
        self.subtree: dict[str, list[str]] = {}
        self.first_call: dict[str, int | None] = {}  # min over the subtree
        self.flops: dict[str, float] = {}  # inclusive, of the subtree
        self.bytes: dict[str, int] = {}  # of the subtree
        for fqn in reversed(records):  # children before parents
            if fqn in other_names:  # never called under this name, holds nothing of its own (see _module_records)
                self.subtree[fqn], self.first_call[fqn], self.flops[fqn], self.bytes[fqn] = [], None, 0.0, 0
            else:
                self._summarise(fqn)
        total = trace.total_time_s if trace.timed else trace.total_flops
        self.flops[_ROOT] = max(float(total), self.flops[_ROOT])
        self.first_call[_ROOT] = -1  # the root runs the step: treat it as called first
        self.total_flops = self.flops[_ROOT]
        self.total_bytes = self.bytes[_ROOT]
        # Nodes merged into one: modules sharing a parameter (colocate), or only names of one module object holding
        # parameters (replicate); see [Note: tied weights].
        holding = {m for group in trace.shared_groups for m in group}
        merged = [g for g in trace.alias_groups if holding.intersection(g)] if replicate else trace.shared_groups
        self.group_of = {m: i for i, group in enumerate(merged) for m in group}
        # Replicated parameters: module -> indices into trace.shared_parameters it holds; the charge of a copy.
        self.shared_of: dict[str, list[int]] = {}
        for index, shared in enumerate(trace.shared_parameters):
            for holder in shared.holders:
                self.shared_of.setdefault(holder, []).append(index)
        self.copy_cost = [self.cost(0.0, s.num_bytes * optimizer_state_factor) for s in trace.shared_parameters]
        self._called_children = {fqn: self._order_called_children(fqn) for fqn in records}
        self._cache: dict[tuple, tuple] = {}

    def _summarise(self, fqn: str) -> None:
        record = self.trace.modules[fqn]
        children = self.children[fqn]
        self.subtree[fqn] = [fqn, *self.aliases.get(fqn, ())] + [m for child in children for m in self.subtree[child]]
        calls = [self.first_call[c] for c in children if self.first_call[c] is not None]
        if record.first_call is not None:
            calls.append(record.first_call)
        self.first_call[fqn] = min(calls) if calls else None
        children_flops = sum(self.flops[c] for c in children)
        compute = record.time_s if self.trace.timed else record.flops
        self.flops[fqn] = float(compute) if record.num_calls > 0 else children_flops
        self.bytes[fqn] = self.own_memory(fqn) + sum(self.bytes[c] for c in children)

    def own_memory(self, fqn: str) -> float:
        """Bytes a module itself needs in training: its parameters x the optimizer-state factor (weights,
        gradients, optimizer states), plus, for a leaf, the outputs it leaves alive for backward."""
        record = self.trace.modules[fqn]
        activations = record.activation_bytes if not self.children[fqn] else 0
        return record.param_bytes * self.optimizer_state_factor + activations

    def cost(self, flops: float, num_bytes: float) -> float:
        flops_share = flops / self.total_flops if self.total_flops > 0 else 0.0
        bytes_share = num_bytes / self.total_bytes if self.total_bytes > 0 else 0.0
        return (1.0 - self.memory_weight) * flops_share + self.memory_weight * bytes_share

    def self_flops(self, fqn: str) -> float:
        return max(0.0, self.flops[fqn] - sum(self.flops[c] for c in self.children[fqn]))

    def own_cost(self, fqn: str) -> float:
        """Cost of one module alone: self FLOPs and own bytes."""
        return self.cost(self.self_flops(fqn), self.own_memory(fqn))

    def called_children(self, fqn: str) -> list[str]:
        """Children with a call in their subtree, by first call (definition order on ties)."""
        return self._called_children[fqn]

    def _order_called_children(self, fqn: str) -> list[str]:
        called = [c for c in self.children[fqn] if self.first_call[c] is not None]
        return sorted(called, key=lambda c: self.first_call[c])  # stable: definition order

    def expandable(self, item: _Item) -> bool:
        fqn, is_residual = item
        return not is_residual and fqn not in self.whole and bool(self.called_children(fqn))

    def expand(self, fqn: str) -> list[_Item]:
        return [(fqn, True)] + [(child, False) for child in self.called_children(fqn)]

    def copies(self, item: _Item) -> tuple[frozenset[int], frozenset[int]]:
        """(shared parameters some module of the node holds, those whose first owner is in the node)."""
        key = ("copies",) + item
        if key not in self._cache:
            members = self.describe(item)[1]
            touched = frozenset(i for m in members for i in self.shared_of.get(m, ()))
            inside = set(members) if touched else set()
            first = frozenset(i for i in touched if self.trace.shared_parameters[i].holders[0] in inside)
            self._cache[key] = (touched, first)
        return self._cache[key]

    def describe(self, item: _Item) -> tuple[float, list[str], frozenset[int]]:
        """(cost, covered module FQNs, shared-group indices) of a node."""
        if item not in self._cache:
            self._cache[item] = self._describe(*item)
        return self._cache[item]

    def _describe(self, fqn: str, is_residual: bool) -> tuple[float, list[str], frozenset[int]]:
        if is_residual:
            uncalled = [c for c in self.children[fqn] if self.first_call[c] is None]
            members = [fqn, *self.aliases.get(fqn, ())] + [m for child in uncalled for m in self.subtree[child]]
            num_bytes = self.own_memory(fqn) + sum(self.bytes[c] for c in uncalled)
            cost = self.cost(self.self_flops(fqn), num_bytes)
        else:
            members = self.subtree[fqn]
            cost = self.cost(self.flops[fqn], self.bytes[fqn])
        groups = frozenset(self.group_of[m] for m in members if m in self.group_of)
        return cost, members, groups


def stage_costs(
    trace: ModelTrace,
    stage_of: Mapping[str, int],
    num_stages: int,
    *,
    memory_weight: float = 0.2,
    optimizer_state_factor: float = 3.0,
    charge_copies: bool = True,
) -> tuple[float, ...]:
    """Normalised cost of each stage for *any* assignment of modules to stages (plans, baselines, hand splits).

    Uses the same cost model as :func:`plan`; each module contributes its own cost (self compute, own memory)
    to its stage, and, with ``charge_copies``, a stage holding a tied parameter whose first owner is elsewhere pays
    for its copy (see [Note: tied weights]; ``False`` scores the split as if ties were free). The costs are
    normalised by the model without copies: they sum to 1 when no copy is charged (all zeros for a model without
    compute and memory).
    """
    costs = _CostModel(trace, memory_weight, optimizer_state_factor)
    return _stage_costs(costs, stage_of, num_stages, charge_copies)


def _stage_costs(costs: _CostModel, stage_of: Mapping[str, int], num_stages: int, charge_copies: bool = True) -> tuple:
    """Own costs per stage plus one copy of each replicated parameter on every stage holding it besides its first
    owner's; normalised by the model without copies (see [Note: tied weights])."""
    raw = [0.0] * num_stages
    for fqn, stage in stage_of.items():
        raw[stage] += costs.own_cost(fqn)
    total = sum(raw)
    for index, shared in enumerate(costs.trace.shared_parameters if charge_copies else ()):
        owner = stage_of.get(shared.holders[0])
        for stage in {stage_of[h] for h in shared.holders if h in stage_of} - {owner}:
            raw[stage] += costs.copy_cost[index]
    return tuple(c / total if total > 0 else 0.0 for c in raw)
