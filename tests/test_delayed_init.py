"""Delayed parameter initialisation: the initial weights are bitwise those of an eager one-process build.

Tier 1 (one process): whole builds and per-stage builds (stages planned by the real partitioner on a meta trace,
the other stages' tensors dropped as the engine drops them) for the example GPT, tiny random HF GPT-2, a tied HF
Llama with rotary buffers and a custom module with ``randn * 0.02`` in ``__init__``; storage sizes show that no
other stage's tensor is ever allocated. Tier 2 (``Trainer.fit`` with ``strategy="smp"``, fork): the same at pp=2,
pp=4 and dp=2 through ``trainer.init_module(empty_init=True)``, ``configure_model`` with the strategy argument or
the ``DelayedParameterInit`` callback, and the context manager; training with delayed init matches one process.
"""

from __future__ import annotations

import os
import time
import warnings
from datetime import timedelta

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_mp
from lightning_mp.strategy._tied import original_names
from lightning_mp.init import delay_param_initialization, find_record, materialize_module
from lightning_mp.partition import plan, trace
from lightning_mp.strategy._placement import make_plan_in_child

warnings.filterwarnings("ignore", message=".*token_id.*")


class Custom(nn.Module):
    """No ``reset_parameters``: ``randn * 0.02``, a transposed (non-contiguous) init, a view init, buffers."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.a = nn.Linear(dim, dim)
        self.p = nn.Parameter(torch.randn(dim, dim) * 0.02)
        self.b = nn.Linear(dim, dim)
        self.q = nn.Parameter(torch.empty(dim, dim).t())
        nn.init.normal_(self.q)
        self.register_buffer("freq", 1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim), persistent=False)
        self.register_buffer("scale", torch.tensor([1.0, 2.0]).repeat(dim // 2))
        with torch.no_grad():
            self.b.weight[:, : dim // 2].uniform_(-1, 1)
        self.c = nn.Sequential(nn.Linear(dim, dim), nn.Dropout(0.1), nn.Linear(dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, dim)
        x = self.a(x) @ self.p * self.scale
        x = self.b(x) @ self.q + self.freq.sum()
        return self.c(x)


def _gpt():
    from examples.gpt import GPT

    return GPT(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=32, dropout=0.1)


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=32, n_head=2, vocab_size=64, n_positions=16))


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64, tie_word_embeddings=True, max_position_embeddings=32,
    )
    return LlamaForCausalLM(config)


BUILDS = {"gpt": _gpt, "gpt2": _gpt2, "llama": _llama, "custom": Custom}


def _run_fn(name: str, model: nn.Module, device: str = "meta"):
    if name == "custom":
        x = torch.randn(4, 16, device=device)
        return lambda: model(x)
    idx = torch.zeros(2, 8, dtype=torch.long, device=device)
    return (lambda: model(idx)) if name == "gpt" else (lambda: model(input_ids=idx))


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(dict(model.named_buffers(remove_duplicate=False)))
    return named


def _eager(name: str, seed: int = 1234) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    model = BUILDS[name]()
    return model, torch.get_rng_state()


def _delayed(name: str, seed: int = 1234) -> nn.Module:
    torch.manual_seed(seed)
    with delay_param_initialization():
        return BUILDS[name]()


def _assert_bitwise(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got, "nothing was compared"
    for fqn, value in got.items():
        assert value.device.type == "cpu", fqn
        assert value.dtype == expected[fqn].dtype and torch.equal(value, expected[fqn]), f"{fqn} differs from eager"


@pytest.mark.parametrize("name", list(BUILDS))
def test_whole_model_is_bitwise_the_eager_build_and_the_rng_stream_continues_as_eager(name):
    eager, rng_after_eager = _eager(name)
    model = _delayed(name)
    assert all(t.is_meta for t in _tensors(model).values()), "nothing allocated by the build"
    assert torch.equal(torch.get_rng_state(), rng_after_eager), "code after the build sees the eager random state"
    report = materialize_module(model)
    assert report.num_tensors == len({id(t) for t in _tensors(model).values()})
    _assert_bitwise(_tensors(model), _tensors(eager))
    assert find_record(model) is None, "the record is dropped after materialisation"
    if name in ("gpt", "llama"):
        head = model.lm_head.weight
        assert head is (model.wte.weight if name == "gpt" else model.model.embed_tokens.weight), "still tied"


def _stage_of(name: str, model: nn.Module, num_stages: int) -> dict[str, int]:
    """The real partitioner's plan from a meta trace, with the engine's rule: stateless modules run everywhere."""
    with torch.random.fork_rng():
        model_trace = trace(model, _run_fn(name, model))
    stage_of = dict(plan(model_trace, num_stages).stage_of)
    return stage_of


def _drop_other_stages(model: nn.Module, stage_of: dict[str, int], stage: int) -> None:
    """What ``PipelineEngine.install`` does to the modules of other stages (their own tensors become ``None``)."""
    for fqn, module in model.named_modules(remove_duplicate=False):
        stateful = next(module.parameters(), None) is not None
        if stateful and stage_of[fqn] != stage:
            for kind in ("_parameters", "_buffers"):
                for key in getattr(module, kind):
                    getattr(module, kind)[key] = None


@pytest.mark.parametrize("num_stages", [2, 4])
@pytest.mark.parametrize("name", list(BUILDS))
def test_each_stage_allocates_only_its_own_tensors_bitwise_as_eager(name, num_stages):
    eager_tensors = _tensors(_eager(name)[0])
    covered: set[str] = set()
    for stage in range(num_stages):
        model = _delayed(name)
        stage_of = _stage_of(name, model, num_stages)
        _drop_other_stages(model, stage_of, stage)
        kept = _tensors(model)
        own_bytes = sum(t.numel() * t.element_size() for t in {id(t): t for t in kept.values()}.values())
        report = materialize_module(model)
        _assert_bitwise(kept and _tensors(model), eager_tensors)
        covered |= set(_tensors(model))
        # storage sizes, not RSS: every kept tensor owns exactly its bytes, and the replay never held more than
        # this stage's tensors plus one temporary of at most the largest tensor (no other stage's parameter)
        largest = max(t.numel() * t.element_size() for t in eager_tensors.values())
        for fqn, tensor in _tensors(model).items():
            assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size(), fqn
        assert report.kept_bytes == own_bytes
        assert report.peak_bytes <= own_bytes + largest, (report, own_bytes, largest)
        assert report.max_scratch_bytes <= largest
    assert covered == set(eager_tensors), "the stages together hold every tensor"


def test_storages_remember_the_device_of_the_eager_build():
    """Factories record the device they asked for and ops inherit their input's: CPU builds record nothing."""
    model = _delayed("gpt")
    record = find_record(model)
    assert record is not None and record.storage_devices == {}
    with torch.device("meta"), delay_param_initialization():  # a device context fills in the factories' device
        on_meta = nn.Linear(4, 4)
    assert set(find_record(on_meta).storage_devices.values()) == {torch.device("meta")}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["gpt", "custom"])
def test_a_build_under_a_cuda_device_gives_each_stage_the_eager_cuda_weights(name):
    """Other stages' random ops draw on CUDA scratch, so the CUDA generator advances as in the eager build."""
    torch.cuda.manual_seed(1234)
    torch.manual_seed(1234)
    with torch.device("cuda"):
        eager = {k: v.cpu() for k, v in _tensors(BUILDS[name]()).items()}
    covered: set[str] = set()
    for stage in range(2):
        torch.cuda.manual_seed(1234)
        torch.manual_seed(1234)
        with torch.device("cuda"), delay_param_initialization():
            model = BUILDS[name]()
        stage_of = _stage_of(name, model, 2)
        _drop_other_stages(model, stage_of, stage)
        materialize_module(model)
        got = {k: v.cpu() for k, v in _tensors(model).items()}
        _assert_bitwise(got, eager)
        covered |= set(got)
    assert covered == set(eager)


def test_a_tensor_parallel_shard_is_the_slice_of_the_eager_tensor():
    eager = _tensors(_eager("gpt")[0])
    model = _delayed("gpt")
    materialize_module(model, shard_fn=lambda fqn, full: full.chunk(2, dim=0)[1].clone() if full.dim() == 2 else full)
    for fqn, value in _tensors(model).items():
        expected = eager[fqn].chunk(2, dim=0)[1] if eager[fqn].dim() == 2 else eager[fqn]
        assert torch.equal(value, expected), fqn
        assert value.untyped_storage().nbytes() == value.numel() * value.element_size(), "the full tensor is freed"


def test_random_draws_between_build_and_materialisation_do_not_shift_the_stream():
    eager = _tensors(_eager("custom")[0])
    model = _delayed("custom")
    torch.rand(1000)  # e.g. a trace with dropout, a data shuffle
    model.to(torch.float64)  # a precision conversion on meta before materialisation
    materialize_module(model)
    for fqn, value in _tensors(model).items():
        assert value.dtype == torch.float64 and torch.equal(value, eager[fqn].to(torch.float64)), fqn


class ReadsData(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))
        self.n = int(self.w.abs().argmax().item())


def test_construction_that_reads_data_is_a_clear_error():
    with pytest.raises(RuntimeError, match=r"reads a tensor's value \(`.item\(\)`"):
        with delay_param_initialization():
            ReadsData()


def test_explicit_generator_and_unrecorded_meta_tensors_are_clear_errors():
    with pytest.raises(RuntimeError, match="explicit torch.Generator"):
        with delay_param_initialization():
            nn.init.normal_(nn.Parameter(torch.empty(3)), generator=torch.Generator().manual_seed(0))
    with torch.device("meta"):
        plain = nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match=r"not built under.*delay_param_initialization"):
        materialize_module(plain)


def test_delayed_model_cannot_be_pickled_to_spawned_processes():
    import pickle

    with pytest.raises(TypeError, match="start_method='popen' or 'fork'"):
        pickle.dumps(_delayed("custom"))


# ---- tier 2: Trainer(strategy="smp"), fork -------------------------------------------------------------------

SEED, STEPS, BATCH = 7, 2, 8


def _token_batches(vocab: int = 64, t: int = 8) -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, vocab, (BATCH * STEPS, t), generator=g)
    return TensorDataset(x, torch.roll(x, -1, dims=1))


class Wrapped(L.LightningModule):
    """One of ``BUILDS`` as a LightningModule, built in ``__init__`` or in ``configure_model`` (seeded there)."""

    def __init__(self, name: str, in_configure_model: bool = False) -> None:
        super().__init__()
        self.name = name
        self.net = None if in_configure_model else BUILDS[name]()

    def configure_model(self) -> None:
        if self.net is None:
            torch.manual_seed(SEED)
            self.net = BUILDS[self.name]()

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.name == "custom":
            return self.net(x.float()[:, :1].repeat(1, 16) / 64).pow(2).mean()
        logits = self.net(input_ids=x).logits
        return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_token_batches(), batch_size=BATCH)


class Snapshot(L.Callback):
    """Per rank, after setup: the local tensors and their storage sizes; after training: the parameters."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.initial: dict[str, torch.Tensor] = {}
        self.storage_ok: dict[str, bool] = {}

    def on_fit_start(self, trainer, pl_module):
        for fqn, tensor in _tensors(pl_module).items():
            self.initial[fqn] = tensor.detach().clone()
            self.storage_ok[fqn] = tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()

    def on_train_end(self, trainer, pl_module):
        final = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
        torch.save(
            {"initial": self.initial, "storage_ok": self.storage_ok, "final": final},
            os.path.join(self.out_dir, f"{trainer.global_rank}.pt"),
        )


def _trainer(out_dir: str, devices: int, strategy, callbacks=()) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=STEPS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[Snapshot(out_dir), *callbacks], use_distributed_sampler=False,
    )


def _results(out_dir: str, devices: int) -> list[dict]:
    return [torch.load(os.path.join(out_dir, f"{r}.pt"), weights_only=False) for r in range(devices)]


def _check_ranks(results: list[dict], expected: dict[str, torch.Tensor], pp: int, tied: frozenset = frozenset()) -> None:
    """Bitwise initial tensors per rank; each storage its own size; one replica's stages hold everything once, but
    the copies of a replicated tied weight (``tied``: every name of a tied parameter; ``tied_weights="auto"``)."""
    for result in results:
        _assert_bitwise(result["initial"], expected)
        assert all(result["storage_ok"].values()), [k for k, ok in result["storage_ok"].items() if not ok]
    replica = [set(r["initial"]) for r in results[:pp]]
    assert set().union(*replica) == set(expected), "the stages of a replica hold every tensor"
    params = [n for r in results[:pp] for n in r["final"]]
    assert {n for n in params if params.count(n) > 1} <= tied, "no parameter on two stages, but tied copies"
    if pp > 1:
        assert all(len(names) < len(expected) for names in replica), "no rank allocates another stage's tensors"


def test_gpt_init_module_empty_init_pp2_bitwise_and_training_matches_one_process(tmp_path):
    """`trainer.init_module(empty_init=True)` builds on meta; pp=2 ranks get eager's weights; 2 AdamW steps match."""
    from examples.gpt import GPT

    class StableAdamGPT(GPT):
        def configure_optimizers(self):
            """The GPT's AdamW with ``eps=1e-4``: the attention key bias's true gradient is zero (softmax is shift
            invariant), so its gradient is rounding noise (another on one process than on two) that Adam with a
            tiny eps turns into full-size steps."""
            config = super().configure_optimizers()
            for group in config["optimizer"].param_groups:
                group["eps"] = 1e-4
            return config

    def build():
        return StableAdamGPT(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=32, dropout=0.0, warmup_steps=1)

    def data():
        return DataLoader(_token_batches(), batch_size=BATCH)

    os.makedirs(tmp_path / "ref")
    os.makedirs(tmp_path / "smp")
    reference = _trainer(str(tmp_path / "ref"), 1, "auto")
    torch.manual_seed(SEED)
    eager = build()
    expected = {k: v.detach().clone() for k, v in _tensors(eager).items()}
    reference.fit(eager, train_dataloaders=data())
    ref_final = _results(str(tmp_path / "ref"), 1)[0]["final"]

    strategy = lightning_mp.SMPStrategy(pipeline_parallel_degree=2, microbatches=2, start_method="fork")
    trainer = _trainer(str(tmp_path / "smp"), 2, strategy)
    torch.manual_seed(SEED)
    with trainer.init_module(empty_init=True):
        model = build()
    assert all(p.is_meta for p in model.parameters())
    trainer.fit(model, train_dataloaders=data())
    results = _results(str(tmp_path / "smp"), 2)
    _check_ranks(results, expected, pp=2, tied=_tied_names(eager))
    for result in results:
        for fqn, value in result["final"].items():
            torch.testing.assert_close(value, ref_final[fqn], rtol=1e-5, atol=1e-6, msg=fqn)


@pytest.mark.parametrize(
    ("name", "pp", "dp", "how"),
    [("custom", 1, 2, "strategy-arg"), ("llama", 2, 2, "callback"), ("gpt2", 4, 1, "context")],
    ids=["custom-dp2-strategy-arg", "tied-llama-pp2xdp2-callback", "gpt2-pp4-context-manager"],
)
def test_every_layout_gets_the_eager_weights_bitwise(tmp_path, name, pp, dp, how):
    eager = _eager(name, SEED)[0]
    expected = {f"net.{k}": v for k, v in _tensors(eager).items()}
    strategy = lightning_mp.SMPStrategy(
        pipeline_parallel_degree=pp, microbatches=2, start_method="fork",
        delayed_parameter_initialization=how == "strategy-arg",
    )
    callbacks = [lightning_mp.DelayedParameterInit()] if how == "callback" else []
    trainer = _trainer(str(tmp_path), pp * dp, strategy, callbacks)
    if how == "context":
        torch.manual_seed(SEED)
        with lightning_mp.delay_param_initialization():
            model = Wrapped(name)
    else:
        model = Wrapped(name, in_configure_model=True)
    trainer.fit(model)
    _check_ranks(_results(str(tmp_path), pp * dp), expected, pp, tied=_tied_names(eager, prefix="net."))


def _tied_names(model: torch.nn.Module, prefix: str = "") -> frozenset:
    names = original_names(model)
    return frozenset(prefix + n for n in {*names, *names.values()})


def test_reseeding_inside_the_build_is_replayed():
    """``seed_everything`` inside ``configure_model`` (after the delayed-init context was entered)."""
    torch.manual_seed(99)
    eager, rng_after = _eager("custom", SEED)
    torch.manual_seed(99)
    with delay_param_initialization():
        torch.manual_seed(SEED)
        model = Custom()
    assert torch.equal(torch.get_rng_state(), rng_after)
    torch.rand(10)
    materialize_module(model)
    _assert_bitwise(_tensors(model), _tensors(eager))


class Wide(nn.Module):
    """Tensors above the chunk size of scratch draws (65,536 elements), with ragged tails and every fill kind."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(300, 300)  # kaiming_uniform_, then re-initialised below (a dead first write)
        self.b = nn.Parameter(torch.empty(65_541))  # a tail of 5 elements after one chunk
        self.c = nn.Parameter(torch.empty(3, 70_001))
        self.d = nn.Parameter(torch.empty(400, 400).t())  # non-contiguous: a full-size scratch
        self.e = nn.Parameter(torch.randn(200, 400))  # a random factory
        nn.init.normal_(self.a.weight, std=0.02)
        nn.init.normal_(self.b)
        nn.init.uniform_(self.c, -1, 1)
        nn.init.normal_(self.d, std=0.02)
        with torch.no_grad():
            self.c.bernoulli_(0.3)
            self.e.exponential_()


@pytest.mark.parametrize("keep", ["a.weight", "c", "e"])
def test_other_stages_draw_on_a_small_chunked_scratch_bitwise(keep):
    """[Note: chunked scratch draws]: the generator advances exactly, with scratch far below the largest tensor."""
    torch.manual_seed(3)
    eager = Wide()
    rng_after = torch.get_rng_state()
    torch.manual_seed(3)
    with delay_param_initialization():
        model = Wide()
    assert torch.equal(torch.get_rng_state(), rng_after), "advancing the stream on exit uses the same draws"
    for name, module in model.named_modules():
        for pname in list(module._parameters):
            if f"{name}.{pname}".lstrip(".") != keep:
                module._parameters[pname] = None
    report = materialize_module(model)
    assert torch.equal(model.get_parameter(keep), eager.get_parameter(keep))
    largest_other = 400 * 400 * 4  # `d` is non-contiguous: drawn whole; the contiguous ones in chunks
    assert report.max_scratch_bytes <= largest_other
    assert report.peak_bytes <= model.get_parameter(keep).numel() * 4 + 65_552 * 4


def test_truncated_normal_init_is_a_clear_error():
    """torch's ``trunc_normal_`` rejects and redraws samples until they fall inside the bounds: how many numbers it
    draws depends on the values, so it cannot be replayed (and it skips meta tensors silently)."""
    with pytest.raises(RuntimeError, match="trunc_normal_.*depends on the values it draws"):
        with delay_param_initialization():
            nn.init.trunc_normal_(nn.Parameter(torch.empty(4, 4)), std=0.02)
    nn.init.trunc_normal_(torch.empty(2))  # restored after the block


class CountingSteps(Wrapped):
    """``Wrapped`` that counts its ``training_step`` calls per process and writes the count and the plan at the end;
    ``fail_in_trace`` makes the first call (the partitioning trace) raise."""

    def __init__(self, name: str, out_dir: str, fail_in_trace: bool = False) -> None:
        super().__init__(name, in_configure_model=True)
        self.out_dir, self.fail_in_trace, self.calls = out_dir, fail_in_trace, 0

    def training_step(self, batch, batch_idx):
        self.calls += 1
        if self.fail_in_trace and self.calls == 1:
            raise ValueError("the step failed while being traced")
        return super().training_step(batch, batch_idx)

    def train_dataloader(self) -> DataLoader:  # shuffles: iterating it draws from the global generator
        return DataLoader(_token_batches(), batch_size=BATCH, shuffle=True)

    def on_fit_start(self) -> None:
        self.rng_at_fit_start = torch.rand(4)

    def on_train_end(self) -> None:
        plan = self.trainer.strategy.partition_plan.to_dict()
        torch.save({"calls": self.calls, "plan": plan, "rng": self.rng_at_fit_start},
                   os.path.join(self.out_dir, f"calls{self.global_rank}.pt"))


def test_the_meta_trace_runs_in_a_child_process_and_plans_as_in_process(tmp_path, monkeypatch):
    """See [Note: the meta trace runs in a child process]: rank 0's module never runs the trace's step itself (its
    step count is the training steps' microbatches only), and the plan equals the in-process trace's."""
    results = {}
    for in_child in (True, False):
        if not in_child:
            monkeypatch.setattr(lightning_mp.strategy._stages, "trace_in_child", lambda is_meta: False)
        out = tmp_path / str(in_child)
        out.mkdir()
        strategy = lightning_mp.SMPStrategy(
            pipeline_parallel_degree=2, microbatches=2, start_method="fork", delayed_parameter_initialization=True
        )
        torch.manual_seed(0)
        _trainer(str(out), 2, strategy).fit(CountingSteps("gpt2", str(out)))
        results[in_child] = torch.load(out / "calls0.pt", weights_only=False)
    assert results[True]["calls"] == STEPS * 2  # 2 microbatches per step; the trace ran in the child
    assert results[False]["calls"] == STEPS * 2 + 1  # + the trace, in-process
    assert results[True]["plan"] == results[False]["plan"]
    # the first batch, fetched in the parent for the child (a shuffling sampler draws), leaves the generator as is
    assert torch.equal(results[True]["rng"], results[False]["rng"])


def test_an_error_in_the_child_trace_reaches_the_user_with_its_message(tmp_path):
    strategy = lightning_mp.SMPStrategy(
        pipeline_parallel_degree=2, microbatches=2, start_method="fork", delayed_parameter_initialization=True
    )
    with pytest.raises(Exception, match=r"Setup failed on global rank 0 while tracing.*ValueError: the step failed"):
        _trainer(str(tmp_path), 2, strategy).fit(CountingSteps("gpt2", str(tmp_path), fail_in_trace=True))


# ---- the trace's child process, and where scratch draws run (found in review) ------------------------------


class _NeedsTwoArguments(Exception):
    def __init__(self, name, shape):
        super().__init__(f"{name} has shape {shape}")
        self.name, self.shape = name, shape


def _raise_needs_two():
    raise _NeedsTwoArguments("wte", (3, 4))


def test_an_exception_that_does_not_unpickle_keeps_its_message():
    with pytest.raises(RuntimeError, match=r"_NeedsTwoArguments: wte has shape \(3, 4\)"):
        make_plan_in_child(_raise_needs_two, timedelta(seconds=60))


def test_a_child_that_dies_and_a_child_that_hangs_are_reported():
    with pytest.raises(RuntimeError, match="died"):
        make_plan_in_child(lambda: os._exit(3), timedelta(seconds=60))
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="did not finish within"):
        make_plan_in_child(lambda: time.sleep(60), timedelta(seconds=1))
    assert time.monotonic() - started < 30  # killed, not waited for


def _parallel_kernel():
    torch.stack([torch.ones(1 << 20) for _ in range(8)]).mul_(2).sum()  # e.g. the DataLoader's collate
    raise ValueError("the child ran a parallel CPU kernel")


def test_the_child_runs_parallel_cpu_kernels_after_the_parent_used_its_openmp_pool():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        (torch.ones(1 << 22) * 2).sum()  # the parent's pool exists now (a datamodule's setup would do this)
        with pytest.raises(ValueError, match="parallel CPU kernel"):
            make_plan_in_child(_parallel_kernel, timedelta(seconds=30))
    finally:
        torch.set_num_threads(threads)


class _NextToAParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Parameter(torch.empty(64, 8, device=self.a.weight.device))  # meta under delayed init
        nn.init.normal_(self.b)
        self.c = nn.Linear(8, 8)


def test_a_tensor_allocated_on_a_build_tensors_device_draws_on_the_build_device():
    """`device=w.device` is meta while recording; the eager build drew `b` on CPU, so `c` depends on that draw."""
    torch.manual_seed(0)
    eager = _NextToAParameter()
    torch.manual_seed(0)
    with delay_param_initialization():
        model = _NextToAParameter()
    model._parameters["b"] = None  # another stage's
    materialize_module(model)
    for name in ("c.weight", "c.bias"):
        assert torch.equal(model.get_parameter(name), eager.get_parameter(name)), name


def test_like_new_and_to_copy_keep_their_inputs_device():
    with torch.device("meta"), delay_param_initialization():  # stands in for a CUDA build on a CPU machine
        w = nn.Parameter(torch.empty(4, 4))
        holder = nn.Module()
        holder.w = w
        holder.n = nn.Parameter(torch.randn_like(w))
        holder.h = nn.Parameter(w.new_empty(4).uniform_())
        holder.f = nn.Parameter(w.to(torch.float64))
    record = find_record(holder)
    sids = {record.ref(t).sid for t in (holder.n, holder.h, holder.f)}
    assert all(record.storage_devices.get(s) == torch.device("meta") for s in sids), record.storage_devices


class _FactoryOnABuildTensorsDevice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Parameter(torch.randn(8, device=self.a.weight.device))  # `device=` is meta while recording
        self.c = nn.Linear(8, 8)


def test_a_random_factory_on_a_build_tensors_device_is_made_real_on_its_own_stage_and_drawn_on_others():
    torch.manual_seed(0)
    eager = _FactoryOnABuildTensorsDevice()
    for drop in (None, "b"):
        torch.manual_seed(0)
        with delay_param_initialization():
            model = _FactoryOnABuildTensorsDevice()
        if drop:
            model._parameters[drop] = None  # another stage's
        materialize_module(model)
        for name, value in model.named_parameters():
            assert value.device.type == "cpu" and torch.equal(value, eager.get_parameter(name)), (drop, name)
