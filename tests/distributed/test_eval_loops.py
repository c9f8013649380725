"""Eval under the pipeline engine on gloo processes: the Hugging Face cache of every layer comes back to the
caller, and generation with it matches one process."""

from __future__ import annotations

import pytest
import torch
from torch import nn


# ---- HF use_cache=True: the cache comes back whole ([Note: caches written back] in pipeline/_messages.py) --------


def _generate_two_steps(model: nn.Module, ids: torch.Tensor) -> dict:
    """A prompt with ``use_cache=True``, then one more token fed with the returned cache (greedy generation)."""
    first = model(input_ids=ids, use_cache=True)
    cache = first.past_key_values
    cached = {
        f"{i}.{part}": getattr(layer, part).clone() for i, layer in enumerate(cache.layers) for part in ("keys", "values")
    }
    second = model(input_ids=first.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
    return {"logits": first.logits.clone(), "next_logits": second.logits.clone(), "cached": cached}


def _pipelined_generation(rank: int, world_size: int, remote_handles: bool) -> dict:
    from lightning_mp.pipeline import PipelineEngine
    from tests._dist import make_transport
    from tests.models import expand_placement
    from tests.distributed.test_remote_handles import GPT2_PLACEMENT, _tiny_gpt2

    torch.manual_seed(0)
    model = _tiny_gpt2().eval()
    engine = PipelineEngine(make_transport([0, 1]), 2, timeout_s=60, remote_handles=remote_handles)
    engine.install(model, expand_placement(model, GPT2_PLACEMENT))
    found: dict = {}
    with torch.no_grad(), engine.session() as session:
        if engine.is_driver:
            step = lambda ids, i: found.update(_generate_two_steps(model, ids))  # noqa: E731
            session.drive(step, [_prompt()], loss_fn=lambda _: None, backward=False)
            session.finish(None)
        else:
            session.serve()
    return found


def _prompt() -> torch.Tensor:
    return torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("remote_handles", [True, False], ids=["handles", "no-handles"])
def test_hf_cache_of_every_layer_comes_back_and_generation_with_it_matches_one_process(remote_handles):
    """Tiny GPT-2, blocks 2-3 on stage 1: the cache they fill there is written back into the driver's cache."""
    from tests._dist import run_distributed
    from tests.distributed.test_remote_handles import _tiny_gpt2

    torch.manual_seed(0)
    with torch.no_grad():
        expected = _generate_two_steps(_tiny_gpt2().eval(), _prompt())
    got = run_distributed(_pipelined_generation, 2, remote_handles, start_method="fork")[0]
    assert sorted(got["cached"]) == sorted(expected["cached"]), "every layer's keys and values"
    for key in ("logits", "next_logits"):
        torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=1e-6, msg=key)
    for name, value in expected["cached"].items():
        torch.testing.assert_close(got["cached"][name], value, rtol=1e-5, atol=1e-6, msg=name)
