"""lightning_mp.partition: tracing and planning in one process, no Lightning."""

from __future__ import annotations

import itertools
import json
import random

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.flop_counter import FlopCounterMode

from lightning_mp.partition import ModelTrace, PartitionPlan, plan, stage_costs, trace
from lightning_mp.partition._search import _COLLAPSE_SLACK

BATCH = 4


# ----------------------------------------------------------------------------- helpers


def _trace_forward(model: nn.Module, x: torch.Tensor) -> ModelTrace:
    return trace(model, lambda: model(x))


def _memory(tr: ModelTrace, fqn: str, optimizer_state_factor: float = 3.0) -> float:
    """Parameter bytes x optimizer-state factor + output bytes for a leaf (SMP's memory cost)."""
    record = tr.modules[fqn]
    return record.param_bytes * optimizer_state_factor + (0 if record.children else record.activation_bytes)


def _layer_costs(tr: ModelTrace, fqns: list[str], memory_weight: float) -> list[float]:
    """Costs as the planner defines them, for whole-subtree nodes of leaf modules."""
    total_memory = sum(_memory(tr, f) for f in tr.modules)
    return [
        (1 - memory_weight) * tr.modules[f].flops / tr.total_flops
        + memory_weight * _memory(tr, f) / total_memory
        for f in fqns
    ]


def _best_contiguous_split(costs: list[float], num_parts: int) -> tuple[list[int], float, int]:
    """Brute force over every cut of ``costs`` into ``num_parts`` non-empty contiguous parts.

    Returns the part index of each element for a best cut, its largest part, and how many cuts
    reach that optimum.
    """
    results = []
    for cuts in itertools.combinations(range(1, len(costs)), num_parts - 1):
        bounds = [0, *cuts, len(costs)]
        parts = [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]
        stages = [s for s, (a, b) in enumerate(zip(bounds, bounds[1:])) for _ in range(a, b)]
        results.append((max(parts), stages))
    optimum, stages = min(results, key=lambda r: r[0])
    return stages, optimum, sum(r[0] == optimum for r in results)


def _check_plan_invariants(model: nn.Module, tr: ModelTrace, p: PartitionPlan) -> None:
    names = [name for name, _ in model.named_modules(remove_duplicate=False)]
    assert list(p.stage_of) == names  # every module exactly once, in named_modules order
    assert p.stage_of[""] == 0
    assert set(p.stage_of.values()) == set(range(p.num_stages))  # no empty stage
    assert sum(p.stage_costs) == pytest.approx(1.0)
    for group in tr.shared_groups:
        assert len({p.stage_of[m] for m in group}) == 1, group


def _check_contiguous(tr: ModelTrace, p: PartitionPlan) -> None:
    called = sorted((r.first_call, f) for f, r in tr.modules.items() if r.first_call is not None)
    stages = [p.stage_of[f] for _, f in called]
    assert stages == sorted(stages), f"stages in call order are not contiguous: {stages}"


class Chain(nn.Module):
    """Calls the modules of a ModuleList one after another (the ModuleList itself is not called)."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.proj = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, C)
        return x + self.proj(F.gelu(self.fc(self.ln(x))))


class TinyGPT(nn.Module):
    """nanoGPT-shaped model with the LM head tied to the token embedding."""

    def __init__(self, vocab: int = 64, dim: int = 16, num_layers: int = 6, seq: int = 8) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(vocab, dim),
                wpe=nn.Embedding(seq, dim),
                h=nn.ModuleList([Block(dim) for _ in range(num_layers)]),
                ln_f=nn.LayerNorm(dim),
            )
        )
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.transformer.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, V)
        t = self.transformer
        x = t.wte(idx) + t.wpe(torch.arange(idx.shape[1]))  # (B, T, C)
        for block in t.h:
            x = block(x)
        return self.lm_head(t.ln_f(x))


def _gpt_trace(num_layers: int = 6) -> tuple[TinyGPT, ModelTrace]:
    model = TinyGPT(num_layers=num_layers)
    idx = torch.randint(0, 64, (BATCH, 8))

    def training_step() -> torch.Tensor:
        logits = model(idx)
        return F.cross_entropy(logits.flatten(0, 1), idx.flatten())

    return model, trace(model, training_step)


# ----------------------------------------------------------------------------- trace


def test_trace_records_tree_calls_bytes_and_flops() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    tr = _trace_forward(model, torch.randn(BATCH, 8))
    assert list(tr.modules) == ["", "0", "1", "2"]
    assert tr.modules[""].children == ["0", "1", "2"]
    assert tr.modules["0"].parent == "" and tr.modules[""].parent is None
    assert [tr.modules[f].first_call for f in tr.modules] == [0, 1, 2, 3]
    assert all(r.num_calls == 1 for r in tr.modules.values())
    for fqn in ("0", "2"):
        layer = model[int(fqn)]
        expected_bytes = sum(t.numel() * t.element_size() for t in layer.parameters())
        assert tr.modules[fqn].param_bytes == expected_bytes
        assert tr.modules[fqn].num_params == sum(t.numel() for t in layer.parameters())
        assert tr.modules[fqn].flops == 2 * BATCH * layer.in_features * layer.out_features
    assert tr.modules[""].flops == tr.modules["0"].flops + tr.modules["2"].flops
    assert tr.total_flops == tr.modules[""].flops
    assert tr.shared_groups == []


def test_trace_removes_hooks_and_leaves_model_unchanged() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _trace_forward(model, torch.randn(BATCH, 4))
    for module in model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key])


def test_trace_counts_work_outside_modules_in_total() -> None:
    model = nn.Linear(8, 8)
    x = torch.randn(BATCH, 8)
    tr = trace(model, lambda: model(x) @ x.T)  # the matmul runs outside any module
    with FlopCounterMode(display=False) as counter:
        _ = x @ x.T
    assert tr.total_flops == tr.modules[""].flops + counter.get_total_flops()


def test_submodule_called_twice_counts_calls_and_flops_twice() -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layer(self.layer(x))

    model = Twice()
    x = torch.randn(BATCH, 8)
    with FlopCounterMode(display=False) as counter:
        model.layer(x)
    tr = _trace_forward(model, x)
    assert tr.modules["layer"].num_calls == 2
    assert tr.modules["layer"].first_call == 1
    assert tr.modules["layer"].flops == 2 * counter.get_total_flops()


def test_trace_failure_raises_runtime_error_and_removes_hooks() -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(RuntimeError, match="tracing the model failed") as info:
        trace(model, lambda: model(torch.randn(BATCH, 5)))
    assert isinstance(info.value.__cause__, RuntimeError)
    assert not model[0]._forward_hooks and not model[0]._forward_pre_hooks


def test_trace_on_meta_device() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)).to("meta")
    tr = _trace_forward(model, torch.randn(BATCH, 8, device="meta"))
    assert tr.modules["1"].flops == 2 * BATCH * 8 * 2
    assert tr.modules["0"].param_bytes == (8 * 8 + 8) * torch.float32.itemsize


def test_tied_weights_form_a_shared_group_and_count_once() -> None:
    model, tr = _gpt_trace()
    assert tr.shared_groups == [["transformer.wte", "lm_head"]]
    wte = model.transformer.wte.weight
    assert tr.modules["transformer.wte"].param_bytes == wte.numel() * wte.element_size()
    assert tr.modules["lm_head"].param_bytes == 0
    total = sum(r.num_params for r in tr.modules.values())
    assert total == sum(p.numel() for p in model.parameters())  # parameters() deduplicates


# ----------------------------------------------------------------------------- plan: exact


def test_four_equal_layers_on_two_stages_split_two_and_two() -> None:
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    tr = _trace_forward(model, torch.randn(BATCH, 8))
    p = plan(tr, 2)
    assert p.stage_of == {"": 0, "0": 0, "1": 0, "2": 1, "3": 1}
    assert p.stage_costs == pytest.approx((0.5, 0.5))
    assert p.modules_on(0) == [""]
    assert p.modules_on(1) == ["2", "3"]


@pytest.mark.parametrize("memory_weight", [0.0, 0.2, 1.0])
def test_three_unequal_layers_follow_the_min_max_split(memory_weight: float) -> None:
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 16), nn.Linear(16, 16))
    tr = _trace_forward(model, torch.randn(BATCH, 32))
    layers = ["0", "1", "2"]
    costs = _layer_costs(tr, layers, memory_weight)
    stages, optimum, num_optimal = _best_contiguous_split(costs, 2)
    assert num_optimal == 1  # the expected split is unique
    p = plan(tr, 2, memory_weight=memory_weight)
    assert [p.stage_of[f] for f in layers] == stages
    assert p.stage_of[""] == 0
    assert max(p.stage_costs) == pytest.approx(optimum)


def test_single_stage_holds_everything() -> None:
    model, tr = _gpt_trace()
    p = plan(tr, 1)
    assert set(p.stage_of.values()) == {0}
    assert p.stage_costs == (pytest.approx(1.0),)
    assert p.modules_on(0) == [""]


def test_expansion_reaches_into_nested_containers() -> None:
    inner = [nn.Linear(8, 8) for _ in range(4)]
    model = nn.Sequential(nn.Sequential(*inner[:2]), nn.Sequential(*inner[2:]))
    tr = _trace_forward(model, torch.randn(BATCH, 8))
    p = plan(tr, 4)
    _check_plan_invariants(model, tr, p)
    _check_contiguous(tr, p)
    leaf_stages = [p.stage_of[f] for f in ("0.0", "0.1", "1.0", "1.1")]
    assert leaf_stages == [0, 1, 2, 3]  # four equal leaves, one per stage


def _finest_optimum(tr: ModelTrace, num_stages: int) -> float:
    """Reference: min-max contiguous split of every module's own cost in ``named_modules`` order.

    That order is the planner's finest frontier (every leaf and every residual) when modules are
    called in definition order and share no parameters. Plain O(stages x n^2) DP.
    """
    own = stage_costs(tr, {fqn: i for i, fqn in enumerate(tr.modules)}, len(tr.modules))
    prefix = list(itertools.accumulate(own, initial=0.0))
    n = len(own)
    best = [prefix[i] if i else float("inf") for i in range(n + 1)]
    for parts in range(2, num_stages + 1):
        best = [
            min((max(best[p], prefix[i] - prefix[p]) for p in range(parts - 1, i)), default=float("inf"))
            for i in range(n + 1)
        ]
    return best[n]


def test_expansion_passes_through_containers_with_one_called_child() -> None:
    # Chain -> layers (a ModuleList, never called) -> six Linear: splitting the Chain only pays off
    # two levels down, as in nn.TransformerEncoder -> layers -> layers.i.
    model = nn.Sequential(nn.Linear(16, 16), Chain([nn.Linear(16, 16) for _ in range(6)]))
    tr = _trace_forward(model, torch.randn(BATCH, 16))
    for num_stages in (2, 3, 4):
        p = plan(tr, num_stages)
        _check_plan_invariants(model, tr, p)
        _check_contiguous(tr, p)
        assert max(p.stage_costs) == pytest.approx(_finest_optimum(tr, num_stages))
    p = plan(tr, 2)
    assert {p.stage_of[f"1.layers.{i}"] for i in range(6)} == {0, 1}  # the Chain is split


def _pairs_trace(num_pairs: int) -> tuple[nn.Module, ModelTrace, list[str]]:
    """Sequential of Sequential pairs of equal Linear layers; returns the leaf FQNs too."""
    model = nn.Sequential(
        *[nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)) for _ in range(num_pairs)]
    )
    leaves = [f"{i}.{j}" for i in range(num_pairs) for j in range(2)]
    return model, _trace_forward(model, torch.randn(BATCH, 8)), leaves


def test_splits_a_container_when_that_lowers_the_bottleneck() -> None:
    model, tr, leaves = _pairs_trace(3)
    p = plan(tr, 2)  # whole pairs give 2/3 of the cost on one stage; leaves allow 1/2
    per_stage = len(leaves) // 2
    assert [p.stage_of[f] for f in leaves] == [i // per_stage for i in range(len(leaves))]
    assert p.stage_costs == pytest.approx((0.5, 0.5))
    _check_plan_invariants(model, tr, p)


def test_splits_containers_when_several_stages_tie_at_the_bottleneck() -> None:
    num_stages = 4
    model, tr, leaves = _pairs_trace(6)  # whole pairs: two stages tie at 2 pairs (1/3)
    p = plan(tr, num_stages)
    per_stage = len(leaves) // num_stages
    assert [p.stage_of[f] for f in leaves] == [i // per_stage for i in range(len(leaves))]
    assert p.stage_costs == pytest.approx((1 / num_stages,) * num_stages)
    _check_contiguous(tr, p)


def test_does_not_split_containers_that_need_no_split() -> None:
    model, tr, leaves = _pairs_trace(4)
    p = plan(tr, 2)
    for i in range(4):
        assert p.stage_of[f"{i}.0"] == p.stage_of[f"{i}.1"] == p.stage_of[str(i)]


def test_root_never_called_as_module_still_on_stage_zero() -> None:
    model = nn.ModuleDict(dict(enc=nn.Linear(8, 8), dec=nn.Linear(8, 8)))
    x = torch.randn(BATCH, 8)
    tr = trace(model, lambda: model["dec"](model["enc"](x)).sum())
    assert tr.modules[""].first_call is None
    p = plan(tr, 2)
    assert p.stage_of == {"": 0, "enc": 0, "dec": 1}


def test_tied_gpt_keeps_embedding_and_head_together() -> None:
    model, tr = _gpt_trace()
    for num_stages in range(1, 9):
        p = plan(tr, num_stages)
        _check_plan_invariants(model, tr, p)
        assert p.stage_of["transformer.wte"] == p.stage_of["lm_head"]


def test_gpt_blocks_are_balanced_on_stages() -> None:
    num_layers = 6
    model, tr = _gpt_trace(num_layers)
    p = plan(tr, 3)
    _check_plan_invariants(model, tr, p)
    blocks = [p.stage_of[f"transformer.h.{i}"] for i in range(num_layers)]
    assert blocks == sorted(blocks)
    assert p.stage_of["transformer.ln_f"] == blocks[-1]
    assert max(p.stage_costs) < 1.0 / 3 + max(_layer_costs(tr, ["transformer.h.0"], 0.2))


def test_data_dependent_branch_not_taken_stays_with_parent() -> None:
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pre = nn.Linear(8, 8)
            self.pos = nn.Linear(8, 8)
            self.neg = nn.Linear(8, 8)
            self.post = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.pre(x)
            x = self.pos(x) if x.sum() > 0 else self.neg(x)
            return self.post(x)

    model = Branchy()
    with torch.no_grad():
        model.pre.weight.fill_(1.0)
        model.pre.bias.zero_()
    for sign, taken, skipped in ((1.0, "pos", "neg"), (-1.0, "neg", "pos")):
        tr = _trace_forward(model, torch.full((BATCH, 8), sign))
        assert tr.modules[taken].num_calls == 1
        assert tr.modules[skipped].num_calls == 0 and tr.modules[skipped].first_call is None
        p = plan(tr, 3)
        _check_plan_invariants(model, tr, p)
        assert p.stage_of[skipped] == p.stage_of[""]
        assert [p.stage_of[f] for f in ("pre", taken, "post")] == [0, 1, 2]


def test_plan_is_deterministic() -> None:
    torch.manual_seed(0)
    model, tr = _gpt_trace()
    first = plan(tr, 4)
    torch.manual_seed(0)
    _, tr_again = _gpt_trace()
    assert plan(tr, 4) == first
    assert plan(tr_again, 4) == first


# ----------------------------------------------------------------------------- plan: random trees


def _random_tree(
    rng: random.Random, dim: int, depth: int, top: bool = True
) -> tuple[nn.Module, int]:
    """A random nest of Sequential / Chain(ModuleList) of Linear; returns (module, out dim)."""
    if depth == 0 or (not top and rng.random() < 0.3):
        out = rng.choice([4, 8, 16, 32])
        return nn.Linear(dim, out), out
    children = []
    for _ in range(rng.randint(1, 4)):
        child, dim = _random_tree(rng, dim, depth - 1, top=False)
        children.append(child)
    container = nn.Sequential(*children) if rng.random() < 0.5 else Chain(children)
    return container, dim


def _tie_two_same_shape_layers(rng: random.Random, model: nn.Module) -> None:
    by_shape: dict[tuple[int, int], list[nn.Linear]] = {}
    for module in model.modules():
        if isinstance(module, nn.Linear):
            by_shape.setdefault(tuple(module.weight.shape), []).append(module)
    for layers in by_shape.values():
        if len(layers) >= 2:
            first, second = rng.sample(layers, 2)
            second.weight = first.weight
            return


@pytest.mark.parametrize("seed", range(40))
def test_random_trees_give_valid_plans(seed: int) -> None:
    rng = random.Random(seed)
    in_dim = rng.choice([4, 8, 16])
    model, _ = _random_tree(rng, in_dim, depth=3)
    model = nn.Sequential(model, nn.Linear(_out_dim(model, in_dim), 8))
    tied = seed % 3 == 0
    if tied:
        _tie_two_same_shape_layers(rng, model)
    tr = _trace_forward(model, torch.randn(BATCH, in_dim))
    num_modules = len(tr.modules)  # every module is called or holds called modules
    for num_stages in range(1, 9):
        if not tied and num_stages > num_modules:
            with pytest.raises(ValueError, match=f"only {num_modules} placeable modules"):
                plan(tr, num_stages)
            break
        try:
            p = plan(tr, num_stages)
        except ValueError as error:
            assert tied and "placeable modules" in str(error)
            break
        _check_plan_invariants(model, tr, p)
        if not tied:
            _check_contiguous(tr, p)


@pytest.mark.parametrize("seed", range(40))
def test_random_trees_reach_the_finest_optimum_within_the_collapse_slack(seed: int) -> None:
    rng = random.Random(seed)
    in_dim = rng.choice([4, 8, 16])
    model, _ = _random_tree(rng, in_dim, depth=3)
    model = nn.Sequential(model, nn.Linear(_out_dim(model, in_dim), 8))
    tr = _trace_forward(model, torch.randn(BATCH, in_dim))
    for num_stages in range(2, min(8, len(tr.modules)) + 1):
        p = plan(tr, num_stages)
        assert max(p.stage_costs) <= _finest_optimum(tr, num_stages) * (1 + _COLLAPSE_SLACK) + 1e-12


def _out_dim(model: nn.Module, in_dim: int) -> int:
    with torch.no_grad():
        return model(torch.zeros(1, in_dim)).shape[-1]


# ----------------------------------------------------------------------------- manual placement


def _seq_trace(num_layers: int = 4) -> tuple[nn.Module, ModelTrace]:
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(num_layers)])
    return model, _trace_forward(model, torch.randn(BATCH, 8))


def test_manual_placement_innermost_entry_wins() -> None:
    model, tr = _seq_trace()
    p = plan(tr, 2, manual={"0": 1, "0.1": 0, "3": 0, "2": 1})
    assert p.stage_of["0"] == 1 and p.stage_of["0.0"] == 1
    assert p.stage_of["0.1"] == 0
    assert p.stage_of["3"] == 0 and p.stage_of["3.0"] == 0
    assert p.stage_of["2.0"] == 1


def test_manual_only_uses_default_partition() -> None:
    model, tr = _seq_trace()
    p = plan(tr, 3, manual={"1": 2, "2": 0}, auto_partition=False, default_partition=1)
    assert p.stage_of[""] == 0
    assert p.stage_of["0"] == 1 and p.stage_of["0.0"] == 1 and p.stage_of["3.1"] == 1
    assert p.stage_of["1.0"] == 2 and p.stage_of["2.1"] == 0
    _check_plan_invariants(model, tr, p)


def test_manual_stage_out_of_range() -> None:
    _, tr = _seq_trace()
    with pytest.raises(ValueError, match=r"'1' -> 5 is not a valid stage for num_stages=2.*0\.\.1"):
        plan(tr, 2, manual={"1": 5})


def test_manual_unknown_module_suggests_close_names() -> None:
    _, tr = _gpt_trace()
    with pytest.raises(ValueError, match=r"unknown module 'transformer\.h\.10'.*'transformer\.h"):
        plan(tr, 2, manual={"transformer.h.10": 1})


def test_manual_split_of_shared_group() -> None:
    _, tr = _gpt_trace()
    expected = r"share parameters.*'transformer\.wte' -> 0.*'lm_head' -> 1"
    with pytest.raises(ValueError, match=expected):
        plan(tr, 2, manual={"transformer.wte": 0, "lm_head": 1})


def test_manual_root_off_stage_zero() -> None:
    _, tr = _seq_trace()
    with pytest.raises(ValueError, match=r"root module \(''\) on stage 1"):
        plan(tr, 2, manual={"": 1})


def test_manual_leaves_a_stage_empty() -> None:
    _, tr = _seq_trace()
    with pytest.raises(ValueError, match="stage 2 has no modules"):
        plan(tr, 3, manual={"1": 1}, auto_partition=False)


# ----------------------------------------------------------------------------- argument errors


def test_too_many_stages() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    tr = _trace_forward(model, torch.randn(BATCH, 4))
    num_nodes = len(tr.modules)  # the root plus two leaves
    with pytest.raises(ValueError, match=f"cannot place {num_nodes + 1} stages.*only {num_nodes}"):
        plan(tr, num_nodes + 1)


@pytest.mark.parametrize("num_stages", [0, -1])
def test_num_stages_must_be_positive(num_stages: int) -> None:
    _, tr = _seq_trace()
    with pytest.raises(ValueError, match=f"num_stages must be an integer >= 1, got {num_stages}"):
        plan(tr, num_stages)


@pytest.mark.parametrize("memory_weight", [-0.1, 1.5])
def test_memory_weight_range(memory_weight: float) -> None:
    _, tr = _seq_trace()
    expected = rf"memory_weight must be in \[0, 1\], got {memory_weight}"
    with pytest.raises(ValueError, match=expected):
        plan(tr, 2, memory_weight=memory_weight)


def test_modules_on_rejects_bad_stage() -> None:
    _, tr = _seq_trace()
    with pytest.raises(ValueError, match="stage 2.*num_stages=2"):
        plan(tr, 2).modules_on(2)


# ----------------------------------------------------------------------------- plan object


def test_to_dict_from_dict_roundtrip_through_json() -> None:
    _, tr = _gpt_trace()
    p = plan(tr, 3)
    again = PartitionPlan.from_dict(json.loads(json.dumps(p.to_dict())))
    assert again == p


def test_from_dict_rejects_missing_keys() -> None:
    with pytest.raises(ValueError, match="lacks.*stage_costs"):
        PartitionPlan.from_dict({"num_stages": 1, "stage_of": {"": 0}})


def test_format_table_mentions_every_stage_and_abbreviates() -> None:
    num_layers = 12
    _, tr = _gpt_trace(num_layers)
    num_stages = 3
    p = plan(tr, num_stages)
    table = p.format_table(tr)
    lines = table.splitlines()
    assert len(lines) == 2 + num_stages
    for stage, line in enumerate(lines[2:]):
        assert line.split("|")[0].strip() == str(stage)
        assert f"{100 * p.stage_costs[stage]:.1f}%" in line
    assert "modules)" in table  # runs of blocks are abbreviated
    total_params = sum(r.num_params for r in tr.modules.values())
    shown = sum(int(line.split("|")[2].strip().replace(",", "")) for line in lines[2:])
    assert shown == total_params


# ----------------------------------------------------------------------------- trace: memory and time


def test_activation_bytes_are_the_outputs_of_each_call() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    tr = _trace_forward(model, torch.randn(BATCH, 8))
    assert tr.modules["0"].activation_bytes == BATCH * 16 * 4
    assert tr.modules["2"].activation_bytes == BATCH * 4 * 4
    assert tr.modules[""].activation_bytes == BATCH * 4 * 4


def test_measured_times_are_inclusive_and_make_the_trace_timed() -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    tr = trace(model, lambda: model(torch.randn(BATCH, 64)), measure_time=True)
    assert tr.timed and tr.total_time_s > 0
    children = tr.modules["0"].time_s + tr.modules["1"].time_s
    assert 0 < children <= tr.modules[""].time_s <= tr.total_time_s
    assert not _trace_forward(model, torch.randn(BATCH, 64)).timed


def test_meta_device_trace_allocates_no_parameter_storage() -> None:
    import resource

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(16384, 16384), nn.Linear(16384, 16384))  # 2 GiB of fp32 weights
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    tr = trace(model, lambda: model(torch.zeros(BATCH, 16384, device="meta")))
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert all(p.is_meta for p in model.parameters())
    assert grown_mib < 256, f"tracing on meta grew the process by {grown_mib:.0f} MiB"
    assert tr.modules["0"].flops == 2 * BATCH * 16384 * 16384
    assert tr.modules["1"].param_bytes == (16384 * 16384 + 16384) * 4


def test_stage_costs_of_any_assignment_match_the_plan() -> None:
    from lightning_mp.partition import stage_costs

    model = nn.Sequential(*[nn.Linear(8 * (i + 1), 8 * (i + 2)) for i in range(4)])
    tr = _trace_forward(model, torch.randn(BATCH, 8))
    p = plan(tr, 2)
    assert stage_costs(tr, p.stage_of, 2) == pytest.approx(p.stage_costs)
    everything_on_0 = {fqn: 0 for fqn in tr.modules}
    assert stage_costs(tr, everything_on_0, 2) == pytest.approx((1.0, 0.0))


# ----------------------------------------------------------------------------- aliases


def _check_aliases_on_one_stage(tr: ModelTrace, p: PartitionPlan) -> None:
    assert tr.alias_groups, "the model has aliases"
    for group in tr.alias_groups:
        assert len({p.stage_of[m] for m in group}) == 1, group


@pytest.mark.parametrize("tied_weights", ["colocate", "replicate", "auto"])
def test_aliased_parameter_and_module_split_like_torchs_own_test_model(tied_weights: str) -> None:
    """torch's ``ModelWithParamAlias`` as the root: its own (aliased) parameter stays with it on stage 0, the
    aliased ``nn.Linear`` (``lin1``, its first name, and ``lin0``) is one unit on stage 1; at 3 stages the error
    counts two units."""
    from tests.registry_models import DIM, ModelWithParamAlias

    model = ModelWithParamAlias()
    x, y = torch.randn(BATCH, DIM), torch.randn(BATCH, DIM)
    tr = trace(model, lambda: model(x, y).sum())
    p = plan(tr, 2, tied_weights=tied_weights)
    assert p.stage_of == {"": 0, "lin1": 1, "lin0": 1}
    assert p.replicated == {}
    with pytest.raises(ValueError, match="only 2 placeable modules"):
        plan(tr, 3, tied_weights=tied_weights)


class BlockTwice(nn.Module):
    """One ``Block`` registered as ``block`` and ``again`` and called under both names."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.pre = nn.Linear(dim, dim)
        self.block = Block(dim)
        self.again = self.block
        self.post = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, C)
        return self.post(self.again(self.block(self.pre(x))))


@pytest.mark.parametrize("num_stages", [2, 3, 4])
def test_submodules_of_an_aliased_module_follow_their_first_names(num_stages: int) -> None:
    model = BlockTwice()
    tr = _trace_forward(model, torch.randn(BATCH, 4, 8))
    p = plan(tr, num_stages)
    _check_plan_invariants(model, tr, p)
    _check_aliases_on_one_stage(tr, p)
    assert p.stage_of["pre"] == 0 and p.stage_of["post"] == num_stages - 1
    if num_stages > 2:  # the block is split over stages; each name of a piece goes with it
        assert len({p.stage_of[f"block.{c}"] for c in ("ln", "fc", "proj")}) > 1
