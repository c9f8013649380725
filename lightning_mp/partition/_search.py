"""The search of [Note: partition algorithm] (in ``_plan.py``): finest frontier, coarsening, min-max DP."""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_mp.partition._checks import _ROOT
from lightning_mp.partition._cost import _CostModel, _Item

# Costs are normalised (they sum to about 1); differences below this are float noise.
_TOL = 1e-12
# Expansions of the finest frontier are undone while the bottleneck stage cost stays within this
# fraction of its optimum: splitting a module over stages adds communication the cost model does not see.
_COLLAPSE_SLACK = 0.01


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
