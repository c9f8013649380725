"""Tensor-parallel glue of ``SMPStrategy``: swaps at setup, the tp group's random state, parameter counts.

[Note: tp in the strategy] The ranks of one tp group read the same batch (the sampler shards over replicas
only, Megatron's semantics), run the same module calls in the same order (the engine's deterministic order is
on when tp > 1) and so hold equal replicated activations. Hence replicated parameters (LayerNorms, row biases,
position tables) get equal gradients on every tp rank without communication, except those marked
``allreduce_grad``; how those are reduced, and how the gradient norm counts each logical parameter once, is in
[Note: a step's reductions] in ``_gradients.py``. The tp group and the other groups come from
``lightning_mp.topology`` ([Note: process group order]).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_mp.tp import ParallelGroups, TPGroup, shard_spec
from lightning_mp.nn import translate_hf
from lightning_mp.tp._random import RandomStreams, install_sharded_random
from lightning_mp.tp._swap import SwapReport, swap_modules

__all__ = ["apply_tensor_parallelism", "parameter_counts", "sync_rng_over_tp"]


def apply_tensor_parallelism(
    model: nn.Module,
    groups: ParallelGroups,
    stage_of: Mapping[str, int],
    own_stage: int,
    global_rank: int,
    optimize: str = "speed",
    random_streams: RandomStreams = "one_process",
) -> tuple[dict[str, int], SwapReport]:
    """Swap this stage's marked modules; return the stage map of the new module tree and the report.

    Modules inside a swapped one take its stage; ``optimize`` goes to the distributed classes that take it
    (``"memory"``: sequence parallelism); ``random_streams`` says how random ops on sharded activations draw
    (:func:`~lightning_mp.tp._random.install_sharded_random`). Warns once on global rank 0 naming unswapped
    marked modules.
    """
    tp = TPGroup.of(groups.tp)
    report = swap_modules(
        model,
        tp,
        translations=[translate_hf],
        owns=lambda fqn: stage_of.get(fqn, own_stage) == own_stage,
        defaults={"optimize": optimize},
    )
    if global_rank == 0:
        message = report.warning()
        if message:
            rank_zero_warn(message)
        local, full = parameter_counts(model)
        rank_zero_info(
            f"lightning_mp tensor parallel: swapped {len(report.swapped)} module(s) on global rank 0's stage; the"
            f" rank holds {local:,} parameter elements where it held {full:,} ({local / max(full, 1):.0%}; with"
            " pipeline stages, the other stages' parameters are released right after this)"
        )
        if not report.swapped:
            rank_zero_warn(
                f"tensor_parallel_degree={tp.size} but no module was swapped on global rank 0's stage: mark modules"
                " with `lightning_mp.set_tensor_parallelism(module)` or `with lightning_mp.tensor_parallelism():`."
            )
    if random_streams != "one_process":  # the swap installed "one_process"
        install_sharded_random(model, tp, random_streams)
    sync_rng_over_tp(groups)
    new_stage_of: dict[str, int] = {}
    for fqn, _ in model.named_modules(remove_duplicate=False):
        ancestor = fqn
        while ancestor not in stage_of and ancestor:
            ancestor = ancestor.rpartition(".")[0]
        new_stage_of[fqn] = stage_of.get(ancestor, own_stage)
    return new_stage_of, report


def sync_rng_over_tp(groups: ParallelGroups) -> None:
    """Give every rank of the tp group tp rank 0's torch RNG state (CPU, and CUDA when in use).

    Replicated activations must stay equal across the group, so random ops outside the tensor-parallel regions
    (dropout on embeddings and residuals) must draw the same numbers on every tp rank, even when the ranks were
    not seeded alike.
    """
    states = [torch.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states.append(torch.cuda.get_rng_state())
    payload = [states]
    dist.broadcast_object_list(payload, src=dist.get_global_rank(groups.tp, 0), group=groups.tp)
    torch.set_rng_state(payload[0][0])
    if len(payload[0]) > 1:
        torch.cuda.set_rng_state(payload[0][1])


def parameter_counts(model: nn.Module) -> tuple[int, int]:
    """``(local, full)`` numbers of parameter elements this rank holds and the logical model (its stage) has."""
    local = full = 0
    for p in model.parameters():
        spec = shard_spec(p)
        local += p.numel()
        full += p.numel() if spec is None else p.numel() // p.size(spec.dim) * spec.full_size
    return local, full
