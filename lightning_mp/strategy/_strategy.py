"""``SMPStrategy``: the Lightning strategy ``"smp"`` (pipeline x data parallel, automatic partitioning)."""

from __future__ import annotations

import os
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import pl_worker_init_function, reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mp.config import SMPConfig
from lightning_mp.partition import ModelTrace, PartitionPlan, manual_placements
from lightning_mp.pipeline import MicrobatchSplitError, PipelineEngine, merge_microbatches, split_batch
from lightning_mp.init import delay_param_initialization
from lightning_mp.memory._host import fix_mmap_threshold, trim_host_memory
from lightning_mp.strategy import _checkpoint
from lightning_mp.strategy._consolidate import hf_info
from lightning_mp.strategy import _tp
from lightning_mp.strategy._exit import release_at_exit
from lightning_mp.strategy._launch import apply_thread_policy, make_launcher, resolve_resume_path
from lightning_mp.strategy._prelaunch import check_before_launch
from lightning_mp.strategy._metrics import load_metric_log, sync_metrics_over
from lightning_mp.strategy._tied import TiedWeights, build_tied_weights, original_names, replicated_stages
from lightning_mp.strategy._precision import install_synced_scaler, loss_scale_of
from lightning_mp.strategy._gradients import StepGradients
from lightning_mp.strategy._transport import (
    build_order_transport,
    build_pipeline_transport,
    check_data_plane,
    group_options,
)
from lightning_mp.strategy._summary import (
    gather_parameter_counts,
    silence_single_replica_sync_advice,
    summarize_whole_model,
)
from lightning_mp.strategy._replicas import share_generators, sync_initial_states
from lightning_mp.strategy._placement import (
    _FETCH,
    PLAN_KEY,
    broadcast_plan,
    first_batch,
    load_plan,
    make_plan,
    make_plan_in_child,
    plan_saved_in,
    single_stage_plan,
    trace_in_child,
)
from lightning_mp.strategy._delayed import holds_meta_tensors, is_delayed, materialize_stage, meta_trace_inputs
from lightning_mp.strategy._step import LogRecorder, StepSummary, detach_cpu, replay_logs
from lightning_mp.strategy._zero import (
    local_optimizer,
    shard_optimizer,
    sync_hyperparameters_from_local,
    track_step_for_schedulers,
)
from lightning_mp.topology import MeshAxis, ProcessGroups, Topology, build_process_groups
from lightning_mp.tp import ParallelGroups

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["SMPStrategy"]


class SMPStrategy(ParallelStrategy):
    """Model parallelism after the SageMaker model parallelism library (Karakus et al., 2021), for Lightning.

    The model is split automatically into ``pipeline_parallel_degree`` stages (paper section 3.1) and run by a
    module-server pipeline engine (section 3.2) that keeps the LightningModule's eager Python code working;
    the remaining factor of the world size is data parallelism: ``dp = world_size / (pp * tp)``. Each step the
    batch is split into ``microbatches`` along dim 0; pipeline rank 0 runs ``training_step`` per microbatch;
    the step returns the mean loss on every rank.

    Args:
        pipeline_parallel_degree: number of pipeline stages (SMP ``partitions``).
        tensor_parallel_degree: ranks per tensor-parallel group; modules marked with ``set_tensor_parallelism`` /
            ``tensor_parallelism()`` are swapped for distributed ones at setup (see ``strategy/_tp.py``).
        microbatches: microbatches per batch; every tensor's dim 0 (and every list of one value per sample) must divide by it.
        non_split_inputs: top-level batch entries (dict keys, dataclass/NamedTuple field names, tuple/list
            positions) given whole to every microbatch instead of split (SMP's ``non_split_inputs``).
        pipeline: ``"interleaved"`` (ready work in 1F1B order, 1F1B-like memory) or ``"simple"`` (GPipe).
        active_microbatches: cap on microbatches in flight; ``None`` = ``pipeline_parallel_degree + 2``.
        auto_partition: balance modules over stages automatically; if ``False``, ``partition`` must place them.
        default_partition: stage of unplaced modules when ``auto_partition=False``.
        partition: manual placement ``{module FQN: stage}``; innermost wins; auto fills the rest.
        optimize: ``"speed"`` (memory_weight 0.2) or ``"memory"`` (0.8), the partition objective preset.
        memory_weight: weight of memory balance in [0, 1]; overrides ``optimize``.
        tied_weights: modules sharing a parameter: ``"colocate"`` (one stage), ``"replicate"`` (a copy on each stage
            using it, gradients summed over those stages) or ``"auto"`` (replicate when that balances better); see
            :class:`lightning_mp.SMPConfig` and ``strategy/_tied.py``.
        trace_execution_times: balance measured module times instead of FLOPs (SMP's knob of that name).
        partition_plan: reuse a saved plan (JSON from ``PartitionSummary`` or a lightning_mp checkpoint folder)
            instead of tracing; a resumed run is then placed exactly as before.
        process_group_backend: ``None`` picks gloo on CPU, NCCL on CUDA.
        timeout: how long any rank waits for a peer before raising (collectives and pipeline messages).
        start_method: ``"popen"`` (re-run the script per rank, like ``ddp``) or ``"spawn"``/``"fork"``.
        save_distributed_checkpoint: as in Lightning's ``ModelParallelStrategy``: ``True`` writes a folder of DCP
            shards per checkpoint (every rank writes its own part; resumable at any layout); ``False`` writes one
            full Lightning checkpoint file from global rank 0 (tp shards gathered into full tensors), which
            ``Model.load_from_checkpoint`` and any other strategy read. Either kind resumes an ``smp`` run, as does a plain Lightning checkpoint file.
        load_weights: initial weights for the model, read at setup after partitioning, each rank keeping its own
            stage's tensors and its tp slice of them: a plain state dict (``.pt``, ``.bin``, ``.safetensors``), a
            Lightning checkpoint file, a lightning_mp checkpoint folder, or a Hugging Face folder (keys of the
            LightningModule's transformers model). The optimizer starts fresh. Missing keys raise unless the
            LightningModule's ``strict_loading`` is ``False``.
        replan_on_resume: a run resumed with ``fit(ckpt_path=...)`` (a path, or ``"last"``/``"best"`` as Lightning
            resolves them) reuses the partition plan saved in that checkpoint when it fits the model and
            ``pipeline_parallel_degree`` (else it plans anew, and says so); ``True`` always plans anew.
        remote_handles: a remote module call returns at once with a handle to its output, which stays on its stage
            until local code touches it; a later call on that stage takes it by reference, so a loop over remote
            blocks costs one-way messages (:attr:`lightning_mp.SMPConfig.remote_handles`). ``False``: every remote
            call waits for its outputs (one round trip per call).
        tp_random_streams: ``"one_process"`` (random ops on sharded activations draw the full tensor and keep the
            slice: tp=2 trains as tp=1) or ``"per_rank"`` (each tp rank draws its shard from its own stream,
            Megatron's tracker); see [Note: random numbers under tensor parallelism] in ``tp/_random.py``.
        delayed_parameter_initialization: build the model of ``configure_model`` on meta; each rank allocates and
            initialises only its own stage, bitwise as an eager build (models built under
            ``lightning_mp.delay_param_initialization()`` or ``trainer.init_module(empty_init=True)`` are delayed
            anyway).
        shard_optimizer_state: ZeRO-1 over the data-parallel group: each dp rank keeps 1/dp of its stage's
            optimizer state (see [Note: sharded optimizer state] in ``_zero.py``).
        release_host_memory: on glibc Linux, freed CPU tensors leave each rank's resident memory at once (a fixed
            malloc mmap threshold; slower steps, see :attr:`lightning_mp.SMPConfig.release_host_memory`); for
            training under a per-rank memory budget.
        data_plane: how tensor bytes travel between stages: ``"auto"``, ``"gloo"`` (CUDA tensors staged through
            pinned host memory) or ``"nccl"`` (one NCCL group per ordered pair of stages); headers always go over a
            CPU gloo group. See ``SMPConfig.data_plane``.
        placement_strategy: which axis gets neighbouring ranks: ``"cluster"`` (tp, default), ``"spread"``
            (replicas) or a permutation of ``D``, ``P``, ``T`` (outermost first).

    Raises:
        ValueError: at construction for invalid values (see :class:`lightning_mp.SMPConfig`); at setup for a world
            size not divisible by ``pipeline_parallel_degree``, a model with fewer placeable modules than stages,
            or a batch that does not split into ``microbatches``.
    """

    strategy_name = "smp"

    def __init__(
        self,
        pipeline_parallel_degree: int = 1,
        tensor_parallel_degree: int = 1,
        microbatches: int = 1,
        non_split_inputs: list[str | int] | None = None,
        pipeline: Literal["interleaved", "simple"] = "interleaved",
        active_microbatches: int | None = None,
        auto_partition: bool = True,
        default_partition: int = 0,
        partition: dict[str, int] | None = None,
        optimize: Literal["speed", "memory"] = "speed",
        memory_weight: float | None = None,
        tied_weights: Literal["colocate", "replicate", "auto"] = "auto",
        trace_execution_times: bool = False,
        partition_plan: str | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta = default_pg_timeout,
        deterministic_order: bool | None = None,
        remote_handles: bool = True,
        start_method: Literal["popen", "spawn", "fork"] = "popen",
        save_distributed_checkpoint: bool = True,
        load_weights: str | Path | None = None,
        replan_on_resume: bool = False,
        tp_random_streams: Literal["one_process", "per_rank"] = "one_process",
        delayed_parameter_initialization: bool = False,
        shard_optimizer_state: bool = False,
        release_host_memory: bool = False,
        placement_strategy: str = "cluster",
        data_plane: Literal["auto", "gloo", "nccl"] = "auto",
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.config = SMPConfig(
            pipeline_parallel_degree=pipeline_parallel_degree,
            tensor_parallel_degree=tensor_parallel_degree,
            microbatches=microbatches,
            non_split_inputs=non_split_inputs if isinstance(non_split_inputs, (str, int)) else tuple(non_split_inputs or ()),
            pipeline=pipeline,
            active_microbatches=active_microbatches,
            auto_partition=auto_partition,
            default_partition=default_partition,
            partition=dict(partition or {}),
            optimize=optimize,
            memory_weight=memory_weight,
            tied_weights=tied_weights,
            trace_execution_times=trace_execution_times,
            partition_plan=partition_plan,
            process_group_backend=process_group_backend,
            timeout=timeout,
            deterministic_order=deterministic_order,
            remote_handles=remote_handles,
            tp_random_streams=tp_random_streams,
            delayed_parameter_initialization=delayed_parameter_initialization,
            shard_optimizer_state=shard_optimizer_state,
            release_host_memory=release_host_memory,
            placement_strategy=placement_strategy,
            data_plane=data_plane,
        )
        self._start_method = start_method
        self._save_distributed_checkpoint = save_distributed_checkpoint
        self._load_weights = load_weights
        self._param_order: list[str] | None = None  # the whole model's parameter FQNs, before placement
        self._param_names: dict[str, str] = {}  # other names of shared parameters -> original FQN (see _tied.py)
        self._tied = TiedWeights([])
        self._replan_on_resume = replan_on_resume
        self._resume_path: str | Path | None = None  # set by the launcher (see `resume_path_of` in _launch.py)
        self.num_nodes = 1
        self._topology: Topology | None = None
        self._device_mesh: DeviceMesh | None = None
        self._groups: ParallelGroups | None = None
        self._process_groups: ProcessGroups | None = None  # every group of the run (see lightning_mp/topology.py)
        self._engine: PipelineEngine | None = None
        self._plan: PartitionPlan | None = None
        self._trace: ModelTrace | None = None
        self._gradients: StepGradients | None = None  # the owner of a step's gradients, built at setup
        self._warned_eval_split = False
        self._warned_replicated = False  # a batch in which nothing splits (see `_split`)

    # ---- parallel layout -------------------------------------------------------------------------------------

    @property
    def topology(self) -> Topology:
        """This rank's (dp, pp, tp) coordinates. Available after ``setup_environment``."""
        if self._topology is None:
            raise RuntimeError("The topology exists after the processes are launched; call `trainer.fit` first.")
        return self._topology

    @property
    def device_mesh(self) -> DeviceMesh:
        if self._device_mesh is None:
            raise RuntimeError("The device mesh exists after the processes are launched; call `trainer.fit` first.")
        return self._device_mesh

    @property
    def groups(self) -> ParallelGroups:
        """Named process groups (``TP``, ``PP``, ``DP``, ``RDP``, ``WORLD``) for ``lightning_mp.allgather`` & co."""
        if self._groups is None:
            raise RuntimeError("The process groups exist after the processes are launched; call `trainer.fit` first.")
        return self._groups

    @property
    def partition_plan(self) -> PartitionPlan:
        """Module FQN -> stage, the same on every rank. Available after ``setup``."""
        if self._plan is None:
            raise RuntimeError("The partition plan is made in `setup`; it exists once the trainer has started.")
        return self._plan

    @property
    def partition_trace(self) -> ModelTrace | None:
        """The trace the plan was made from, on global rank 0 (``None`` elsewhere, or when a plan was reused)."""
        return self._trace

    @property
    def pipeline_engine(self) -> PipelineEngine | None:
        """This rank's pipeline engine (``None`` before the processes are launched); ``engine.timeline`` records."""
        return self._engine

    @property
    def pp_rank(self) -> int:
        return self.topology.pp_rank

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel replica (the ``dp`` axis: the sampler's rank; SMP's ``rdp_rank``). Not
        ``lightning_mp.dp_rank(strategy.groups)``, which is SMP's DP rank over replicas x tp ranks (see [Note: axis
        vocabulary] in ``lightning_mp/topology.py``)."""
        return self.topology.dp_rank

    @property
    def tp_rank(self) -> int:
        return self.topology.tp_rank

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        """Whether data is sharded over replicas: Lightning reads this to insert a ``DistributedSampler``.

        With one data-parallel replica (pipeline or tensor parallelism only) every rank reads the whole loader as
        the user built it, so ``shuffle=False`` keeps its order, as on one device. With ``dp > 1`` Lightning injects
        ``DistributedSampler`` over the data-parallel axis exactly as under ``ddp`` (training loaders shuffled with
        the global seed, whatever the loader's own ``shuffle``; pass ``use_distributed_sampler=False`` to keep your
        own sampler). Before the processes are launched it is ``True`` (the layout is not known yet).
        """
        if self._topology is None:
            return True
        return self._topology.data_parallel_degree > 1

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Shard data over the data-parallel axis only: all stages of one replica read the same batches."""
        return {"num_replicas": self.topology.data_parallel_degree, "rank": self.topology.dp_rank}

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Under ``seed_everything(workers=True)``, seed loader workers by data-parallel rank, not global rank.

        Lightning then leaves the ``worker_init_fn`` alone; every pp/tp rank of a replica draws in its workers what
        ``ddp``'s rank ``dp_rank`` draws (one device's with one replica), so the ranks of a replica read one batch.
        """
        if (
            int(os.environ.get("PL_SEED_WORKERS", 0))
            and getattr(dataloader, "worker_init_fn", False) is None
            and self._topology is not None
        ):
            dataloader.worker_init_fn = partial(pl_worker_init_function, rank=self._topology.dp_rank)  # type: ignore[attr-defined]
        return dataloader

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False

    @override
    def _configure_launcher(self) -> None:
        self._launcher = make_launcher(self, self._start_method)  # see [Note: threads per process] in _launch.py

    def check_before_launch(self, function: Any, args: tuple, kwargs: dict) -> None:
        """What the layout makes certain to fail, raised in the launching process before any other process starts
        (the launchers call this; see ``_prelaunch.py``)."""
        check_before_launch(self.config, self.num_nodes * self.num_processes, function, args, kwargs)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        apply_thread_policy(self.num_processes)  # for launch paths without a launcher; see _launch.py
        if self.config.release_host_memory and not fix_mmap_threshold():
            rank_zero_warn("release_host_memory=True has no effect here: it needs glibc (Linux) malloc.")
        self.set_world_ranks()
        backend = self.config.process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        self._process_group_backend = backend
        # Fail before the first collective: the layout is pure arithmetic on the world size.
        self._topology = Topology(
            self.world_size,
            self.global_rank,
            self.config.pipeline_parallel_degree,
            self.config.tensor_parallel_degree,
            self.config.placement_strategy,
        )
        if self._topology.data_parallel_degree > 1:  # see [Note: generators at launch]
            reset_seed()
        check_data_plane(self.config, self.root_device)  # before the first collective
        assert self.cluster_environment is not None
        _init_dist_connection(self.cluster_environment, backend, timeout=self.config.timeout)
        if self._engine is None:  # a later fit/validate/test in the same processes keeps groups, plan and placement
            share_generators()  # without a seed, every rank takes rank 0's: see [Note: ranks start alike]
            options = group_options(self._topology, self.config, self.root_device)
            self._process_groups = build_process_groups(
                self._topology, self.root_device.type, self.config.timeout, options
            )  # every group from the layout, in one order: see [Note: process group order] in topology.py
            self._device_mesh = self._process_groups.mesh
            self._groups = self._process_groups.smp_groups()
            self._engine = self._build_engine()
            release_at_exit(self)  # see [Note: exit-time abort] in _exit.py

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """With ``empty_init=True`` (``trainer.init_module``) or ``delayed_parameter_initialization`` (for
        ``configure_model``): build under :func:`lightning_mp.delay_param_initialization`, else as Lightning does."""
        delayed = empty_init or (empty_init is None and self.config.delayed_parameter_initialization)
        if not delayed:
            with super().tensor_init_context(empty_init):
                yield
            return
        with self.root_device, delay_param_initialization(), self.precision_plugin.tensor_init_context():
            yield

    def enable_delayed_parameter_initialization(self) -> None:
        """Turn on delayed init for ``configure_model`` (the ``DelayedParameterInit`` callback calls this)."""
        self.config = replace(self.config, delayed_parameter_initialization=True)

    def _release_process_groups(self) -> None:
        """Drop every object that holds a process group (at exit, after they were destroyed)."""
        self._engine = None
        self._gradients = None
        self._process_groups = None
        self._device_mesh = None
        self._groups = None

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    def _build_engine(self) -> PipelineEngine:
        """The pipeline engine over this rank's pipeline transport (see ``_transport.py``)."""
        topology = self.topology
        assert self._process_groups is not None
        return PipelineEngine(
            build_pipeline_transport(self._process_groups, self.root_device, self.config),
            topology.pipeline_parallel_degree,
            schedule=self.config.pipeline,
            active_microbatches=self.config.effective_active_microbatches,
            timeout_s=self.config.timeout.total_seconds(),
            forward_context=self.precision_plugin.forward_context,
            global_ranks=topology.pp_group_ranks(),
            order_transport=build_order_transport(self._process_groups, self.root_device),
            seed=int(os.environ.get("PL_GLOBAL_SEED", torch.initial_seed())),
            remote_handles=self.config.remote_handles,
        )

    # ---- setup -----------------------------------------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        self._check_supported(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if self._param_order is None:
            self._param_order = [fqn for fqn, _ in self.model.named_parameters()]
            self._param_names = original_names(self.model)
        if self._save_distributed_checkpoint:
            _checkpoint.name_checkpoint_folders(trainer.checkpoint_callbacks)
        if self._plan is None:  # the first setup of these processes: every rank starts from rank 0's model
            sync_initial_states(self.lightning_module)
        self._place_modules(trainer)
        if self._load_weights is not None:
            _checkpoint.load_weights(
                self._load_weights, self.lightning_module, self._param_names, strict=self.lightning_module.strict_loading
            )
        self._build_reducer()
        if self.topology.pipeline_parallel_degree * self.topology.tensor_parallel_degree > 1:
            sync_metrics_over(self.lightning_module, self.device_mesh.get_group(MeshAxis.DP.value))
        if self.topology.pipeline_parallel_degree * self.topology.tensor_parallel_degree > 1:  # the whole model, full sizes
            counts = gather_parameter_counts(
                self.lightning_module, self.device_mesh.get_group(MeshAxis.PP.value), names=self._param_names
            )
            summarize_whole_model(trainer.callbacks, counts)
        if self.topology.data_parallel_degree == 1:
            silence_single_replica_sync_advice()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            if self.config.pipeline_parallel_degree > 1 or self.config.tensor_parallel_degree > 1:
                self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_global_norm
        self.setup_precision_plugin()
        install_synced_scaler(self.precision_plugin, _group.WORLD)  # see [Note: GradScaler over stages]
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _check_supported(self, trainer: pl.Trainer) -> None:
        module = self.lightning_module
        pp = self.config.pipeline_parallel_degree
        if pp > 1 and self.config.microbatches < pp:
            rank_zero_warn(
                f"microbatches={self.config.microbatches} is fewer than pipeline_parallel_degree={pp}: stages mostly"
                f" wait for each other. Use microbatches >= {pp} (e.g. {2 * pp}) for the pipeline to overlap work."
            )
        if self.config.tensor_parallel_degree > 1 and self.config.tied_weights == "replicate":
            raise ValueError(
                f"tied_weights='replicate' with tensor_parallel_degree={self.config.tensor_parallel_degree} is not"
                " supported yet (tie groups over tensor-parallel shards are not built). Use tied_weights='colocate' or"
                " 'auto' (which co-locates under tensor parallelism)."
            )
        if trainer.state.fn == TrainerFn.FITTING and not module.automatic_optimization:
            raise ValueError(
                "The 'smp' strategy runs backward inside the pipeline, so manual optimization"
                " (`self.automatic_optimization = False`) is not supported. Use automatic optimization."
            )
        if self.config.trace_execution_times and is_delayed(module):
            raise ValueError(
                "trace_execution_times=True cannot time a model built under delayed parameter initialisation (it is"
                " traced on the meta device). Drop trace_execution_times, or build the model eagerly."
            )

    def _place_modules(self, trainer: pl.Trainer) -> None:
        """Trace and plan on global rank 0, broadcast, keep this stage's modules (see ``_placement``)."""
        if self._plan is not None:  # already placed (e.g. validate after fit): the layout stays
            return
        module = self.lightning_module
        if self.config.pipeline_parallel_degree == 1:
            if self.config.partition or self.config.partition_plan or manual_placements(module):
                rank_zero_warn(
                    "Stage placements (`partition=`, `partition_plan=` or `with lightning_mp.partition(k)`) have no"
                    " effect with pipeline_parallel_degree=1; set pipeline_parallel_degree > 1 to split the model."
                )
            self._plan = single_stage_plan(module)
        elif self.config.partition_plan is not None:
            self._plan = load_plan(self.config.partition_plan, module, self.config.pipeline_parallel_degree)
            rank_zero_info(f"lightning_mp: reusing the partition plan from {self.config.partition_plan}")
        elif (
            not self._replan_on_resume
            and (resume := resolve_resume_path(self._resume_path, trainer)) is not None
            and (saved := plan_saved_in(resume, module, self.config.pipeline_parallel_degree)) is not None
        ):
            self._plan = saved
        else:
            result: Any = None
            if self.global_rank == 0:
                try:  # the sample goes in as the loop would give it (device, then the precision's dtype; meta if delayed)
                    to_device = meta_trace_inputs(self._sample_to_device) if is_delayed(module) else self._sample_to_device

                    in_child = trace_in_child(is_delayed(module))
                    # the batch is fetched here: data loading (workers, collate) stays in this process
                    batch = first_batch(trainer) if in_child else _FETCH

                    def make() -> tuple[PartitionPlan, ModelTrace]:
                        with self.precision_plugin.forward_context():
                            return make_plan(trainer, self.config, to_device, batch)

                    # see [Note: the meta trace runs in a child process] in _placement.py; the child gets 80% of the
                    # timeout, so that the other ranks, waiting in the plan's broadcast, hear why it failed
                    result = make_plan_in_child(make, self.config.timeout * 0.8) if in_child else make()
                except Exception as err:  # every rank must learn of it, or the others wait in the broadcast
                    result = err
            self._plan = broadcast_plan(result)
            if self.global_rank == 0:
                self._trace = result[1]
                if not any(getattr(c, "shows_partition_table", False) for c in trainer.callbacks):  # PartitionSummary
                    rank_zero_info("lightning_mp partition plan:\n" + self._plan.format_table(self._trace))
            if module.example_input_array is not None:
                rank_zero_warn(
                    "`example_input_array` cannot run through the pipeline outside a step, so it is cleared after"
                    " partitioning (Lightning's model summary then shows no in/out sizes)."
                )
                module.example_input_array = None
        assert self._engine is not None
        self._plan = self._check_ties(self._plan, module)
        stage_of = self._plan.stage_of
        if self.config.tensor_parallel_degree > 1:
            stage_of, _ = _tp.apply_tensor_parallelism(
                module, self.groups, stage_of, self.pp_rank, self.global_rank, optimize=self.config.optimize,
                random_streams=self.config.tp_random_streams,
            )
        self._engine.install(module, stage_of, self._plan.ordered_state)
        if is_delayed(module):  # only this stage's tensors (under tp, shards) are left: allocate and initialise them
            materialize_stage(module, self.root_device, self.pp_rank)
        if self.config.release_host_memory:
            trim_host_memory()  # what the build, the trace and the replay freed
        self._tied = build_tied_weights(module, self._plan, self._param_names, self.topology, self.config.timeout)
        self._tied.broadcast_copies()  # see [Note: replicated tied weights] in _tied.py
        self._engine.order_gradients(module)

    def _build_reducer(self) -> None:
        """The owner of a step's gradients (see [Note: a step's reductions] in ``_gradients.py``), with the bucketed
        all-reduce over dp during backward when the groups include one (dp > 1 without tensor parallelism; with it,
        the replicated parameters' gradients are reduced over tp first, so dp runs after backward, as it always did)."""
        if self._gradients is not None:
            return
        assert self._engine is not None and self._process_groups is not None
        topology = self.topology
        self._gradients = StepGradients(
            self.model,
            self._process_groups,
            self._tied,
            self._engine,
            self.root_device,
            launch_in_hooks=self.root_device.type != "cuda" or topology.pipeline_parallel_degree == 1,
        )

    def _check_ties(self, stages: PartitionPlan, module: torch.nn.Module) -> PartitionPlan:
        """The plan with its replicated parameters as its placement implies (a plan saved before they were recorded
        gets them); an error if it splits a tie under ``tied_weights="colocate"``."""
        replicated = replicated_stages(module, stages.stage_of)
        if replicated and self.config.tensor_parallel_degree > 1:
            raise ValueError(
                f"The partition plan places modules that share a parameter on different stages ({replicated}), which"
                " is not supported with tensor_parallel_degree > 1 yet. Use a plan that keeps tied modules together."
            )
        if replicated and self.config.tied_weights == "colocate":
            raise ValueError(
                f"The partition plan places modules that share a parameter on different stages ({replicated}), but"
                " tied_weights='colocate'. Use tied_weights='replicate' (or 'auto') to keep a copy on each stage, or"
                " a plan that keeps tied modules together."
            )
        return stages if replicated == stages.replicated else replace(stages, replicated=replicated)

    def _sample_to_device(self, batch: Any) -> Any:
        return self.precision_plugin.convert_input(self.batch_to_device(batch))

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        self._reset_optimizers_and_schedulers()
        super().setup_optimizers(trainer)
        if self.config.shard_optimizer_state and self.topology.data_parallel_degree > 1:
            self._shard_optimizers()
        elif self.config.shard_optimizer_state:
            rank_zero_warn(
                "shard_optimizer_state=True has no effect with one data-parallel replica (world size = pipeline x"
                " tensor parallel degree); use more devices to shard the optimizer state."
            )

    def _shard_optimizers(self) -> None:
        """ZeRO-1 over this stage's dp group; schedulers follow (see [Note: sharded optimizer state])."""
        group = self.device_mesh.get_group(MeshAxis.DP.value)
        sharded = {id(o): shard_optimizer(o, group) for o in self.optimizers}
        for config in self.lr_scheduler_configs:
            if id(config.scheduler.optimizer) in sharded:
                config.scheduler.optimizer = sharded[id(config.scheduler.optimizer)]
                track_step_for_schedulers(config.scheduler.optimizer)
        self.optimizers = list(sharded.values())

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        if is_delayed(self.model):
            return  # meta until partitioned; each stage is materialised on the root device in `_place_modules`
        self.model.to(self.root_device)

    # ---- steps -----------------------------------------------------------------------------------------------

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        trainer = self.lightning_module.trainer
        assert self._gradients is not None
        self._gradients.begin(
            list(self.model.parameters()),
            first_in_window=trainer.fit_loop.epoch_loop.batch_idx % trainer.accumulate_grad_batches == 0,
            last_in_window=_steps_optimizer(trainer),
            microbatches=self.config.microbatches,
        )
        summary = None
        try:
            summary = self._pipelined_step(
                "training_step",
                self.precision_plugin.train_step_context,
                args,
                kwargs,
                loss_scale=_LossScale(
                    self.config.microbatches, trainer.accumulate_grad_batches, loss_scale_of(self.precision_plugin)
                ),
            )
        finally:
            self._gradients.end(summary)
        return _to_device(summary.output, self.root_device)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        summary = self._pipelined_step("validation_step", self.precision_plugin.val_step_context, args, kwargs)
        return _to_device(summary.output, self.root_device)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        summary = self._pipelined_step("test_step", self.precision_plugin.test_step_context, args, kwargs)
        return _to_device(summary.output, self.root_device)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        summary = self._pipelined_step("predict_step", self.precision_plugin.predict_step_context, args, kwargs)
        return _to_device(summary.output, self.root_device)

    def _pipelined_step(
        self, hook: str, context: Any, args: tuple, kwargs: dict, loss_scale: _LossScale | None = None
    ) -> StepSummary:
        """Run ``hook`` per microbatch through the pipeline; every rank gets the step's summary.

        A ``loss_scale`` makes it a training step (backward per microbatch).
        """
        assert self._engine is not None
        module = self.lightning_module
        batch, rest = args[0], args[1:]
        microbatches = self._split(batch, training=loss_scale is not None)
        step = getattr(module, hook)
        recorder = LogRecorder(module)

        def step_fn(microbatch: Any, index: int) -> Any:
            with recorder.microbatch(index), context():
                return step(microbatch, *rest, **kwargs)

        with self._engine.session(hook, rng_key=self._rng_key(hook, rest)) as session:
            if self._engine.is_driver:
                with recorder:
                    outputs = session.drive(
                        step_fn,
                        microbatches,
                        loss_fn=partial(_scaled_loss, scale=loss_scale),
                        backward=loss_scale is not None,
                    )
                summary = _summarize(outputs, recorder, send_metric_states=self.topology.pipeline_parallel_degree > 1)
                session.finish(summary)
            else:
                summary = session.serve()
                for state in summary.metric_states:  # see [Note: metrics in a pipelined step]
                    load_metric_log(module, state)
        model_parallel = self.topology.pipeline_parallel_degree * self.topology.tensor_parallel_degree > 1
        dp_group = self.device_mesh.get_group(MeshAxis.DP.value) if model_parallel else None  # sync over replicas
        replay_logs(module, summary.logs, dp_group)
        return summary

    def _rng_key(self, hook: str, rest: tuple) -> tuple:
        """The step's name for its random streams: the same on every rank, layout and run (and after a resume)."""
        trainer = self.lightning_module.trainer
        return (hook, trainer.current_epoch, trainer.global_step, tuple(a for a in rest if isinstance(a, int)))

    def _split(self, batch: Any, training: bool) -> list[Any]:
        """Split on every rank (all stages hold the batch), so a bad batch fails everywhere before any message."""
        try:
            split = split_batch(batch, self.config.microbatches, non_split_inputs=self.config.non_split_inputs)
        except MicrobatchSplitError:
            if training:
                raise
            if not self._warned_eval_split:
                rank_zero_warn(
                    f"An evaluation batch does not split into `microbatches={self.config.microbatches}`; running"
                    " such batches as one microbatch (results are the same, only slower). Use `drop_last=True` or a"
                    " divisible batch size to avoid this."
                )
                self._warned_eval_split = True
            return [batch]
        if not split.split_any and self.config.microbatches > 1 and not self._warned_replicated:
            rank_zero_warn(
                f"Nothing in this batch splits into `microbatches={self.config.microbatches}`: every microbatch gets"
                f" the whole batch ({', '.join(split.replicated) or 'an empty batch'}), so each one computes it all."
                " Return tensors with the batch on dim 0, or lists/tuples of one value per sample, or use"
                " microbatches=1."
            )
            self._warned_replicated = True
        return split.parts

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """Finish a pipelined step's backward (it already ran in ``training_step``): put its gradients in ``.grad``.

        On the batch that ends an accumulation window the gradients are reduced here (``StepGradients.finish``),
        before ``post_backward`` runs ``on_after_backward``: a hook there sees the averaged gradients, as under DDP
        (whose all-reduce ends with backward); on the other batches of a window it sees the window's local gradients
        so far, as under DDP's ``no_sync``.
        """
        module = self.lightning_module
        assert self._gradients is not None
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self._gradients.apply()
        if _steps_optimizer(module.trainer):
            self._gradients.finish()
        return self.precision_plugin.post_backward(closure_loss, module)

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Step after the gradients are reduced (once per optimizer step, after accumulation): :meth:`backward` of
        the window's last batch did it (see [Note: a step's reductions] in ``_gradients.py``); if backward did not
        run (a step that returned ``None``), it happens here after the closure."""
        gradients = self._gradients
        assert gradients is not None
        if not gradients.syncs:
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def closure_then_reduce() -> Any:
            result = closure()
            gradients.finish()  # a no-op when backward reduced them (it does unless backward was skipped)
            return result

        return super().optimizer_step(optimizer, closure_then_reduce, model, **kwargs)

    def _clip_grad_by_global_norm(self, optimizer: Optimizer, clip_val: float | int) -> None:
        """``gradient_clip_algorithm="norm"`` over the whole model: reduced over stages and tp shards."""
        assert self._gradients is not None
        self._gradients.clip(optimizer, clip_val)

    # ---- collectives -----------------------------------------------------------------------------------------

    @override
    def barrier(self, name: str | None = None) -> None:
        if _distributed_is_initialized():
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        payload = [obj]
        dist.broadcast_object_list(payload, src, group=_group.WORLD)
        return payload[0]

    @override
    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor | Any:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # ---- checkpoints -----------------------------------------------------------------------------------------

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return _checkpoint.model_state_dict(self.model)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return _checkpoint.optimizer_state_dict(self.model, local_optimizer(_unwrap(optimizer)))

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("The 'smp' strategy saves through torch.distributed.checkpoint; `storage_options` is unused.")
        path = Path(self.broadcast(str(filepath)))
        checkpoint[PLAN_KEY] = {
            "partition_plan": self.partition_plan.to_dict(),
            "layout": dict(zip(("dp", "pp", "tp"), self.topology.mesh_shape)),
            "tied_names": dict(self._param_names),  # for consolidation (see _consolidate.py)
            "hf": hf_info(self.lightning_module),
        }
        if self._save_distributed_checkpoint:
            _checkpoint.save_checkpoint(checkpoint, path, self.is_global_zero, self._param_names, self.model)
            return
        if self._sharded_optimizers():  # ZeRO-1: each dp rank holds a share of its stage's optimizer state
            group = self.device_mesh.get_group(MeshAxis.DP.value)
            merged = _checkpoint.gather_sharded_optimizer_states(
                checkpoint.get("optimizer_states", []), group, dist.get_global_rank(group, 0)
            )
            if merged is not None:
                checkpoint["optimizer_states"] = merged
        if self.topology.dp_rank == 0 and self.topology.tensor_parallel_degree > 1:  # tp shards -> full tensors
            checkpoint["state_dict"] = _checkpoint.gather_tp_shards(checkpoint["state_dict"], self.model)
            checkpoint["optimizer_states"] = [
                _checkpoint.gather_tp_shards(state, self.model, flat=True)
                for state in checkpoint.get("optimizer_states", [])
            ]
        if self.topology.dp_rank == 0 and self.topology.tp_rank == 0:  # replica 0's stages hold the whole model
            assert self._param_order is not None
            _checkpoint.save_full_checkpoint(
                checkpoint, path, self.model, [_unwrap(o) for o in self.optimizers], self._param_order,
                self.device_mesh.get_group(MeshAxis.PP.value), self.checkpoint_io if self.is_global_zero else None,
                self._param_names,
            )
        self.barrier("save_checkpoint")

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:  # its name goes in one rename (see [Note: checkpoint commit] in _checkpoint/_folder.py)
            _checkpoint.remove_checkpoint(Path(filepath))

    def _sharded_optimizers(self) -> bool:
        return any(local_optimizer(_unwrap(o)) is not _unwrap(o) for o in self.optimizers)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        optimizers = [_unwrap(o) for o in self.optimizers]
        local = [local_optimizer(o) for o in optimizers]
        if path.is_file():  # one full file: a plain Lightning checkpoint, or save_distributed_checkpoint=False
            assert self._param_order is not None
            checkpoint = _checkpoint.load_full_checkpoint(
                path, self.model, optimizers, self._param_order, self.device_mesh.get_group(MeshAxis.PP.value),
                strict=self.lightning_module.strict_loading, weights_only=weights_only, local_optimizers=local,
                names=self._param_names,
            )
        else:
            checkpoint = _checkpoint.load_checkpoint(
                path, self.model, local, strict=self.lightning_module.strict_loading, weights_only=weights_only,
                names=self._param_names,
            )
        for optimizer in optimizers:
            sync_hyperparameters_from_local(optimizer)
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # loaded in `load_checkpoint`

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # loaded in `load_checkpoint`

    @override
    def teardown(self) -> None:
        assert self.cluster_environment is not None
        self.cluster_environment.teardown()
        module = self.lightning_module
        if module is None or not holds_meta_tensors(module):
            super().teardown()
            return
        # a setup that failed before materialisation: the model is still on meta and Lightning's move to CPU would
        # raise "Cannot copy out of meta tensor" over the error that stopped the setup; there is nothing to move
        module.cpu = lambda: module
        try:
            super().teardown()
        finally:
            del module.cpu

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            "smp", cls, description="lightning_mp: automatic pipeline partitioning x data parallel (SageMaker MP design)"
        )


# [Note: generators at launch] One replica (pp x tp ranks and no more) is the peer of one device (``"auto"``),
# which leaves the global generators as the user's script left them: the shuffle of a ``shuffle=True`` loader, then
# every draw, equals that run's. Several replicas are the peer of ``ddp``, which re-seeds from ``PL_GLOBAL_SEED``
# in ``setup_environment`` (and shards with ``DistributedSampler``); so do we. Every rank of a replica starts from
# the same state either way: with a seed, popen and torchrun re-run the script, Lightning's spawn launcher restores
# the parent's snapshot, and ours does so under fork too (Python re-seeds `random` in a forked child); without one,
# every rank takes global rank 0's generators and model (see [Note: ranks start alike] in ``_replicas.py``).
# Setup's extra work (first batch, trace) restores them (``generators_kept``).


# [Note: token-weighted losses] A loss that is a mean over a data-dependent count (tokens with ``labels != -100``
# in a masked LM, unpadded positions) is not the mean of its microbatches' means: one process divides the sum over
# the batch by the batch's count. A step may therefore return ``{"loss": mean, "num_tokens": n}``, ``mean`` being
# the mean over the microbatch's ``n`` counted elements (as Megatron's ``calculate_per_token_loss`` and torchtitan's
# global token normalisation). Each microbatch then backpropagates ``mean * n / accumulate_grad_batches`` (its sum),
# and once every microbatch is done each stage divides the step's gradients by the batch's total ``n`` (sent to it
# with the step summary), so gradients, the returned loss and mean-reduced logged values all weigh microbatches by
# ``n / sum(n)``: one process's maths on the batch. A microbatch with ``n == 0`` runs no backward. Without
# ``num_tokens`` the loss is the mean of the microbatch losses. Data-parallel replicas then average their
# gradients as under ``ddp`` (each replica's batch is normalised by its own count).


def _steps_optimizer(trainer: pl.Trainer) -> bool:
    """Whether Lightning steps the optimizer after the current training batch (the accumulation window ends)."""
    epoch_loop = trainer.fit_loop.epoch_loop
    should_accumulate = getattr(epoch_loop, "_should_accumulate", None)
    if should_accumulate is None:  # another Lightning version: only without accumulation is it certain
        return trainer.accumulate_grad_batches == 1
    return not should_accumulate()


def _num_tokens(output: Any) -> float | None:
    if isinstance(output, Mapping) and "num_tokens" in output:
        n = output["num_tokens"]
        n = float(n.item() if isinstance(n, Tensor) else n)
        if n < 0:
            raise ValueError(f"A step returned num_tokens={n}; it must count elements, >= 0.")
        return n
    return None


@dataclass(frozen=True)
class _LossScale:
    """What a microbatch's loss is multiplied by before its backward (see ``_scaled_loss``).

    Attributes:
        microbatches: microbatches per batch.
        accumulate: Lightning's ``accumulate_grad_batches``.
        grad_scale: the GradScaler's scale under ``16-mixed`` (see [Note: GradScaler over stages]), else 1.
    """

    microbatches: int
    accumulate: int
    grad_scale: float = 1.0


def _scaled_loss(output: Any, scale: _LossScale | None) -> Tensor | None:
    """The tensor a microbatch backpropagates: loss x grad_scale / (microbatches x accumulate), or, token-weighted
    (see [Note: token-weighted losses]), loss x n x grad_scale / accumulate."""
    if scale is None or output is None:
        return None
    loss = output.get("loss") if isinstance(output, Mapping) else output
    if not isinstance(loss, Tensor):
        raise TypeError(
            f"training_step must return a loss tensor or a dict with 'loss' under the 'smp' strategy, got {type(loss).__name__}."
        )
    n = _num_tokens(output)
    if n is None:
        return loss * scale.grad_scale / (scale.microbatches * scale.accumulate)
    return None if n == 0 else loss * (n * scale.grad_scale) / scale.accumulate


def _summarize(outputs: list[Any], recorder: LogRecorder, send_metric_states: bool) -> StepSummary:
    """Merge the microbatch outputs and logged values; token-weighted when the step returns ``num_tokens``.
    ``send_metric_states``: other stages exist, to which the states of unlogged updated metrics go."""
    counts = [_num_tokens(o) for o in outputs]
    states = recorder.unlogged_metric_states() if send_metric_states else []
    if all(n is None for n in counts):
        return StepSummary(merge_microbatches([detach_cpu(o) for o in outputs]), recorder.reduced(), metric_states=states)
    if any(n is None for n in counts):
        raise ValueError(
            "Some microbatches returned `num_tokens` and others did not; a step that weights its loss by tokens must"
            " return {'loss': ..., 'num_tokens': ...} for every microbatch."
        )
    total = sum(counts)
    merged = merge_microbatches([detach_cpu(o) for o in outputs])
    losses = [detach_cpu(o["loss"]).to(torch.float64) for o in outputs]
    if total > 0:
        weighted = sum(loss * n for loss, n in zip(losses, counts) if n > 0) / total
    else:
        weighted = torch.tensor(float("nan"), dtype=torch.float64)
    dtype = outputs[0]["loss"].dtype
    merged["loss"] = weighted.to(dtype if dtype.is_floating_point else torch.float32)
    return StepSummary(merged, recorder.reduced(weights=counts), num_tokens=total, metric_states=states)


def _unwrap(optimizer: Any) -> Optimizer:
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def _to_device(obj: Any, device: torch.device) -> Any:
    from lightning.fabric.utilities.apply_func import move_data_to_device

    return move_data_to_device(obj, device)
