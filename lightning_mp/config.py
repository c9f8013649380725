"""The one dataclass of every lightning_mp knob, validated on construction.

Each field is written here once, with its docstring; ``SMPStrategy(**fields)``, ``SMPStrategy.from_config`` and
the CLI's ``trainer.strategy.init_args`` (jsonargparse reads these fields and their docstrings) all take them.
Names follow the SageMaker model parallelism library (Karakus et al., 2021, arXiv 2111.05972; the "smp" v1
configuration keys such as ``partitions``, ``microbatches``, ``pipeline``, ``active_microbatches``,
``auto_partition``, ``default_partition``, ``optimize``, ``memory_weight``) where a user would look for them.
"""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

__all__ = ["SMPConfig"]

PipelineSchedule = Literal["interleaved", "simple", "zero_bubble"]
_SCHEDULES = ("interleaved", "simple", "zero_bubble")
Optimize = Literal["speed", "memory"]
TiedWeights = Literal["colocate", "replicate", "auto"]
DataPlane = Literal["auto", "gloo", "nccl"]
ReshardAfterForward = Literal["default", "always", "never"]

_DEFAULT_MEMORY_WEIGHT = {"speed": 0.2, "memory": 0.8}
_BOOLS = (
    "delayed_parameter_initialization",
    "shard_optimizer_state",
    "release_host_memory",
    "save_distributed_checkpoint",
    "replan_on_resume",
    "_remote_handles",
)


@dataclass(kw_only=True, frozen=True)
class SMPConfig:
    """Every knob of the ``smp`` strategy, in groups: layout, the pipelined step, placement, tensor parallelism,
    memory, checkpoints, processes.

    Raises:
        ValueError: on any value out of range, naming the value and the fix (checked here, at construction, before
            any process starts). What depends on the world size or the model (a world size not divisible by
            ``pipeline_parallel_degree * tensor_parallel_degree``, fewer placeable modules than stages, a batch
            that does not split into ``microbatches``) is checked at launch or setup.
    """

    # ---- Layout: ``dp = world_size / (pipeline_parallel_degree * tensor_parallel_degree)``
    pipeline_parallel_degree: int = 1
    """Number of pipeline stages (SMP ``partitions``). Each stage lives on its own rank."""

    tensor_parallel_degree: int = 1
    """Size of a tensor-parallel group: marked modules are split over this many neighbouring ranks, which read the
    same batch (see ``lightning_mp.set_tensor_parallelism``). ``dp = world_size / (pp * tp)``."""

    placement_strategy: str = "cluster"
    """Which parallel axis gets neighbouring global ranks (SMP's knob): ``"cluster"`` (= ``"DPT"``: the ranks of a
    tensor-parallel group are neighbours, then the stages, then the replicas), ``"spread"`` (= ``"TPD"``: replicas
    are neighbours) or any permutation of ``D``, ``P``, ``T`` from the outermost axis to the innermost. Put the
    axis with the most traffic (tp) on the fastest links (the ranks of one node)."""

    # ---- The pipelined step
    microbatches: int = 1
    """Microbatches per batch. Every tensor in a batch is split along dim 0 into this many equal parts."""

    non_split_inputs: tuple[str | int, ...] = ()
    """Top-level entries of a batch given whole to every microbatch instead of split along dim 0 (SMP's
    ``@smp.step(non_split_inputs=...)``): keys of a dict batch, field names of a dataclass or NamedTuple batch,
    integer positions of a tuple or list batch. E.g. ``("table",)`` for a lookup table every sample reads."""

    pipeline: PipelineSchedule = "interleaved"
    """``"interleaved"``: each stage runs its ready forward and backward work in the order 1F1B would (warm-up
    forwards, then one forward / one backward), taking the next ready task when the preferred one is not ready
    (1F1B-like activation memory). ``"simple"``: all forwards, then all backwards (GPipe). ``"zero_bubble"``: as
    ``"interleaved"``, with each backward split into its input gradient (sent upstream at once) and its weight
    gradient, deferred into the time the stage would wait (ZB-H1, Qi et al. 2023; any model, see [Note:
    zero-bubble] in ``pipeline/_zero_bubble.py``)."""

    active_microbatches: int | None = None
    """Cap on microbatches in flight on the driver at once. ``None`` means ``pipeline_parallel_degree + 2``
    (the SMP default)."""

    deterministic_order: bool | None = None
    """Make the ranks that hold the same stage in different data-parallel replicas (and one tensor-parallel group)
    run their stage's module calls in one order, decided by the lowest rank, whatever the message arrival times.
    Needed when those modules enter collectives together (e.g. ``SyncBatchNorm`` over the data-parallel group).
    Costs one small message per task from the leader; requires the replicas to make the same calls (no
    data-dependent control flow that differs between replicas). ``None``: on when ``tensor_parallel_degree > 1``."""

    # ---- Placement: which module runs on which stage (``with lightning_mp.partition(k)`` in the model places too)
    auto_partition: bool = True
    """Place modules on stages automatically (balanced by the cost model). If ``False``, modules not named in
    ``partition`` go to ``default_partition``."""

    default_partition: int = 0
    """Stage for modules without a placement when ``auto_partition`` is ``False``."""

    partition: Mapping[str, int] = field(default_factory=dict)
    """Manual placement: ``{module FQN: stage}``. The innermost entry wins for its subtree; auto fills the rest."""

    optimize: Optimize = "speed"
    """SMP's ``optimize``, which sets two things, as in SMP: the partition objective (``"speed"``:
    ``memory_weight=0.2``, ``"memory"``: ``0.8``) and, with ``tensor_parallel_degree > 1``, the built-in
    distributed transformer layers' variant (``"memory"``: sequence parallel, activations sharded along the
    sequence with all-gather / reduce-scatter; ``"speed"``: activations replicated, all-reduce). Setup says so on
    global rank 0 when ``"memory"`` turns sequence parallelism on."""

    memory_weight: float | None = None
    """Weight in [0, 1] of memory balance against compute balance in the partition cost. ``None``: from ``optimize``."""

    tied_weights: TiedWeights = "auto"
    """Modules sharing a parameter (a tied embedding and LM head): ``"colocate"`` puts them on one stage;
    ``"replicate"`` lets them sit on different stages, each holding a copy whose gradient is summed over those
    stages after every backward (Megatron-LM, DeepSpeed's ``TiedLayerSpec``), so the copies stay bitwise equal;
    ``"auto"`` plans both and replicates only when that lowers the largest stage cost by more than 1%, each copy's
    training memory charged to its stage (for an embedding tied to an LM head it rarely does: see [Note: tied
    weights] in ``partition/_plan.py``). A manual ``partition`` map that places tied modules apart needs ``"replicate"`` or
    ``"auto"``. With ``tensor_parallel_degree > 1`` ties are co-located (``"auto"``; ``"replicate"`` is an error):
    tie groups over tensor-parallel shards are not built yet."""

    trace_execution_times: bool = False
    """Balance measured per-module times instead of FLOPs (SMP's ``trace_execution_times``). Runs the traced step
    twice more on global rank 0 at setup."""

    partition_plan: str | None = None
    """Reuse a plan instead of tracing: a JSON file written by ``PartitionSummary`` (``PartitionPlan.to_dict()``)
    or a lightning_mp checkpoint folder (plans are saved with checkpoints), so a resumed run is placed identically."""

    replan_on_resume: bool = False
    """A run resumed with ``fit(ckpt_path=...)`` (a path, or ``"last"`` / ``"best"`` as Lightning resolves them)
    reuses the partition plan saved in that checkpoint when it fits the model and ``pipeline_parallel_degree``
    (else it plans anew, and says so); ``True`` always plans anew."""

    # ---- Tensor parallelism (``optimize`` above also picks its layers' variant)
    tp_random_streams: Literal["one_process", "per_rank"] = "one_process"
    """How random ops (dropout) on tensor-parallel sharded activations draw (see [Note: random numbers under tensor
    parallelism] in ``tp/_random.py``). ``"one_process"``: each tp rank draws the full tensor from the call's stream
    and keeps its slice, so tp=2 trains as tp=1. ``"per_rank"``: each tp rank draws only its shard, from a stream of
    its own (Megatron's ``CudaRNGStatesTracker``): fewer numbers drawn, masks independent across ranks but not one
    process's."""

    # ---- Memory
    delayed_parameter_initialization: bool = False
    """Build the model in ``configure_model`` without allocating parameters (SMP's
    ``delayed_parameter_initialization``): the trace runs on meta and each rank allocates and initialises only
    its own stage, bitwise as an eager one-process build with the same seed. Models built under
    ``lightning_mp.delay_param_initialization()`` or ``trainer.init_module(empty_init=True)`` are delayed anyway."""

    shard_optimizer_state: bool = False
    """ZeRO-1 (SMP's ``shard_optimizer_state``): each data-parallel rank keeps and steps 1/dp of its stage's
    optimizer state (``torch.distributed.optim.ZeroRedundancyOptimizer``); checkpoints save the shards through DCP."""

    sharded_data_parallel_degree: int = 1
    """Sharded data parallelism (SMP's ``sharded_data_parallel_degree``; 1: off): each stage's parameters, gradients
    and optimizer state are sharded over this many of its data-parallel ranks with torch's FSDP2
    (``torch.distributed.fsdp.fully_shard``); below the data-parallel degree, groups of that many ranks shard and
    the groups replicate each other (HSDP). Must divide ``dp = world_size / (pp * tp)``; excludes
    ``shard_optimizer_state`` (FSDP shards the optimizer state already). See ``[Note: sharded stages]`` in
    ``lightning_mp/strategy/_fsdp.py``."""

    reshard_after_forward: ReshardAfterForward = "default"
    """When a sharded stage's FSDP units are gathered (torchtitan's ``reshard_after_forward_policy``; with
    ``sharded_data_parallel_degree > 1``). ``"never"``: every unit once per optimizer step, kept through all its
    microbatches, gradients reduce-scattered once at the step's end (the stage's whole parameters and gradients
    during the step). ``"always"``: FSDP's own per-unit schedule, only at ``pipeline_parallel_degree == 1``: each
    unit gathered for its forward and freed after it, gathered again for its backward and its gradients
    reduce-scattered right after it, every microbatch (one unit's whole parameters and gradients at a time; the
    root, which holds what no unit holds, stays gathered through each batch); refused with tensor parallelism, and
    with token-weighted losses at the step that returns ``num_tokens`` (both gave wrong gradients in review; needs a
    model with FSDP units). ``"default"``: ``"never"`` on every layout for now (torchtitan's default is ``"always"``
    at ``pipeline_parallel_degree == 1``; ours waits for those gaps). See ``[Note: sharded stages]`` in
    ``lightning_mp/strategy/_fsdp.py``."""

    release_host_memory: bool = False
    """On glibc Linux, fix malloc's mmap threshold at 128 KiB in every rank (``mallopt``, as the
    ``MALLOC_MMAP_THRESHOLD_`` environment variable does), so freed CPU tensors leave the resident set at once
    instead of staying in the engine threads' malloc arenas (about one gradient copy more per rank at the step's
    peak otherwise; see [Note: freed tensors stay resident under glibc]). Costs page faults: each step maps its
    large tensors afresh (steps 1.0-2.0x as long on the example GPT at pp=2 on CPU, in alternating rounds on a
    loaded machine). A no-op without glibc. When False, pipelined ranks run one malloc arena that keeps freed memory
    for the next step instead (see [Note: engine threads and glibc malloc])."""

    # ---- Checkpoints and initial weights
    save_distributed_checkpoint: bool = True
    """As in Lightning's ``ModelParallelStrategy``: ``True`` writes a folder of DCP shards per checkpoint (every rank
    writes its own part; resumable at any layout); ``False`` writes one full Lightning checkpoint file from global
    rank 0 (tp shards gathered into full tensors), which ``Model.load_from_checkpoint`` and any other strategy
    read. Either kind resumes an ``smp`` run, as does a plain Lightning checkpoint file."""

    load_weights: str | Path | None = None
    """Initial weights, read at setup after partitioning, each rank keeping its own stage's tensors and its tp
    slice of them: a plain state dict (``.pt``, ``.bin``, ``.safetensors``), a Lightning checkpoint file, a
    lightning_mp checkpoint folder, or a Hugging Face folder (keys of the LightningModule's transformers model).
    The optimizer starts fresh. Missing keys raise unless the LightningModule's ``strict_loading`` is ``False``."""

    # ---- Processes and transport
    process_group_backend: str | None = None
    """``torch.distributed`` backend. ``None``: ``"gloo"`` on CPU, ``"nccl"`` on CUDA."""

    timeout: timedelta = timedelta(minutes=30)
    """How long a rank waits for a peer (the rendezvous at start, collectives, checkpoint saves and pipeline messages)
    before failing with an error naming the rank it waited for. It is also the watchdog of hangs: a rank that stops
    answering (stopped, stuck in an endless loop, deadlocked) makes the others fail after this long, so it bounds
    how long a hung job holds its machines. A pipeline stage with no request to work on fails when no message
    reaches it for this long within a step (it cannot tell a stuck stage from a slow one), so it must exceed the
    longest stretch of a step without a message to some stage, e.g. a long computation that stays on one stage.
    The default, 30 minutes, is ``torch.distributed``'s and Lightning's for CPU process groups: it leaves room for
    slow steps, the first step's warm-up and a checkpoint save of a large model. Set it to a few times your slowest
    step or save (and no less than the time all ranks take to start): a shorter one finds a hung rank sooner
    (``scripts/fault_harness.py`` measures the time to detect one)."""

    start_method: Literal["popen", "spawn", "fork"] = "popen"
    """How the processes start: ``"popen"`` re-runs the script per rank (like ``ddp``); ``"spawn"`` / ``"fork"``
    start them from the launching process (see [Note: threads per process] in ``strategy/_launch.py``)."""

    data_plane: DataPlane = "auto"
    """How tensor bytes travel between pipeline stages; headers always go over a CPU gloo group ([Note: two planes]
    in ``comm/_planes.py``). ``"gloo"``: over that group, CUDA tensors staged through pinned host memory.
    ``"nccl"``: one NCCL group per ordered pair of stages (CUDA only; NCCL before 2.30 refuses two ranks on one GPU).
    ``"auto"``: ``"nccl"`` on CUDA when no two stages of a pipeline share a GPU (or NCCL >= 2.30), else ``"gloo"``."""

    _remote_handles: bool = True
    """Not a user knob (an engine switch, kept for the engine's tests and benchmarks): ``True``, a call into a
    module on another stage returns at once with a handle to its output (``RemoteValue``, [Note: remote handles]
    in ``pipeline/_handles.py``); ``False``, every remote call waits for its outputs (one round trip per call, the
    engine before handles). The results are the same either way."""

    def __post_init__(self) -> None:
        degrees = ("pipeline_parallel_degree", "tensor_parallel_degree", "microbatches", "sharded_data_parallel_degree")
        for name in degrees:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be an integer >= 1, got {value!r}.")
        self._check_non_split_inputs()
        if self.pipeline not in _SCHEDULES:
            raise ValueError(f"`pipeline` must be one of {', '.join(map(repr, _SCHEDULES))}, got {self.pipeline!r}.")
        if self.tied_weights not in ("colocate", "replicate", "auto"):
            raise ValueError(f"`tied_weights` must be 'colocate', 'replicate' or 'auto', got {self.tied_weights!r}.")
        if self.optimize not in _DEFAULT_MEMORY_WEIGHT:
            raise ValueError(f"`optimize` must be 'speed' or 'memory', got {self.optimize!r}.")
        if self.memory_weight is not None and not 0.0 <= self.memory_weight <= 1.0:
            raise ValueError(f"`memory_weight` must be in [0, 1], got {self.memory_weight}.")
        if self.active_microbatches is not None and self.active_microbatches < 1:
            raise ValueError(f"`active_microbatches` must be >= 1 or None, got {self.active_microbatches}.")
        for name, stage in {"default_partition": self.default_partition, **self.partition}.items():
            if not isinstance(stage, int) or not 0 <= stage < self.pipeline_parallel_degree:
                raise ValueError(
                    f"Stage {stage!r} for {name!r} is out of range: stages are 0..{self.pipeline_parallel_degree - 1}"
                    f" for `pipeline_parallel_degree={self.pipeline_parallel_degree}`."
                )
        if self.deterministic_order not in (None, True, False):
            raise ValueError(f"`deterministic_order` must be True, False or None, got {self.deterministic_order!r}.")
        for name in _BOOLS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"`{name}` must be True or False, got {getattr(self, name)!r}.")
        if self.start_method not in ("popen", "spawn", "fork"):
            raise ValueError(f"`start_method` must be 'popen', 'spawn' or 'fork', got {self.start_method!r}.")
        if self.tp_random_streams not in ("one_process", "per_rank"):
            raise ValueError(
                f"`tp_random_streams` must be 'one_process' or 'per_rank', got {self.tp_random_streams!r}."
            )
        if self.data_plane not in ("auto", "gloo", "nccl"):
            raise ValueError(f"`data_plane` must be 'auto', 'gloo' or 'nccl', got {self.data_plane!r}.")
        order = {"cluster": "DPT", "spread": "TPD"}.get(self.placement_strategy, self.placement_strategy)
        if not isinstance(order, str) or sorted(order) != ["D", "P", "T"]:
            raise ValueError(
                f"`placement_strategy` must be 'cluster', 'spread' or a permutation of 'D', 'P', 'T' (outermost axis"
                f" first), got {self.placement_strategy!r}."
            )
        if self.timeout.total_seconds() <= 0:
            raise ValueError(f"`timeout` must be positive, got {self.timeout}.")
        self._check_reshard_after_forward()
        if self.sharded_data_parallel_degree > 1 and self.shard_optimizer_state:
            raise ValueError(
                f"shard_optimizer_state=True (ZeRO-1) cannot be combined with sharded_data_parallel_degree="
                f"{self.sharded_data_parallel_degree}: FSDP already shards the optimizer state with the parameters."
                " Drop shard_optimizer_state, or set sharded_data_parallel_degree=1."
            )

    def _check_reshard_after_forward(self) -> None:
        if self.reshard_after_forward not in ("default", "always", "never"):
            raise ValueError(
                "`reshard_after_forward` must be 'default', 'always' or 'never', got "
                f"{self.reshard_after_forward!r}."
            )
        if self.reshard_after_forward == "always" and self.tensor_parallel_degree > 1:
            raise ValueError(
                f"reshard_after_forward='always' does not compose with tensor_parallel_degree="
                f"{self.tensor_parallel_degree} yet (tp's replicated-gradient sums would run on the reduce-scattered "
                "DTensor shards). Use reshard_after_forward='never' (the default)."
            )
        if self.reshard_after_forward == "always" and self.pipeline_parallel_degree > 1:
            raise ValueError(
                f"reshard_after_forward='always' needs pipeline_parallel_degree=1, got "
                f"{self.pipeline_parallel_degree}: a pipeline stage runs its microbatches on engine threads and "
                "serves other stages' calls in an order that can differ between its sharded data-parallel peers, "
                "and a per-unit all-gather or reduce-scatter entered in a different order on two peers hangs or "
                "mixes units. Use reshard_after_forward='never' (or 'default', which is 'never' for pipeline "
                "stages: one all-gather and one reduce-scatter per unit and step)."
            )

    @property
    def reshards_after_forward(self) -> bool:
        """Whether sharded stages gather and free each FSDP unit around its forward and backward (the resolved
        ``reshard_after_forward``: ``"always"`` only, for now)."""
        return self.reshard_after_forward == "always"

    def _check_non_split_inputs(self) -> None:
        names = self.non_split_inputs
        if not isinstance(names, tuple):
            hint = f" For one entry pass ({names!r},)." if isinstance(names, (str, int)) else ""
            raise ValueError(
                f"`non_split_inputs` must be a tuple of batch keys, field names or positions, got {names!r}.{hint}"
            )
        bad = [n for n in names if isinstance(n, bool) or not isinstance(n, (str, int))]
        if bad:
            raise ValueError(f"`non_split_inputs` entries must be str (keys, field names) or int (positions), got {bad!r}.")
        if len(set(names)) != len(names):
            raise ValueError(f"`non_split_inputs` names an entry twice: {names!r}.")

    @property
    def effective_deterministic_order(self) -> bool:
        """``deterministic_order`` if set, else whether tensor parallelism is on."""
        if self.deterministic_order is not None:
            return self.deterministic_order
        return self.tensor_parallel_degree > 1

    @property
    def effective_memory_weight(self) -> float:
        """``memory_weight`` if set, else the preset of ``optimize`` (0.2 speed / 0.8 memory, as SMP)."""
        return self.memory_weight if self.memory_weight is not None else _DEFAULT_MEMORY_WEIGHT[self.optimize]

    @property
    def effective_active_microbatches(self) -> int:
        """``active_microbatches`` if set, else ``pipeline_parallel_degree + 2`` (the SMP default)."""
        if self.active_microbatches is not None:
            return self.active_microbatches
        return self.pipeline_parallel_degree + 2


_DEPRECATED = {  # names that were user knobs and are not any more -> (the field they still set, what to write)
    "remote_handles": (
        "_remote_handles",
        "`SMPStrategy(remote_handles=...)` is deprecated: remote handles are always on (the results are the same"
        " without them; the switch is the engine's own, `SMPConfig._remote_handles`, for its tests). Drop it.",
    ),
}


def config_fields(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``SMPStrategy``'s keyword arguments as :class:`SMPConfig` fields: ``non_split_inputs`` (a list, say) as a
    tuple, ``partition`` as a dict (``None`` as ``{}``).

    Raises:
        TypeError: for a name that is not a field, naming the closest one.

    Warns:
        DeprecationWarning: for a retired knob (``remote_handles``), which still sets its hidden field.
    """
    names = {f.name for f in fields(SMPConfig) if not f.name.startswith("_")}
    overrides = dict(overrides)
    for name in [n for n in overrides if n in _DEPRECATED]:
        field_name, message = _DEPRECATED[name]
        warnings.warn(message, DeprecationWarning, stacklevel=3)
        overrides[field_name] = overrides.pop(name)
    for name in overrides:
        if name not in names and name != "_remote_handles":
            close = difflib.get_close_matches(name, sorted(names), n=1)
            hint = f" Did you mean `{close[0]}`?" if close else " See `lightning_mp.SMPConfig` for the fields."
            raise TypeError(f"SMPStrategy got an unexpected argument `{name}`.{hint}")
    result = dict(overrides)
    if "non_split_inputs" in result:
        names = result["non_split_inputs"]
        result["non_split_inputs"] = names if isinstance(names, (str, int)) else tuple(names or ())
    if "partition" in result:
        result["partition"] = dict(result["partition"] or {})
    return result
