"""Planning: module FQN -> pipeline stage, balanced by a compute + memory cost model.

[Note: partition algorithm]
A *node* is a piece of the module tree that goes to one stage whole: either a *subtree* (a module
and all its descendants) or the *residual* of an expanded module (the module itself, its own
parameters, its self FLOPs, plus any child subtree that was never called during tracing, so such
children stay with their parent). The *frontier* is a sequence of nodes covering every module
exactly once, in call order; expanding a subtree node replaces it by ``[its residual] + its
children``, the children ordered by the first call in their subtree, so the pieces of a subtree stay
contiguous. Nodes whose modules share a parameter are merged into one super-node at the position
of the earliest member.
An exact min-max DP cuts the merged sequence into ``num_stages`` non-empty contiguous segments;
among the splits with the optimal bottleneck it takes the one with the smallest sum of squared
stage costs (then the earliest cut points).
The search starts from the *finest* frontier, every module with called children expanded (all
leaves and residuals): its optimum is the lowest any frontier reaches, since a coarser frontier
only forces pieces onto one stage (up to where shared-parameter super-nodes sit). It then coarsens:
expansions are undone, innermost first, while the optimum stays within ``_COLLAPSE_SLACK`` (1%) of
the finest one, because splitting a module over stages costs communication the model does not
count. A split of the current frontier under the limit (stages filled greedily) serves as a
certificate: a module whose pieces all lie on one of its stages collapses without a check; only
modules that straddle a stage boundary or share parameters need a DP, so planning a model of a few
hundred modules takes tens of milliseconds. (A top-down greedy search, expanding a node only when
that alone lowers the optimum, stalls where the gain needs two levels at once: a container whose
only called child is another container, as ``nn.TransformerEncoder`` -> ``layers`` -> ``layers.i``.)
The root residual is always the first node, so the root and its own parameters land on stage 0. A module object
registered under several FQNs is one piece: its other names and their submodules go with its first name (see
[Note: aliased modules] in ``_CostModel``).
Manual placements are applied on top; the innermost entry wins for its subtree.

[Note: tied weights] A parameter held by several modules (a tied embedding and LM head) is either *co-located*
(``tied_weights="colocate"``: its holders form one super-node, as above) or *replicated* (``"replicate"``: only
names of one module object are merged; the holders may sit on different stages, each of those stages keeps a copy
and the strategy sums its gradient over them, as Megatron-LM and DeepSpeed's ``TiedLayerSpec`` do). A copy costs its
stage the parameter's training memory (bytes x ``optimizer_state_factor``): the DP charges it to every merged node
that holds the parameter without its first owner (exact unless two such nodes share a stage, where it is charged
twice), and the plan's ``stage_costs`` count it exactly, once per stage holding a copy. Costs stay normalised by the
model without copies, so plans of both kinds compare on one scale. ``"auto"`` plans both and keeps the replicated
plan only when its largest stage cost is lower by more than ``_REPLICATE_GAIN`` (1%, the slack that already keeps a
module whole for communication the model does not count). For an embedding tied to an LM head that rarely happens:
the embedding's cost is almost all memory, so the copy costs the head's stage what co-locating the embedding costs
(GPT-2, BERT, RoBERTa at 2-8 stages: under 0.5%). It pays where one small weight is used by compute-heavy modules
far apart (a block shared across depth), which co-location would pull onto one stage.
"""

from __future__ import annotations

import bisect
import difflib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_mp.partition._trace import ModelTrace

__all__ = ["TIED_WEIGHTS", "PartitionPlan", "plan", "stage_costs"]

TIED_WEIGHTS = ("colocate", "replicate", "auto")

# Costs are normalised (they sum to about 1); differences below this are float noise.
_TOL = 1e-12
# Expansions of the finest frontier are undone while the bottleneck stage cost stays within this
# fraction of its optimum: splitting a module over stages adds communication the cost model does not see.
_COLLAPSE_SLACK = 0.01
# ``tied_weights="auto"`` replicates only when that lowers the bottleneck stage cost by more than this fraction: a
# copy adds a remote call and a gradient all-reduce per step that the cost model does not see (the example GPT at
# 2 stages, predicted 0.6% better replicated, ran at 0.91x the steps/s; see [Note: tied weights]).
_REPLICATE_GAIN = _COLLAPSE_SLACK
_ROOT = ""
_MAX_TABLE_ENTRIES = 6


@dataclass(frozen=True)
class PartitionPlan:
    """Where every module runs: module FQN -> pipeline stage.

    A module executes (its forward code runs) on ``stage_of[fqn]`` and its direct parameters live
    there. The root ``""`` is always on stage 0.

    Attributes:
        num_stages: number of pipeline stages.
        stage_of: every module FQN of the trace -> stage in ``[0, num_stages)``.
        stage_costs: normalised cost (compute and memory, weighted as planned) per stage; sums to
            about 1 (all zeros for a model without FLOPs and parameters).
        ordered_state: FQNs of the modules whose traced forward wrote their own buffers (BatchNorm
            running statistics); the engine updates them in microbatch order. ``None`` when unknown
            (a plan saved before this was recorded): then every module with buffers is treated so.
        replicated: tied parameters whose holders sit on several stages (see [Note: tied weights]): original
            parameter FQN -> the stages holding a copy, ascending. Empty when every tie is co-located.
    """

    num_stages: int
    stage_of: dict[str, int]
    stage_costs: tuple[float, ...]
    ordered_state: tuple[str, ...] | None = None
    replicated: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stage_costs", tuple(float(c) for c in self.stage_costs))
        _check_num_stages(self.num_stages)
        if len(self.stage_costs) != self.num_stages:
            raise ValueError(
                f"stage_costs has {len(self.stage_costs)} entries but num_stages is "
                f"{self.num_stages}; give one cost per stage"
            )
        for fqn, stage in self.stage_of.items():
            _check_stage(stage, self.num_stages, f"stage_of[{fqn!r}] = {stage!r}")
        object.__setattr__(self, "replicated", {str(k): tuple(int(s) for s in v) for k, v in self.replicated.items()})
        for fqn, stages in self.replicated.items():
            if len(stages) < 2 or list(stages) != sorted(set(stages)):
                raise ValueError(
                    f"replicated[{fqn!r}] = {stages}; a replicated parameter lists two or more distinct stages, ascending"
                )
            for stage in stages:
                _check_stage(stage, self.num_stages, f"replicated[{fqn!r}] stage {stage!r}")
        if self.stage_of.get(_ROOT, 0) != 0:
            raise ValueError(
                f"the root module ('') is on stage {self.stage_of[_ROOT]}; the root always "
                "runs on stage 0"
            )

    def modules_on(self, stage: int) -> list[str]:
        """Top-most modules of ``stage``: those on it whose parent is on another stage.

        The root counts as top-most on stage 0. Order is ``named_modules`` order.

        Raises:
            ValueError: if ``stage`` is not in ``[0, num_stages)``.
        """
        _check_stage(stage, self.num_stages, f"stage {stage!r}")
        return [
            fqn
            for fqn, s in self.stage_of.items()
            if s == stage and (fqn == _ROOT or self.stage_of.get(_parent_of(fqn)) != stage)
        ]

    def format_table(self, trace: ModelTrace) -> str:
        """A human-readable table: stage | top-most modules | #parameters (elements) | cost %."""
        num_params = [0] * self.num_stages
        for fqn, stage in self.stage_of.items():
            record = trace.modules.get(fqn)
            num_params[stage] += record.num_params if record is not None else 0
        copies = self.replica_params(trace)
        header = ("stage", "modules", "parameters", "cost") + (("replicated (tied)",) if self.replicated else ())
        shown = [[fqn for fqn in names if holds_parameters(trace, fqn)] for names in self.display_modules()]
        rows = [
            (
                str(stage),
                _abbreviate(shown[stage]),
                f"{num_params[stage]:,}" + (f" + {copies[stage]:,} replica" if copies[stage] else ""),
                f"{100.0 * self.stage_costs[stage]:.1f}%",
            )
            + ((", ".join(f for f, s in self.replicated.items() if stage in s) or "-",) if self.replicated else ())
            for stage in range(self.num_stages)
        ]
        return _render_table(header, rows)

    def replica_params(self, trace: ModelTrace) -> list[int]:
        """Per stage, elements of the replicated parameters it holds as a copy (not as their first owner)."""
        sizes = {shared.fqn: shared for shared in trace.shared_parameters}
        copies = [0] * self.num_stages
        for fqn, stages in self.replicated.items():
            shared = sizes.get(fqn)
            if shared is None:
                continue
            owner = self.stage_of.get(shared.holders[0])
            for stage in stages:
                copies[stage] += shared.num_params if stage != owner else 0
        return copies

    def display_modules(self) -> list[list[str]]:
        """Per stage, the modules worth naming in a summary: children of modules whose subtree spans several stages."""
        spans: dict[str, set[int]] = {fqn: {stage} for fqn, stage in self.stage_of.items()}
        for fqn in sorted(self.stage_of, key=lambda f: -f.count(".") if f else 1):
            if fqn != _ROOT:
                spans.setdefault(_parent_of(fqn), set()).update(spans[fqn])
        shown: list[list[str]] = [[] for _ in range(self.num_stages)]
        for fqn, stage in self.stage_of.items():
            if fqn == _ROOT:
                if len(spans[fqn]) == 1:
                    shown[stage].append("<root>")
                continue
            if len(spans[_parent_of(fqn)]) > 1 and len(spans[fqn]) == 1:
                shown[stage].append(fqn)
        return shown

    def to_dict(self) -> dict[str, Any]:
        """The plan as plain JSON-able data; :meth:`from_dict` reverses it."""
        data: dict[str, Any] = {
            "num_stages": self.num_stages,
            "stage_of": dict(self.stage_of),
            "stage_costs": list(self.stage_costs),
        }
        if self.ordered_state is not None:
            data["ordered_state"] = list(self.ordered_state)
        if self.replicated:
            data["replicated"] = {fqn: list(stages) for fqn, stages in self.replicated.items()}
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PartitionPlan:
        """Rebuilds a plan from :meth:`to_dict` output.

        Raises:
            ValueError: if a key is missing or a value is out of range.
        """
        missing = [key for key in ("num_stages", "stage_of", "stage_costs") if key not in data]
        if missing:
            raise ValueError(
                f"partition plan data lacks {missing}; pass the output of PartitionPlan.to_dict()"
            )
        return cls(
            num_stages=int(data["num_stages"]),
            stage_of={str(fqn): int(stage) for fqn, stage in data["stage_of"].items()},
            stage_costs=tuple(float(c) for c in data["stage_costs"]),
            ordered_state=tuple(data["ordered_state"]) if data.get("ordered_state") is not None else None,
            replicated={str(f): tuple(int(s) for s in v) for f, v in (data.get("replicated") or {}).items()},
        )


def plan(
    trace: ModelTrace,
    num_stages: int,
    *,
    memory_weight: float = 0.2,
    manual: Mapping[str, int] | None = None,
    auto_partition: bool = True,
    default_partition: int = 0,
    optimizer_state_factor: float = 3.0,
    tied_weights: str = "colocate",
) -> PartitionPlan:
    """Places every module of a traced model on one of ``num_stages`` pipeline stages.

    See [Note: partition algorithm]. The result depends only on the arguments (deterministic).

    Args:
        trace: the output of :func:`lightning_mp.partition.trace`.
        num_stages: number of pipeline stages (``pipeline_parallel_degree``), at least 1.
        memory_weight: weight in ``[0, 1]`` of memory in a node's cost; compute (FLOPs, or measured
            time if the trace has it) gets ``1 - memory_weight``. Both are shares of the model's totals.
            Memory = parameter bytes x ``optimizer_state_factor`` + output bytes of leaf modules (the
            activations kept for backward), as SMP's cost model (paper section 3.1).
        optimizer_state_factor: training bytes per parameter byte: weights, gradients and optimizer
            states (SMP uses 3; Adam in fp32 needs 4).
        manual: optional ``{module_fqn: stage}`` placements applied after the automatic plan; the
            innermost entry wins for its subtree. The root ``""`` may only be placed on stage 0.
        auto_partition: if False, skip the automatic plan: modules not under a ``manual`` entry go
            to ``default_partition`` (the root stays on stage 0).
        default_partition: stage for unplaced modules when ``auto_partition`` is False.
        tied_weights: ``"colocate"`` (modules sharing a parameter on one stage), ``"replicate"`` (they may sit on
            different stages, each holding a copy) or ``"auto"`` (plan both, keep the replicated plan when its
            largest stage cost, copies charged, is lower by more than 1%); see [Note: tied weights].

    Returns:
        The :class:`PartitionPlan`.

    Raises:
        ValueError: if ``num_stages < 1``; ``memory_weight`` is outside ``[0, 1]``; a stage is out
            of range; ``manual`` names an unknown module or puts the root off stage 0; the model
            has fewer placeable modules than ``num_stages``; under ``tied_weights="colocate"``, modules sharing
            a parameter end up on different stages; or a stage ends up with no modules.
    """
    if tied_weights not in TIED_WEIGHTS:
        raise ValueError(f"tied_weights must be one of {TIED_WEIGHTS}, got {tied_weights!r}")
    if tied_weights != "auto" or not trace.shared_parameters:
        return _plan(trace, num_stages, memory_weight, manual, auto_partition, default_partition,
                     optimizer_state_factor, replicate=tied_weights == "replicate")
    try:
        colocated = _plan(trace, num_stages, memory_weight, manual, auto_partition, default_partition,
                          optimizer_state_factor, replicate=False)
    except ValueError:  # e.g. a manual map that splits a tie, or too few nodes once ties are merged
        colocated = None
    replicated = _plan(trace, num_stages, memory_weight, manual, auto_partition, default_partition,
                       optimizer_state_factor, replicate=True)
    if colocated is None or max(replicated.stage_costs) < max(colocated.stage_costs) * (1.0 - _REPLICATE_GAIN):
        return replicated
    return colocated


def _plan(
    trace: ModelTrace,
    num_stages: int,
    memory_weight: float,
    manual: Mapping[str, int] | None,
    auto_partition: bool,
    default_partition: int,
    optimizer_state_factor: float,
    replicate: bool,
) -> PartitionPlan:
    _check_num_stages(num_stages)
    if not 0.0 <= memory_weight <= 1.0:
        raise ValueError(f"memory_weight must be in [0, 1], got {memory_weight}; use e.g. 0.2")
    _check_stage(default_partition, num_stages, f"default_partition={default_partition!r}")
    if manual:
        _check_manual(trace, manual, num_stages)
        manual = _with_aliases(trace, manual)
    costs = _CostModel(trace, memory_weight, optimizer_state_factor, replicate=replicate)
    if auto_partition:
        stage_of = _auto_stages(costs, num_stages)
    else:
        stage_of = {fqn: default_partition for fqn in trace.modules}
        stage_of[_ROOT] = 0
    if manual:
        stage_of = _apply_manual(trace, stage_of, manual)
    if not replicate:
        _check_shared_groups(trace, stage_of)
    _check_aliases_together(trace, stage_of)
    _check_no_empty_stage(stage_of, num_stages)
    ordered_state = tuple(fqn for fqn, record in trace.modules.items() if record.updates_buffers)
    return PartitionPlan(
        num_stages, stage_of, _stage_costs(costs, stage_of, num_stages), ordered_state, _replicated(trace, stage_of)
    )


def _replicated(trace: ModelTrace, stage_of: Mapping[str, int]) -> dict[str, tuple[int, ...]]:
    """Original FQN -> stages holding a copy, for every shared parameter whose holders sit on several stages."""
    result = {}
    for shared in trace.shared_parameters:
        stages = sorted({stage_of[holder] for holder in shared.holders})
        if len(stages) > 1:
            result[shared.fqn] = tuple(stages)
    return result


# ----------------------------------------------------------------------------- cost model

_Item = tuple[str, bool]  # (module FQN, is_residual); a subtree node when is_residual is False


class _CostModel:
    """Per-subtree FLOPs, bytes, call order and shared-group membership of a trace."""

    def __init__(
        self, trace: ModelTrace, memory_weight: float, optimizer_state_factor: float = 3.0, replicate: bool = False
    ) -> None:
        self.trace = trace
        self.replicate = replicate
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
        return not is_residual and bool(self.called_children(fqn))

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


# ----------------------------------------------------------------------------- search


@dataclass
class _Split:
    """A merged frontier cut into stages: ``nodes[i]`` lists frontier indices of node i."""

    nodes: list[list[int]]
    starts: list[int]  # index of the first node of each stage; starts[0] == 0
    stage_costs: list[float]
    optimum: float  # the min-max optimum: the largest stage cost, up to float rounding


def _auto_stages(costs: _CostModel, num_stages: int) -> dict[str, int]:
    frontier = _finest_frontier(costs, num_stages)
    frontier = _coarsen(costs, frontier, num_stages, _COLLAPSE_SLACK)
    split = _split(costs, frontier, num_stages)
    stage_of: dict[str, int] = {}
    for stage, start in enumerate(split.starts):
        end = split.starts[stage + 1] if stage + 1 < num_stages else len(split.nodes)
        for node in split.nodes[start:end]:
            for index in node:
                for fqn in costs.describe(frontier[index])[1]:
                    assert fqn not in stage_of, f"module {fqn!r} covered twice"
                    stage_of[fqn] = stage
    assert stage_of.keys() == costs.trace.modules.keys(), "frontier does not cover the model"
    assert stage_of[_ROOT] == 0, "the root residual must be on stage 0"
    return {fqn: stage_of[fqn] for fqn in costs.trace.modules}


def _finest_frontier(costs: _CostModel, num_stages: int) -> list[_Item]:
    """Every module with called children expanded: residuals and leaves in call order.

    Raises:
        ValueError: if even this frontier has fewer (merged) nodes than ``num_stages``.
    """
    frontier: list[_Item] = []
    pending: list[_Item] = [(_ROOT, False)]  # a stack: the next node to place is on top
    while pending:
        item = pending.pop()
        if costs.expandable(item):
            pending.extend(reversed(costs.expand(item[0])))
        else:
            frontier.append(item)
    num_nodes = len(_merge(costs, frontier))
    if num_nodes < num_stages:
        raise ValueError(
            f"cannot place {num_stages} stages: the model has only {num_nodes} placeable "
            "modules (modules called during tracing, counting modules that share parameters "
            f"as one); use fewer pipeline stages (at most {num_nodes}) or place modules with "
            "a manual map and auto_partition=False"
        )
    return frontier


def _coarsen(costs: _CostModel, frontier: list[_Item], num_stages: int, slack: float) -> list[_Item]:
    """Undoes expansions, innermost first, while the optimum stays within ``1 + slack`` of the finest one.

    Keeps as a certificate a split of the current frontier with every stage under the limit (greedy:
    each stage filled up to the limit from the left). A module whose pieces all lie on one stage of it,
    and share no parameters, collapses without changing the certificate; any other collapse is checked
    with the DP and, when it passes, gets a new certificate. A collapse that fails stays refused: later
    collapses only add constraints.
    """
    limit = _optimum(costs, frontier, num_stages) * (1.0 + slack) + _TOL
    stage_at = _greedy_stages(costs, frontier, num_stages, limit)
    refused: set[str] = set()
    collapsed_any = True
    while collapsed_any:
        collapsed_any = False
        for index in reversed(range(len(frontier))):
            trial = None if frontier[index][0] in refused else _collapse_at(costs, frontier, index)
            if trial is None:
                continue
            width = len(frontier) - len(trial) + 1
            if _within_one_stage(costs, frontier[index : index + width], stage_at[index : index + width]):
                stage_at[index : index + width] = [stage_at[index]]
            elif _optimum(costs, trial, num_stages) <= limit:
                stage_at = _greedy_stages(costs, trial, num_stages, limit)
            else:
                refused.add(frontier[index][0])
                continue
            frontier, collapsed_any = trial, True
    return frontier


def _within_one_stage(costs: _CostModel, items: list[_Item], stages: list[int]) -> bool:
    return len(set(stages)) == 1 and not any(costs.describe(item)[2] for item in items)


def _greedy_stages(costs: _CostModel, frontier: list[_Item], num_stages: int, limit: float) -> list[int]:
    """A stage for every frontier index: the merged nodes in order, each stage filled up to ``limit``,
    except that the last nodes get a stage each when only as many are left as stages still empty.

    Every stage is non-empty and at most ``limit`` when the min-max optimum is at most ``limit``.
    """
    nodes = _merge(costs, frontier)
    stage_at = [0] * len(frontier)
    stage, load = 0, 0.0
    for position, (node, cost) in enumerate(zip(nodes, _node_costs(costs, frontier, nodes))):
        stages_left_empty = num_stages - 1 - stage
        if position > 0 and (load + cost > limit or len(nodes) - position == stages_left_empty):
            stage, load = stage + 1, 0.0
        load += cost
        for index in node:
            stage_at[index] = stage
    assert stage == num_stages - 1, f"greedy split used {stage + 1} of {num_stages} stages"
    return stage_at


def _collapse_at(costs: _CostModel, frontier: list[_Item], index: int) -> list[_Item] | None:
    """Reverses ``expand`` of the residual at ``index`` if its children are all unexpanded."""
    fqn, is_residual = frontier[index]
    if not is_residual or fqn == _ROOT:
        return None
    span = costs.expand(fqn)
    if frontier[index : index + len(span)] != span:
        return None
    return frontier[:index] + [(fqn, False)] + frontier[index + len(span) :]


def _optimum(costs: _CostModel, frontier: list[_Item], num_stages: int) -> float:
    """Min-max stage cost of the merged frontier; infinite if it has fewer nodes than stages."""
    nodes = _merge(costs, frontier)
    if len(nodes) < num_stages:
        return math.inf
    return _min_max(_node_costs(costs, frontier, nodes), num_stages)


def _merge(costs: _CostModel, frontier: list[_Item]) -> list[list[int]]:
    """Groups frontier indices whose nodes share parameters; each group sits at its first index."""
    root_of = list(range(len(frontier)))

    def find(i: int) -> int:
        while root_of[i] != i:
            root_of[i] = root_of[root_of[i]]
            i = root_of[i]
        return i

    first_holder: dict[int, int] = {}
    for i, item in enumerate(frontier):
        for group in sorted(costs.describe(item)[2]):
            a, b = find(i), find(first_holder.setdefault(group, i))
            root_of[max(a, b)] = min(a, b)
    nodes: dict[int, list[int]] = {}
    for i in range(len(frontier)):
        nodes.setdefault(find(i), []).append(i)
    return list(nodes.values())


def _node_costs(costs: _CostModel, frontier: list[_Item], nodes: list[list[int]]) -> list[float]:
    if not costs.replicate or not costs.shared_of:
        return [sum(costs.describe(frontier[i])[0] for i in node) for node in nodes]
    return [sum(costs.describe(frontier[i])[0] for i in node) + _copy_charge(costs, frontier, node) for node in nodes]


def _copy_charge(costs: _CostModel, frontier: list[_Item], node: list[int]) -> float:
    """Memory of the replicated parameters this node holds without their first owner (see [Note: tied weights])."""
    held: set[int] = set()
    owned: set[int] = set()
    for i in node:
        touched, first = costs.copies(frontier[i])
        held |= touched
        owned |= first
    return sum(costs.copy_cost[index] for index in held - owned)


def _split(costs: _CostModel, frontier: list[_Item], num_stages: int) -> _Split:
    nodes = _merge(costs, frontier)
    node_costs = _node_costs(costs, frontier, nodes)
    optimum = _min_max(node_costs, num_stages)
    starts = _balanced_starts(node_costs, num_stages, optimum + _TOL)
    ends = starts[1:] + [len(nodes)]
    stage_costs = [sum(node_costs[s:e]) for s, e in zip(starts, ends)]
    return _Split(nodes, starts, stage_costs, optimum)


def _prefix_sums(values: Sequence[float]) -> list[float]:
    prefix = [0.0]
    for value in values:
        prefix.append(prefix[-1] + value)
    return prefix


def _min_max(costs: Sequence[float], num_parts: int) -> float:
    """Smallest possible largest part when cutting ``costs`` into ``num_parts`` contiguous parts.

    Exact DP over (parts, prefix length). For a fixed prefix the best cut ``p`` sits where the
    optimum of the first ``p`` nodes (non-decreasing in ``p``) meets the last part (non-increasing
    in ``p``), so it is found by bisection: O(num_parts * n * log n).
    """
    n = len(costs)
    assert 1 <= num_parts <= n, f"cannot cut {n} nodes into {num_parts} parts"
    prefix = _prefix_sums(costs)
    best = prefix[:]  # best[i]: optimum for the first i nodes in the current number of parts
    for parts in range(2, num_parts + 1):
        crossing = [b + q for b, q in zip(best, prefix)]  # >= prefix[i] iff best[p] >= last part
        new = [math.inf] * (n + 1)
        for i in range(parts, n + 1):
            p = bisect.bisect_left(crossing, prefix[i], parts - 1, i)
            value = best[p] if p < i else math.inf
            if p > parts - 1:
                value = min(value, prefix[i] - prefix[p - 1])
            new[i] = value
        best = new
    return best[n]


def _balanced_starts(costs: Sequence[float], num_parts: int, cap: float) -> list[int]:
    """Cut with every part <= ``cap`` minimising the sum of squared parts; earliest cuts on ties.

    Returns the index of the first element of each part.
    """
    n = len(costs)
    prefix = _prefix_sums(costs)
    best = [prefix[i] ** 2 if prefix[i] <= cap else math.inf for i in range(n + 1)]
    cut_before: list[list[int]] = []
    for parts in range(2, num_parts + 1):
        new, cuts = [math.inf] * (n + 1), [0] * (n + 1)
        first = parts - 1  # earliest cut whose last part fits under the cap; grows with i
        for i in range(parts, n + 1):
            while prefix[i] - prefix[first] > cap:
                first += 1
            for p in range(first, i):
                if best[p] == math.inf:
                    continue
                part = prefix[i] - prefix[p]
                value = best[p] + part * part
                if value < new[i] - _TOL:
                    new[i], cuts[i] = value, p
        best = new
        cut_before.append(cuts)
    assert best[n] < math.inf, "no split under the min-max optimum"
    starts, end = [], n
    for cuts in reversed(cut_before):
        end = cuts[end]
        starts.append(end)
    return [0] + starts[::-1]


# ----------------------------------------------------------------------------- checks


def _check_num_stages(num_stages: int) -> None:
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(
            f"num_stages must be an integer >= 1, got {num_stages!r}; "
            "set the number of pipeline stages to 1 or more"
        )


def _check_stage(stage: int, num_stages: int, description: str) -> None:
    """Raises if ``stage`` is not an int in ``[0, num_stages)``; ``description`` shows the value."""
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < num_stages:
        raise ValueError(
            f"{description} is not a valid stage for num_stages={num_stages}; use an integer "
            f"in 0..{num_stages - 1}"
        )


def _check_manual(trace: ModelTrace, manual: Mapping[str, int], num_stages: int) -> None:
    for fqn, stage in manual.items():
        if fqn not in trace.modules:
            close = difflib.get_close_matches(fqn, list(trace.modules), n=3)
            hint = f"did you mean {', '.join(repr(c) for c in close)}? " if close else ""
            raise ValueError(
                f"manual placement names unknown module {fqn!r}; {hint}use module names as "
                "in model.named_modules() ('' for the root)"
            )
        _check_stage(stage, num_stages, f"manual placement {fqn!r} -> {stage!r}")
    if manual.get(_ROOT, 0) != 0:
        raise ValueError(
            f"manual placement puts the root module ('') on stage {manual[_ROOT]}; the root runs "
            "the training step and always stays on stage 0; place its children instead"
        )


def _with_aliases(trace: ModelTrace, manual: Mapping[str, int]) -> dict[str, int]:
    """A placement of one name of a module object places all its names (``self.lin1 = self.lin0``)."""
    expanded = dict(manual)
    for group in trace.alias_groups:
        named = [fqn for fqn in group if fqn in manual]
        if not named:
            continue
        stages = {manual[fqn] for fqn in named}
        if len(stages) > 1:
            raise ValueError(
                f"manual placement puts one module, registered as {named}, on stages {sorted(stages)}; a module"
                " object runs on one stage: name one of its names only"
            )
        for fqn in group:
            expanded.setdefault(fqn, manual[named[0]])
    return expanded


def _apply_manual(
    trace: ModelTrace, stage_of: dict[str, int], manual: Mapping[str, int]
) -> dict[str, int]:
    """Overrides ``stage_of`` with ``manual``: the innermost entry wins for its subtree."""
    result: dict[str, int] = {}
    placed: set[str] = set()
    for fqn, record in trace.modules.items():  # parents before children
        if fqn in manual:
            result[fqn] = manual[fqn]
            placed.add(fqn)
        elif record.parent in placed:
            result[fqn] = result[record.parent]
            placed.add(fqn)
        else:
            result[fqn] = stage_of[fqn]
    return result


def _check_shared_groups(trace: ModelTrace, stage_of: Mapping[str, int]) -> None:
    for group in trace.shared_groups:
        if len({stage_of[fqn] for fqn in group}) > 1:
            where = ", ".join(f"{fqn!r} -> {stage_of[fqn]}" for fqn in group)
            raise ValueError(
                f"modules that share parameters are placed on different stages ({where}); "
                "with tied_weights='colocate' shared parameters need one stage: place all of them on the same "
                "stage in the manual map, or use tied_weights='replicate' (a copy on each stage, gradients summed)"
            )


def _check_aliases_together(trace: ModelTrace, stage_of: Mapping[str, int]) -> None:
    holding = {m for group in trace.shared_groups for m in group}
    for group in trace.alias_groups:
        if holding.intersection(group) and len({stage_of[fqn] for fqn in group}) > 1:
            where = ", ".join(f"{fqn!r} -> {stage_of[fqn]}" for fqn in group)
            raise ValueError(
                f"one module object with parameters, registered as several names, is placed on different stages"
                f" ({where}); a module runs on one stage: place all its names on the same stage"
            )


def _check_no_empty_stage(stage_of: Mapping[str, int], num_stages: int) -> None:
    used = set(stage_of.values())
    for stage in range(num_stages):
        if stage not in used:
            raise ValueError(
                f"stage {stage} has no modules; the placement uses stages {sorted(used)} of "
                f"num_stages={num_stages}; place a module on stage {stage} in the manual map, "
                "enable auto_partition, or use fewer pipeline stages"
            )


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


# ----------------------------------------------------------------------------- formatting


def _parent_of(fqn: str) -> str:
    return fqn.rpartition(".")[0]


def _abbreviate(fqns: list[str]) -> str:
    """Joins names, collapsing runs of indexed siblings: ``h.0 .. h.3 (4 modules)``."""
    entries: list[str] = []
    run: list[str] = []

    def flush() -> None:
        if len(run) >= 3:
            entries.append(f"{run[0]} .. {run[-1]} ({len(run)} modules)")
        else:
            entries.extend(run)
        run.clear()

    for fqn in fqns:
        indexed = fqn.rpartition(".")[2].isdigit()
        if not (indexed and run and _parent_of(run[-1]) == _parent_of(fqn)):
            flush()
        if indexed:
            run.append(fqn)
        else:
            entries.append(fqn if fqn else "<root>")
    flush()
    if len(entries) > _MAX_TABLE_ENTRIES:
        hidden = len(entries) - _MAX_TABLE_ENTRIES + 1
        entries = entries[: _MAX_TABLE_ENTRIES - 1] + [f"... (+{hidden} more)"]
    return ", ".join(entries) if entries else "-"


def _render_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[c]) for row in [header, *rows]) for c in range(len(header))]

    def line(cells: tuple[str, ...]) -> str:
        return " | ".join(cell.ljust(width) for cell, width in zip(cells, widths)).rstrip()

    rule = "-+-".join("-" * width for width in widths)
    return "\n".join([line(header), rule, *(line(row) for row in rows)])


def holds_parameters(trace: ModelTrace, fqn: str) -> bool:
    """Whether the module (or one below it) holds parameters. Stateless modules (activations, torchmetrics
    objects) run on whichever stage calls them, so placement tables leave them out. ``"<root>"`` always shows."""
    record = trace.modules.get(fqn)
    if record is None:
        return True
    if record.num_params > 0 or any(fqn in shared.holders for shared in trace.shared_parameters):
        return True
    return any(holds_parameters(trace, child) for child in record.children)
