"""Memory of the example GPT per rank: eager vs delayed init, with and without checkpointing / offloading / sharding.

Every configuration runs ``Trainer.fit`` with ``strategy="smp"`` (fork, CPU, gloo) for two AdamW steps and
measures, on each rank:

- **setup peak**: peak resident memory (``VmHWM``) from the ``setup`` hook to ``on_fit_start`` (the build,
  the partitioning trace and the materialisation), above the rank's resident memory when setup started
  (``VmHWM`` is reset by writing 5 to ``/proc/self/clear_refs`` between phases);
- **own params**: the bytes of the parameters the rank holds (from their storages);
- **step-2 peak**: the peak of the second training step above the resident memory before it, which holds the
  first step's gradients: the step frees them before it makes its own (``GradientStash``), so this is the
  activations and temporaries of the step;
- **param + grad + optimizer bytes** after training, counted from storages (optimizer: the local shard's state),
  and ``(params + optimizer) / ideal`` with ideal = total params / pp + AdamW state (2x) / (pp x dp-shard).

A separate one-process column counts the bytes of the tensors autograd saves for backward in one microbatch
(every saved tensor's storage once, through ``torch.autograd.graph.saved_tensors_hooks``): activation memory
without allocator noise. With ``--budget-mb`` the script also runs the eager one-process build and the pp=4
delayed-init fit under a measured per-rank cap (``RssCap``: resident memory sampled every 5 ms, the rank ends
when it passes its start + budget; ``RLIMIT_AS`` fails at thread creation long before) and reports whether
each built and trained. With ``--budget-pp2-mb`` it runs pp=2 x dp=2 with replicas, with ZeRO-1 and with
``sharded_data_parallel_degree=2`` (AdamW, delayed init) under one cap.

Workers run with ``SMPStrategy(release_host_memory=True)`` (``--host-memory default`` keeps glibc's dynamic mmap
threshold, under which freed tensors stay resident in the engine threads' malloc arenas and every rank shows
about one extra gradient's worth of memory after the first step; see ``lightning_mp/memory/_host.py``).

Run: ``python benchmarks/memory.py --budget-mb 650`` (about twelve minutes on two cores; ``--n-layer 2
--n-embd 64`` for a smoke run).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning_mp  # noqa: E402
from examples.gpt import GPT  # noqa: E402

MiB = 2**20


@dataclass(frozen=True)
class Setting:
    name: str
    pp: int = 1
    dp: int = 1
    delayed: bool = False
    checkpointing: bool = False
    offloading: bool = False
    sharding: bool = False
    sdp: int = 1  # sharded_data_parallel_degree
    reshard: str = "default"  # reshard_after_forward under sdp


SETTINGS = [
    Setting("eager", 1),
    Setting("delayed", 1, delayed=True),
    Setting("delayed+ckpt", 1, delayed=True, checkpointing=True),
    Setting("delayed+ckpt+offload", 1, delayed=True, checkpointing=True, offloading=True),
    Setting("eager", 2),
    Setting("delayed", 2, delayed=True),
    Setting("eager", 4),
    Setting("delayed", 4, delayed=True),
    Setting("delayed+ckpt", 4, delayed=True, checkpointing=True),
    Setting("eager", 1, dp=2),
    Setting("delayed+shard", 1, dp=2, delayed=True, sharding=True),
    Setting("delayed+ckpt+offload+shard", 2, dp=2, delayed=True, checkpointing=True, offloading=True, sharding=True),
    Setting("delayed", 2, dp=2, delayed=True),
    Setting("delayed+shard", 2, dp=2, delayed=True, sharding=True),
    Setting("delayed+sdp", 2, dp=2, delayed=True, sdp=2),
    Setting("delayed+sdp(reshard always)", 1, dp=2, delayed=True, sdp=2, reshard="always"),
    Setting("delayed+sdp(reshard never)", 1, dp=2, delayed=True, sdp=2, reshard="never"),
]
BUDGET_EAGER, BUDGET_DELAYED = 6, 7  # the pp=4 eager and delayed settings
BUDGET_PP2 = (12, 13, 14)  # pp=2 x dp=2: replicas, ZeRO-1, sharded data parallelism


def _status(key: str) -> int:
    """A ``/proc/self/status`` field in bytes (``VmRSS``, ``VmHWM``, ``VmSize``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def _storage_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor  # noqa: PLC0415

    seen: dict[int, int] = {}
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t  # a sharded_data_parallel_degree shard: its own storage
        if t is not None and not t.is_meta:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


class BenchGPT(L.LightningModule):
    """The example GPT built in ``configure_model`` (so each rank builds it, eagerly or delayed)."""

    def __init__(self, n_layer: int, n_embd: int, block_size: int, batch: int, steps: int, optimizer: str) -> None:
        super().__init__()
        self.optimizer_name = optimizer
        self.dims = (n_layer, n_embd, block_size)
        self.batch, self.steps = batch, steps
        self.gpt: GPT | None = None

    def configure_model(self) -> None:
        if self.gpt is None:
            torch.manual_seed(0)
            n_layer, n_embd, block_size = self.dims
            self.gpt = GPT(vocab_size=256, block_size=block_size, n_layer=n_layer, n_head=8, n_embd=n_embd)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.gpt(x)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))

    def configure_optimizers(self):
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=1e-3)
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, 256, (self.batch * self.steps, self.dims[2]), generator=g)
        return DataLoader(TensorDataset(x, torch.roll(x, -1, 1)), batch_size=self.batch)


class HostMemoryProbe(L.Callback):
    """Measurement only (``--host-memory mmap|trim``): ``mmap`` fixes glibc's mmap threshold in each rank at
    setup (what ``release_host_memory=True`` does), ``trim`` calls ``malloc_trim(0)`` after setup and after every
    batch (see [Note: freed tensors stay resident under glibc] in ``lightning_mp/memory/_host.py``)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode

    def setup(self, trainer, pl_module, stage):
        from lightning_mp.memory._host import fix_mmap_threshold  # noqa: PLC0415

        if self.mode == "mmap":
            assert fix_mmap_threshold()

    def on_fit_start(self, trainer, pl_module):
        from lightning_mp.memory._host import trim_host_memory  # noqa: PLC0415

        if self.mode == "trim":
            trim_host_memory()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        from lightning_mp.memory._host import trim_host_memory  # noqa: PLC0415

        if self.mode == "trim":
            started = time.perf_counter()
            trim_host_memory()
            pl_module._trim_s = getattr(pl_module, "_trim_s", 0.0) + time.perf_counter() - started


class MemoryProbe(L.Callback):
    """Resident-memory peaks per phase and storage bytes, written per rank as JSON."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.row: dict = {}

    def setup(self, trainer, pl_module, stage):
        torch.set_num_threads(1)
        _reset_peak()
        self.row["baseline"] = _status("VmRSS")

    def on_fit_start(self, trainer, pl_module):
        self.row["setup_peak"] = _status("VmHWM") - self.row["baseline"]
        self.row["own_params"] = _storage_bytes(pl_module.parameters())

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._started = time.perf_counter()
        if batch_idx == 1:
            self.row["before_step2"] = _status("VmRSS")
        _reset_peak()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.row.setdefault("step_s", []).append(time.perf_counter() - self._started)
        # every step's peak above the rank's resident memory at setup
        self.row.setdefault("step_peaks", []).append(_status("VmHWM") - self.row["baseline"])
        if batch_idx == 1:
            self.row["step2_peak"] = _status("VmHWM") - self.row["before_step2"]

    def on_train_end(self, trainer, pl_module):
        from torch.distributed.optim import ZeroRedundancyOptimizer

        optimizer = trainer.optimizers[0]
        local = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
        params = list(pl_module.parameters())
        self.row["params"] = _storage_bytes(params)
        self.row["grads"] = _storage_bytes(p.grad for p in params)
        states = [t for state in local.state.values() for t in state.values() if torch.is_tensor(t)]
        self.row["optimizer"] = _storage_bytes(states)
        Path(self.out_dir, f"{trainer.global_rank}.json").write_text(json.dumps(self.row))


def run_setting(setting: Setting, args: argparse.Namespace, extra_callbacks=(), optimizer: str = "adamw") -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        callbacks: list = [MemoryProbe(out), *extra_callbacks]
        if setting.checkpointing:
            callbacks.append(lightning_mp.ActivationCheckpointing(["examples.gpt.Block"]))
        if setting.offloading:
            callbacks.append(lightning_mp.ActivationOffloading(horizon=4))
        sdp = {"sharded_data_parallel_degree": setting.sdp, "reshard_after_forward": setting.reshard}
        sdp = sdp if setting.sdp > 1 else {}
        strategy = lightning_mp.SMPStrategy(
            pipeline_parallel_degree=setting.pp, microbatches=args.microbatches, start_method="fork",
            delayed_parameter_initialization=setting.delayed, shard_optimizer_state=setting.sharding,
            release_host_memory=args.host_memory == "release", **sdp,
        )
        trainer = L.Trainer(
            accelerator="cpu", devices=setting.pp * setting.dp, strategy=strategy, max_steps=args.steps, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
            use_distributed_sampler=False, precision=args.precision,
        )
        trainer.fit(BenchGPT(args.n_layer, args.n_embd, args.block_size, args.batch * setting.dp, args.steps, optimizer))
        return [json.loads(Path(out, f"{r}.json").read_text()) for r in range(setting.pp * setting.dp)]


def saved_activation_bytes(args: argparse.Namespace, checkpointing: bool) -> int:
    """Bytes autograd saves for one microbatch's backward (each storage once), one process, small depth."""
    torch.manual_seed(0)
    model = GPT(vocab_size=256, block_size=args.block_size, n_layer=args.n_layer, n_head=8, n_embd=args.n_embd)
    if checkpointing:
        for block in model.h:
            lightning_mp.set_activation_checkpointing(block)
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.nn.Parameter) and t.untyped_storage().nbytes():
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    x = torch.randint(0, 256, (args.batch // args.microbatches, args.block_size))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(x)
    del logits
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in storages.items() if ptr not in params)


class RssCap(L.Callback):
    """A per-rank memory cap, enforced by measurement: from ``setup`` to ``on_train_end`` (setup and training), a
    thread samples ``VmRSS`` every 5 ms and ends the rank (exit code 3) once it exceeds the resident memory at
    ``setup`` plus ``budget`` bytes. After training the fork launcher hands rank 0's whole weights back to the
    launching process (under sharded data parallelism each stage's rank gathers its stage whole for that): not
    training, so not capped.

    ``RLIMIT_AS`` cannot serve here: it caps virtual memory, and every engine and gloo thread reserves stacks and
    malloc arenas far beyond what it touches, so a limit near the real need fails at thread creation first.
    """

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.phase = "setup"

    def on_fit_start(self, trainer, pl_module):
        self.phase = "training"

    def on_train_end(self, trainer, pl_module):
        self.phase = "after training"

    def setup(self, trainer, pl_module, stage):
        import threading  # noqa: PLC0415

        cap = _status("VmRSS") + self.budget

        def watch() -> None:
            while self.phase != "after training":
                if _status("VmRSS") > cap:
                    print(
                        f"rank {trainer.global_rank}: over the budget of {self.budget / MiB:.0f} MiB (global step"
                        f" {trainer.global_step}, {self.phase})", flush=True,
                    )
                    os._exit(3)
                threading.Event().wait(0.005)

        threading.Thread(target=watch, daemon=True).start()


def budget_demo(args: argparse.Namespace) -> list[str]:
    """pp=4 eager vs pp=4 delayed init of a wider GPT under one per-rank cap (plain SGD: 2x own params to train,
    gradients freed at the start of each batch).

    An eager rank holds the whole model while it builds (4x its own parameters at pp=4) before dropping the other
    stages; a delayed rank never holds more than its own, so a cap between the two separates them.
    """
    demo = ["--n-layer", str(args.budget_n_layer), "--n-embd", str(args.budget_n_embd)]
    with torch.device("meta"):
        model = GPT(256, args.block_size, args.budget_n_layer, 8, args.budget_n_embd)
        total = sum(p.numel() * 4 for p in model.parameters())
    lines = [f"| (model: n_layer={args.budget_n_layer}, n_embd={args.budget_n_embd}, {_mib(total)} MiB of parameters,"
             f" {_mib(total / 4)} MiB per stage; SGD) | | |"]
    for index in (BUDGET_EAGER, BUDGET_DELAYED):
        rows = _run_worker(index, [*demo, "--cap-mb", str(args.budget_mb), "--optimizer", "sgd"], args)
        result = "FAILED (a rank passed the cap)" if rows is None else "built and trained; per-rank peak " + ", ".join(
            _mib(max(r["setup_peak"], r["before_step2"] - r["baseline"] + r["step2_peak"])) for r in rows
        ) + " MiB"
        lines.append(f"| {SETTINGS[index].name}, pp=4 | {args.budget_mb} MiB per rank | {result} |")
    return lines


def budget_pp2_demo(args: argparse.Namespace) -> list[str]:
    """pp=2 x dp=2 under one per-rank cap (AdamW): replicas (each rank its stage's parameters, gradients and
    both moments), ZeRO-1 (half the moments) and ``sharded_data_parallel_degree=2`` (parameters, gradients and
    moments sharded between steps); a cap between the last two separates them."""
    demo = ["--n-layer", str(args.budget_n_layer), "--n-embd", str(args.budget_n_embd)]
    with torch.device("meta"):
        model = GPT(256, args.block_size, args.budget_n_layer, 8, args.budget_n_embd)
        total = sum(p.numel() * 4 for p in model.parameters())
    lines = [f"| (model: n_layer={args.budget_n_layer}, n_embd={args.budget_n_embd}, {_mib(total)} MiB of parameters,"
             f" {_mib(total / 2)} MiB per stage; AdamW, {args.precision}) | | |"]
    for index in BUDGET_PP2:
        rows = _run_worker(index, [*demo, "--cap-mb", str(args.budget_pp2_mb)], args)
        result = "FAILED (a rank passed the cap)" if rows is None else "trained; per-rank peak " + ", ".join(
            _mib(max(r["step_peaks"])) for r in rows
        ) + " MiB"
        lines.append(f"| {SETTINGS[index].name}, pp=2 x dp=2 | {args.budget_pp2_mb} MiB per rank | {result} |")
    return lines


def _run_worker(index: int, extra: list[str], args: argparse.Namespace) -> list[dict] | None:
    """Run one setting in a fresh interpreter (forked ranks then inherit no heap of earlier runs)."""
    base = ["--block-size", str(args.block_size), "--batch", str(args.batch), "--microbatches", str(args.microbatches),
            "--precision", args.precision]
    if "--n-layer" not in extra:
        base += ["--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd)]
    extra = [*extra, "--host-memory", args.host_memory, "--steps", str(args.steps)]
    command = [sys.executable, __file__, "--worker", str(index), *base, *extra]
    env = dict(os.environ)
    if args.host_memory == "env":
        # A fixed mmap threshold: blocks above 128 KiB are mapped and unmapped, so resident memory follows live
        # tensors. glibc's default threshold grows after the first large free, and then freed gradients and
        # activations stay resident in the engine threads' arenas (about one extra gradient copy per rank).
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
    if args.host_memory == "arena":  # one malloc arena for all threads: freed memory is reused across threads
        env.setdefault("MALLOC_ARENA_MAX", "1")
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800, env=env)
    for line in done.stdout.splitlines():
        if line.startswith(_MARK):
            return json.loads(line[len(_MARK):])
    if "over the budget" not in done.stdout:
        print(done.stdout[-2000:], done.stderr[-3000:], file=sys.stderr)
    return None


def _worker(args: argparse.Namespace) -> None:
    extra = [RssCap(args.cap_mb * MiB)] if args.cap_mb else []
    if args.host_memory in ("mmap", "trim"):
        extra.append(HostMemoryProbe(args.host_memory))
    rows = run_setting(SETTINGS[args.worker], args, extra_callbacks=extra, optimizer=args.optimizer)
    print(_MARK + json.dumps(rows), flush=True)


_MARK = "LIGHTNING_MP_MEMORY_ROWS "


def _mib(n: float) -> str:
    return f"{n / MiB:.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-layer", type=int, default=16)
    parser.add_argument("--n-embd", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4, help="per data-parallel replica")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--only", default=None, help="comma-separated indices into the settings list")
    parser.add_argument("--budget-mb", type=int, default=0, help="also run pp=4 eager and delayed under this cap (650)")
    parser.add_argument(
        "--budget-pp2-mb", type=int, default=0,
        help="also run pp=2 x dp=2 replicas, ZeRO-1 and sharded data parallelism under this cap",
    )
    parser.add_argument("--budget-n-layer", type=int, default=16)
    parser.add_argument("--budget-n-embd", type=int, default=1024)
    parser.add_argument(
        "--host-memory", default="release", choices=["release", "default", "env", "arena", "mmap", "trim"],
        help="release: SMPStrategy(release_host_memory=True) (default); default: glibc's dynamic mmap threshold;"
        " env: MALLOC_MMAP_THRESHOLD_=131072 in the workers; arena: MALLOC_ARENA_MAX=1; mmap / trim: mallopt /"
        " malloc_trim from a callback",
    )
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument(
        "--precision", default="32-true", help="Lightning's precision (bf16-mixed: sdp gathers in bf16, see the README)"
    )
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--cap-mb", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--optimizer", default="adamw", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.worker is not None:
        _worker(args)
        return
    # Every setting runs in a fresh interpreter whose ranks are forked from it: heap freed in an earlier run (e.g.
    # the rank-0 weights Lightning sends back to the launching process) would stay resident in forked ranks and
    # hide their own allocations (glibc keeps freed chunks below its mmap threshold in the heap).
    with torch.device("meta"):
        total = sum(p.numel() * 4 for p in GPT(256, args.block_size, args.n_layer, 8, args.n_embd).parameters())
    print(f"example GPT n_layer={args.n_layer} n_embd={args.n_embd}: {_mib(total)} MiB of fp32 parameters; AdamW;"
          f" batch {args.batch} x {args.block_size} tokens per replica, {args.microbatches} microbatches,"
          f" {args.precision}\n")
    print("| setting | pp | dp | rank | setup peak | own params | setup peak / own params | step-2 peak |"
          " params + grads + optimizer | (params + optimizer) / ideal |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    chosen = SETTINGS if args.only is None else [SETTINGS[int(i)] for i in args.only.split(",")]
    for setting in chosen:
        rows = _run_worker(SETTINGS.index(setting), [], args)
        if rows is None:
            print(f"| {setting.name} | {setting.pp} | {setting.dp} | failed, see stderr |")
            continue
        for rank, row in enumerate(rows):
            shard = setting.dp if setting.sharding else setting.sdp
            ideal = total / (setting.pp * setting.sdp) + 2 * total / (setting.pp * shard)
            print(
                f"| {setting.name} | {setting.pp} | {setting.dp} | {rank} | {_mib(row['setup_peak'])} |"
                f" {_mib(row['own_params'])} | {row['setup_peak'] / max(1, row['own_params']):.2f} |"
                f" {_mib(row['step2_peak'])} |"
                f" {_mib(row['params'] + row['grads'] + row['optimizer'])} |"
                f" {(row['params'] + row['optimizer']) / ideal:.2f} |",
                flush=True,
            )
    if args.budget_mb:
        print("\n| run | measured cap (resident memory above the rank's start) | result |\n|---|---|---|")
        print("\n".join(budget_demo(args)))
    if args.budget_pp2_mb:
        print("\n| run | measured cap (resident memory above the rank's start) | result |\n|---|---|---|")
        print("\n".join(budget_pp2_demo(args)))
    plain, ckpt = saved_activation_bytes(args, False), saved_activation_bytes(args, True)
    print(f"\nsaved activations of one microbatch, one process: {_mib(plain)} MiB without checkpointing,"
          f" {_mib(ckpt)} MiB with every Block checkpointed ({ckpt / plain:.2f}x)")


if __name__ == "__main__":
    main()
