"""Split/merge of microbatches, config and topology validation, wire format, plan checks."""

from __future__ import annotations

import dataclasses
import warnings
from datetime import timedelta
from typing import NamedTuple

import pytest
import torch

from lightning_mp import SMPConfig, SMPStrategy
from lightning_mp.comm._wire import _unpack, gather, pack
from lightning_mp.topology import Topology
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
        ({"pipeline": "1f1b"}, "`pipeline` must be one of 'interleaved', 'simple', 'zero_bubble'"),
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


@pytest.mark.parametrize("rank", range(8))
def test_topology_grid(rank):
    topo = Topology(world_size=8, rank=rank, pipeline_parallel_degree=2, tensor_parallel_degree=1)
    assert topo.data_parallel_degree == 4
    assert topo.global_rank(dp_rank=topo.dp_rank, pp_rank=topo.pp_rank, tp_rank=topo.tp_rank) == rank
    assert rank in topo.pp_group_ranks() and rank in topo.dp_group_ranks()
    assert len(set(topo.pp_group_ranks()) & set(topo.dp_group_ranks())) == 1


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


def test_strategy_takes_fields_or_a_config_and_names_unknown_fields():
    config = SMPConfig(pipeline_parallel_degree=2, microbatches=4, start_method="spawn", _remote_handles=False)
    assert SMPStrategy.from_config(config).config == config
    strategy = SMPStrategy(pipeline_parallel_degree=2, microbatches=4, start_method="spawn", non_split_inputs=["t"])
    assert strategy.config == dataclasses.replace(config, non_split_inputs=("t",), _remote_handles=True)
    with pytest.raises(TypeError, match="unexpected argument `microbatch`. Did you mean `microbatches`"):
        SMPStrategy(microbatch=2)
    with pytest.warns(DeprecationWarning, match=r"`SMPStrategy\(remote_handles=...\)` is deprecated"):
        assert SMPStrategy(remote_handles=False).config._remote_handles is False
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
