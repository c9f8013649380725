"""Delayed parameter initialisation: the initial weights are bitwise those of an eager one-process build.

Whole builds and per-stage builds (stages planned by the real partitioner on a meta trace, the other stages'
tensors dropped as the engine drops them) for the example GPT, tiny random HF GPT-2, a tied HF Llama with rotary
buffers and a custom module with ``randn * 0.02`` in ``__init__``; storage sizes show that no other stage's tensor
is ever allocated."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_mp.init import delay_param_initialization, find_record, materialize_module
from lightning_mp.partition import plan, trace
from tests.models import tiny_gpt2


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
    return tiny_gpt2(n_layer=4, n_embd=32, n_head=2, vocab_size=64, n_positions=16, dropout=0.1)


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


SEED, STEPS, BATCH = 7, 2, 8


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


# ---- the trace's child process, and where scratch draws run (found in review) ------------------------------


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
