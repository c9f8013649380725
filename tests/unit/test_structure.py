"""The package's structure, checked in one process: the process-group plan and its axis vocabulary, the import
graph (no circle, no upward arrow between layers) and the public surface."""

from __future__ import annotations

import pytest

from lightning_mp.topology import Topology


@pytest.mark.parametrize("placement", ["cluster", "spread", "PDT"])
def test_group_plan_order_and_axis_vocabulary(placement):
    """Every rank plans the same groups in one documented order; each name means one thing: ``dp`` the replicas of
    one (stage, tp rank) (whose group rank is ``Topology.dp_rank``, SMP's rdp_rank), ``dp_tp`` SMP's DP group."""
    from lightning_mp.topology import GroupName, GroupOptions, plan_process_groups

    world, pp, tp = 8, 2, 2
    options = GroupOptions(host=True, order=True, reducer=True)
    plans = [plan_process_groups(Topology(world, r, pp, tp, placement), options) for r in range(world)]
    assert all(plan == plans[0] for plan in plans), "every rank must create the same groups in the same order"
    names = [spec.name for spec in plans[0]]
    order = [GroupName.DP, GroupName.PP, GroupName.TP, GroupName.DP_TP, GroupName.PIPELINE, GroupName.HOST,
             GroupName.ORDER, GroupName.REDUCER]
    assert list(dict.fromkeys(names)) == order
    assert names.count(GroupName.DP) == pp * tp and names.count(GroupName.DP_TP) == pp
    gloo = {GroupName.PIPELINE, GroupName.HOST, GroupName.ORDER}  # CPU control groups; the rest use the device's
    assert all((spec.backend == "gloo") == (spec.name in gloo) for spec in plans[0])
    for rank in range(world):
        topo = Topology(world, rank, pp, tp, placement)
        own = {}
        for spec in plans[0]:
            if rank in spec.ranks:
                assert spec.name not in own, f"rank {rank} is in two {spec.name.value} groups"
                own[spec.name] = spec.ranks
        assert set(own) == set(order)
        assert sorted(own[GroupName.DP]) == sorted(topo.dp_group_ranks())
        assert sorted(own[GroupName.DP]).index(rank) == topo.dp_rank  # strategy.dp_rank == lightning_mp.rdp_rank
        assert list(own[GroupName.PP]) == list(own[GroupName.PIPELINE]) == topo.pp_group_ranks()
        assert own[GroupName.REDUCER] == own[GroupName.DP]
        stage = {r for r in range(world) if Topology(world, r, pp, tp, placement).pp_rank == topo.pp_rank}
        assert set(own[GroupName.DP_TP]) == set(own[GroupName.ORDER]) == stage  # SMP's DP: world / pp ranks
        assert len(own[GroupName.DP_TP]) == world // pp and len(own[GroupName.DP]) == world // (pp * tp)
        assert all(Topology(world, r, pp, tp, placement).dp_rank == topo.dp_rank for r in own[GroupName.TP])
    # what the layout makes pointless is not made: no order group with one rank per stage, no reducer at dp=1
    single = plan_process_groups(Topology(2, 0, 2, 1), options)
    assert {s.name for s in single} == {GroupName.DP, GroupName.PP, GroupName.TP, GroupName.DP_TP, GroupName.PIPELINE,
                                        GroupName.HOST}


# The layers of lightning_mp, lowest first: a module may import its own layer or a lower one, never a higher one.
# Only the last layer imports Lightning; the others are torch-only and usable without a Trainer.
_LAYERS = (
    ("config",),
    ("comm", "partition", "init", "memory"),
    ("pipeline",),
    ("tp",),
    ("nn",),
    ("topology",),  # builds every process group, of comm/ and tp/ included ([Note: process group order])
    ("strategy",),
    ("callbacks", "cli", "smp", ""),  # "" is the package face, lightning_mp/__init__.py
)


_LIGHTNING_LAYER = len(_LAYERS) - 2  # strategy/ and above


def _import_graph() -> dict[str, set[str]]:
    """Module -> the lightning_mp modules it imports (anywhere in the file, except under ``if TYPE_CHECKING:``)."""
    import ast
    import pathlib

    import lightning_mp

    root = pathlib.Path(lightning_mp.__file__).parent
    files = {}
    for path in root.rglob("*.py"):
        parts = ("lightning_mp", *path.relative_to(root).with_suffix("").parts)
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def targets(node: ast.AST, package: str) -> list[str]:
        if isinstance(node, ast.Import):
            return [alias.name for alias in node.names]
        if not isinstance(node, ast.ImportFrom):
            return []
        base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
        module = ".".join(base + ([node.module] if node.module else []))
        return [f"{module}.{a.name}" if f"{module}.{a.name}" in files else module for a in node.names]

    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text())
        type_only = {
            id(n)
            for block in ast.walk(tree)
            if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
            for stmt in block.body
            for n in ast.walk(stmt)
        }
        graph[name] = {
            target
            for node in ast.walk(tree)
            if id(node) not in type_only
            for target in targets(node, package)
            if target == "lightning" or target.startswith(("lightning.", "lightning_mp"))
        }
    return graph


def _layer(module: str) -> int:
    area = module.split(".")[1] if module.count(".") else ""
    return next(index for index, names in enumerate(_LAYERS) if area in names)


def _import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each a list of module names."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:
        order[node] = low[node] = len(order)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in graph:
                continue
            if nxt not in order:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], order[nxt])
        if low[node] == order[node]:
            component = [stack.pop()]
            while component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in order:
            visit(node)
    return cycles


def test_lightning_mp_imports_have_no_cycle_and_no_upward_arrow():
    graph = _import_graph()
    assert _import_cycles(graph) == []
    upward = sorted(
        f"{source} -> {target}"
        for source, targets in graph.items()
        for target in targets
        if (target.startswith("lightning_mp") and _layer(target) > _layer(source))
        or (not target.startswith("lightning_mp") and _layer(source) < _LIGHTNING_LAYER)
    )
    assert upward == []


def test_public_surface_is_grouped_and_moved_names_still_import_with_a_warning():
    import lightning_mp
    from lightning_mp import smp

    assert len(lightning_mp.__all__) == 21 and len(set(lightning_mp.__all__)) == 21
    assert {"PipelineError", "RankFailedError", "PartitionPlan", "RemoteValue"} <= set(lightning_mp.__all__)
    assert not set(smp.__all__) & set(lightning_mp.__all__)
    for name in lightning_mp.__all__:
        assert getattr(lightning_mp, name) is not None
    lightning_mp.__dict__.pop("tp_rank", None)  # a moved name warns on its first use in a process
    with pytest.warns(DeprecationWarning, match=r"`lightning_mp.tp_rank` moved to `lightning_mp.smp.tp_rank`"):
        from lightning_mp import tp_rank
    assert tp_rank is smp.tp_rank
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        lightning_mp.not_a_name  # noqa: B018
