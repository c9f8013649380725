"""Which module runs on which stage, decided once per process at setup, and this rank's stage installed.

:func:`choose_plan` picks where the plan comes from (one stage; a saved plan named by ``partition_plan``; the plan
saved in the checkpoint a run resumes from; or a trace on global rank 0, broadcast, see ``_placement.py``);
:func:`install_stage` checks the plan's tied weights, swaps this stage's modules for tensor-parallel ones, hands
the stage to the pipeline engine, builds the tied-weight copies, shards the stage (``sharded_data_parallel_degree``)
and materialises delayed parameters, straight into the shards when it can (see [Note: sharded stages] in
``_fsdp.py``).
:func:`check_supported` is the check that comes before; :func:`launch_runtime` (every process group, in one order,
and the engine over them, through :func:`build_engine`) runs once per process at launch.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_mp.config import SMPConfig
from lightning_mp.memory._host import trim_host_memory
from lightning_mp.partition import ModelTrace, PartitionPlan, manual_placements
from lightning_mp.pipeline import PipelineEngine
from lightning_mp.strategy import _tp
from lightning_mp.strategy._delayed import is_delayed, materialize_stage, meta_trace_inputs
from lightning_mp.strategy._fsdp import ShardedStage, wrap_stage
from lightning_mp.strategy._launch import resolve_resume_path
from lightning_mp.strategy._placement import (
    _FETCH,
    broadcast_plan,
    first_batch,
    load_plan,
    make_plan,
    make_plan_in_child,
    plan_saved_in,
    single_stage_plan,
    trace_in_child,
)
from lightning_mp.strategy._tied import TiedWeights, build_tied_weights, replicated_stages
from lightning_mp.strategy._transport import build_order_transport, build_pipeline_transport, group_options
from lightning_mp.topology import ProcessGroups, Topology, build_process_groups

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["InstalledStage", "build_engine", "check_supported", "choose_plan", "install_stage", "launch_runtime"]


def check_supported(module: Any, config: SMPConfig, fitting: bool) -> None:
    """What the strategy cannot run, raised at setup before the trace; a warning for a pipeline that cannot overlap.

    Raises:
        ValueError: ``tied_weights="replicate"`` under tensor parallelism, manual optimization when fitting, or
            ``trace_execution_times`` on a delayed (meta) model.
    """
    pp = config.pipeline_parallel_degree
    if pp > 1 and config.microbatches < pp:
        rank_zero_warn(
            f"microbatches={config.microbatches} is fewer than pipeline_parallel_degree={pp}: stages mostly"
            f" wait for each other. Use microbatches >= {pp} (e.g. {2 * pp}) for the pipeline to overlap work."
        )
    if config.tensor_parallel_degree > 1 and config.tied_weights == "replicate":
        raise ValueError(
            f"tied_weights='replicate' with tensor_parallel_degree={config.tensor_parallel_degree} is not"
            " supported yet (tie groups over tensor-parallel shards are not built). Use tied_weights='colocate' or"
            " 'auto' (which co-locates under tensor parallelism)."
        )
    if fitting and not module.automatic_optimization:
        raise ValueError(
            "The 'smp' strategy runs backward inside the pipeline, so manual optimization"
            " (`self.automatic_optimization = False`) is not supported. Use automatic optimization."
        )
    if config.trace_execution_times and is_delayed(module):
        raise ValueError(
            "trace_execution_times=True cannot time a model built under delayed parameter initialisation (it is"
            " traced on the meta device). Drop trace_execution_times, or build the model eagerly."
        )


def launch_runtime(
    topology: Topology, config: SMPConfig, device: torch.device, forward_context: Callable[[], Any]
) -> tuple[ProcessGroups, PipelineEngine]:
    """Every process group the layout needs, created by every rank in one order (see [Note: process group order] in
    ``topology.py``), and this rank's pipeline engine over them. Once per process, at launch."""
    groups = build_process_groups(topology, device.type, config.timeout, group_options(topology, config, device))
    return groups, build_engine(groups, device, config, forward_context)


def build_engine(
    groups: ProcessGroups, device: torch.device, config: SMPConfig, forward_context: Callable[[], Any]
) -> PipelineEngine:
    """This rank's pipeline engine over its pipeline transport (see ``_transport.py``), on ``groups`` (the run's
    process groups, see [Note: process group order] in ``topology.py``)."""
    topology = groups.topology
    return PipelineEngine(
        build_pipeline_transport(groups, device, config),
        topology.pipeline_parallel_degree,
        schedule=config.pipeline,
        active_microbatches=config.effective_active_microbatches,
        timeout_s=config.timeout.total_seconds(),
        forward_context=forward_context,
        global_ranks=topology.pp_group_ranks(),
        order_transport=build_order_transport(groups, device),
        seed=int(os.environ.get("PL_GLOBAL_SEED", torch.initial_seed())),
        remote_handles=config._remote_handles,
    )


def choose_plan(
    trainer: pl.Trainer,
    config: SMPConfig,
    global_rank: int,
    resume_path: str | Path | None,
    sample_to_device: Callable[[Any], Any],
    forward_context: Callable[[], Any],
) -> tuple[PartitionPlan, ModelTrace | None]:
    """The plan, the same on every rank, and the trace it was made from (global rank 0's own, else ``None``).

    Raises:
        Exception: whatever made the trace or the plan fail on global rank 0, on every rank (see ``broadcast_plan``).
    """
    module = trainer.lightning_module
    pp = config.pipeline_parallel_degree
    if pp == 1:
        if config.partition or config.partition_plan or manual_placements(module):
            rank_zero_warn(
                "Stage placements (`partition=`, `partition_plan=` or `with lightning_mp.partition(k)`) have no"
                " effect with pipeline_parallel_degree=1; set pipeline_parallel_degree > 1 to split the model."
            )
        return single_stage_plan(module), None
    if config.partition_plan is not None:
        plan = load_plan(config.partition_plan, module, pp)
        rank_zero_info(f"lightning_mp: reusing the partition plan from {config.partition_plan}")
        return plan, None
    if (
        not config.replan_on_resume
        and (resume := resolve_resume_path(resume_path, trainer)) is not None
        and (saved := plan_saved_in(resume, module, pp)) is not None
    ):
        return saved, None
    result: Any = _trace_and_plan(trainer, config, sample_to_device, forward_context) if global_rank == 0 else None
    plan = broadcast_plan(result)
    model_trace = result[1] if global_rank == 0 else None
    if global_rank == 0 and not any(getattr(c, "shows_partition_table", False) for c in trainer.callbacks):  # PartitionSummary
        rank_zero_info("lightning_mp partition plan:\n" + plan.format_table(model_trace))  # the callback prints more
    if module.example_input_array is not None:
        rank_zero_warn(
            "`example_input_array` cannot run through the pipeline outside a step, so it is cleared after"
            " partitioning (Lightning's model summary then shows no in/out sizes)."
        )
        module.example_input_array = None
    return plan, model_trace


def _trace_and_plan(
    trainer: pl.Trainer, config: SMPConfig, sample_to_device: Callable[[Any], Any], forward_context: Callable[[], Any]
) -> tuple[PartitionPlan, ModelTrace] | BaseException:
    """Global rank 0's trace and plan, or the error that stopped them (every rank must learn of it, or the others
    wait in the plan's broadcast)."""
    module = trainer.lightning_module
    try:  # the sample goes in as the loop would give it (device, then the precision's dtype; meta if delayed)
        to_device = meta_trace_inputs(sample_to_device) if is_delayed(module) else sample_to_device
        in_child = trace_in_child(is_delayed(module))
        # the batch is fetched here: data loading (workers, collate) stays in this process
        batch = first_batch(trainer) if in_child else _FETCH

        def make() -> tuple[PartitionPlan, ModelTrace]:
            with forward_context():
                return make_plan(trainer, config, to_device, batch)

        # see [Note: the meta trace runs in a child process] in _placement.py; the child gets 80% of the
        # timeout, so that the other ranks, waiting in the plan's broadcast, hear why it failed
        return make_plan_in_child(make, config.timeout * 0.8) if in_child else make()
    except Exception as err:
        return err


@dataclass(frozen=True)
class InstalledStage:
    """What :func:`install_stage` leaves on this rank.

    Attributes:
        plan: the plan with its replicated tied parameters recorded.
        tied: this rank's tied-weight copies (``_tied.py``).
        sharded: the stage under FSDP2 (``sharded_data_parallel_degree > 1``, see ``_fsdp.py``), else ``None``.
    """

    plan: PartitionPlan
    tied: TiedWeights
    sharded: ShardedStage | None = None


def install_stage(
    module: torch.nn.Module,
    plan: PartitionPlan,
    engine: PipelineEngine,
    groups: ProcessGroups,
    topology: Topology,
    config: SMPConfig,
    device: torch.device,
    names: dict[str, str],
    precision: str = "32-true",
) -> InstalledStage:
    """Keep this rank's stage of ``module`` (its tp shards under tensor parallelism) and hand it to ``engine``;
    under sharded data parallelism, shard it over ``groups.shard_mesh`` (see [Note: sharded stages] in ``_fsdp.py``),
    in the low dtype of ``precision`` (Lightning's precision plugin's) when it is a mixed one. A delayed stage is
    sharded on meta and materialised into its shards (under tensor parallelism: materialised tp-local, then
    sharded).

    Raises:
        ValueError: the plan splits a tie that ``tied_weights`` or tensor parallelism cannot replicate.
    """
    plan = check_ties(plan, module, config)
    stage_of = plan.stage_of
    if config.tensor_parallel_degree > 1:
        if config.optimize == "memory":
            rank_zero_info(
                "lightning_mp: optimize='memory' makes the built-in tensor-parallel transformer layers sequence"
                " parallel (activations sharded along the sequence), as SMP's `optimize` does; 'speed' keeps them"
                " replicated."
            )
        stage_of, _ = _tp.apply_tensor_parallelism(
            module, groups.smp_groups(), stage_of, topology.pp_rank, topology.rank, optimize=config.optimize,
            random_streams=config.tp_random_streams,
        )
    engine.install(module, stage_of, plan.ordered_state)
    tied = build_tied_weights(module, plan, names, topology, config.timeout)  # before FSDP: every name of a tie
    attributes = None
    if groups.shard_mesh is not None and (not is_delayed(module) or config.tensor_parallel_degree == 1):
        # delayed: shard on meta, then materialise straight into the shards (see [Note: sharded stages] in _fsdp.py)
        attributes = wrap_stage(
            module, groups.shard_mesh, stage_of, topology.pp_rank, precision, config.reshards_after_forward
        )
    if is_delayed(module):  # only this stage's tensors (under tp, shards) are left: allocate and initialise them
        materialize_stage(module, device, topology.pp_rank)
    if config.release_host_memory:
        trim_host_memory()  # what the build, the trace and the replay freed
    if groups.shard_mesh is not None and attributes is None:  # delayed tp x sdp: the tp-local stage, then shards
        attributes = wrap_stage(
            module, groups.shard_mesh, stage_of, topology.pp_rank, precision, config.reshards_after_forward
        )
    tied.rebind(module)  # FSDP's sharded parameter objects
    tied.broadcast_copies()  # see [Note: replicated tied weights] in _tied.py
    if groups.shard_mesh is None:
        engine.order_gradients(module)
        return InstalledStage(plan, tied)
    sharded = ShardedStage(module, attributes, config.reshards_after_forward)
    for params in sharded.gathered_units():  # the engine's gradient hooks go on the gathered parameters
        engine.order_gradients(params)
    return InstalledStage(plan, tied, sharded)  # sharded: what configure_optimizers sees


def check_ties(plan: PartitionPlan, module: torch.nn.Module, config: SMPConfig) -> PartitionPlan:
    """The plan with its replicated parameters as its placement implies (a plan saved before they were recorded
    gets them); an error if it splits a tie under ``tied_weights="colocate"`` or tensor parallelism."""
    replicated = replicated_stages(module, plan.stage_of)
    if replicated and config.tensor_parallel_degree > 1:
        raise ValueError(
            f"The partition plan places modules that share a parameter on different stages ({replicated}), which"
            " is not supported with tensor_parallel_degree > 1 yet. Use a plan that keeps tied modules together."
        )
    if replicated and config.tied_weights == "colocate":
        raise ValueError(
            f"The partition plan places modules that share a parameter on different stages ({replicated}), but"
            " tied_weights='colocate'. Use tied_weights='replicate' (or 'auto') to keep a copy on each stage, or"
            " a plan that keeps tied modules together."
        )
    return plan if replicated == plan.replicated else replace(plan, replicated=replicated)
