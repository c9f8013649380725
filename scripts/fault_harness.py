"""Fault harness: one fault per trial in a real ``lightning-mp fit`` run, and what the other ranks did about it.

    python scripts/fault_harness.py --trials 30 --seed 0 [--layouts pp2xdp2 pp2xtp2] [--points ...] [--out f.json]

Each trial runs the example GPT (``examples.gpt.GPT``, tiny) through the ``lightning-mp`` console script at
pp2 x dp2 or pp2 x tp2 (4 ranks, the popen launcher, as a user starts it) with a checkpoint at every epoch end,
and injects one fault at a point chosen by the seed (point, victim rank, step):

=============  ==========================================================================================
point          fault
=============  ==========================================================================================
``setup``      the victim is SIGKILLed in ``Callback.setup`` (process groups up, the others in strategy setup)
``forward``    SIGKILL in a forward pre-hook of a module of the victim's stage, in training step ``step``
``backward``   SIGKILL when a parameter of the victim's stage has its gradient accumulated, in step ``step``
``allreduce``  SIGKILL at the victim's first ``torch.distributed.all_reduce`` of a gradient bucket in ``step``
``optimizer``  SIGKILL in an optimizer step pre-hook (``Optimizer.register_step_pre_hook``) in ``step``
``checkpoint`` SIGKILL after the victim wrote its files of the checkpoint after epoch 1 (DCP's writer)
``validation`` SIGKILL in a forward pre-hook during the first validation
``sigstop``    the victim SIGSTOPs itself (hung, not dead) in a forward pre-hook in ``step``
``sigterm``    the harness sends SIGTERM to the launcher (global rank 0) once step ``step`` starts
``sigint``     the harness sends SIGINT to the launcher (Ctrl-C) once step ``step`` starts
=============  ==========================================================================================

The fault is injected by :class:`FaultInjector`, a test-only callback named in the run's config that reads the
``SMP_FAULT`` environment variable; the library is not edited. Per trial the harness records: whether every other
rank exited and how long after the fault (the goal: within ``timeout`` + 10 s), whether some rank's error names the
failed rank (its global rank) and what the survivor was waiting for (the text is kept), the processes of the run left
behind (found by a per-trial token in ``/proc/<pid>/environ``; killed after the deadline and counted), and the newest
complete checkpoint: it is resumed (``--ckpt_path``) and the resumed run's losses are compared with the
uninterrupted run's, which the harness ran first (one per layout). A SIGSTOPped victim is killed by the harness once
the others are gone (it cannot exit by itself); it is not counted as left behind. Each run starts in a fresh
folder; a trial whose fault did not fire is reported and drawn again (``run_until_reached``). Prints a table (fault
point x outcome), a summary line, and writes every trial's record as JSON (``--out``).
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from torch.utils.data import DataLoader, DistributedSampler

from examples.text_data import ByteTextDataModule, TrainWindows

ROOT = Path(__file__).resolve().parents[1]
POINTS = ("setup", "forward", "backward", "allreduce", "optimizer", "checkpoint", "validation", "sigstop", "sigterm",
          "sigint")
LAYOUTS = {  # (config, arguments after the common ones)
    "pp2xdp2": ("configs/gpt_pp2_dp2.yaml", []),
    # placed by hand: the automatic plan of this tiny model cuts inside a block's MLP, which tp then swaps whole, and
    # the step fails ("mat1 and mat2 shapes cannot be multiplied"), a failure of its own
    "pp2xtp2": ("configs/gpt_pp2_tp2.yaml", ["--trainer.strategy.init_args.partition", '{"h.0": 0, "h.1": 1, "ln_f": 1}']),
}
STEPS_PER_EPOCH = 2
EPOCHS = 3
_KILL_POINTS = ("setup", "forward", "backward", "allreduce", "optimizer", "checkpoint", "validation")


# ---- the injector (runs in every rank of the trial) -----------------------------------------------------------


class FaultInjector(pl.Callback):
    """Test-only: injects the fault that ``SMP_FAULT`` names (``point:rank:step``) and records when (``fault.json``
    in ``SMP_FAULT_DIR``); rank 0 also writes ``step-N`` markers there, for the harness's signals to the launcher.
    Without ``SMP_FAULT`` it only writes the markers.
    """

    def __init__(self) -> None:
        spec = os.environ.get("SMP_FAULT", "")
        self.point, rank, step = (spec.split(":") + ["", "-1", "-1"])[:3] if spec else ("", "-1", "-1")
        self.rank, self.step = int(rank), int(step)
        self.dir = Path(os.environ.get("SMP_FAULT_DIR", "."))
        self._trainer: pl.Trainer | None = None
        self._armed = True
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # the harness asks survivors where they are stuck

    def _victim(self, trainer: pl.Trainer) -> bool:
        return self._armed and trainer.global_rank == self.rank

    def _fire(self, what: str, sig: int = signal.SIGKILL) -> None:
        self._armed = False
        record = {"point": self.point, "rank": self.rank, "pid": os.getpid(), "time": time.time(), "what": what,
                  "signal": signal.Signals(sig).name, "token": os.environ.get("SMP_FAULT_TOKEN", "")}
        (self.dir / "fault.json").write_text(json.dumps(record))
        os.kill(os.getpid(), sig)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer = trainer
        if self.point == "setup" and self._victim(trainer):
            self._fire("Callback.setup")

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.rank != trainer.global_rank:
            return
        if self.point in ("forward", "validation", "sigstop"):
            for module in pl_module.modules():
                if next(module.parameters(recurse=False), None) is not None:
                    module.register_forward_pre_hook(self._forward_hook)
        if self.point == "backward":
            for param in pl_module.parameters():
                param.register_post_accumulate_grad_hook(self._grad_hook)
        if self.point == "optimizer":
            for optimizer in trainer.optimizers:
                optimizer.register_step_pre_hook(self._optimizer_hook)
        if self.point == "allreduce":
            import torch.distributed as dist

            original = dist.all_reduce

            def all_reduce(tensor, *args, **kwargs):
                if self._armed and self._in_step() and tensor.numel() > 1 and tensor.is_floating_point():
                    self._fire(f"all_reduce of {tensor.numel()} gradient values")
                return original(tensor, *args, **kwargs)

            dist.all_reduce = all_reduce
        if self.point == "checkpoint":
            self._patch_dcp_writer()

    def _in_step(self) -> bool:
        trainer = self._trainer
        return trainer is not None and trainer.training and trainer.global_step == self.step

    def _forward_hook(self, module: Any, args: Any) -> None:
        trainer = self._trainer
        if not self._armed or trainer is None:
            return
        if self.point == "validation":
            if trainer.validating:
                self._fire(f"validation forward of {type(module).__name__}")
        elif self._in_step():
            sig = signal.SIGSTOP if self.point == "sigstop" else signal.SIGKILL
            self._fire(f"forward of {type(module).__name__}", sig)

    def _grad_hook(self, param: Any) -> None:
        if self._armed and self._in_step():
            self._fire(f"backward (gradient of a {tuple(param.shape)} parameter)")

    def _optimizer_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._armed and self._in_step():
            self._fire(f"{type(optimizer).__name__}.step")

    def _patch_dcp_writer(self) -> None:
        from torch.distributed.checkpoint.filesystem import FileSystemWriter

        original = FileSystemWriter.write_data
        injector = self

        def write_data(writer, plan, planner):
            result = original(writer, plan, planner)
            trainer = injector._trainer
            if injector._armed and trainer is not None and trainer.current_epoch >= 1:
                result.wait()  # its files are written; the commit of the whole checkpoint is not
                injector._fire("checkpoint save (DCP write_data)")
            return result

        FileSystemWriter.write_data = write_data

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if trainer.global_rank == 0:
            (self.dir / f"step-{trainer.global_step}").touch()


class InOrderText(ByteTextDataModule):
    """The example's byte-text data with its training windows in order (no shuffle; run with
    ``use_distributed_sampler=False``, as Lightning's own sampler would shuffle): every epoch reads the same batches,
    so a run resumed from an epoch-end checkpoint sees the uninterrupted run's data whatever epoch number Lightning
    gives the sampler (Lightning 2.6 shifts it by one on such a resume)."""

    def train_dataloader(self) -> DataLoader:
        """This data-parallel replica's windows in order, batches of ``(B, T)``."""
        windows = TrainWindows(self.train_data, self.block_size, self.seed)
        sampler = DistributedSampler(windows, shuffle=False, **self.trainer.strategy.distributed_sampler_kwargs)
        return DataLoader(windows, batch_size=self.batch_size, sampler=sampler, drop_last=True,
                          num_workers=self.num_workers)


class LossLog(pl.Callback):
    """Appends ``(global_step, loss)`` of every training step on global rank 0 to ``SMP_FAULT_DIR/losses.jsonl``."""

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_rank == 0:
            loss = float(outputs["loss"] if isinstance(outputs, dict) else outputs)
            with open(Path(os.environ["SMP_FAULT_DIR"]) / "losses.jsonl", "a") as f:
                f.write(json.dumps([trainer.global_step, loss.hex()]) + "\n")


# ---- the harness ----------------------------------------------------------------------------------------------


@dataclass
class Trial:
    """One trial's record."""

    index: int
    layout: str
    point: str
    rank: int
    step: int
    fault_s: float | None = None  # wall time of the fault (epoch seconds)
    what: str = ""
    others_out: bool = False  # every rank but a SIGSTOPped victim exited by the deadline
    out_after_s: float | None = None  # the last of them, after the fault
    named: bool | None = None  # some error names the failed rank (None: not applicable)
    error: str = ""
    left_behind: int = 0
    exit_code: int | None = None
    checkpoint: str = ""
    resume_exact: bool | None = None
    resume_note: str = ""
    log: str = ""
    extra: dict = field(default_factory=dict)

    def ok(self, timeout_s: float) -> bool:
        return (self.others_out and self.left_behind == 0 and self.named is not False and self.resume_exact is not False
                and self.out_after_s is not None and self.out_after_s <= timeout_s + 10)


def run_args(layout: str, run_dir: Path, timeout_s: int, ckpt_path: str | None = None) -> list[str]:
    """The ``lightning-mp fit`` command line of one run of ``layout`` into ``run_dir``."""
    config, layout_args = LAYOUTS[layout]
    args = [
        sys.executable, "-m", "lightning_mp.cli", "fit", "--config", config,
        "--data", "scripts.fault_harness.InOrderText", "--model.init_args.n_layer", "2", "--model.init_args.n_head", "2",
        "--model.init_args.n_embd", "32", "--model.init_args.block_size", "32", "--model.init_args.warmup_steps", "2",
        "--data.init_args.block_size", "32", "--data.init_args.batch_size", "8", "--data.init_args.max_bytes", "200000",
        "--trainer.max_epochs", str(EPOCHS + 2), "--trainer.max_steps", str(EPOCHS * STEPS_PER_EPOCH),
        "--trainer.limit_train_batches", str(STEPS_PER_EPOCH), "--trainer.limit_val_batches", "2",
        "--trainer.val_check_interval", "null", "--trainer.check_val_every_n_epoch", "1",
        "--trainer.num_sanity_val_steps", "0", "--trainer.log_every_n_steps", "1", "--trainer.logger", "false",
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
        "--trainer.enable_checkpointing", "true", "--trainer.use_distributed_sampler", "false",
        "--trainer.default_root_dir", str(run_dir),
        "--trainer.strategy.init_args.timeout", f"{timeout_s // 3600}:{timeout_s // 60 % 60:02d}:{timeout_s % 60:02d}",
        "--trainer.strategy.init_args.microbatches", "2",
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        "--trainer.callbacks.dirpath", str(run_dir / "ckpt"), "--trainer.callbacks.save_last", "true",
        "--trainer.callbacks.save_top_k", "-1", "--trainer.callbacks.every_n_epochs", "1",
        "--trainer.callbacks.save_on_train_epoch_end", "true",
        "--trainer.callbacks+=scripts.fault_harness.FaultInjector",
        "--trainer.callbacks+=scripts.fault_harness.LossLog",
    ]
    args += layout_args
    if ckpt_path is not None:
        args += ["--ckpt_path", ckpt_path]
    return args


def _run_pids(token: str) -> dict[int, str]:
    """Live processes (not zombies) whose environment holds ``token``: pid -> their ``LOCAL_RANK`` (or "")."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if f"SMP_FAULT_TOKEN={token}".encode() in env:
            rank = next((e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"LOCAL_RANK=")), "")
            found[int(entry)] = rank
    return found


def launch(layout: str, run_dir: Path, token: str, timeout_s: int, fault: str = "", ckpt_path: str | None = None
           ) -> subprocess.Popen:
    """Start one run into a fresh ``run_dir`` (a folder left by an earlier harness run is removed first: its
    ``fault.json``, step markers and checkpoints would be read as this run's)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    env = dict(os.environ, SMP_FAULT=fault, SMP_FAULT_DIR=str(run_dir), SMP_FAULT_TOKEN=token,
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1",
               PYTHONFAULTHANDLER="1")
    log = open(run_dir / "log.txt", "wb")
    # SIGINT as a terminal gives it: a harness started in the background (``&``, nohup) has SIGINT ignored, which
    # its children would inherit (Python then never raises KeyboardInterrupt)
    return subprocess.Popen(run_args(layout, run_dir, timeout_s, ckpt_path), cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def read_losses(run_dir: Path) -> dict[int, float]:
    path = run_dir / "losses.jsonl"
    if not path.exists():
        return {}
    return {step: float.fromhex(value) for step, value in map(json.loads, path.read_text().splitlines())}


def newest_checkpoint(run_dir: Path) -> Path | None:
    """The newest epoch checkpoint folder (half-written ones are hidden, ``.name.partial``, and skipped)."""
    found = []
    for path in (run_dir / "ckpt").glob("epoch=*-step=*"):
        match = re.fullmatch(r"epoch=(\d+)-step=(\d+)", path.name)
        if match:
            found.append((int(match[2]), path))
    return max(found)[1] if found else None


def run_reference(layout: str, root: Path, timeout_s: int) -> dict[int, float]:
    run_dir = root / f"reference-{layout}"
    proc = launch(layout, run_dir, f"ref-{layout}-{os.getpid()}", timeout_s)
    if proc.wait() != 0:
        raise RuntimeError(f"the uninterrupted {layout} run failed; see {run_dir / 'log.txt'}")
    return read_losses(run_dir)


def _victim_error(log: str, rank: int) -> str:
    """The first line of an error in ``log`` that names global rank ``rank`` ("" when none does) as the failed one:
    ours ("global rank R died", "global ranks [.., R, ..] died", "pipeline stage S (global rank R)", "its host,
    global rank R's process"), or Lightning's launcher's ("[rank: R] Child process with PID ... terminated with code
    -9"). A list of a collective's ranks ("over global ranks [0, 1, 2, 3]") and the reporting rank ("failed on
    global rank R") do not count."""
    pattern = re.compile(rf"((?<!on )global rank {rank}\b(?![,\]])|global ranks \[[\d, ]*\b{rank}\b[\d, ]*\] died"
                         rf"|\[rank: {rank}\] Child process)")
    for line in log.splitlines():
        if pattern.search(line) and re.search(r"Error|error|failed|Lost|heard nothing|Timed out|terminated", line):
            return line.strip()[:400]
    return ""


def run_trial(trial: Trial, root: Path, timeout_s: int, reference: dict[int, float]) -> Trial:
    """Run one faulted trial, watch its processes, then resume its newest checkpoint."""
    run_dir = root / f"trial-{trial.index:03d}"
    token = f"t{trial.index}-{os.getpid()}-{time.time_ns()}"
    proc = launch(trial.layout, run_dir, token, timeout_s, fault=f"{trial.point}:{trial.rank}:{trial.step}")
    start = time.time()
    signalled = trial.point not in ("sigterm", "sigint")
    deadline = dump_at = None
    victim_pid = None
    seen: dict[int, str] = {}
    while True:
        time.sleep(0.1)
        if "start_s" not in trial.extra and (run_dir / "step-0").exists():  # every rank past setup's collectives
            trial.extra["start_s"] = round((run_dir / "step-0").stat().st_mtime - start, 1)
        if not signalled and (run_dir / f"step-{trial.step}").exists():
            proc.send_signal(signal.SIGTERM if trial.point == "sigterm" else signal.SIGINT)
            trial.fault_s, trial.what, signalled = time.time(), f"{trial.point.upper()} to the launcher", True
            trial.rank = 0
        if trial.fault_s is None and (run_dir / "fault.json").exists():
            try:
                fault = json.loads((run_dir / "fault.json").read_text())
            except ValueError:
                continue  # being written
            if fault.get("token") != token:
                raise RuntimeError(f"{run_dir / 'fault.json'} is not this trial's (token {fault.get('token')!r})")
            trial.fault_s, trial.what, victim_pid = fault["time"], fault["what"], fault["pid"]
        if trial.fault_s is not None and deadline is None:
            deadline = trial.fault_s + timeout_s + 30
            dump_at = trial.fault_s + 20
        if dump_at is not None and time.time() > dump_at:  # still there 20 s after the fault: where is each stuck?
            dump_at = None
            for pid in _run_pids(token):
                if pid != victim_pid or trial.point != "sigstop":
                    os.kill(pid, signal.SIGUSR1)
        pids = _run_pids(token)
        _note_exits(trial, seen, pids, proc.pid)
        others = [pid for pid in pids if pid != victim_pid or trial.point != "sigstop"]
        if not others:
            trial.out_after_s = time.time() - trial.fault_s if trial.fault_s is not None else None
            trial.others_out = trial.fault_s is not None
            break
        if (deadline is not None and time.time() > deadline) or time.time() - start > 600:
            trial.left_behind = len(others)
            trial.extra["left_ranks"] = sorted(pids[pid] or "launcher" for pid in others)
            break
    _end_run(token, victim_pid if trial.point == "sigstop" else None)
    trial.exit_code = proc.wait()
    log = (run_dir / "log.txt").read_text(errors="replace")
    trial.log = str(run_dir / "log.txt")
    if trial.point in _KILL_POINTS + ("sigstop",):
        trial.error = _victim_error(log, trial.rank)
        trial.named = bool(trial.error)
    _check_resume(trial, run_dir, timeout_s, reference)
    return trial


def _digest(folder: Path) -> str:
    """A hash of the tensor files (model and optimizer shards) under ``folder``, with their relative paths."""
    digest = hashlib.sha256()
    for path in sorted(folder.rglob("*.distcp")):
        digest.update(str(path.relative_to(folder)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


_RESUMED: dict[tuple[str, str], tuple[bool, str]] = {}  # (layout, checkpoint digest) -> resume outcome


def _end_run(token: str, stopped: int | None) -> None:
    """Kill what is left of a run: a SIGSTOPped victim at once; others with SIGABRT first, so that Python's
    ``faulthandler`` (on in every rank: ``PYTHONFAULTHANDLER``) writes where each thread was stuck to the log."""
    left = [pid for pid in _run_pids(token) if pid != stopped]
    for pid in left:
        os.kill(pid, signal.SIGABRT)
    if left:
        time.sleep(3)
    for pid in _run_pids(token):
        os.kill(pid, signal.SIGKILL)


def _note_exits(trial: Trial, seen: dict[int, str], pids: dict[int, str], launcher: int) -> None:
    """Record in ``trial.extra["exit_s"]`` when each rank's process went, in seconds after the fault (rank 0: the
    launcher)."""
    for pid, rank in pids.items():
        seen.setdefault(pid, "0" if pid == launcher else rank)
    exits = trial.extra.setdefault("exit_s", {})
    for pid, rank in seen.items():
        if pid not in pids and rank not in exits and trial.fault_s is not None:
            exits[rank] = round(time.time() - trial.fault_s, 1)


def _check_resume(trial: Trial, run_dir: Path, timeout_s: int, reference: dict[int, float]) -> None:
    """Resume the trial's newest checkpoint to the end; compare its losses with the uninterrupted run's. A checkpoint
    byte-identical to one an earlier trial of the layout resumed is not resumed again (the runs are deterministic)."""
    ckpt = newest_checkpoint(run_dir)
    if ckpt is None:
        trial.resume_note = "no checkpoint yet"
        return
    trial.checkpoint = ckpt.name
    key = (trial.layout, _digest(ckpt))
    if key in _RESUMED:
        trial.resume_exact, note = _RESUMED[key]
        trial.resume_note = f"byte-identical to a checkpoint resumed before: {note}"
        return
    _resume(trial, run_dir, ckpt, timeout_s, reference)
    _RESUMED[key] = (bool(trial.resume_exact), trial.resume_note)


def _resume(trial: Trial, run_dir: Path, ckpt: Path, timeout_s: int, reference: dict[int, float]) -> None:
    resumed_dir = run_dir / "resumed"
    proc = launch(trial.layout, resumed_dir, f"r{trial.index}-{os.getpid()}-{time.time_ns()}", timeout_s,
                  ckpt_path=str(ckpt))
    if proc.wait(timeout=600) != 0:
        trial.resume_exact, trial.resume_note = False, f"resume failed, see {resumed_dir / 'log.txt'}"
        return
    losses = read_losses(resumed_dir)
    after = int(ckpt.name.rsplit("=", 1)[1])  # the checkpoint's global step
    expected = {step: loss for step, loss in reference.items() if step > after}
    trial.resume_exact = losses == expected  # none after the last checkpoint: the resumed run only loads it
    trial.resume_note = f"steps {min(losses)}..{max(losses)}" if losses else "no steps"
    if not trial.resume_exact:
        diff = {s: (losses.get(s), expected.get(s)) for s in sorted(set(losses) | set(expected))}
        trial.resume_note += f"; differs from the uninterrupted run: {diff}"


def plan_trials(count: int, seed: int, layouts: list[str], points: list[str]) -> list[Trial]:
    """``count`` trials: every point in turn (each at least once when ``count >= len(points)``), the victim rank,
    the step and the layout drawn from ``seed``."""
    rng = random.Random(seed)
    trials = []
    for index in range(count):
        point = points[index % len(points)]
        layout = layouts[(index // len(points)) % len(layouts)] if len(layouts) > 1 else layouts[0]
        rank = 0 if point in ("sigterm", "sigint") else rng.randrange(4)
        step = rng.randrange(1, EPOCHS * STEPS_PER_EPOCH - 1)
        trials.append(Trial(index, layout, point, rank, step))
    return trials


MAX_REDRAWS = 2


def run_until_reached(trial: Trial, root: Path, timeout_s: int, reference: dict[int, float], seed: int) -> Trial:
    """Run ``trial``; a run that ended without its fault firing is reported ("fault not reached", with its exit
    code) and the trial is drawn again (victim rank and step, from ``seed`` and the trial's index), at most
    ``MAX_REDRAWS`` times. The draws that missed stay in ``extra["redrawn"]``; the last run is the trial's record."""
    rng = random.Random(f"{seed}-{trial.index}")
    missed = []
    while True:
        done = run_trial(dataclasses.replace(trial, extra={}), root, timeout_s, reference)
        if done.fault_s is not None or len(missed) == MAX_REDRAWS:
            done.extra["redrawn"] = missed
            return done
        missed.append(f"rank {done.rank} step {done.step}: fault not reached (exit code {done.exit_code})")
        print(f"trial {trial.index}: {trial.point} at {missed[-1]}; drawn again", flush=True)
        rank = 0 if trial.point in ("sigterm", "sigint") else rng.randrange(4)
        trial = dataclasses.replace(trial, rank=rank, step=rng.randrange(1, EPOCHS * STEPS_PER_EPOCH - 1))


def outcome(trial: Trial, timeout_s: float) -> str:
    if trial.fault_s is None:
        return "fault not reached"
    if trial.left_behind:
        return f"{trial.left_behind} left behind"
    if not trial.others_out or trial.out_after_s is None or trial.out_after_s > timeout_s + 10:
        return "late"
    if trial.named is False:
        return "rank not named"
    if trial.resume_exact is False:
        return "resume differs"
    return "ok"


def _redraws(trial: Trial) -> str:
    missed = trial.extra.get("redrawn", [])
    return f" (drawn again {len(missed)}x: {'; '.join(missed)})" if missed else ""


def print_table(trials: list[Trial], timeout_s: float) -> None:
    print("| # | layout | point | rank | step | out after (s) | named | left | checkpoint | resume exact | outcome |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for t in trials:
        after = f"{t.out_after_s:.1f}" if t.out_after_s is not None else "-"
        named = "-" if t.named is None else ("yes" if t.named else "no")
        exact = "-" if t.resume_exact is None else ("yes" if t.resume_exact else "no")
        print(f"| {t.index} | {t.layout} | {t.point} | {t.rank} | {t.step} | {after} | {named} | {t.left_behind} |"
              f" {t.checkpoint or '-'} | {exact} | {outcome(t, timeout_s)}{_redraws(t)} |")
    ok = sum(outcome(t, timeout_s) == "ok" for t in trials)
    worst = max((t.out_after_s for t in trials if t.out_after_s is not None), default=float("nan"))
    resumed = [t for t in trials if t.resume_exact is not None]
    print(f"summary: {ok}/{len(trials)} ok (timeout {timeout_s:.0f} s; every other rank out within timeout + 10 s,"
          f" slowest {worst:.1f} s); {sum(t.left_behind for t in trials)} processes left behind;"
          f" {sum(bool(t.resume_exact) for t in resumed)}/{len(resumed)} resumes exact;"
          f" points: {', '.join(sorted({t.point for t in trials}))}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=int, default=120, help="SMPConfig.timeout of the runs, seconds")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--points", nargs="+", default=list(POINTS), choices=list(POINTS))
    parser.add_argument("--root", type=Path, default=Path("fault_runs"), help="where the runs' folders go")
    parser.add_argument("--out", type=Path, default=None, help="write every trial's record here (JSON)")
    parser.add_argument("--table", type=Path, nargs="+", default=None,
                        help="only print the table of the trials recorded in these --out files")
    args = parser.parse_args(argv)
    if args.table is not None:
        trials = [Trial(**record) for path in args.table for record in json.loads(path.read_text())]
        print_table(trials, args.timeout)
        return 0
    root = args.root.resolve()
    references = {layout: run_reference(layout, root, args.timeout) for layout in args.layouts}
    trials = []
    for trial in plan_trials(args.trials, args.seed, args.layouts, args.points):
        trials.append(run_until_reached(trial, root, args.timeout, references[trial.layout], args.seed))
        t = trials[-1]
        print(f"trial {t.index}: {t.layout} {t.point} rank {t.rank} step {t.step}: {outcome(t, args.timeout)}"
              f" ({t.what}; out after {t.out_after_s}; {t.error[:160]!r}; {t.resume_note[:200]})", flush=True)
        if args.out is not None:
            args.out.write_text(json.dumps([asdict(t) for t in trials], indent=1))
    print_table(trials, args.timeout)
    return 0 if all(outcome(t, args.timeout) == "ok" for t in trials) else 1


if __name__ == "__main__":
    sys.exit(main())
