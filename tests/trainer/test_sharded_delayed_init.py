"""Delayed initialisation under sharded data parallelism materialises straight into the FSDP shards.

``fully_shard`` goes on the meta stage and the init record's replay keeps each rank's piece of every tensor (see
[Note: sharded stages] in ``lightning_mp/strategy/_fsdp.py``). At sdp2 and pp2 x sdp2 (a tied embedding/head
replicated over the stages), through ``Trainer.fit``: the parameters right after setup are bitwise one process's
eager build (each rank holding its shard), every parameter and loss after training matches one process, and the
most bytes torch's CPU allocator held at once during setup stay below the rank's whole stage. At tp2 x sdp2 (the
tp-local stage materialised, then sharded) the same values.
"""

from __future__ import annotations

import itertools
import os

import lightning as L
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import lightning_mp
from tests._fit import _whole, fit_and_collect
from tests.trainer import test_tp_trainer
from tests.trainer.test_sharded_data_parallel import (
    TOL,
    DelayedLM,
    RecordShards,
    _assert_matches,
    _assert_tp_pieces_match,
    _fit_lm,
    _local,
    _sdp,
    _shard_numel,
)
from tests.trainer.test_strategy import CLIP

# 32 blocks of width 128 (66 KiB each) and a 16 KiB embedding/head: a stage is many FSDP units, so one unit gathered
# (or one full tensor replayed) next to the shards is well under the whole stage
SIZES = {"dim": 128, "depth": 32}
SECOND_HALF = {**{f"net.blocks.{i}": 1 for i in range(16, 32)}, "net.head": 1}  # the embedding's tie replicated


class RecordSetup(RecordShards):
    """Also per rank, at ``on_fit_start``: the parameters (the shards gathered whole) and how many elements this rank
    holds of each; the stage's whole parameter bytes; and ``setup_peak``, the most bytes torch's CPU allocator held
    at once from the ``setup`` hook on (build, plan, the strategy's setup) above what it held then
    (:func:`_peak_bytes`)."""

    def setup(self, trainer, pl_module, stage):
        self.profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self.profiler.start()

    def on_fit_start(self, trainer, pl_module):
        self.profiler.stop()
        self.setup_peak = _peak_bytes(self.profiler)
        self.initial = {n: _whole(p) for n, p in pl_module.named_parameters()}
        self.initial_held = {n: _local(p).numel() for n, p in pl_module.named_parameters()}
        self.stage_bytes = sum(p.numel() * p.element_size() for p in pl_module.parameters())
        del self.profiler

    def extra(self, trainer, pl_module):
        setup = {"setup_peak": self.setup_peak, "stage_bytes": self.stage_bytes}
        return {**super().extra(trainer, pl_module), **setup, "initial": self.initial, "held0": self.initial_held}


def _peak_bytes(profiler: profile) -> int:
    """The most bytes torch's CPU allocator held at once while ``profiler`` ran, above what it held at its start:
    its memory events (allocations, and frees of what it saw allocated; every thread), accumulated in time order."""
    events = profiler.profiler.kineto_results.events()
    changes = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    return max(itertools.accumulate(nbytes for _, nbytes in changes), default=0)


def _print_setup_peaks(results: list[dict]) -> None:
    """The figures behind the setup-peak check (``pytest -s``)."""
    for rank, result in enumerate(results):
        print(
            f"rank {rank}: setup peak {result['setup_peak'] / 2**10:.1f} KiB, whole stage"
            f" {result['stage_bytes'] / 2**10:.1f} KiB, ratio {result['setup_peak'] / result['stage_bytes']:.2f}"
        )


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """One process, eager build (no strategy): initial and trained parameters, losses."""
    out = str(tmp_path_factory.mktemp("ref"))
    return _fit_lm(out, None, 1, CLIP, record=RecordSetup(out, logged=True, metrics=True), module=DelayedLM(**SIZES))[0]


@pytest.mark.parametrize(
    ("pp", "kwargs"),
    [(1, {}), (2, {"tied_weights": "replicate", "partition": SECOND_HALF, "auto_partition": False})],
    ids=["sdp2", "pp2xsdp2-replicated-tie"],
)
def test_delayed_init_materialises_into_the_shards(tmp_path, reference, pp, kwargs):
    out = str(tmp_path)
    strategy = _sdp(pp, 2, delayed_parameter_initialization=True, **kwargs)
    record = RecordSetup(out, logged=True, metrics=True)
    results = _fit_lm(out, strategy, 2 * pp, CLIP, record=record, module=DelayedLM(**SIZES))
    _print_setup_peaks(results)
    for rank, result in enumerate(results):
        for name, value in result["initial"].items():  # bitwise one process's eager build
            torch.testing.assert_close(value, reference["initial"][name], rtol=0, atol=0, msg=name)
            assert result["held0"][name] == _shard_numel(value, 2, (rank // pp) % 2), f"{name}: a shard at setup"
        assert result["setup_peak"] < result["stage_bytes"], "a rank held its whole stage during setup"
    _assert_matches(results, reference, pp, 2)  # reshard_after_forward's default: once per step


@pytest.mark.filterwarnings("ignore:.*copying from a non-meta parameter")  # torch's, on the swapped tp modules
def test_delayed_init_at_tp2_x_sdp2(tmp_path):
    """``trainer.init_module(empty_init=True)`` at tp2 x sdp2: the tensor-parallel modules load their pieces as the
    replay makes each tensor, then FSDP shards the tp-local stage. After setup each rank holds the FSDP shard of its
    tp piece of one process's eager build, bitwise; after training, of one process's trained parameters."""
    torch.manual_seed(0)
    reference = fit_and_collect(
        test_tp_trainer.TinyTPGPT(), str(tmp_path / "ref"), max_steps=test_tp_trainer.STEPS,
        record=RecordSetup(str(tmp_path / "ref")), num_sanity_val_steps=0, use_distributed_sampler=False, **CLIP,
    )[0]
    out = str(tmp_path / "smp")
    os.makedirs(out)
    strategy = lightning_mp.SMPStrategy(
        tensor_parallel_degree=2, sharded_data_parallel_degree=2, microbatches=2, start_method="fork"
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=4, strategy=strategy, max_steps=test_tp_trainer.STEPS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[RecordSetup(out)], use_distributed_sampler=False, **CLIP,
    )
    torch.manual_seed(0)
    with trainer.init_module(empty_init=True):
        model = test_tp_trainer.TinyTPGPT()
    assert all(p.is_meta for p in model.parameters())
    trainer.fit(model)
    results = [torch.load(os.path.join(out, f"{rank}.pt"), weights_only=False) for rank in range(4)]
    _print_setup_peaks(results)  # not asserted: the tp-local stage is whole before FSDP shards it
    for result in results:  # held: the shards after training; held0: after setup, the same sizes
        assert result["held0"] == result["held"]
    _assert_tp_pieces_match(results, reference, "initial", {"rtol": 0, "atol": 0})
    _assert_tp_pieces_match(results, reference, "params", TOL)
