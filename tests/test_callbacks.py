"""Tier 1: the partition summary's per-stage numbers add up to the traced model."""

from __future__ import annotations


from lightning_mp.callbacks import summarize_stages
from lightning_mp.partition import plan, trace
from tests.models import TinyLM


def test_stage_summaries_add_up_to_the_model():
    model = TinyLM()  # blocks is a ModuleList: a container that is never called itself
    batch = TinyLM.batch()
    model_trace = trace(model, lambda: TinyLM.loss(model, batch))
    stages = summarize_stages(plan(model_trace, 2), model_trace)
    assert sum(s.flops for s in stages) == model_trace.total_flops
    assert sum(s.num_params for s in stages) == sum(p.numel() for p in model.parameters())
    leaves = [r for r in model_trace.modules.values() if not r.children]
    assert sum(s.activation_bytes for s in stages) == sum(r.activation_bytes for r in leaves)
    assert all(s.flops > 0 for s in stages), "each stage holds transformer blocks"
    assert abs(sum(s.cost_share for s in stages) - 1) < 1e-9
