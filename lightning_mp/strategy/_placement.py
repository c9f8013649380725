"""Partitioning at setup: one sample microbatch, a trace on global rank 0, a plan broadcast to every rank.

SMP traced at the first step (paper section 3.1); we trace in ``SMPStrategy.setup`` instead, from the first
batch of the stage's dataloader (or ``LightningModule.example_input_array``), so that optimizers are built over
local parameters only and a checkpoint can be restored right after setup.
"""

from __future__ import annotations

import json
import os
import pickle
import select
import signal
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_mp.config import SMPConfig
from lightning_mp.memory._host import fix_mmap_threshold
from lightning_mp.nn import translate_hf
from lightning_mp.partition import ModelTrace, PartitionPlan, manual_placements, plan, trace
from lightning_mp.pipeline import split_microbatches
from lightning_mp.strategy._delayed import needs_real_values, trace_per_call
from lightning_mp.strategy._launch import print_on_one_rank
from lightning_mp.tp import whole_swaps

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = [
    "PLAN_KEY",
    "broadcast_plan",
    "first_batch",
    "load_plan",
    "make_plan",
    "make_plan_in_child",
    "plan_saved_in",
    "read_plan",
    "single_stage_plan",
    "trace_in_child",
]

PLAN_KEY = "lightning_mp"  # checkpoint entry: {"partition_plan": PartitionPlan.to_dict()}

_STEP_OF_FN = {
    TrainerFn.FITTING: "training_step",
    TrainerFn.VALIDATING: "validation_step",
    TrainerFn.TESTING: "test_step",
    TrainerFn.PREDICTING: "predict_step",
}


def single_stage_plan(module: torch.nn.Module) -> PartitionPlan:
    """Everything on stage 0 (pipeline_parallel_degree = 1): no trace needed."""
    return PartitionPlan(1, {fqn: 0 for fqn, _ in module.named_modules(remove_duplicate=False)}, (1.0,))


_FETCH = object()  # `make_plan(batch=...)`: take the first batch from the trainer's dataloader


def make_plan(
    trainer: pl.Trainer, config: SMPConfig, to_device: Callable[[Any], Any], batch: Any = _FETCH
) -> tuple[PartitionPlan, ModelTrace]:
    """Trace one microbatch through the step the trainer is about to run, and plan the stages.

    ``batch``: the batch to trace (from :func:`first_batch`); by default the first batch of the stage's dataloader
    is fetched here.

    Raises:
        ValueError: if no sample input can be found, or the planner rejects the model/config.
        RuntimeError: if the model fails while being traced.
    """
    module = trainer.lightning_module
    model_trace = _trace_like_the_step(trainer, config, to_device, batch)
    _reset_metrics(module)
    stages = plan(
        model_trace,
        config.pipeline_parallel_degree,
        memory_weight=config.effective_memory_weight,
        manual={**manual_placements(module), **config.partition},  # the strategy's map wins for one FQN
        auto_partition=config.auto_partition,
        default_partition=config.default_partition,
        tied_weights=_planned_ties(config),
        whole=whole_swaps(module, [translate_hf]) if config.tensor_parallel_degree > 1 else (),
    )
    if trainer.state.fn == TrainerFn.FITTING:
        _check_every_stage_has_parameters(stages, model_trace)
    return stages, model_trace


def make_plan_in_child(
    make: Callable[[], tuple[PartitionPlan, ModelTrace]], timeout: timedelta
) -> tuple[PartitionPlan, ModelTrace]:
    """Run ``make`` (the meta trace and the planner) in a forked child process and return its result.

    [Note: the meta trace runs in a child process] Under delayed init global rank 0 traces the meta-built model once
    to plan the stages. That trace costs about 10 MiB of resident memory that is never given back (the first use of
    torch's meta kernels and autograd on meta tensors: C++ and interpreter caches, not tensors; a second trace in the
    same process costs ~0) -- rank 0's setup peak was its own parameter bytes x 1.39 against 1.18 on the other ranks
    with 48 MiB stages. A forked child shares the parent's pages copy-on-write, traces, sends back the plan and the
    trace (plain data, pickled through a pipe) and exits, and its memory leaves with it; the parent's modules,
    buffers, metric states and random generators are not touched at all. The parent fetches the first batch before
    the fork (data loading, its workers and collate stay in the parent), so the child runs the user's step on meta
    tensors only: no collectives and, normally, no CPU kernels; it runs with one intra-op thread anyway (a forked
    child cannot use the parent's OpenMP pool, as torch's DataLoader workers also know). Used only while CUDA is
    uninitialised in the process (a forked child cannot use CUDA). The child has ``timeout`` to answer (it is
    killed then, and on an interrupt); an error in it is raised here as it was raised there, or as a
    ``RuntimeError`` with its type and message when it does not survive pickling. While the child runs, its
    copy-on-write pages (refcounts touched by Python) add to the machine's memory, not to rank 0's.

    Raises:
        RuntimeError: if the child dies without an answer or does not answer within ``timeout``.
        Exception: what ``make`` raised in the child.
    """
    read_fd, write_fd = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    with warnings.catch_warnings():  # Python >= 3.12 warns on fork() with threads (gloo's); the child runs none
        warnings.filterwarnings("ignore", message=".*fork.*", category=DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: never returns
        status = 0
        try:
            os.close(read_fd)
            # the parent's OpenMP pool does not exist here: a parallel CPU kernel (the DataLoader's collate of the
            # first batch) would wait for it forever; torch's DataLoader workers do the same (_worker_loop)
            torch.set_num_threads(1)
            fix_mmap_threshold()  # weights made real per call and freed (`trace_per_call`) go back to the OS
            try:
                stages, model_trace = make()
                payload: tuple = ("ok", stages.to_dict(), model_trace)
            except BaseException as err:  # noqa: BLE001 - every failure goes back to the parent
                payload = ("error", err)
            try:
                data = pickle.dumps(payload)
                pickle.loads(data)  # an exception can pickle and still not unpickle (a required __init__ argument)
            except Exception as failure:  # noqa: BLE001 - what does not travel goes back as text
                err = payload[1] if payload[0] == "error" else failure
                data = pickle.dumps(("error", RuntimeError(f"{type(err).__name__}: {err}")))
            with os.fdopen(write_fd, "wb") as pipe:
                pipe.write(data)
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException:  # noqa: BLE001
            status = 1
        finally:
            os._exit(status)
    os.close(write_fd)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout.total_seconds()
    try:
        with os.fdopen(read_fd, "rb", buffering=0) as pipe:
            poller = select.poll()  # not select.select: a process of a large job may hold descriptors >= 1024
            poller.register(pipe, select.POLLIN)
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not poller.poll(left * 1000):
                    raise RuntimeError(
                        f"The partitioning trace (in a child process of global rank 0) did not finish within"
                        f" timeout={timeout}; raise `timeout` if the model is that large."
                    )
                chunk = pipe.read(1 << 20)
                if not chunk:
                    break
                chunks.append(chunk)
    except BaseException:  # the timeout, or e.g. KeyboardInterrupt: do not wait for the trace to end
        os.kill(pid, signal.SIGKILL)
        raise
    finally:
        _, code = os.waitpid(pid, 0)
    if not chunks:
        raise RuntimeError(f"The partitioning trace (in a child process of global rank 0) died (wait status {code}).")
    status, *rest = pickle.loads(b"".join(chunks))
    if status == "error":
        raise rest[0]
    return PartitionPlan.from_dict(rest[0]), rest[1]


def trace_in_child(model_is_meta: bool) -> bool:
    """Whether the partitioning trace runs in a child (see [Note: the meta trace runs in a child process])."""
    return model_is_meta and hasattr(os, "fork") and not torch.cuda.is_initialized()


def _trace_like_the_step(
    trainer: pl.Trainer, config: SMPConfig, to_device: Callable[[Any], Any], batch: Any = _FETCH
) -> ModelTrace:
    """Trace one microbatch on the code path the trainer will run, leaving no trace of the trace.

    A fit is traced in training mode with gradients (dropout, ``if self.training:`` branches, BatchNorm
    statistics, no inference fast paths), evaluation in eval mode without; the random generators and every
    buffer (running statistics) are restored afterwards, and the modules' train/eval flags too.
    """
    module = trainer.lightning_module
    training = trainer.state.fn == TrainerFn.FITTING
    modes = {m: m.training for m in module.modules()}
    buffers = {id(b): (b, b.detach().clone()) for b in module.buffers()}
    module.train(training)

    def run(inputs: Callable[[Any], Any]) -> ModelTrace:
        with generators_kept():  # the sample and the trace leave every generator as it was
            run_step = _trace_run(trainer, config, inputs, batch)
            return trace(module, run_step, measure_time=config.trace_execution_times, grad_enabled=training)

    try:
        try:
            return run(to_device)
        except RuntimeError as err:
            if not needs_real_values(to_device, err):
                raise
            device = trainer.strategy.root_device  # delayed init and a step that reads values: see the Note there
            return trace_per_call(module, run, to_device, err, device)
    except RuntimeError as err:
        raise RuntimeError(f"{err}.\n{_trace_hint(config)}") from err.__cause__
    finally:
        for m, was_training in modes.items():
            m.training = was_training
        with torch.no_grad():
            for b, saved in buffers.values():
                b.copy_(saved)


def _trace_hint(config: SMPConfig) -> str:
    split = (
        f"Partitioning runs the step once on global rank 0, on the first microbatch of the first batch: every tensor"
        f" of the batch split along dim 0 into `microbatches={config.microbatches}` parts."
    )
    return (
        f"{split} If an entry must be given whole to every microbatch (e.g. a (T, T) mask or a table shared by all"
        " rows), name it in `non_split_inputs` (dict keys, field names or tuple positions). Otherwise check that the"
        " step runs on one process on a batch of that size."
        if config.microbatches > 1
        else f"{split} Check that the step runs on one process first."
    )


def _check_every_stage_has_parameters(stages: PartitionPlan, model_trace: ModelTrace) -> None:
    counts = [0] * stages.num_stages
    for fqn, stage in stages.stage_of.items():
        counts[stage] += model_trace.modules[fqn].num_params
    counts = [c + r for c, r in zip(counts, stages.replica_params(model_trace))]
    empty = [stage for stage, count in enumerate(counts) if count == 0]
    if empty:
        raise ValueError(
            f"Pipeline stage(s) {empty} would hold no parameters (parameters per stage: {counts}), so their"
            " optimizers would be empty. Use fewer stages, or place modules with parameters there with"
            " `partition={fqn: stage}`."
        )


def load_plan(path: str, module: torch.nn.Module, num_stages: int) -> PartitionPlan:
    """Read a saved plan (JSON file, lightning_mp checkpoint folder or file) and check it fits ``module``.

    Raises:
        FileNotFoundError: if ``path`` holds no plan.
        ValueError: if the file is not a readable plan, or the plan has another number of stages or other module
            names than ``module``.
    """
    loaded = read_plan(path, num_stages)
    names = {fqn for fqn, _ in module.named_modules(remove_duplicate=False)}
    if names != set(loaded.stage_of):
        missing, extra = sorted(names - set(loaded.stage_of)), sorted(set(loaded.stage_of) - names)
        raise ValueError(
            f"The plan at {path!r} is for another model: modules missing from it {missing[:5]}, unknown to the"
            f" model {extra[:5]}. Drop `partition_plan` to plan anew."
        )
    return loaded


def read_plan(path: str, num_stages: int) -> PartitionPlan:
    """The plan saved at ``path`` (JSON file, lightning_mp checkpoint folder or file), checked for ``num_stages``;
    no model needed, so the launching process checks it before any process starts.

    Raises:
        FileNotFoundError: if ``path`` holds no plan.
        ValueError: if the file is not a readable plan, or the plan has another number of stages.
    """
    source = Path(path)
    if (source / "partition.json").is_file():  # the log folder PartitionSummary wrote to
        source = source / "partition.json"
    if source.is_dir():
        metadata = torch.load(source / "meta.pt", weights_only=False) if (source / "meta.pt").is_file() else {}
        data = metadata.get(PLAN_KEY, {}).get("partition_plan")
    elif source.is_file() and source.suffix == ".json":
        try:
            data = json.loads(source.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(_unreadable_plan(source, f"it is not valid JSON ({err})")) from err
    elif source.is_file():  # one full checkpoint file (save_distributed_checkpoint=False)
        checkpoint = torch.load(source, map_location="cpu", mmap=True, weights_only=False)
        data = checkpoint.get(PLAN_KEY, {}).get("partition_plan") if isinstance(checkpoint, dict) else None
    else:
        data = None
    if data is None:
        raise FileNotFoundError(
            f"No partition plan at {path!r}: pass a JSON file written by PartitionSummary or a lightning_mp"
            " checkpoint folder."
        )
    try:
        loaded = PartitionPlan.from_dict(data)
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise ValueError(_unreadable_plan(source, f"it holds no partition plan ({type(err).__name__}: {err})")) from err
    if loaded.num_stages != num_stages:
        raise ValueError(
            f"The plan at {path!r} has {loaded.num_stages} stages but pipeline_parallel_degree={num_stages}."
            " Use the same degree, or drop `partition_plan` to plan anew."
        )
    return loaded


def _unreadable_plan(source: Path, why: str) -> str:
    return (
        f"Cannot read the partition plan {str(source)!r}: {why}. Write it again (PartitionSummary writes"
        " partition.json to the log folder), point `partition_plan` at a lightning_mp checkpoint folder, or drop"
        " `partition_plan` to plan anew."
    )


def plan_saved_in(path: Path, module: torch.nn.Module, num_stages: int) -> PartitionPlan | None:
    """The plan saved in the checkpoint at ``path`` if it fits ``module`` and ``num_stages``, else ``None``.

    Says in one line (global rank 0) whether it is reused. Every rank reads the same file, so all decide alike.
    """
    try:
        saved = load_plan(str(path), module, num_stages)
    except FileNotFoundError:  # e.g. a plain Lightning checkpoint: nothing to reuse
        return None
    except ValueError as err:  # another layout or model
        rank_zero_info(f"lightning_mp: planning anew, the partition plan in {path} does not fit: {err}")
        return None
    rank_zero_info(f"lightning_mp: reusing the partition plan from {path}")
    return saved


def _planned_ties(config: SMPConfig) -> str:
    """``tied_weights`` as the planner takes it: no tie groups over tensor-parallel shards yet, so tp > 1 co-locates;
    under sharded data parallelism ``"auto"`` co-locates (one parameter in one FSDP unit; an explicit
    ``"replicate"`` sums the copies before FSDP's reduce-scatter)."""
    if config.tensor_parallel_degree > 1:
        return "colocate"
    if config.sharded_data_parallel_degree > 1 and config.tied_weights == "auto":
        return "colocate"
    return config.tied_weights


def broadcast_plan(result: tuple[PartitionPlan, Any] | BaseException | None, src: int = 0) -> PartitionPlan:
    """Send the plan (or the error that prevented it) from ``src`` to every rank; raise the error everywhere."""
    payload = [None]
    if dist.get_rank() == src:
        if isinstance(result, BaseException):
            kind = "ValueError" if isinstance(result, ValueError) else type(result).__name__
            payload = [("error", kind, f"{type(result).__name__}: {result}")]
        else:
            payload = [("ok", result[0].to_dict())]
    dist.broadcast_object_list(payload, src=src)
    status, *rest = payload[0]
    if status == "error":
        kind, message = rest
        error = (ValueError if kind == "ValueError" else RuntimeError)(
            f"Setup failed on global rank {src} while tracing one microbatch to partition the model: {message}"
        )
        raise print_on_one_rank(error, printed_by=src, rank=dist.get_rank())
    return PartitionPlan.from_dict(rest[0])


def _trace_run(
    trainer: pl.Trainer, config: SMPConfig, to_device: Callable[[Any], Any], batch: Any = _FETCH
) -> Callable[[], Any]:
    module = trainer.lightning_module
    batch = first_batch(trainer) if batch is _FETCH else batch
    if batch is None:
        example = module.example_input_array
        if example is None:
            raise ValueError(
                "lightning_mp needs one sample input to partition the model, but the trainer has no dataloader"
                " for this stage and `example_input_array` is not set. Set `self.example_input_array` in your"
                " LightningModule or pass a dataloader/datamodule."
            )
        example = to_device(example)
        if isinstance(example, dict):
            return lambda: module(**example)
        return lambda: module(*example) if isinstance(example, tuple) else module(example)
    microbatch = split_microbatches(to_device(batch), config.microbatches, non_split_inputs=config.non_split_inputs)[0]
    step = getattr(module, _STEP_OF_FN.get(trainer.state.fn, "training_step"))

    def run() -> Any:
        module.log = lambda *args, **kwargs: None  # tracing must not log
        try:
            return step(microbatch, 0)
        finally:
            del module.log

    return run


def first_batch(trainer: pl.Trainer) -> Any | None:
    """The first batch of the dataloader of the stage the trainer runs, as the loop would get it (before moving it
    to the device); ``None`` without a dataloader. The random generators are left as they were (the dataloader
    hook, a shuffling sampler and worker seeds draw from them)."""
    with generators_kept():
        return _first_batch(trainer)


@contextmanager
def generators_kept() -> Iterator[None]:
    """Restore every global generator a step may draw from on exit: torch's CPU one (and CUDA's once CUDA is
    initialised), numpy's and Python's ``random`` (Lightning's own snapshot of them, as its spawn launcher takes).

    The first batch and the trace run the user's dataloader and ``training_step`` once more than a run on one
    device does; without this, the loader's shuffle and every later draw would differ from that run's.
    """
    states = _collect_rng_states(include_cuda=torch.cuda.is_initialized())
    try:
        yield
    finally:
        _set_rng_states(states)


def _first_batch(trainer: pl.Trainer) -> Any | None:
    loop = {
        TrainerFn.FITTING: trainer.fit_loop,
        TrainerFn.VALIDATING: trainer.validate_loop,
        TrainerFn.TESTING: trainer.test_loop,
        TrainerFn.PREDICTING: trainer.predict_loop,
    }.get(trainer.state.fn)
    source = getattr(loop, "_data_source", None)
    if source is None or not source.is_defined():
        return None
    dataloader = source.dataloader()
    if isinstance(dataloader, (list, tuple)):
        dataloader = dataloader[0] if dataloader else None
    if isinstance(dataloader, dict):
        dataloader = next(iter(dataloader.values()), None)
    if dataloader is None:
        return None
    if trainer.state.fn == TrainerFn.FITTING:
        _warn_if_last_batch_indivisible(dataloader, trainer)
    return next(iter(dataloader))


def _warn_if_last_batch_indivisible(dataloader: Any, trainer: pl.Trainer) -> None:
    """The last batch of an epoch is smaller unless ``drop_last``; say now if it will not split."""
    microbatches = trainer.strategy.config.microbatches
    batch_size = getattr(dataloader, "batch_size", None)
    dataset = getattr(dataloader, "dataset", None)
    if microbatches == 1 or not batch_size or getattr(dataloader, "drop_last", True) or not hasattr(dataset, "__len__"):
        return
    replicas = trainer.strategy.distributed_sampler_kwargs["num_replicas"] if trainer._accelerator_connector.use_distributed_sampler else 1
    per_replica = -(-len(dataset) // replicas)
    last = per_replica % batch_size
    if last and last % microbatches:
        rank_zero_warn(
            f"The last training batch of each epoch will have {last} samples ({per_replica} per data-parallel"
            f" replica, batch_size={batch_size}), which does not split into microbatches={microbatches}: that step"
            " will fail. Use `drop_last=True` in the train DataLoader, or a batch size that divides the data."
        )

def _reset_metrics(module: torch.nn.Module) -> None:
    """Undo the trace's updates of torchmetrics states."""
    for child in module.modules():
        if hasattr(child, "_update_count") and hasattr(child, "reset"):
            child.reset()
