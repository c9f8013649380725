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
A *whole* module (``whole=``: one that tensor parallelism replaces by one distributed module, whose column- and
row-parallel halves pass a sharded intermediate between them) is never expanded: its subtree is one node, and a
manual map that splits it is refused.

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

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning_mp.partition._checks import (
    _ROOT,
    _apply_manual,
    _check_aliases_together,
    _check_manual,
    _check_no_empty_stage,
    _check_num_stages,
    _check_shared_groups,
    _check_stage,
    _check_whole,
    _with_aliases,
)
from lightning_mp.partition._cost import _CostModel, _stage_costs
from lightning_mp.partition._search import _COLLAPSE_SLACK, _auto_stages
from lightning_mp.partition._table import _abbreviate, _parent_of, _render_table, holds_parameters
from lightning_mp.partition._trace import ModelTrace

__all__ = ["TIED_WEIGHTS", "PartitionPlan", "plan"]

TIED_WEIGHTS = ("colocate", "replicate", "auto")

# ``tied_weights="auto"`` replicates only when that lowers the bottleneck stage cost by more than this fraction: a
# copy adds a remote call and a gradient all-reduce per step that the cost model does not see (the example GPT at
# 2 stages, predicted 0.6% better replicated, ran at 0.91x the steps/s; see [Note: tied weights]).
_REPLICATE_GAIN = _COLLAPSE_SLACK


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
    whole: Collection[str] = (),
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
        whole: FQNs of modules whose subtree must lie on one stage (never cut inside), e.g. the modules tensor
            parallelism swaps whole (:func:`lightning_mp.tp.whole_swaps`); unknown names are ignored.

    Returns:
        The :class:`PartitionPlan`.

    Raises:
        ValueError: if ``num_stages < 1``; ``memory_weight`` is outside ``[0, 1]``; a stage is out
            of range; ``manual`` names an unknown module or puts the root off stage 0; the model
            has fewer placeable modules than ``num_stages``; under ``tied_weights="colocate"``, modules sharing
            a parameter end up on different stages; ``manual`` splits a ``whole`` module over stages; or a
            stage ends up with no modules.
    """
    if tied_weights not in TIED_WEIGHTS:
        raise ValueError(f"tied_weights must be one of {TIED_WEIGHTS}, got {tied_weights!r}")
    whole = frozenset(whole).intersection(trace.modules)
    if tied_weights != "auto" or not trace.shared_parameters:
        return _plan(trace, num_stages, memory_weight, manual, auto_partition, default_partition,
                     optimizer_state_factor, replicate=tied_weights == "replicate", whole=whole)
    try:
        colocated = _plan(trace, num_stages, memory_weight, manual, auto_partition, default_partition,
                          optimizer_state_factor, replicate=False, whole=whole)
    except ValueError:  # e.g. a manual map that splits a tie, or too few nodes once ties are merged
        colocated = None
    replicated = _plan(trace, num_stages, memory_weight, manual, auto_partition, default_partition,
                       optimizer_state_factor, replicate=True, whole=whole)
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
    whole: frozenset[str] = frozenset(),
) -> PartitionPlan:
    _check_num_stages(num_stages)
    if not 0.0 <= memory_weight <= 1.0:
        raise ValueError(f"memory_weight must be in [0, 1], got {memory_weight}; use e.g. 0.2")
    _check_stage(default_partition, num_stages, f"default_partition={default_partition!r}")
    if manual:
        _check_manual(trace, manual, num_stages)
        manual = _with_aliases(trace, manual)
    costs = _CostModel(trace, memory_weight, optimizer_state_factor, replicate=replicate, whole=whole)
    if auto_partition:
        stage_of = _auto_stages(costs, num_stages)
    else:
        stage_of = {fqn: default_partition for fqn in trace.modules}
        stage_of[_ROOT] = 0
    if manual:
        stage_of = _apply_manual(trace, stage_of, manual)
    _check_whole(trace, stage_of, whole)
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
