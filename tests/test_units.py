"""Tier 1: one process, no process group. Split/merge, config and topology validation, wire format."""

from __future__ import annotations

import dataclasses
import warnings
from datetime import timedelta
from typing import NamedTuple

import pytest
import torch

from lightning_mp import SMPConfig, SMPStrategy
from lightning_mp.topology import Topology
from lightning_mp.comm._wire import _unpack, gather, pack
from lightning_mp.pipeline import MicrobatchSplitError, merge_microbatches, split_microbatches


class Pair(NamedTuple):
    x: torch.Tensor
    label: str


@dataclasses.dataclass
class Inputs:
    ids: torch.Tensor
    mask: torch.Tensor | None
    temperature: float = 1.0


def test_split_recurses_and_replicates_non_tensors():
    batch = {
        "pair": Pair(torch.arange(8).reshape(8, 1), "tag"),
        "inputs": Inputs(torch.arange(16).reshape(8, 2), None, 0.5),
        "list": [torch.ones(8, 3), 7],
        "scalar": torch.tensor(2.0),
    }
    parts = split_microbatches(batch, 4)
    assert len(parts) == 4
    for index, part in enumerate(parts):
        assert part["pair"].label == "tag" and part["list"][1] == 7
        assert torch.equal(part["pair"].x, torch.arange(8).reshape(8, 1)[2 * index : 2 * index + 2])
        assert part["inputs"].ids.shape == (2, 2) and part["inputs"].mask is None
        assert part["inputs"].temperature == 0.5
        assert part["scalar"] is batch["scalar"]


def test_split_cuts_sequences_of_one_value_per_sample_like_dim_0():
    """Strings collated by ``default_collate`` (a list of B) split with the tensors; other lengths stay whole."""
    texts = [f"text {i}" for i in range(8)]
    batch = {"text": texts, "label": torch.arange(8), "ids": tuple(range(8)), "classes": ["neg", "pos"]}
    parts = split_microbatches(batch, 4)
    for index, part in enumerate(parts):
        assert part["text"] == texts[2 * index : 2 * index + 2]
        assert part["ids"] == (2 * index, 2 * index + 1)
        assert torch.equal(part["label"], torch.arange(2 * index, 2 * index + 2))
        assert part["classes"] == ["neg", "pos"], "a list of another length is not per sample"
    only_strings = split_microbatches((texts, ["a"] * 8), 2)  # no tensor: the batch size is the first list's length
    assert only_strings[1] == (texts[4:], ["a"] * 4)
    kept = split_microbatches({"text": texts, "label": torch.arange(8)}, 2, non_split_inputs=["text"])
    assert all(part["text"] is texts for part in kept), "non_split_inputs opts out"
    with pytest.raises(MicrobatchSplitError, match=r"batch\['text'\] \(a list of 6 samples.*into 4 microbatches"):
        split_microbatches({"text": texts[:6]}, 4)


def test_a_batch_in_which_nothing_splits_warns_once_naming_what_was_replicated():
    strategy = SMPStrategy(microbatches=2)
    batch = {"text": "one string", "n": 3}
    with pytest.warns(UserWarning, match=r"Nothing in this batch splits.*batch\['text'\], batch\['n'\]"):
        assert strategy._runner.split(batch, training=True) == [batch, batch]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        strategy._runner.split(batch, training=True)  # once
        SMPStrategy(microbatches=2)._runner.split({"text": ["a", "b"]}, training=True)  # it splits: no warning


def test_split_then_merge_is_identity_for_tensors():
    batch = (torch.randn(12, 3), {"y": torch.arange(12)})
    merged = merge_microbatches(split_microbatches(batch, 3))
    assert torch.equal(merged[0], batch[0]) and torch.equal(merged[1]["y"], batch[1]["y"])


def test_merge_averages_float_scalars_and_sums_counts():
    merged = merge_microbatches(
        [
            {"loss": torch.tensor(1.0), "n": 2, "tokens": torch.tensor(3), "k": 7},
            {"loss": torch.tensor(3.0), "n": 4, "tokens": torch.tensor(5), "k": 7},
        ]
    )
    assert merged["loss"].item() == pytest.approx(2.0)
    assert merged["n"] == 6 and merged["tokens"].item() == 8, "counts add up over microbatches"
    assert merged["k"] == 7, "a constant stays a constant"


def test_merge_none_outputs():
    assert merge_microbatches([None, None]) is None
    with pytest.raises(ValueError, match="Some microbatches returned None"):
        merge_microbatches([torch.tensor(1.0), None])


def test_indivisible_batch_is_a_clear_error():
    with pytest.raises(MicrobatchSplitError, match=r"batch\[0\] with shape \(10, 3\) into 4 microbatches.*drop_last"):
        split_microbatches([torch.zeros(10, 3)], 4)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tensor_parallel_degree": 0}, "`tensor_parallel_degree` must be an integer >= 1, got 0"),
        ({"microbatches": 0}, "`microbatches` must be an integer >= 1, got 0"),
        ({"pipeline": "1f1b"}, "`pipeline` must be 'interleaved' or 'simple'"),
        ({"pipeline_parallel_degree": 2, "partition": {"h.0": 2}}, r"Stage 2 for 'h.0' is out of range: stages are 0..1"),
        ({"memory_weight": 1.5}, r"`memory_weight` must be in \[0, 1\], got 1.5"),
        ({"timeout": timedelta(0)}, "`timeout` must be positive"),
        ({"data_plane": "mpi"}, "`data_plane` must be 'auto', 'gloo' or 'nccl', got 'mpi'"),
    ],
)
def test_config_errors_name_the_value_and_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SMPConfig(**kwargs)
    with pytest.raises(ValueError, match=match):
        SMPStrategy(**kwargs)  # the strategy validates at construction, before any process starts


def test_config_defaults_follow_smp():
    config = SMPConfig(pipeline_parallel_degree=3)
    assert config.effective_memory_weight == 0.2
    assert SMPConfig(optimize="memory").effective_memory_weight == 0.8
    assert config.effective_active_microbatches == 5


def test_strategy_takes_fields_or_a_config_and_names_unknown_fields():
    config = SMPConfig(pipeline_parallel_degree=2, microbatches=4, start_method="spawn", _remote_handles=False)
    assert SMPStrategy.from_config(config).config == config
    strategy = SMPStrategy(pipeline_parallel_degree=2, microbatches=4, start_method="spawn", non_split_inputs=["t"])
    assert strategy.config == dataclasses.replace(config, non_split_inputs=("t",), _remote_handles=True)
    with pytest.raises(TypeError, match="unexpected argument `microbatch`. Did you mean `microbatches`"):
        SMPStrategy(microbatch=2)
    with pytest.raises(TypeError, match="`remote_handles` is no longer an argument"):
        SMPStrategy(remote_handles=False)
    with pytest.raises(ValueError, match="`start_method` must be 'popen', 'spawn' or 'fork', got 'forkserver'"):
        SMPStrategy(start_method="forkserver")
    with pytest.raises(ValueError, match="`replan_on_resume` must be True or False, got 'yes'"):
        SMPConfig(replan_on_resume="yes")


def test_every_config_field_is_written_once_with_its_docstring():
    """SMPConfig is the one place a knob is written: each field has a docstring, and SMPStrategy's signature holds
    only Lightning's plugins (the fields come through ``**fields``)."""
    import ast
    import inspect

    body = ast.parse(inspect.getsource(SMPConfig)).body[0].body
    fields = [node.target.id for node in body if isinstance(node, ast.AnnAssign)]
    documented = [
        node.target.id for node, after in zip(body, body[1:])
        if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
    ]
    assert fields == [f.name for f in dataclasses.fields(SMPConfig)] and documented == fields
    own = set(inspect.signature(SMPStrategy).parameters) - {"fields"}
    assert own == {"accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin"}


@pytest.mark.parametrize("rank", range(8))
def test_topology_grid(rank):
    topo = Topology(world_size=8, rank=rank, pipeline_parallel_degree=2, tensor_parallel_degree=1)
    assert topo.data_parallel_degree == 4
    assert topo.global_rank(dp_rank=topo.dp_rank, pp_rank=topo.pp_rank, tp_rank=topo.tp_rank) == rank
    assert rank in topo.pp_group_ranks() and rank in topo.dp_group_ranks()
    assert len(set(topo.pp_group_ranks()) & set(topo.dp_group_ranks())) == 1


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


def test_topology_rejects_indivisible_world():
    with pytest.raises(ValueError, match=r"World size 3 is not divisible by pipeline_parallel_degree \(2\)"):
        Topology(world_size=3, rank=0, pipeline_parallel_degree=2)


def test_wire_format_round_trip_keeps_structure_dtype_and_flags():
    shared = torch.randn(3, requires_grad=True)
    obj = {
        "float": shared,
        "again": shared,
        "ints": torch.arange(5, dtype=torch.int32),
        "mask": torch.tensor([True, False]),
        "half": torch.randn(2, 2).to(torch.bfloat16),
        "empty": torch.zeros(0, 4),
        "view": torch.randn(4, 4).t(),
        "nested": Inputs(torch.ones(2), None),
        "text": "hi",
    }
    packed = pack(obj)
    data = torch.empty(packed.data_nbytes, dtype=torch.uint8)
    gather(packed, data)
    message = _unpack(packed.payload, data, torch.device("cpu"))
    out = message.obj
    assert out["float"] is out["again"], "one tensor sent twice arrives as one tensor"
    assert message.requires_grad == [t.requires_grad for t in packed.tensors]
    for key in ("float", "ints", "mask", "half", "empty", "view"):
        assert out[key].dtype == obj[key].dtype and torch.equal(out[key], obj[key].detach()), key
    assert isinstance(out["nested"], Inputs) and out["text"] == "hi"


def test_unpicklable_value_is_a_clear_error():
    with pytest.raises(TypeError, match="Cannot send .* between pipeline stages"):
        pack({"fn": lambda x: x})


def test_a_stage_without_parameters_is_rejected_before_training():
    from torch import nn

    from lightning_mp.partition import plan, trace
    from lightning_mp.strategy._placement import _check_every_stage_has_parameters

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    model_trace = trace(model, lambda: model(torch.randn(2, 4)))
    stages = plan(model_trace, 2, manual={"1": 1})
    with pytest.raises(ValueError, match=r"Pipeline stage\(s\) \[1\] would hold no parameters"):
        _check_every_stage_has_parameters(stages, model_trace)


def test_saved_plans_are_checked_against_the_model(tmp_path):
    import json

    from torch import nn

    from lightning_mp.partition import plan, trace
    from lightning_mp.strategy._placement import load_plan

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    saved = plan(trace(model, lambda: model(torch.randn(2, 4))), 2)
    (tmp_path / "partition.json").write_text(json.dumps(saved.to_dict()))
    assert load_plan(str(tmp_path), model, 2) == saved, "the log folder PartitionSummary wrote to"
    assert load_plan(str(tmp_path / "partition.json"), model, 2) == saved
    with pytest.raises(ValueError, match="has 2 stages but pipeline_parallel_degree=4"):
        load_plan(str(tmp_path / "partition.json"), model, 4)
    with pytest.raises(ValueError, match=r"is for another model: modules missing from it \['2'\]"):
        load_plan(str(tmp_path / "partition.json"), nn.Sequential(*model, nn.ReLU()), 2)
    with pytest.raises(FileNotFoundError, match="No partition plan"):
        load_plan(str(tmp_path / "nothing.json"), model, 2)


def _mesh_group_waits_for_timeout(rank: int, world_size: int, flag: str) -> str | bool:
    import os
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from lightning_mp.topology import MeshAxis, build_device_mesh

    mesh = build_device_mesh(Topology(world_size=2, rank=rank), "cpu", timedelta(seconds=2))
    group = mesh.get_group(MeshAxis.DP.value)
    if rank == 1:  # never joins; stays alive until rank 0 gave up (or 30 s): was rank 0's error a timeout?
        deadline = time.monotonic() + 30
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.1)
        return os.path.exists(flag)
    try:
        dist.all_reduce(torch.ones(1), group=group)
        return "no error"
    except RuntimeError as err:
        return str(err)
    finally:
        open(flag, "w").close()


def test_device_mesh_groups_use_the_strategy_timeout(tmp_path):
    """With torch's default (30 min) rank 0 would fail only when rank 1 exits; with the mesh's 2 s it fails first."""
    from tests._dist import run_distributed

    error, peer_was_alive = run_distributed(_mesh_group_waits_for_timeout, 2, str(tmp_path / "flag"), start_method="fork")
    assert peer_was_alive is True, "rank 0 gave up only after its peer left: not the mesh group's timeout"
    assert "timed out" in error.lower() or "timeout" in error.lower(), error


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

    assert len(lightning_mp.__all__) == 20 and len(set(lightning_mp.__all__)) == 20
    assert {"PipelineError", "PartitionPlan", "RemoteValue"} <= set(lightning_mp.__all__)
    assert not set(smp.__all__) & set(lightning_mp.__all__)
    for name in lightning_mp.__all__:
        assert getattr(lightning_mp, name) is not None
    lightning_mp.__dict__.pop("tp_rank", None)  # a moved name warns on its first use in a process
    with pytest.warns(DeprecationWarning, match=r"`lightning_mp.tp_rank` moved to `lightning_mp.smp.tp_rank`"):
        from lightning_mp import tp_rank
    assert tp_rank is smp.tp_rank
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        lightning_mp.not_a_name  # noqa: B018



def _built_groups(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from lightning_mp.topology import GroupOptions, build_process_groups, plan_process_groups
    from lightning_mp.tp import dp_rank, dp_size, rdp_rank, rdp_size

    topology = Topology(world_size, rank, pipeline_parallel_degree=1, tensor_parallel_degree=2)
    options = GroupOptions(host=True, order=True, reducer=True)
    groups = build_process_groups(topology, "cpu", timedelta(seconds=30), options)
    built = {name: groups.mesh.get_group(name) for name in ("dp", "pp", "tp")}
    built |= {name: getattr(groups, name) for name in ("dp_tp", "pipeline", "host", "order", "reducer")}
    planned = {spec.name.value: list(spec.ranks) for spec in plan_process_groups(topology, options) if rank in spec.ranks}
    smp = groups.smp_groups()
    return {
        "built": {name: dist.get_process_group_ranks(group) for name, group in built.items()},
        "planned": planned,
        "smp": (dp_rank(smp), dp_size(smp), rdp_rank(smp), rdp_size(smp)),
        "dp_rank": topology.dp_rank,
    }


def test_built_groups_are_the_planned_ones_and_smp_names_map_onto_them():
    """At (dp, pp, tp) = (2, 1, 2): each group this rank holds has the planned ranks; SMP's DP is ``dp_tp`` (every
    rank of the stage) and SMP's RDP the ``dp`` axis, so ``rdp_rank`` is the strategy's ``dp_rank``."""
    from tests._dist import run_distributed

    results = run_distributed(_built_groups, 4, start_method="fork")
    for rank, result in enumerate(results):
        assert result["built"].keys() == result["planned"].keys()
        for name, ranks in result["planned"].items():
            assert result["built"][name] == sorted(ranks), (rank, name)
        assert result["smp"] == (rank, 4, result["dp_rank"], 2)
