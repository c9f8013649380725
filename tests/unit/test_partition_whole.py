"""Modules that tensor parallelism swaps whole stay on one pipeline stage: the plan never cuts between a
transformer block's column-parallel ``c_fc`` and its row-parallel ``c_proj`` (their intermediate is sharded)."""

from __future__ import annotations

import pytest
import torch

import lightning_mp
from examples.gpt import GPT
from examples.gpt_tp import TPGPT  # registers Block -> DistributedTransformerLayer
from lightning_mp.partition import plan, trace
from lightning_mp.tp import whole_swaps

# The fault harness's pp2 x tp2 GPT: a vocabulary wide against the width pulls the first cut into block h.0.
_SIZES = {"vocab_size": 256, "block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 32}


def _traced(model_cls=TPGPT):
    torch.manual_seed(0)
    model = model_cls(**_SIZES)
    x = torch.randint(0, _SIZES["vocab_size"], (2, _SIZES["block_size"]))
    return model, trace(model, lambda: model(x).sum(), grad_enabled=True)


def _stages_of_block(stage_of: dict[str, int], block: str) -> set[int]:
    return {stage for fqn, stage in stage_of.items() if fqn == block or fqn.startswith(f"{block}.")}


def test_whole_swaps_names_the_registered_blocks_outermost_only():
    model = TPGPT(**_SIZES)
    assert whole_swaps(model) == ["h.0", "h.1"]
    lightning_mp.set_tensor_parallelism(model.h[1], enabled=False)
    assert whole_swaps(model) == ["h.0"]
    assert whole_swaps(GPT(**_SIZES)) == []  # nothing marked


@pytest.mark.parametrize("tied_weights", ["colocate", "auto"])
def test_automatic_plan_keeps_swapped_blocks_on_one_stage(tied_weights):
    model, tr = _traced()
    unconstrained = plan(tr, 2, tied_weights=tied_weights)
    assert len(_stages_of_block(unconstrained.stage_of, "h.0")) == 2, "the case this test is about: h.0 is cut"
    assert unconstrained.stage_of["h.0.mlp.c_fc"] != unconstrained.stage_of["h.0.mlp.c_proj"]
    constrained = plan(tr, 2, tied_weights=tied_weights, whole=whole_swaps(model))
    for block in ("h.0", "h.1"):
        assert len(_stages_of_block(constrained.stage_of, block)) == 1, block
    assert set(constrained.stage_of.values()) == {0, 1}
    assert max(constrained.stage_costs) >= max(unconstrained.stage_costs)  # coarser, never better balanced


def test_manual_map_that_splits_a_whole_module_is_refused():
    model, tr = _traced()
    manual = {"h.0": 0, "h.0.mlp.c_proj": 1, "h.1": 1, "ln_f": 1, "lm_head": 1}
    plan(tr, 2, manual=manual, tied_weights="replicate")  # allowed when nothing is swapped whole
    with pytest.raises(ValueError, match=r"splits module 'h.0' \(stage 0\) over stages \('h.0.mlp.c_proj' -> 1\)"):
        plan(tr, 2, manual=manual, tied_weights="replicate", whole=whole_swaps(model))
