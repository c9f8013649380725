"""Delayed parameter initialisation under tensor parallelism: each rank allocates only its shards, bitwise the
eager build's.

The eager reference of a swapped module (``DistributedLinear``, ``DistributedEmbedding``,
``DistributedTransformerLayer``) is the one-process model before the swap: its full tensor, cut with the
parameter's ``ShardSpec`` for this tp rank, which is what the eager tp=2 path loads. Tier 1 (one process, the
swap's sharding maths with ``TPGroup(None, rank, 2)``): the example GPT, tiny HF GPT-2 and a tied HF Llama
with rotary buffers at tp=2 and at pp2 x tp2 (the real partitioner on a meta trace); storage sizes show that
no rank keeps a full tensor of a sharded parameter and that the replay holds at most one full tensor at a time.
Tier 2 (``Trainer.fit``, fork): the example GPT at tp=2 and pp2 x tp2 and the tied Llama at tp=2, initial
weights per rank and training against one process.
"""

from __future__ import annotations

import os
import warnings

import lightning as L
import pytest
import torch
from torch import nn

import lightning_mp
from lightning_mp.init import delay_param_initialization, materialize_module
from lightning_mp.tp import TPGroup, shard, shard_spec
from lightning_mp.nn._hf import translate_hf
from lightning_mp.tp._swap import swap_modules
from tests.test_delayed_init import BUILDS, _drop_other_stages, _stage_of, _tensors

warnings.filterwarnings("ignore", message=".*token_id.*")
pytestmark = pytest.mark.filterwarnings("ignore:.*copying from a non-meta parameter")


def _tp_gpt() -> nn.Module:
    from examples.gpt_tp import TPGPT

    return TPGPT(vocab_size=33, block_size=16, n_layer=4, n_head=4, n_embd=32, dropout=0.1)


def _marked(name: str) -> nn.Module:
    model = _tp_gpt() if name == "gpt" else BUILDS[name]()
    return lightning_mp.set_tensor_parallelism(model)


MODELS = ["gpt", "gpt2", "llama"]


def _expected_shards(full: dict[str, torch.Tensor], swapped: nn.Module, rank: int) -> dict[str, torch.Tensor]:
    """The eager one-process tensors, cut for ``rank`` where the swapped model's tensor is a shard."""
    out = {}
    for fqn, tensor in _tensors(swapped).items():
        spec = shard_spec(tensor)
        out[fqn] = full[fqn] if spec is None else shard(full[fqn], spec, rank, 2)
    return out


def _own_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors.values()}.values())


def _check(model: nn.Module, expected: dict[str, torch.Tensor], report, largest_full: int) -> None:
    got = _tensors(model)
    assert got and set(got) <= set(expected)
    for fqn, value in got.items():
        assert not value.is_meta, fqn
        assert value.dtype == expected[fqn].dtype and torch.equal(value, expected[fqn]), f"{fqn} differs from eager"
        # each tensor owns exactly its bytes: a shard is a copy, never a view into a kept full tensor
        assert value.untyped_storage().nbytes() == value.numel() * value.element_size(), fqn
    # the replay held the rank's own unsharded tensors plus at most one full tensor (made, sliced, freed)
    assert report.peak_bytes <= report.kept_bytes + largest_full, (report, largest_full)
    assert report.loaded_bytes > 0, "swapped modules loaded their shards from the replay"


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("name", MODELS)
def test_tp2_shards_are_bitwise_the_eager_swap(name, rank):
    tp = TPGroup(None, rank, 2)
    torch.manual_seed(11)
    eager = _marked(name)
    full = {k: v.detach().clone() for k, v in _tensors(eager).items()}
    eager_report = swap_modules(eager, tp, translations=[translate_hf])
    rng_after_eager_swap = torch.get_rng_state()
    eager_local = _tensors(eager)

    torch.manual_seed(11)
    with delay_param_initialization():
        model = _marked(name)
    report = swap_modules(model, tp, translations=[translate_hf])
    assert report.swapped == eager_report.swapped and not report.skipped
    largest = max(t.numel() * t.element_size() for t in full.values())
    sharded_shapes = {k: v.shape for k, v in eager_local.items()}
    mat = materialize_module(model)
    assert torch.equal(torch.get_rng_state(), rng_after_eager_swap), "code after setup sees eager's random state"
    expected = _expected_shards(full, model, rank)
    _check(model, expected, mat, largest)
    assert set(_tensors(model)) == set(full)
    for fqn, value in _tensors(model).items():
        assert value.shape == sharded_shapes[fqn] and torch.equal(value, eager_local[fqn]), fqn
    assert sum(shard_spec(t) is not None for t in _tensors(model).values()) >= 8, "most weights are shards"
    if name in ("gpt", "llama"):
        inputs = model.get_input_embeddings() if name == "llama" else model.wte
        head = model.lm_head
        assert head.weight is inputs.weight, "the tied embedding is one (sharded) parameter again"


@pytest.mark.parametrize("name", MODELS)
def test_pp2_tp2_each_rank_holds_its_stage_shards_bitwise(name):
    """What the strategy does per rank: swap the owned stage's modules, drop other stages, materialise."""
    torch.manual_seed(11)
    eager = _marked(name)
    full = {k: v.detach().clone() for k, v in _tensors(eager).items()}
    largest = max(t.numel() * t.element_size() for t in full.values())
    covered: set[str] = set()
    for stage in range(2):
        for rank in range(2):
            torch.manual_seed(11)
            with delay_param_initialization():
                model = _marked(name)
            stage_of = _stage_of(name, model, 2)
            swap_modules(model, TPGroup(None, rank, 2), translations=[translate_hf], owns=lambda f: stage_of[f] == stage)
            new_stage_of = {}
            for fqn, _ in model.named_modules(remove_duplicate=False):
                ancestor = fqn
                while ancestor not in stage_of and ancestor:
                    ancestor = ancestor.rpartition(".")[0]
                new_stage_of[fqn] = stage_of.get(ancestor, stage)
            _drop_other_stages(model, new_stage_of, stage)
            report = materialize_module(model)
            _check(model, _expected_shards(full, model, rank), report, largest)
            assert len(_tensors(model)) < len(full), "no rank allocates another stage's tensors"
            covered |= set(_tensors(model))
    assert covered == set(full), "the four ranks hold every tensor"


# ---- tier 2: Trainer(strategy="smp"), fork -------------------------------------------------------------------


class Initial(L.Callback):
    """Per rank at fit start: the local tensors and whether each storage is exactly its own size."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_fit_start(self, trainer, pl_module):
        local = {k: v.detach().clone() for k, v in _tensors(pl_module).items()}
        specs = {k: shard_spec(v) for k, v in _tensors(pl_module).items()}
        sized = {k: v.untyped_storage().nbytes() == v.numel() * v.element_size() for k, v in _tensors(pl_module).items()}
        grid = trainer.strategy.topology
        torch.save(
            {"local": local, "specs": specs, "sized": sized, "tp_rank": grid.tp_rank, "pp_rank": grid.pp_rank},
            os.path.join(self.out_dir, f"init{trainer.global_rank}.pt"),
        )


def _check_initial(out_dir: str, devices: int, full: dict[str, torch.Tensor], pp: int) -> None:
    results = [torch.load(os.path.join(out_dir, f"init{r}.pt"), weights_only=False) for r in range(devices)]
    per_tp: dict[int, set[str]] = {}
    for result in results:
        assert result["local"], "rank holds tensors"
        for fqn, value in result["local"].items():
            spec = result["specs"][fqn]
            expected = full[fqn] if spec is None else shard(full[fqn], spec, result["tp_rank"], 2)
            assert torch.equal(value, expected), f"rank {result['tp_rank']}: {fqn} differs from eager"
            assert result["sized"][fqn], f"{fqn}: storage is not its own size"
        assert any(s is not None for s in result["specs"].values()), "shards were made"
        per_tp.setdefault(result["tp_rank"], set()).update(result["local"])
        if pp > 1:
            assert len(result["local"]) < len(full), "a stage holds only its own tensors"
    assert all(names == set(full) for names in per_tp.values()), "each tp rank's stages hold every tensor"


@pytest.mark.parametrize(("pp", "microbatches"), [(1, 1), (2, 2)], ids=["tp2", "pp2xtp2"])
def test_gpt_fit_delayed_at_tp2_matches_one_process(tmp_path, pp, microbatches):
    from tests.test_tp_trainer import CLIP, STEPS, Record, TinyTPGPT, _check_against_reference, _fit

    os.makedirs(tmp_path / "ref")
    os.makedirs(tmp_path / "smp")
    torch.manual_seed(0)
    full = {k: v.detach().clone() for k, v in _tensors(TinyTPGPT()).items()}
    reference = _fit(str(tmp_path / "ref"), **CLIP)[0]

    strategy = lightning_mp.SMPStrategy(
        pipeline_parallel_degree=pp, tensor_parallel_degree=2, microbatches=microbatches, start_method="fork"
    )
    torch.manual_seed(0)
    trainer = L.Trainer(
        accelerator="cpu", devices=2 * pp, strategy=strategy, max_steps=STEPS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[Record(str(tmp_path / "smp")), Initial(str(tmp_path / "smp"))], use_distributed_sampler=False,
        **CLIP,
    )
    with trainer.init_module(empty_init=True):
        model = TinyTPGPT()
    assert all(p.is_meta for p in model.parameters())
    trainer.fit(model)
    _check_initial(str(tmp_path / "smp"), 2 * pp, full, pp)
    results = [torch.load(tmp_path / "smp" / f"{r}.pt", weights_only=False) for r in range(2 * pp)]
    _check_against_reference(results, reference, tp=2, dp=1, pp=pp)


def test_tied_llama_delayed_through_the_callback_at_tp2(tmp_path):
    """``configure_model`` + ``DelayedParameterInit``: a transformers model with its own tp_plan, tied embeddings
    and rotary buffers; initial shards bitwise, then training equal to the same model on one process."""
    from tests.test_tp_hf import BUILDERS
    from tests.test_tp_trainer import STEPS, Record, TinyHF

    class Configured(TinyHF):
        def __init__(self) -> None:
            L.LightningModule.__init__(self)
            self.model = None

        def configure_model(self) -> None:
            if self.model is None:
                torch.manual_seed(5)
                self.model = lightning_mp.set_tensor_parallelism(BUILDERS["llama"]())

    def fit(out_dir, strategy=None, devices=1, callbacks=()):
        os.makedirs(out_dir)
        trainer = L.Trainer(
            accelerator="cpu", devices=devices, strategy=strategy or "auto", max_steps=STEPS, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0, callbacks=[Record(out_dir), *callbacks], use_distributed_sampler=False,
        )
        trainer.fit(Configured())
        return [torch.load(os.path.join(out_dir, f"{r}.pt"), weights_only=False) for r in range(devices)]

    torch.manual_seed(5)
    full = {f"model.{k}": v.detach().clone() for k, v in _tensors(BUILDERS["llama"]()).items()}
    reference = fit(str(tmp_path / "ref"))[0]
    strategy = lightning_mp.SMPStrategy(tensor_parallel_degree=2, start_method="fork")
    results = fit(
        str(tmp_path / "tp2"), strategy, 2, [lightning_mp.DelayedParameterInit(), Initial(str(tmp_path / "tp2"))]
    )
    _check_initial(str(tmp_path / "tp2"), 2, full, pp=1)
    for result in results:
        torch.testing.assert_close(result["losses"], reference["losses"], rtol=1e-5, atol=1e-6)
        assert set(result["state"]) == set(reference["state"])
        for key, value in result["state"].items():
            torch.testing.assert_close(value, reference["state"][key], rtol=1e-5, atol=1e-6, msg=key)
