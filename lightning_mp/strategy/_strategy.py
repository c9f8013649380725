"""``SMPStrategy``: the Lightning strategy ``"smp"``: pipeline x tensor x data parallelism, automatic partitioning.

Each Lightning hook here is one or two calls into the modules that own the work (as Lightning's own
``ModelParallelStrategy``): the knobs are :class:`~lightning_mp.SMPConfig`; the launch, ``_launch.py`` and
``_prelaunch.py``; the plan and this rank's stage, ``_stages.py``; the pipelined step, ``_runner.py``; checkpoints,
``_saving.py``; gradients, ``_gradients.py`` (the one owner; over ``_reducer.py``, ``_tp.py`` and ``_tied.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mp.config import SMPConfig, config_fields
from lightning_mp.init import delay_param_initialization
from lightning_mp.partition import ModelTrace, PartitionPlan
from lightning_mp.pipeline import PipelineEngine
from lightning_mp.strategy import _checkpoint
from lightning_mp.strategy._delayed import is_delayed, kept_on_meta
from lightning_mp.strategy._exit import release_at_exit
from lightning_mp.strategy._launch import elastic_store, make_launcher, prepare_process
from lightning_mp.strategy._precision import install_synced_scaler
from lightning_mp.strategy._fsdp import ShardedStage
from lightning_mp.strategy._gradients import StepGradients
from lightning_mp.strategy._prelaunch import check_before_launch
from lightning_mp.strategy._preemption import Preemption
from lightning_mp.strategy._roll_call import answer_roll_calls
from lightning_mp.strategy._replicas import seed_workers_by_replica, share_generators, sync_initial_states
from lightning_mp.strategy._runner import StepRunner
from lightning_mp.strategy._runner import steps_optimizer as _steps_optimizer
from lightning_mp.strategy._saving import CheckpointHooks
from lightning_mp.strategy._stages import check_supported, choose_plan, install_stage, launch_runtime
from lightning_mp.strategy._summary import whole_model_views
from lightning_mp.strategy._tied import TiedWeights, original_names
from lightning_mp.strategy._transport import check_data_plane
from lightning_mp.strategy._zero import shard_optimizers
from lightning_mp.topology import MeshAxis, ProcessGroups, Topology
from lightning_mp.tp import ParallelGroups

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["SMPStrategy"]

T = TypeVar("T")
_AFTER_LAUNCH = "after the processes are launched; call `trainer.fit` first."


class SMPStrategy(CheckpointHooks, ParallelStrategy):
    """Model parallelism after the SageMaker model parallelism library (Karakus et al., 2021), for Lightning.

    The model is split automatically into ``pipeline_parallel_degree`` stages (paper section 3.1) and run by a
    module-server pipeline engine (section 3.2) that keeps the LightningModule's eager Python code working;
    modules marked for tensor parallelism are split over ``tensor_parallel_degree`` ranks; the remaining factor of
    the world size is data parallelism: ``dp = world_size / (pp * tp)``. Each step the batch is split into
    ``microbatches`` along dim 0; pipeline rank 0 runs ``training_step`` per microbatch; the step returns the mean
    loss on every rank.

    Args:
        accelerator: Lightning's, as for any ``ParallelStrategy`` (the ``Trainer`` fills it in).
        parallel_devices: one device per local process (the ``Trainer`` fills them in).
        cluster_environment: Lightning's (the ``Trainer`` picks one).
        checkpoint_io: Lightning's; global rank 0 writes full checkpoint files through it.
        precision_plugin: Lightning's (the ``Trainer``'s ``precision=``).
        **fields: :class:`~lightning_mp.SMPConfig` fields by name, where each is documented:
            ``SMPStrategy(pipeline_parallel_degree=2, microbatches=4)``; the CLI's ``init_args`` are these. A
            whole config: :meth:`from_config`.

    Raises:
        ValueError: at construction for invalid values (see :class:`~lightning_mp.SMPConfig`); at launch for a
            world size not divisible by ``pipeline_parallel_degree * tensor_parallel_degree``; at setup for a model
            with fewer placeable modules than stages, or a batch that does not split into ``microbatches``.
        TypeError: at construction for a name that is not a field of :class:`~lightning_mp.SMPConfig`.
    """

    strategy_name = "smp"

    def __init__(
        self,
        *,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        **fields: Any,
    ) -> None:
        super().__init__(accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin)
        fields = config_fields(fields)
        self.config = SMPConfig(**fields)  # jsonargparse reads the fields of this call for the CLI
        self._runner = StepRunner(self.config.microbatches, self.config.non_split_inputs)
        self._param_order: list[str] | None = None  # the whole model's parameter FQNs, before placement
        self._param_names: dict[str, str] = {}  # other names of shared parameters -> original FQN (see _tied.py)
        self._tied = TiedWeights([])
        self._sharded: ShardedStage | None = None  # this stage under FSDP2 (sharded_data_parallel_degree > 1)
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
        self._preemption = Preemption()  # SIGTERM and SIGINT: see [Note: SIGTERM at a step boundary]

    @classmethod
    def from_config(cls, config: SMPConfig, **plugins: Any) -> SMPStrategy:
        """The strategy of ``config``; ``plugins``: Lightning's, as for the constructor."""
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)}, **plugins)

    @property
    def topology(self) -> Topology:
        """This rank's (dp, pp, tp) coordinates. Available after ``setup_environment``."""
        return _launched(self._topology, f"The topology exists {_AFTER_LAUNCH}")

    @property
    def device_mesh(self) -> DeviceMesh:
        return _launched(self._device_mesh, f"The device mesh exists {_AFTER_LAUNCH}")

    @property
    def groups(self) -> ParallelGroups:
        """Named process groups (``TP``, ``PP``, ``DP``, ``RDP``, ``WORLD``) for ``lightning_mp.allgather`` & co."""
        return _launched(self._groups, f"The process groups exist {_AFTER_LAUNCH}")

    @property
    def partition_plan(self) -> PartitionPlan:
        """Module FQN -> stage, the same on every rank. Available after ``setup``."""
        return _launched(self._plan, "The partition plan is made in `setup`; it exists once the trainer has started.")

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
        """Whether data is sharded over replicas (``dp > 1``): Lightning then injects a ``DistributedSampler`` over
        the data-parallel axis as under ``ddp``; with one replica every rank reads the loader as the user built it,
        as on one device. ``True`` before the processes are launched (the layout is not known yet)."""
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
        if self._topology is not None:  # workers seeded by replica (see _replicas.py)
            seed_workers_by_replica(dataloader, self._topology.dp_rank)
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
        self._launcher = make_launcher(self, self.config.start_method)  # see [Note: threads per process] in _launch.py

    def check_before_launch(self, function: Any, args: tuple, kwargs: dict, trainer: Any = None) -> None:
        """What the layout makes certain to fail, raised in the launching process before any other process starts
        (the launchers call this; see ``_prelaunch.py``). With DCP checkpoints it also names ``trainer``'s
        ``ModelCheckpoint`` folders, before the entry point resolves ``ckpt_path="last"`` (Lightning looks for
        ``last`` under the callbacks' file suffix)."""
        check_before_launch(self.config, self.num_nodes * self.num_processes, function, args, kwargs)
        if trainer is not None and self.config.save_distributed_checkpoint:
            _checkpoint.name_checkpoint_folders(trainer.checkpoint_callbacks, announce=False)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        pipelined = self.config.pipeline_parallel_degree > 1
        prepare_process(self.num_processes, self.config.release_host_memory, pipelined)  # threads, malloc: _launch.py
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
            self.config.sharded_data_parallel_degree,
        )
        if self._topology.data_parallel_degree > 1:  # see [Note: generators at launch] in _replicas.py
            reset_seed()
        check_data_plane(self.config, self.root_device)  # before the first collective
        assert self.cluster_environment is not None
        _init_dist_connection(  # a torchrun restart gets its own store keys: see [Note: stores of elastic restarts]
            self.cluster_environment, backend, timeout=self.config.timeout,
            **elastic_store(self.cluster_environment, self.config.timeout),
        )
        answer_roll_calls()  # failed collectives name the dead ranks: see [Note: roll call after a failed collective]
        if self._engine is None:  # a later fit/validate/test in the same processes keeps groups, plan and placement
            share_generators()  # without a seed, every rank takes rank 0's: see [Note: ranks start alike]
            self._process_groups, self._engine = launch_runtime(
                self._topology, self.config, self.root_device, self.precision_plugin.forward_context
            )
            self._device_mesh, self._groups = self._process_groups.mesh, self._process_groups.smp_groups()
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
        self.config = dataclasses.replace(self.config, delayed_parameter_initialization=True)

    def _close_transports(self) -> None:
        """Stop the pipeline transports' threads (at exit, before the process groups are destroyed)."""
        if self._engine is not None:
            self._engine.close()

    def _release_process_groups(self) -> None:
        """Drop every object that holds a process group (at exit, after they were destroyed)."""
        self._runner.detach()
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

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        self._preemption.install(trainer)  # before the Trainer registers its signal handlers
        check_supported(self.lightning_module, self.config, fitting=trainer.state.fn == TrainerFn.FITTING)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if self._param_order is None:
            self._param_order = [fqn for fqn, _ in self.model.named_parameters()]
            self._param_names = original_names(self.model)
        if self.config.save_distributed_checkpoint:
            _checkpoint.name_checkpoint_folders(trainer.checkpoint_callbacks)
        if self._plan is None:  # the first setup of these processes (validate after fit keeps the layout)
            sync_initial_states(self.lightning_module)  # every rank starts from rank 0's model
            plan, self._trace = choose_plan(  # the same on every rank
                trainer, self.config, self.global_rank, self._resume_path,
                lambda batch: self.precision_plugin.convert_input(self.batch_to_device(batch)),
                self.precision_plugin.forward_context,
            )
            stage = install_stage(  # keep this rank's stage
                self.lightning_module, plan, self._engine, self._process_groups, self.topology, self.config,
                self.root_device, self._param_names, self.precision_plugin.precision,
            )
            self._plan, self._tied, self._sharded = stage.plan, stage.tied, stage.sharded
        if self.config.load_weights is not None:
            _checkpoint.load_weights(
                self.config.load_weights, self.lightning_module, self._param_names,
                strict=self.lightning_module.strict_loading,
            )
        if self._gradients is None:  # the one owner of a step's gradients: see [Note: a step's reductions]
            self._gradients = StepGradients(
                self.model, self._process_groups, self._tied, self._engine, self.root_device, sharded=self._sharded
            )
        dp_group = whole_model_views(trainer, self.lightning_module, self.topology, self.device_mesh, self._param_names)
        self._runner.attach(self._engine, self.lightning_module, self.topology.pipeline_parallel_degree, dp_group)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            if self._topology.mesh_shape[1:] != (1, 1) or self._sharded is not None:
                self.precision_plugin.clip_grad_by_norm = self._gradients.clip  # the whole model's norm
        self.setup_precision_plugin()
        install_synced_scaler(self.precision_plugin, _group.WORLD)  # see [Note: GradScaler over stages]
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        self._reset_optimizers_and_schedulers()
        super().setup_optimizers(trainer)
        if self.config.shard_optimizer_state:  # ZeRO-1, see [Note: sharded optimizer state] in _zero.py
            self.optimizers = shard_optimizers(
                self.optimizers, self.lr_scheduler_configs, self.device_mesh.get_group(MeshAxis.DP.value),
                self.topology.data_parallel_degree,
            )

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        if is_delayed(self.model):
            return  # meta until partitioned; each stage is materialised on the root device in `setup`
        self.model.to(self.root_device)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self._gradients is not None
        self._preemption.agree(self.lightning_module.trainer, self.root_device)
        summary = self._runner.train(
            self.lightning_module.trainer, self._gradients, self._gradients.step_parameters(), self.precision_plugin,
            args, kwargs,
        )
        return move_data_to_device(summary.output, self.root_device)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step("validation_step", self.precision_plugin.val_step_context, args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step("test_step", self.precision_plugin.test_step_context, args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step("predict_step", self.precision_plugin.predict_step_context, args, kwargs)

    def _evaluation_step(self, name: str, context: Any, args: tuple, kwargs: dict) -> Any:
        if self._sharded is not None:  # gathered at the loop's start; again if a callback's state_dict() resharded
            self._sharded.keep_gathered()
        summary = self._runner.run(name, context, args, kwargs)
        return move_data_to_device(summary.output, self.root_device)

    @override
    def on_validation_start(self) -> None:  # under sharded data parallelism: one all-gather per loop (_fsdp.py)
        if self._sharded is not None:
            self._sharded.start_evaluation()

    @override
    def on_validation_end(self) -> None:
        if self._sharded is not None:
            self._sharded.end_evaluation()

    on_test_start = on_predict_start = on_validation_start
    on_test_end = on_predict_end = on_validation_end

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """Finish a pipelined step's backward (it already ran in ``training_step``): put its gradients in ``.grad``.
        On the batch that ends an accumulation window they are reduced here (``StepGradients.finish``), before
        ``on_after_backward``, which sees them averaged, as under DDP; on the window's other batches it sees the
        window's local gradients so far, as under DDP's ``no_sync``."""
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
        assert self._gradients is not None
        return super().optimizer_step(optimizer, self._gradients.reducing(closure), model, **kwargs)

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

    @override
    def teardown(self) -> None:
        assert self.cluster_environment is not None
        self.cluster_environment.teardown()
        self._preemption.uninstall()
        with kept_on_meta(self.lightning_module):  # a setup that failed before materialisation (see _delayed.py)
            super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            "smp",
            cls,
            description="lightning_mp: automatic pipeline partitioning x tensor x data parallel (SageMaker MP design)",
        )


def _launched(value: T | None, message: str) -> T:
    if value is None:
        raise RuntimeError(message)
    return value
