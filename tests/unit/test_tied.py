"""Tied weights replicated across pipeline stages (``tied_weights="replicate"`` / ``"auto"``): the planner's choice
(``auto`` colocates a tiny tie, replicates GPT-2's at 4 stages), errors, the plan's record and its table."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning_mp
from lightning_mp.partition import PartitionPlan, plan, stage_costs, trace
from lightning_mp.strategy._tied import original_names
from tests.models import TinyLM, tiny_gpt2


class SharedMiddle(TinyLM):
    """TinyLM (embedding tied to the head) whose blocks 1, 2 and 3 also share one linear weight."""

    def __init__(self) -> None:
        super().__init__(depth=4)
        for block in self.blocks[2:]:
            block[1].weight = self.blocks[1][1].weight


def _gpt2() -> nn.Module:
    return tiny_gpt2(n_layer=3, n_head=2, n_positions=8, bos_token_id=0, eos_token_id=0)


def _gpt2_loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    logits = model(input_ids=x).logits  # (B, T, V)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


BUILDS = {"tinylm": (TinyLM, TinyLM.loss), "sharedmid": (SharedMiddle, TinyLM.loss), "gpt2": (_gpt2, _gpt2_loss)}


def _trace(name: str):
    torch.manual_seed(0)
    build, loss = BUILDS[name]
    model = build()
    batch = TinyLM.batch(n=4)
    return model, trace(model, lambda: loss(model, batch), grad_enabled=True)


def test_auto_colocates_a_tiny_tie_where_a_copy_does_not_pay():
    _, tr = _trace("tinylm")
    colocated = plan(tr, 2, tied_weights="colocate")
    replicated = plan(tr, 2, tied_weights="replicate")
    assert replicated.replicated == {"embed.weight": (0, 1)} and not colocated.replicated
    assert max(replicated.stage_costs) > max(colocated.stage_costs), "the copy costs more than it balances"
    assert plan(tr, 2, tied_weights="auto") == colocated


class SharedDepth(nn.Module):
    """Eight compute-heavy blocks; blocks 0, 3 and 7 use one weight (a block shared across depth)."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(8))
        self.blocks[3].weight = self.blocks[7].weight = self.blocks[0].weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


def test_auto_replicates_a_weight_shared_far_apart_and_colocates_gpt2s_embedding():
    """A copy pays where co-location pulls compute-heavy holders onto one stage; for GPT-2's embedding/head it costs
    the head's stage what co-locating the embedding costs, a gain under the 1% ``auto`` asks for."""
    import transformers as hf

    model, x = SharedDepth(), torch.randn(64, 32)
    tr = trace(model, lambda: model(x).sum(), grad_enabled=True)
    colocated, chosen = plan(tr, 4, tied_weights="colocate"), plan(tr, 4, tied_weights="auto")
    assert [colocated.stage_of[f"blocks.{i}"] for i in (0, 3, 7)] == [0, 0, 0], "three of eight blocks on one stage"
    assert chosen.replicated == {"blocks.0.weight": (0, 1, 3)}
    assert max(chosen.stage_costs) < 0.9 * max(colocated.stage_costs)

    with torch.device("meta"):  # the benchmark's GPT-2 (12 layers, width 256, the real vocabulary)
        model = hf.GPT2LMHeadModel(hf.GPT2Config(n_layer=12, n_embd=256, n_head=4, vocab_size=50257))
        ids = torch.randint(0, 1000, (8, 128))
    tr = trace(model, lambda: model(input_ids=ids, labels=ids).loss)
    colocated, replicated = plan(tr, 4, tied_weights="colocate"), plan(tr, 4, tied_weights="replicate")
    assert replicated.replicated == {"transformer.wte.weight": (replicated.stage_of["transformer.wte"], 3)}
    assert replicated.stage_of["lm_head"] == 3
    gain = 1 - max(replicated.stage_costs) / max(colocated.stage_costs)
    assert 0 < gain < 0.01
    assert plan(tr, 4, tied_weights="auto") == colocated
    # the copy is charged to the head's stage: the plan's costs are those of its placement, recomputed
    assert replicated.stage_costs == stage_costs(tr, replicated.stage_of, 4)
    uncharged = stage_costs(tr, replicated.stage_of, 4, charge_copies=False)
    assert replicated.stage_costs[3] > uncharged[3]


def test_manual_split_of_a_tie_is_an_error_under_colocate_and_a_copy_under_replicate():
    model, tr = _trace("tinylm")
    manual = {"head": 1, "blocks.3": 1}
    with pytest.raises(ValueError, match=r"share parameters.*'embed' -> 0.*'head' -> 1.*tied_weights='replicate'"):
        plan(tr, 2, manual=manual, tied_weights="colocate")
    for mode in ("replicate", "auto"):
        assert plan(tr, 2, manual=manual, tied_weights=mode).replicated == {"embed.weight": (0, 1)}


def test_plan_records_copies_round_trips_and_shows_them():
    model, tr = _trace("sharedmid")
    placed = plan(tr, 3, manual={"blocks.2": 1, "blocks.3": 2, "head": 2}, auto_partition=False,
                  tied_weights="replicate")
    assert placed.replicated == {"embed.weight": (0, 2), "blocks.1.1.weight": (0, 1, 2)}
    assert PartitionPlan.from_dict(placed.to_dict()) == placed
    table = placed.format_table(tr)
    assert "replicated (tied)" in table and "replica" in table
    assert placed.replica_params(tr) == [0, 16 * 16, 16 * 16 + 32 * 16]
    assert original_names(model) == {
        "head.weight": "embed.weight", "blocks.2.1.weight": "blocks.1.1.weight", "blocks.3.1.weight": "blocks.1.1.weight"
    }


def test_tied_weights_value_is_checked():
    _, tr = _trace("tinylm")
    with pytest.raises(ValueError, match="tied_weights must be one of"):
        plan(tr, 2, tied_weights="copy")
    with pytest.raises(ValueError, match="`tied_weights` must be"):
        lightning_mp.SMPConfig(tied_weights="copy")


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # before forking: a forked child can hang in OpenMP otherwise
    # ... and stays at one thread: a one-process fork (the pp=1 resume) would otherwise get ddp's policy of
    # cpu_count threads, and libgomp's pool inherited from a parent that ran parallel regions hangs the child.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    yield
    torch.set_num_threads(threads)
