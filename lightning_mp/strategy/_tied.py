"""Tied weights replicated over pipeline stages: tie groups, their gradient sum, one name in checkpoints.

[Note: replicated tied weights] Under ``tied_weights="replicate"`` (or ``"auto"`` choosing it) the modules sharing a
parameter may sit on different stages (see [Note: tied weights] in ``partition/_plan.py``). The engine frees only
other stages' modules' tensors, so every stage holding one of those modules keeps the parameter object: a *copy*.
As Megatron-LM (its embedding group) and DeepSpeed (``TiedLayerSpec``) do:

* a *tie group* is the process group of exactly the ranks holding a copy, one per (data-parallel replica, tp rank)
  and tied parameter; every rank creates all of them at setup, in the plan's order (``build_tie_groups``, step 3 of
  [Note: process group order] in ``lightning_mp/topology.py``);
* at setup each copy is broadcast from the lowest stage of its group (copies built eagerly, or replayed by delayed
  init, are equal already: this makes it a fact), and put back under every name of the parameter on that rank,
  also in the stubs of holders that run elsewhere (their calls still go to their stage). So every stage holding a
  copy sees the same ``named_parameters()`` name (the original FQN) and the same holders: a
  ``configure_optimizers`` that sorts parameters by name or by module type (no weight decay for embeddings) puts
  every copy in the same group, as on one device; otherwise the copy of a tied embedding/head on the head's stage
  would look like a ``Linear`` weight, get weight decay, and drift from the embedding's stage;
* once per optimizer step, after the pipeline's backward, the tp reduction and the data-parallel average (see
  [Note: a step's reductions] in ``_gradients.py``), each copy's gradient is summed over its tie group (a copy
  without a gradient counts as zeros). Every member then holds the same bits (one all-reduce, the same inputs after
  the dp average), steps the same optimizer state, and the copies stay bitwise equal step after step (Megatron-LM
  #656: pipelined copies that drifted apart). The sum is the one-process gradient up to float rounding (the stages'
  contributions are added in another order). Under sharded data parallelism the sum comes before FSDP's
  reduce-scatter instead (on the gathered copies; :meth:`TiedWeights.rebind` follows FSDP's parameter objects).
* the global gradient norm counts the copy on the lowest stage only;
* DCP checkpoints keep one entry per parameter under its original FQN (the name ``named_parameters()`` of the
  whole model gives it); a load fills every copy, and every other name of the parameter, from it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_mp.partition import PartitionPlan, shared_parameters
from lightning_mp.strategy._fsdp import local_tensor
from lightning_mp.strategy._launch import print_on_one_rank
from lightning_mp.topology import Topology, build_tie_groups

__all__ = ["Tie", "TiedWeights", "build_tied_weights", "original_names", "rename_flat_key", "replicated_stages"]


def original_names(model: nn.Module) -> dict[str, str]:
    """Every other name of a shared parameter -> its original FQN (``lm_head.weight`` -> ``transformer.wte.weight``).

    Call on the whole model, before the engine frees other stages' tensors (meta tensors are fine).
    """
    return {name: shared.fqn for shared in shared_parameters(model) for name in shared.names[1:]}


def replicated_stages(model: nn.Module, stage_of: Mapping[str, int]) -> dict[str, tuple[int, ...]]:
    """Original FQN -> stages holding a copy, for each shared parameter whose holders ``stage_of`` puts apart.

    Call on the whole model (before the engine frees tensors); the same rule as the planner's ``replicated``.
    """
    result = {}
    for shared in shared_parameters(model):
        stages = sorted({stage_of[holder] for holder in shared.holders if holder in stage_of})
        if len(stages) > 1:
            result[shared.fqn] = tuple(stages)
    return result


def rename_flat_key(key: str, names: Mapping[str, str]) -> str:
    """A flattened optimizer key (``state.<fqn>.<name>``, ``param_groups.<fqn>.<name>``) with ``fqn`` renamed."""
    section, _, rest = key.partition(".")
    fqn, _, name = rest.rpartition(".")
    return f"{section}.{names.get(fqn, fqn)}.{name}" if fqn in names else key


@dataclass(frozen=True)
class Tie:
    """One replicated parameter as this rank sees it.

    Attributes:
        fqn: its original FQN.
        stages: the stages holding a copy, ascending.
        param: this rank's copy; ``None`` when this rank's stage holds none.
        group: this rank's tie group (the ranks holding a copy in this replica and tp rank); ``None`` if none.
        src: global rank of the copy on the lowest stage of this rank's tie group (the broadcast source).
    """

    fqn: str
    stages: tuple[int, ...]
    param: nn.Parameter | None
    group: dist.ProcessGroup | None
    src: int | None

    @property
    def counted_here(self) -> bool:
        """Whether this rank's copy counts in the global gradient norm (the lowest stage's does)."""
        return self.param is not None and dist.get_rank() == self.src


class TiedWeights:
    """This rank's replicated tied parameters (see [Note: replicated tied weights])."""

    def __init__(self, ties: list[Tie]) -> None:
        self.ties = ties
        self._mine = [tie for tie in ties if tie.group is not None]

    @property
    def active(self) -> bool:
        """Whether the plan replicates any parameter (then every rank runs the optimizer step's reduction path)."""
        return bool(self.ties)

    def broadcast_copies(self) -> None:
        """Make every copy equal to the lowest stage's, in the plan's order."""
        for tie in self._mine:
            with torch.no_grad():  # under sharded data parallelism each copy's shard (the same on every member)
                dist.broadcast(local_tensor(tie.param.data), src=tie.src, group=tie.group)

    def reduce_gradients(self) -> None:
        """Sum each copy's ``.grad`` over its tie group in place (no gradient anywhere stays ``None``)."""
        for tie in self._mine:
            p = tie.param
            grad = p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
            flag = torch.ones(1, dtype=grad.dtype, device=grad.device) * float(p.grad is not None)
            bucket = torch.cat([grad, flag])
            dist.all_reduce(bucket, group=tie.group)
            p.grad = bucket[:-1].view_as(p).clone() if bucket[-1].item() > 0 else None

    def rebind(self, model: nn.Module) -> None:
        """Take each copy from ``model`` again by its FQN: FSDP2 holds new parameter objects (its shards between
        steps, the gathered ones during a step), so the sum before its reduce-scatter and the norm use them."""
        self._mine = [replace(tie, param=model.get_parameter(tie.fqn)) for tie in self._mine]

    def counted_once(self, params: list[nn.Parameter]) -> list[nn.Parameter]:
        """``params`` without the copies that the global gradient norm must not count again."""
        skip = {id(tie.param) for tie in self._mine if not tie.counted_here}
        return [p for p in params if id(p) not in skip]


def build_tied_weights(
    model: nn.Module, plan: PartitionPlan, names: Mapping[str, str], topology: Topology, timeout: timedelta
) -> TiedWeights:
    """Create every tie group (all ranks, one order: ``build_tie_groups``) and find this rank's copies. Call after
    ``engine.install``.

    Args:
        model: this rank's model, other stages' tensors already freed.
        plan: the partition plan (the same on every rank).
        names: :func:`original_names` of the whole model.

    Raises:
        ValueError: if the plan replicates a parameter this rank's stage should hold but does not (a plan made for
            another model).
    """
    local: dict[str, nn.Parameter] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        local.setdefault(names.get(name, name), param)
    every_name: dict[str, list[str]] = {}
    for name, original in names.items():
        every_name.setdefault(original, [original]).append(name)
    ties, missing = [], []
    tie_groups = build_tie_groups(topology, list(plan.replicated.values()), timeout)
    for (fqn, stages), (own_group, src) in zip(plan.replicated.items(), tie_groups):
        param = local.get(fqn) if own_group is not None else None
        if own_group is not None and param is None:  # said after every group exists, so that no rank waits alone
            missing.append(f"{fqn!r} (on stages {list(stages)})")
        if param is not None:
            _attach_everywhere(model, param, every_name.get(fqn, [fqn]))
        ties.append(Tie(fqn, tuple(stages), param, own_group, src))
    if plan.replicated:  # every rank learns whether any stage lacks a replicated parameter, and all raise
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (topology.pp_rank, missing))
        for pp_rank, names_missing in gathered:
            if names_missing:
                error = ValueError(
                    f"The partition plan replicates {', '.join(names_missing)}, but stage {pp_rank} holds no such"
                    " parameter. The plan is for another model: drop `partition_plan` to plan anew."
                )
                raise print_on_one_rank(error, printed_by=0, rank=dist.get_rank())
    return TiedWeights(ties)


def _attach_everywhere(model: nn.Module, param: nn.Parameter, names: list[str]) -> None:
    """Put ``param`` under each of ``names`` whose slot the engine emptied (a holder stubbed to another stage)."""
    for name in names:
        module_name, _, attribute = name.rpartition(".")
        module = model.get_submodule(module_name)
        if module._parameters.get(attribute) is None:
            module._parameters[attribute] = param
