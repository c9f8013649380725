"""Sharded data parallelism: this rank's stage sharded over its data-parallel ranks with torch's FSDP2.

[Note: sharded stages] Under ``sharded_data_parallel_degree > 1`` (SMP's name), :func:`wrap_stage` wraps this
rank's stage with ``torch.distributed.fsdp.fully_shard`` over ``ProcessGroups.shard_mesh`` (the ``dp`` axis, or
``(dp_replicate, dp_shard)`` for HSDP: shard inside a group, all-reduce across groups). Parameters, gradients and
optimizer state are then DTensor shards between steps; the optimizer from ``configure_optimizers`` steps the shards.

*Wrapping unit* (as torchtitan's ``apply_fsdp``): each outermost block (a module with parameters held by an
``nn.ModuleList`` or ``nn.Sequential``: the transformer layers of a model) and each partitioned subtree (a module
whose parent runs on another stage) is its own FSDP unit, and the root (the LightningModule: embeddings, final norm,
head, whatever no unit holds) is wrapped last. A model that is one ``nn.Sequential`` of whole stacks gets one unit
per stack (its layers are the stack's share). Units bound each collective's flat buffers (the all-gather's output,
the reduce-scatter's input) by one block's size instead of a whole stage's, and are what a per-block schedule would
gather and free one at a time. A module holding a parameter registered outside it too (a tie) is no unit: the
parameter stays with the root, one parameter in one unit. Replicated ties (``tied_weights="replicate"``; ``"auto"``
co-locates under sharding) are summed over their tie group on the gathered copies before the reduce-scatter.

*Who drives the collectives.* FSDP's own module hooks gather before each forward and reduce-scatter after each
backward, assuming one thread that runs one forward and then its backward. The pipeline engine runs microbatches on
several threads, serves calls from other stages, and replays checkpointed forwards inside backward; so the hooks are
removed and the step owner calls FSDP's collectives itself, as torch's pipelining schedules do (``UNSHARD`` /
``RESHARD`` actions and ``perform_reduce_grad`` in ``torch.distributed.pipelining``): :meth:`ShardedStage.gather`
all-gathers every unit once before a step (``FSDPModule.unshard``), the engine runs every microbatch on the whole
parameters (its ordered accumulation and the gradient stash work on them as without sharding), and
:meth:`ShardedStage.reduce_scatter` runs each unit's ``post_backward`` once per optimizer step with gradient sync
on (reduce-scatter, for HSDP then all-reduce across replicas, averaged over ``dp``), and frees the gathered
parameters. So a step costs one all-gather and one reduce-scatter per unit whatever the number of microbatches
(torchtitan's ``reshard_after_forward=False`` for pipeline stages), at the price of the stage's whole parameters
and gradients during the step (the sharded layout's saving holds between steps: optimizer state, master weights).
An evaluation loop gathers once at its start and reshards at its end (:meth:`ShardedStage.start_evaluation`), not
per batch: no evaluation batch runs a collective, so replicas with different numbers of batches cannot hang.

*Per unit* (``SMPConfig.reshard_after_forward="always"``, at pp=1 only, as torchtitan's
``reshard_after_forward_policy``; a string like our other policies. torchtitan's ``"default"`` is per unit at pp=1;
ours is once per step on every layout, until the limits the README lists under "Sharded data parallelism" are
closed: token-weighted losses and tp are refused with it, frozen units and exceptions mid-step are not handled). Without a pipeline the engine runs the microbatches one after the other in the calling thread, forward
then backward, the one thread FSDP's hooks expect, and every peer in the same order; so the units keep FSDP's own
hooks (``fully_shard(unit, reshard_after_forward=True)``) rather than our calls around each unit: they already
handle what a hand-made version would have to redo (checkpointed forwards replayed in backward, the pre-backward
gather registered on the unit's outputs, backward prefetch). A unit is gathered before its forward and freed after
it, gathered again before its backward, and its gradients are reduce-scattered (and freed with its parameters)
right after it, every microbatch, as FSDP runs natively. The root's hooks never run (the engine calls
``training_step``, not ``forward``), so the root (embeddings, head: what no unit holds) is gathered at the batch's
start (:meth:`ShardedStage.gather`), kept through its microbatches (``reshard_after_backward=False``), and FSDP's
end-of-backward callback reduce-scatters its gradients each microbatch; :meth:`ShardedStage.end_step` frees it after
the batch. Accumulation: gradients are reduce-scattered per microbatch and summed in the shards' ``.grad`` (as
FSDP2 does with gradient sync on), not held whole until the window's end (``set_requires_gradient_sync(False)``,
whose whole gradients would undo the saving); the gradient stash holds the shards (:meth:`ShardedStage.
step_parameters`), so Lightning's ``zero_grad`` on a window's first batch does not drop them (a token-weighted
batch is refused: its division by the replica's count would come after FSDP's average over replicas); clipping sums the shards' squares as above. Cost per batch of M microbatches and U
units: 2MU + 1 all-gathers and M(U + 1) reduce-scatters, against U + 1 of each per step (``"never"``); peak: the
root and one or two units whole instead of the stage (``benchmarks/memory.py``). At pp > 1 ``"always"`` is refused
(``SMPConfig``): a stage runs microbatches on engine threads and serves other stages' calls in an order that can
differ between sdp peers, and per-unit collectives entered in different orders hang or mix units. For the same
reason (FSDP's own requirement) every sdp peer must run the same units in each microbatch: a block skipped on one
peer only (data-dependent routing) needs ``"never"``, whose collectives run in a fixed order at the step's end.

*Delayed initialisation* (torchtitan's order: ``fully_shard`` on the meta model, then materialise): a stage built on
meta is wrapped first (:func:`wrap_stage`: its parameters become meta DTensor shards), and the init record's replay
then keeps, of each tensor it makes, only this rank's piece (:func:`~lightning_mp.init.materialize_module` on a
meta DTensor, no communication), freeing the full tensor before the next. The values are the replay's, so bitwise
the one-process eager build, shard by shard; a rank holds its shards plus one full tensor at a time. The
engine's gradient hooks need the gathered parameter objects (FSDP keeps them from one gather to the next), so
setup gathers the units one at a time, each freed before the next (:meth:`ShardedStage.gathered_units`): no rank
holds its whole stage during setup (the first step gathers it, as above). Tie groups are built before wrapping, so
that a replicated tie's every name holds the parameter when FSDP records where to put its gathered copy; the
copies are broadcast shard by shard. Under tensor parallelism the swapped-in modules hold real tp-local tensors that
load their pieces during the replay, so the stage is materialised tp-local and then sharded (the tp-local stage is
whole at setup, not the model).

*Mixed precision.* Under Lightning's ``"bf16-mixed"`` / ``"16-mixed"`` plugins every unit gets FSDP's
``MixedPrecisionPolicy(param_dtype=bf16 / fp16, reduce_dtype=fp32)`` (:func:`mixed_precision_policy`; torchtitan's
``mixed_precision_param`` / ``mixed_precision_reduce``): ``gather`` casts the fp32 shards and all-gathers them in the
low dtype, so the modules compute (under the plugin's autocast, as without sharding) with low-precision parameters
and the engine accumulates low-precision gradients; ``reduce_scatter`` (FSDP's ``post_backward``) casts them to fp32
before the reduce-scatter and leaves fp32 gradients on the fp32 shards, the optimizer's master weights. The policy is
FSDP's own, applied in the param groups' ``unshard`` / ``post_backward`` we call, so it needs no hook we removed
(only its forward-input cast, ``cast_forward_inputs``, lives in the removed root hook; autocast casts inputs here).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

__all__ = [
    "ShardedStage", "check_fsdp_api", "local_tensor", "mixed_precision_policy", "wrap_stage", "wrapping_units",
]

_LOW_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
"""Lightning's mixed precision plugins' ``precision`` -> the dtype their autocast computes in."""


def mixed_precision_policy(precision: str) -> MixedPrecisionPolicy:
    """FSDP2's policy matching Lightning's precision plugin ``precision`` (see [Note: sharded stages]).

    ``"bf16-mixed"`` / ``"16-mixed"``: parameters all-gathered in bf16 / fp16 and gradients reduce-scattered in fp32
    (torchtitan's ``mixed_precision_param=bf16``, ``mixed_precision_reduce=fp32``); the fp32 shards stay the
    optimizer's master weights. Any other precision (``"32-true"``, ``"bf16-true"``, whose module is converted
    already): no casts, FSDP's default.
    """
    low = _LOW_DTYPES.get(precision)
    return MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32 if low is not None else None)


def wrapping_units(module: nn.Module, stage_of: Mapping[str, int], stage: int) -> list[str]:
    """The FQNs of the FSDP units of ``module``'s stage ``stage`` below its root, in module order (see [Note: sharded
    stages]): the outermost blocks (modules held by an ``nn.ModuleList``/``nn.Sequential``) and partitioned subtrees
    (modules whose parent runs on another stage) that hold parameters; a unit's own blocks are its share. A module
    holding a parameter that is also registered outside it (a tie) is no unit: the parameter stays with the root."""
    holders: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        holders.setdefault(id(param), []).append(name)
    units: list[str] = []
    for fqn, child in module.named_modules():  # pre-order: a unit comes before what it holds
        if not fqn or stage_of.get(fqn, stage) != stage or any(fqn.startswith(f"{unit}.") for unit in units):
            continue
        params = list(child.parameters())
        if not params or any(not n.startswith(f"{fqn}.") for p in params for n in holders[id(p)]):
            continue
        parent_fqn = fqn.rpartition(".")[0]
        block = isinstance(module.get_submodule(parent_fqn), (nn.ModuleList, nn.Sequential))
        if block or stage_of.get(parent_fqn, stage) != stage:
            units.append(fqn)
    return units


def wrap_stage(
    module: nn.Module,
    mesh: DeviceMesh,
    stage_of: Mapping[str, int],
    stage: int,
    precision: str = "32-true",
    per_unit: bool = False,
) -> dict[str, dict[str, Any]]:
    """Wrap this rank's stage of ``module`` with ``fully_shard`` over ``mesh``, units first, root last.

    On a real stage, each parameter becomes its DTensor shard; on a meta stage (delayed init: see [Note: sharded
    stages]) the shards are meta DTensors that :func:`~lightning_mp.init.materialize_module` fills. Call after the
    tensor-parallel swap and ``build_tied_weights`` (a tie's every name must hold the parameter, so that FSDP sets
    its gathered parameter under each); pass the result to :class:`ShardedStage` once no tensor is on meta.

    Args:
        module: the LightningModule, every other stage's modules freed (``PipelineEngine.install``).
        mesh: FSDP2's mesh (``ProcessGroups.shard_mesh``): 1-D, or 2-D ``(dp_replicate, dp_shard)`` for HSDP.
        stage_of: module FQN -> stage (the plan's, after the tensor-parallel swap).
        stage: this rank's stage.
        precision: Lightning's precision plugin's ``precision``; its :func:`mixed_precision_policy` is every unit's.
        per_unit: the units reshard after their forward (``SMPConfig.reshards_after_forward``); the root never.

    Returns:
        Parameter FQN -> the attributes its parameter carried (tensor-parallel shard specs and gradient rules), for
        :class:`ShardedStage` to copy onto FSDP's sharded and gathered parameters.
    """
    attributes = {fqn: dict(vars(p)) for fqn, p in module.named_parameters() if vars(p)}
    units = [module.get_submodule(fqn) for fqn in wrapping_units(module, stage_of, stage)]
    if per_unit and not units:
        raise ValueError(
            "reshard_after_forward='always' needs FSDP units (blocks in an nn.ModuleList or nn.Sequential) on every "
            f"stage; stage {stage} has none, so its root's gradients would never be reduce-scattered. Use "
            "reshard_after_forward='never' (the default)."
        )
    policy = mixed_precision_policy(precision)
    for unit in units:
        fully_shard(unit, mesh=mesh, reshard_after_forward=per_unit, mp_policy=policy)
    fully_shard(module, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
    module.set_reduce_scatter_unused_params(True)  # a gradient missing on one rank is zeros there, as under DDP
    return attributes


def check_fsdp_api() -> None:
    """Check that this torch has the FSDP2 internals :class:`ShardedStage` drives (see [Note: sharded stages]) and
    ``DeviceMesh._unflatten`` (HSDP's mesh in ``topology.py``): private APIs, tested with torch 2.13.

    Raises:
        ValueError: naming torch's version and what is missing, so that ``sharded_data_parallel_degree > 1`` fails
            in the launching process instead of midway through setup.
    """
    missing = []
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
        from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    except ImportError as err:
        missing.append(f"torch.distributed.fsdp._fully_shard ({err})")
    else:
        state = FSDPState()
        wanted = {
            FSDPState: ("_lazy_init", "_root_post_backward_final_callback"),
            FSDPParamGroup: ("lazy_init", "unshard", "wait_for_unshard", "reshard", "post_backward", "is_unsharded"),
            FSDPModule: ("set_is_last_backward", "set_reshard_after_backward", "set_requires_gradient_sync",
                         "set_reduce_scatter_unused_params", "set_reshard_after_forward"),
            DeviceMesh: ("_unflatten",),
        }
        missing += [f"{cls.__name__}.{name}" for cls, names in wanted.items() for name in names if not hasattr(cls, name)]
        attributes = ("_fsdp_param_groups", "_state_ctx", "_comm_ctx")
        missing += [f"FSDPState().{name}" for name in attributes if not hasattr(state, name)]
    if missing:
        raise ValueError(
            f"sharded_data_parallel_degree > 1 drives FSDP2 internals that torch {torch.__version__} lacks: "
            f"{', '.join(missing)}. It was built and tested with torch 2.13; install that version, or set "
            "sharded_data_parallel_degree=1 (shard_optimizer_state=True shards the optimizer state only)."
        )


class ShardedStage:
    """This rank's stage under ``fully_shard``, its collectives called by the step's owner (see [Note: sharded
    stages]).

    Args:
        root: the LightningModule, wrapped by ``fully_shard`` last.
        attributes: parameter FQN -> the attributes its parameter carried before sharding.
        per_unit: the units' own FSDP hooks gather and free them around their forward and backward (``wrap_stage``'s
            ``per_unit``; one stage only, whose microbatches run one after the other in the calling thread).
    """

    def __init__(self, root: nn.Module, attributes: dict[str, dict[str, Any]], per_unit: bool = False) -> None:
        assert isinstance(root, FSDPModule)
        self.root = root
        self.per_unit = per_unit
        self._attributes = attributes
        self._reshard_after_evaluation = False
        self._state = fully_shard.state(root)
        self._state._lazy_init()  # the root and the units' shared state, as the root's first forward would
        for state in self._state._state_ctx.all_states:  # the engine, not FSDP's hooks, decides (see the Note)
            if not per_unit or state is self._state:  # per unit: the units' hooks stay, the root's never run
                state._pre_forward_hook_handle.remove()
                state._post_forward_hook_handle.remove()
        if per_unit:  # the root's group stays gathered through a step; FSDP's backward callback reduce-scatters it
            root.set_reshard_after_backward(False, recurse=False)
        self._copy_attributes()  # onto the sharded parameters

    def gathered_units(self) -> Iterator[list[nn.Parameter]]:
        """Gather the units one at a time, each freed before the next (at setup: a rank never holds its whole stage
        there). Yields each unit's gathered parameters: the objects every later :meth:`gather` fills again (FSDP
        keeps them), on which the engine's gradient hooks go."""
        for state in self._state._state_ctx.all_states:
            for group in state._fsdp_param_groups:
                group.lazy_init()
                group.unshard()
                group.wait_for_unshard()
                self._copy_attributes()
                yield [p for p in self.root.parameters() if not isinstance(p, DTensor)]
                group.reshard()

    def gather(self) -> None:
        """All-gather every unit's parameters (once per step; a no-op while gathered): the stage's modules then hold
        the whole (tp-local) parameters, the ones the engine's step computes with and accumulates into. Per unit,
        the root's only (the units' hooks gather each unit when it runs)."""
        self._unshard(self._groups(self._state if self.per_unit else None))

    def step_parameters(self) -> list[nn.Parameter]:
        """Per unit: the sharded parameters (the optimizer's), into whose ``.grad`` FSDP reduce-scatters during the
        step; else the gathered ones the engine accumulates into (after :meth:`gather`)."""
        self.gather()
        if not self.per_unit:
            return list(self.root.parameters())
        return [p.sharded_param for group in self._groups() for p in group.fsdp_params]

    def _groups(self, state: Any = None) -> list[Any]:
        """FSDP's parameter groups: of ``state``, or of every unit and the root (``None``)."""
        states = self._state._state_ctx.all_states if state is None else [state]
        return [group for state in states for group in state._fsdp_param_groups]

    def _unshard(self, groups: list[Any]) -> None:
        """All-gather ``groups`` (each a no-op while gathered) and mark the gathered parameters."""
        for group in groups:
            group.lazy_init()
            group.unshard()
            group.wait_for_unshard()
        self._copy_attributes()

    @property
    def gathered(self) -> bool:
        """Whether the modules hold the gathered parameters (between :meth:`gather` and the next reshard)."""
        states = self._state._state_ctx.all_states
        return any(group.is_unsharded for state in states for group in state._fsdp_param_groups)

    def start_evaluation(self) -> None:
        """At an evaluation loop's start (validate, test, predict): gather once for all its batches, so that no
        batch runs a collective and replicas with different numbers of batches cannot hang. Every rank of the shard
        mesh must run the loop (Lightning skips a loop without batches: give every replica at least one)."""
        self._reshard_after_evaluation = not self.gathered  # mid accumulation window, training keeps them gathered
        if self.per_unit:  # the units' hooks keep what this gathers until end_evaluation
            self.root.set_reshard_after_forward(False)
        self._unshard(self._groups())

    def keep_gathered(self) -> None:
        """Before each evaluation batch: gather again what a ``state_dict()`` during the loop (a callback's; FSDP's
        state-dict hook reshards) freed. Nothing at all, and no collective, while every unit is gathered."""
        groups = self._groups()
        if not all(group.is_unsharded for group in groups):
            self._unshard(groups)

    def end_evaluation(self) -> None:
        """At the loop's end: shard again what :meth:`start_evaluation` gathered (no communication)."""
        if self.per_unit:  # training's per-unit schedule again, without the loop's forwards in its prefetch order
            self.root.set_reshard_after_forward(True)
            self.root.set_reshard_after_forward(False, recurse=False)
            self._state._comm_ctx.post_forward_order.clear()
        if self._reshard_after_evaluation:
            self.reshard()
        self._reshard_after_evaluation = False

    def reshard(self) -> None:
        """Free the gathered parameters: the modules hold the DTensor shards again (what ``configure_optimizers``
        must see, and the layout between steps)."""
        for state in self._state._state_ctx.all_states:
            for group in state._fsdp_param_groups:
                group.reshard()

    def end_step(self) -> None:
        """After a training batch: per unit, free the root (FSDP's backward reduce-scattered its gradients too), so
        that Lightning's hooks, clipping and the optimizer see the shards and their gradients on every batch."""
        if self.per_unit:
            self.reshard()

    def reduce_scatter(self) -> None:
        """Reduce-scatter every unit's accumulated gradients into the shards' ``.grad`` (averaged over ``dp``; HSDP
        all-reduces across replicas too) and free the gathered parameters: once per optimizer step, as
        ``perform_reduce_grad`` of torch's pipelining stages. A parameter without gradient contributes zeros if any
        rank has one. Per unit, a no-op: FSDP's backward reduce-scattered already, and ``end_step`` freed the root."""
        if self.per_unit:
            return
        root = self.root
        root.set_is_last_backward(True)
        root.set_reshard_after_backward(True)
        root.set_requires_gradient_sync(True)
        for state in self._state._state_ctx.all_states:
            for group in state._fsdp_param_groups:
                group.post_backward()
        self._state._root_post_backward_final_callback()

    @contextmanager
    def whole_state_dicts(self) -> Iterator[None]:
        """Inside, the root's ``state_dict()`` holds whole tensors instead of FSDP's DTensor shards: a collective
        over the shard mesh, for what every rank computes alike (the weights a spawn launcher hands back)."""

        def gather_whole(module: nn.Module, state: dict[str, Any], prefix: str, local_metadata: Any) -> None:
            for key, value in state.items():
                if isinstance(value, DTensor):
                    state[key] = value.full_tensor()

        self._copy_attributes()  # Lightning's teardown moved the model (``_apply``: new parameter objects)
        handle = self.root._register_state_dict_hook(gather_whole)
        try:
            yield
        finally:
            handle.remove()

    def _copy_attributes(self) -> None:
        """Onto the parameters the modules hold now (shards, or gathered ones; FSDP makes new objects of both)."""
        for fqn, param in self.root.named_parameters():
            for name, value in self._attributes.get(fqn, {}).items():
                setattr(param, name, value)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s local shard if it is a DTensor, else ``tensor``."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
