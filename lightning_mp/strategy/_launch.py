"""How the strategy's processes start, and how many intra-op threads each one runs.

[Note: threads per process] Under ``ddp`` every process Lightning starts or joins runs
``cpu_count // processes_per_node`` intra-op threads (unless ``OMP_NUM_THREADS`` is set): Lightning's launchers
call ``_set_num_threads_if_needed`` in every process, including processes created externally (torchrun, SLURM,
or the children the popen launcher re-runs the script in). Without it, each of N processes on a C-core machine
runs C threads and they oversubscribe the cores (measured on 2 cores: 1.1 steps/s against ddp's 10.7). The
``smp`` strategy therefore uses the same launchers as ``ddp`` on every launch path, and applies the same policy
again in ``setup_environment`` for launch paths that bypass a launcher. The pipeline engine's threads repeat
the count of the thread that created the engine (see [Note: intra-op threads of engine threads]).

[Note: forked ranks run one intra-op thread] OpenMP (libgomp) is not fork-safe: once the launching process has run
a parallel region, a forked child that runs one with more than one thread waits forever for pool threads that
exist only in the parent (measured: ``start_method="fork"`` with 1 device after a matmul in the parent hung in the
first step). Under ``fork`` every rank therefore runs one intra-op thread, as torch's DataLoader workers do
(``torch.set_num_threads(1)`` in each worker), and the launch says so; ``popen`` and ``spawn`` start fresh
interpreters and keep ddp's policy.
"""

from __future__ import annotations

import atexit
import inspect
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed import PrefixStore, TCPStore
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_mp.memory._host import fix_mmap_threshold, retain_freed_memory
from lightning_mp.strategy._exit import SpawnLauncher
from lightning_mp.strategy._roll_call import naming_failed_ranks

if TYPE_CHECKING:
    from lightning_mp.strategy._strategy import SMPStrategy

__all__ = [
    "apply_thread_policy",
    "elastic_store",
    "make_launcher",
    "prepare_process",
    "print_on_one_rank",
    "resolve_resume_path",
    "resume_path_of",
]


def make_launcher(strategy: SMPStrategy, start_method: str) -> _Launcher:
    """The launcher ``ddp`` would use for ``start_method`` (see [Note: threads per process]).

    ``"popen"`` always gets Lightning's subprocess-script launcher: it starts the other local ranks only when the
    cluster environment does not create them itself, and sets the thread count in every case.
    """
    assert strategy.cluster_environment is not None
    if start_method == "popen":
        return _ScriptLauncher(strategy, strategy.cluster_environment, strategy.num_processes, strategy.num_nodes)
    return _Spawn(strategy, start_method=start_method)


def before_launch(strategy: SMPStrategy, trainer: Any, function: Callable, args: tuple, kwargs: dict) -> None:
    """What every launch does first, in each process that calls the ``Trainer`` entry point ``function``: the
    strategy's checks (and checkpoint names) before the launch, and the path it resumes from."""
    strategy.check_before_launch(function, args, kwargs, trainer)
    strategy._resume_path = resume_path_of(function, args, kwargs)


def resume_path_of(function: Callable, args: tuple, kwargs: dict) -> str | Path | None:
    """The ``ckpt_path`` a ``Trainer`` entry point (``_fit_impl``, ...) is about to resume from.

    The strategy places modules before Lightning reads the checkpoint; knowing it at launch lets it reuse the
    checkpoint's partition plan. A path is returned as a ``Path``; a name Lightning resolves in each process
    (``"last"``, ``"best"``, ``"hpc"``, ``"registry"``) as the string, for the strategy to resolve at setup with
    Lightning's own resolution (:func:`resolve_resume_path`); ``None`` otherwise.
    """
    try:
        ckpt_path = inspect.signature(function).bind(*args, **kwargs).arguments.get("ckpt_path")
    except TypeError:
        return None
    if ckpt_path is None:
        return None
    if Path(str(ckpt_path)).exists():
        return Path(str(ckpt_path))
    return str(ckpt_path) if isinstance(ckpt_path, str) else None


def resolve_resume_path(request: str | Path | None, trainer: Any) -> Path | None:
    """The checkpoint path ``request`` (from :func:`resume_path_of`) names, in this process at setup.

    A name (``"last"``, ``"best"``, ...) goes through Lightning's own ``_parse_ckpt_path``, the call ``Trainer``
    made moments before (so the same file; its warnings were given then and are not repeated). ``None`` when
    nothing resolves to an existing path.
    """
    if request is None or isinstance(request, Path):
        return request
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            resolved = trainer._checkpoint_connector._parse_ckpt_path(
                trainer.state.fn, request, model_provided=True, model_connected=True
            )
    except Exception:  # Lightning raised on this name already, before setup; nothing to reuse
        return None
    if resolved is None or not Path(str(resolved)).exists():
        return None
    return Path(str(resolved))


class _ScriptLauncher(_SubprocessScriptLauncher):
    """Lightning's popen launcher that also hands the strategy the path it resumes from, and whose process waits for
    the ranks it started when it exits (see :func:`join_children`)."""

    def __init__(self, strategy: SMPStrategy, *args: Any) -> None:
        super().__init__(*args)
        self._strategy = strategy

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        before_launch(self._strategy, trainer, function, args, kwargs)
        with naming_failed_ranks(_what(function)):  # see [Note: roll call after a failed collective]
            return super().launch(function, *args, trainer=trainer, **kwargs)

    def _call_children_scripts(self) -> None:
        super()._call_children_scripts()
        atexit.register(join_children, self.procs, CHILDREN_EXIT_S)


def _what(function: Callable) -> str:
    """``Trainer.fit`` for Lightning's ``_fit_impl`` (what failed, in a roll call's message)."""
    return f"`Trainer.{function.__name__.strip('_').removesuffix('_impl')}`"


CHILDREN_EXIT_S = 30.0
"""Seconds the popen launcher's process waits at its exit for the ranks it started, before it kills them."""


def join_children(procs: list[subprocess.Popen], timeout_s: float) -> None:
    """Wait for ``procs`` (the ranks the popen launcher started) for up to ``timeout_s`` in all, then kill those
    still running (SIGKILL). Lightning's launcher lets its process exit first: its ranks then outlive the job's main
    process (measured: 3 of 3 still running 1 s after a 4-rank run's launcher exited) and nobody reaps them."""
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for proc in procs:
        if proc.poll() is None:
            print(f"lightning_mp: rank process {proc.pid} still running {timeout_s:.0f} s after the launcher's process"
                  " ended; killing it.", file=sys.stderr, flush=True)
            proc.kill()
            proc.wait()


class _Spawn(SpawnLauncher):
    """Our spawn/fork launcher that also hands the strategy the path it resumes from (before it is pickled).

    Under ``fork`` it also gives each child the parent's generators, as Lightning's launcher does under ``spawn``:
    Python re-seeds ``random`` from the OS in every forked child (``os.register_at_fork``), so a fork run would
    otherwise draw other Python random numbers than the same script on one device.
    """

    _parent_generators: dict[str, Any] | None = None

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        before_launch(self._strategy, trainer, function, args, kwargs)
        self._parent_generators = _collect_rng_states(include_cuda=False) if self._start_method == "fork" else None
        if self._start_method == "fork":
            rank_zero_info(
                "lightning_mp: start_method='fork' runs one intra-op thread per rank (OpenMP is not fork-safe); use"
                " 'popen' (the default) or 'spawn' for more."
            )
        return super().launch(function, *args, trainer=trainer, **kwargs)

    def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
        if self._start_method == "fork":  # see [Note: forked ranks run one intra-op thread]
            os.environ["OMP_NUM_THREADS"] = "1"
            torch.set_num_threads(1)
        if self._parent_generators is not None:
            _set_rng_states(self._parent_generators)
        with naming_failed_ranks(_what(args[2])):  # (process_idx, trainer, function, ...): see _roll_call.py
            super()._wrapping_function(*args, **kwargs)

    def _collect_rank_zero_results(self, trainer: Any, results: Any) -> Any:
        """Lightning's (every rank computes the state dict), FSDP shards gathered whole for the main process."""
        sharded = self._strategy._sharded
        if sharded is None:
            return super()._collect_rank_zero_results(trainer, results)
        with sharded.whole_state_dicts():
            return super()._collect_rank_zero_results(trainer, results)


def elastic_store(cluster_environment: Any, timeout: timedelta) -> dict[str, Any]:
    """``init_process_group`` arguments for a restart under torchelastic: ``{"store": ...}``, else ``{}``.

    [Note: stores of elastic restarts] Workers started by ``torchrun`` (``TORCHELASTIC_USE_AGENT_STORE=True``) connect
    to the agent's store, and torch's env rendezvous no longer prefixes its keys per attempt ("We create a new
    TCPStore for every retry", ``torch/distributed/rendezvous.py``). Measured with torch 2.13 and ``torchrun
    --standalone --max-restarts 1``: after a worker was killed the agent restarted the workers against the same
    store, and the restarted ranks' gloo groups read the dead ranks' addresses ("Gloo connectFullMesh failed ...
    Connection refused"), in a 15-line script with plain ``torch.distributed`` too. Each attempt therefore gets its
    own key space, ``/lightning_mp/attempt_<TORCHELASTIC_RESTART_COUNT>``, as torch's earlier prefix did.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True) or attempt is None:
        return {}
    client = TCPStore(cluster_environment.main_address, cluster_environment.main_port, is_master=False, timeout=timeout)
    return {"store": PrefixStore(f"/lightning_mp/attempt_{attempt}", client)}


def apply_thread_policy(num_processes: int) -> None:
    """``ddp``'s policy: ``cpu_count // num_processes`` intra-op threads unless ``OMP_NUM_THREADS`` is set.

    Idempotent: a process where a launcher already applied it has ``OMP_NUM_THREADS`` set, and is left alone.
    """
    _set_num_threads_if_needed(num_processes=max(1, num_processes))


def prepare_process(num_processes: int, release_host_memory: bool, pipelined: bool) -> None:
    """What every rank's process sets before its process group: the thread policy (for launch paths without a
    launcher) and glibc's malloc policy: with ``release_host_memory`` the fixed 128 KiB mmap threshold (a warning
    where there is no glibc), otherwise, when ``pipelined`` (the engine computes in several threads), one arena
    that keeps freed memory for the next step ([Note: engine threads and glibc malloc] in ``memory/_host.py``)."""
    apply_thread_policy(num_processes)
    if not release_host_memory and pipelined:
        retain_freed_memory()
    elif release_host_memory and not fix_mmap_threshold():
        rank_zero_warn("release_host_memory=True has no effect here: it needs glibc (Linux) malloc.")


_PRINTED_BY = "_lightning_mp_printed_by"  # attribute on an error that another rank prints in full


def print_on_one_rank(error: BaseException, printed_by: int, rank: int) -> BaseException:
    """Mark ``error``, raised on every rank, so that only global rank ``printed_by`` prints its traceback.

    Every rank still raises (so every process fails and exits); a process whose uncaught error is marked prints
    one line naming the rank that prints it in full, instead of the same traceback once per rank (popen and
    torchrun runs share one terminal; spawn/fork report one error through the parent anyway).
    """
    if rank != printed_by:
        setattr(error, _PRINTED_BY, printed_by)
        if not getattr(sys.excepthook, "_lightning_mp", False):
            sys.excepthook = _excepthook_over(sys.excepthook, rank)
    return error


def _excepthook_over(previous: Callable, rank: int) -> Callable:
    def hook(kind: type[BaseException], value: BaseException, traceback: Any) -> None:
        printed_by = getattr(value, _PRINTED_BY, None)
        if printed_by is None:
            previous(kind, value, traceback)
            return
        print(f"[global rank {rank}] {kind.__name__}: the same error, printed in full by global rank {printed_by}.",
              file=sys.stderr)

    hook._lightning_mp = True  # type: ignore[attr-defined]
    return hook
