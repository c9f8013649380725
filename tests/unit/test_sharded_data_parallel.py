"""Sharded data parallelism in one process: the config's and the layout's errors (before any process or collective),
the HSDP groups in the process-group plan, and FSDP2's wrapping units of a stage."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_mp import SMPConfig, SMPStrategy
from lightning_mp.strategy._fsdp import check_fsdp_api, mixed_precision_policy, wrapping_units
from lightning_mp.topology import GroupName, Topology, plan_process_groups
from tests.models import TinyLM


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"sharded_data_parallel_degree": 0}, "`sharded_data_parallel_degree` must be an integer >= 1, got 0"),
        (
            {"sharded_data_parallel_degree": 2, "shard_optimizer_state": True},
            r"shard_optimizer_state=True \(ZeRO-1\) cannot be combined with sharded_data_parallel_degree=2.*Drop",
        ),
        (
            {"sharded_data_parallel_degree": 2, "pipeline_parallel_degree": 2, "reshard_after_forward": "always"},
            r"reshard_after_forward='always' needs pipeline_parallel_degree=1, got 2: .*engine threads.*order that can "
            r"differ.*Use reshard_after_forward='never'",
        ),
        ({"reshard_after_forward": True}, r"`reshard_after_forward` must be 'default', 'always' or 'never', got True"),
        (
            {"sharded_data_parallel_degree": 2, "tensor_parallel_degree": 2, "reshard_after_forward": "always"},
            r"reshard_after_forward='always' does not compose with tensor_parallel_degree=2 yet.*'never'",
        ),
    ],
)
def test_config_errors_name_the_value_and_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SMPConfig(**kwargs)
    with pytest.raises(ValueError, match=match):
        SMPStrategy(**kwargs)


@pytest.mark.parametrize(
    ("pp", "setting", "per_unit"),
    [(1, "default", False), (2, "default", False), (1, "always", True), (1, "never", False), (2, "never", False)],
)
def test_reshard_after_forward_is_per_unit_only_when_asked(pp, setting, per_unit):
    """Per-unit gathers only with ``"always"`` (at pp=1); the default gathers once per step on every layout."""
    config = SMPConfig(pipeline_parallel_degree=pp, sharded_data_parallel_degree=2, reshard_after_forward=setting)
    assert config.reshards_after_forward is per_unit


def test_shard_degree_must_divide_the_data_parallel_degree():
    with pytest.raises(ValueError, match=r"sharded_data_parallel_degree=3 does not divide the data-parallel degree 4"):
        Topology(8, 0, 2, 1, "cluster", 3)
    assert Topology(8, 0, 2, 1, "cluster", 2).dp_replicate_degree == 2


def test_hsdp_groups_unflatten_the_replicas():
    """dp=4 (pp=2, 8 ranks) as 2 replicas of shard groups of 2: each rank's dp_shard and dp_replicate lines cross at
    it, their product is its dp group, and shard groups hold neighbouring replicas (dp ranks 2r, 2r+1)."""
    world, pp = 8, 2
    plans = [plan_process_groups(Topology(world, r, pp, 1, "cluster", 2)) for r in range(world)]
    assert all(plan == plans[0] for plan in plans)
    for rank in range(world):
        topo = Topology(world, rank, pp, 1, "cluster", 2)
        own = {spec.name: spec.ranks for spec in plans[0] if rank in spec.ranks}
        shard, replicate = own[GroupName.DP_SHARD], own[GroupName.DP_REPLICATE]
        assert len(shard) == 2 and len(replicate) == 2 and set(shard) & set(replicate) == {rank}
        assert {a for a in shard} | {b for b in replicate} <= set(own[GroupName.DP])
        dp_ranks = [Topology(world, r, pp, 1).dp_rank for r in shard]
        assert dp_ranks == [2 * (topo.dp_rank // 2), 2 * (topo.dp_rank // 2) + 1]
    no_hsdp = plan_process_groups(Topology(world, 0, pp, 1, "cluster", 4))  # sdp == dp: FSDP over the dp axis
    assert not {GroupName.DP_SHARD, GroupName.DP_REPLICATE} & {spec.name for spec in no_hsdp}


def test_wrapping_units_are_the_outermost_blocks_and_partitioned_subtrees():
    model = nn.Module()
    model.net = TinyLM(depth=3)
    stage_of = {"": 0, "net": 0, "net.embed": 0, "net.blocks": 0, "net.head": 1}
    stage_of.update({f"net.blocks.{i}": i // 2 for i in range(3)})
    stage_of.update({f"net.blocks.{i}.{j}": i // 2 for i in range(3) for j in range(3)})
    assert wrapping_units(model, stage_of, 0) == ["net.blocks.0", "net.blocks.1"]  # each a Sequential: its layers
    assert wrapping_units(model, stage_of, 1) == ["net.blocks.2"]  # the head shares the embedding's weight
    model.net.head.weight = nn.Parameter(model.net.head.weight.detach().clone())  # untied
    assert wrapping_units(model, stage_of, 1) == ["net.blocks.2", "net.head"]  # a subtree under stage 0
    model.net.blocks[2] = nn.Sequential(nn.Sequential(nn.Linear(2, 2)))
    assert wrapping_units(model, {}, 0) == ["net.blocks.0", "net.blocks.1", "net.blocks.2"]


def test_the_fsdp2_internals_sharding_drives_exist_and_their_absence_is_named(monkeypatch):
    """A torch upgrade that drops a private FSDP2 API fails here (and at launch, before any process), not midway
    through setup."""
    check_fsdp_api()  # this torch has them all
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    monkeypatch.delattr(FSDPParamGroup, "wait_for_unshard")
    with pytest.raises(ValueError, match=r"lacks: FSDPParamGroup.wait_for_unshard\. .*torch 2.13"):
        check_fsdp_api()


@pytest.mark.parametrize(
    ("precision", "param_dtype", "reduce_dtype"),
    [
        ("bf16-mixed", torch.bfloat16, torch.float32),
        ("16-mixed", torch.float16, torch.float32),  # Lightning turns it into bf16-mixed on CPU: not fit here
        ("32-true", None, None),
        ("bf16-true", None, None),  # the module is bf16 already: nothing to cast
    ],
)
def test_the_fsdp_policy_follows_lightnings_precision_plugin(precision, param_dtype, reduce_dtype):
    policy = mixed_precision_policy(precision)
    assert (policy.param_dtype, policy.reduce_dtype) == (param_dtype, reduce_dtype)
