"""Sharded data parallelism (``sharded_data_parallel_degree``, FSDP2) through ``Trainer.fit`` against one process.

Every updated parameter (an FSDP shard gathered whole; under tensor parallelism, this tp rank's piece of the
reference) and every step's loss: sdp2 at pp=1 with gradient accumulation and delayed init; pp2 x sdp2 with
activation checkpointing; HSDP (shard groups of 2, replicated twice, 4 ranks); sdp2 x tp2 on the tensor-parallel
GPT; all with clipping over the global norm of the shards; a tied embedding/head (co-located, in the root's FSDP
unit) throughout; each rank holds only its FSDP shard after training. A token-weighted loss (both replicas read the
whole batch: replicas average their own token-normalised gradients, as under ``ddp``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

import lightning_mp
from lightning_mp.topology import Topology
from lightning_mp.tp import shard, shard_spec
from tests._fit import RecordTraining, fit_and_collect
from tests.models import TinyLM
from tests.scripts import sdp_eval_refit
from tests.trainer import test_same_maths, test_tp_trainer
from tests.trainer.test_strategy import CLIP, STEPS, Wrapped

ROOT = Path(__file__).resolve().parents[2]
TOL = {"rtol": 1e-5, "atol": 1e-6}


class DelayedLM(Wrapped):
    """``tiedlm`` built in ``configure_model`` (delayed under ``delayed_parameter_initialization``), seeded there;
    ``sizes``: ``TinyLM``'s arguments."""

    def __init__(self, **sizes: int) -> None:
        super().__init__("tiedlm")
        self.net = None
        self.sizes = sizes

    def configure_model(self) -> None:
        if self.net is None:
            torch.manual_seed(0)
            self.net = TinyLM(**self.sizes)


def _sdp(pp: int, sdp: int, microbatches: int = 2, **kwargs) -> lightning_mp.SMPStrategy:
    return lightning_mp.SMPStrategy(
        pipeline_parallel_degree=pp, sharded_data_parallel_degree=sdp, microbatches=microbatches, start_method="fork",
        **kwargs,
    )


def _replicas(results: list[dict], pp: int) -> list[list[dict]]:
    """Each replica's ranks, stage by stage (rank = dp_rank * pp + pp_rank)."""
    return [results[r * pp : (r + 1) * pp] for r in range(len(results) // pp)]


def _mean_losses(results: list[dict], pp: int) -> list[float]:
    """Each step's loss averaged over the replicas (each read its share of the batch): one process's."""
    return torch.tensor([replica[0]["losses"] for replica in _replicas(results, pp)]).mean(0).tolist()


def _assert_matches(results: list[dict], reference: dict, pp: int, sdp: int, per_unit: bool = False) -> None:
    replicas = _replicas(results, pp)
    torch.testing.assert_close(_mean_losses(results, pp), reference["losses"], **TOL)
    for replica in replicas:
        assert {n for stage in replica for n in stage["params"]} == set(reference["params"])
    for rank, result in enumerate(results):  # validation ran on the gathered parameters after the last step
        root, *units = result["units"]  # blocks (or the part of one this stage holds) and partitioned subtrees
        assert root == "" and all(u.startswith(("net.blocks.", "net.head")) for u in units), result["units"]
        assert units or not any(n.startswith("net.blocks.") for n in result["params"]), "a block is a unit"
        if per_unit:
            _assert_per_unit_collectives(result["collectives"], len(units))
        else:
            # per optimizer step, one all-gather (its window's first batch) and one reduce-scatter (its last) per unit
            # with parameters, whatever the number of microbatches: none per microbatch
            counts = [c for calls in result["collectives"] for c in calls.values() if c]
            gathers, scatters = ([calls[k] for calls in result["collectives"]] for k in RecordShards.COLLECTIVES)
            assert counts and set(counts) == {counts[0]} and counts[0] <= len(result["units"]), result["collectives"]
            assert sum(gathers) == sum(scatters) == counts[0] * STEPS, result["collectives"]
        torch.testing.assert_close(result["metrics"]["val_loss"], reference["metrics"]["val_loss"], **TOL)
        for name, value in result["params"].items():
            torch.testing.assert_close(value, reference["params"][name], **TOL, msg=name)
            assert result["held"][name] == _shard_numel(value, sdp, (rank // pp) % sdp), f"{name}: a shard"


def _assert_per_unit_collectives(per_batch: list[dict[str, int]], blocks: int) -> None:
    """``reshard_after_forward`` per unit, 2 microbatches: per microbatch each block is all-gathered for its forward
    and again for its backward, and each block and the root are reduce-scattered; the root (what no block holds) is
    all-gathered once per batch."""
    microbatches = 2
    gathers, scatters = 2 * microbatches * blocks + 1, microbatches * (blocks + 1)
    expected = {"all_gather_single": gathers, "reduce_scatter_single": scatters}
    assert per_batch == [expected] * len(per_batch)


@pytest.mark.parametrize(
    ("pp", "dp", "sdp", "kwargs", "trainer_kwargs"),
    [
        (1, 2, 2, {"delayed_parameter_initialization": True}, {**CLIP, "accumulate_grad_batches": 2}),
        (2, 2, 2, {}, {**CLIP, "callbacks_extra": (lightning_mp.ActivationCheckpointing(["net.blocks.*"]),)}),
        (1, 4, 2, {}, CLIP),
        (2, 2, 2, {"tied_weights": "replicate", "partition": {"net.head": 1}, "auto_partition": False}, CLIP),
    ],
    ids=[
        "sdp2-delayed-accumulate2-clipnorm",
        "pp2xsdp2-checkpointing-clipnorm",
        "hsdp-sdp2xreplicate2-clipnorm",
        "pp2xsdp2-replicated-tie-clipnorm",
    ],
)
def test_fit_matches_one_process(tmp_path, pp, dp, sdp, kwargs, trainer_kwargs):
    plain_kwargs = {k: v for k, v in trainer_kwargs.items() if k != "callbacks_extra"}
    reference = _fit_lm(str(tmp_path / "ref"), None, 1, plain_kwargs)[0]
    results = _fit_lm(str(tmp_path / "smp"), _sdp(pp, sdp, **kwargs), pp * dp, trainer_kwargs)
    # reshard_after_forward's default: once per step on every layout
    _assert_matches(results, reference, pp, sdp)


@pytest.mark.parametrize("reshard_after_forward", ["always", "never"])
def test_reshard_after_forward_at_pp1_matches_one_process(tmp_path, reshard_after_forward):
    """sdp2 at pp=1, 2 microbatches, windows of 2 batches, clipping, checkpointed blocks: ``"always"`` (each block
    gathered for its forward and again for its backward, where its forward is replayed, reduce-scattered after it,
    every microbatch) and ``"never"`` (every unit once per window) against one process, every parameter and loss;
    the collectives each batch ran, counted."""
    options = {**CLIP, "accumulate_grad_batches": 2}
    reference = _fit_lm(str(tmp_path / "ref"), None, 1, options)[0]
    strategy = _sdp(1, 2, reshard_after_forward=reshard_after_forward)
    checkpointing = (lightning_mp.ActivationCheckpointing(["net.blocks.*"]),)
    results = _fit_lm(str(tmp_path / "smp"), strategy, 2, {**options, "callbacks_extra": checkpointing})
    _assert_matches(results, reference, 1, 2, per_unit=reshard_after_forward == "always")


def _fit_lm(out_dir: str, strategy, devices: int, trainer_kwargs: dict, record=None, module=None) -> list[dict]:
    trainer_kwargs = dict(trainer_kwargs)
    callbacks = trainer_kwargs.pop("callbacks_extra", ())
    return fit_and_collect(
        module or DelayedLM(), out_dir, devices=devices, strategy=strategy, max_steps=STEPS,
        record=record or RecordShards(out_dir, logged=True, metrics=True),
        callbacks=callbacks, num_sanity_val_steps=0, use_distributed_sampler=False, **trainer_kwargs,
    )


class RecordShards(RecordTraining):
    """Also per rank: each parameter's tensor-parallel spec, how many elements this rank holds of it, the FSDP units,
    and per training batch how many all-gathers and reduce-scatters FSDP ran (its collectives, counted)."""

    COLLECTIVES = ("all_gather_single", "reduce_scatter_single")  # FSDP2's defaults (fsdp/_fully_shard)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls = dict.fromkeys(self.COLLECTIVES, 0)
        self.per_batch: list[dict[str, int]] = []

    def on_train_start(self, trainer, pl_module):
        for name in self.COLLECTIVES:
            original = getattr(dist, name)

            def counted(*args, _name=name, _original=original, **kwargs):
                self.calls[_name] += 1
                return _original(*args, **kwargs)

            setattr(dist, name, counted)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.calls = dict.fromkeys(self.calls, 0)

    def on_step(self, trainer, pl_module, batch_idx):
        self.per_batch.append(dict(self.calls))

    def extra(self, trainer, pl_module):
        return {
            "specs": {n: shard_spec(p) for n, p in pl_module.named_parameters()},
            "held": {n: _local(p).numel() for n, p in pl_module.named_parameters()},
            "units": [fqn for fqn, m in pl_module.named_modules() if isinstance(m, FSDPModule)],
            "collectives": self.per_batch,
        }


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


def _shard_numel(whole: torch.Tensor, shards: int, index: int) -> int:
    """How many elements FSDP2's ``Shard(0)`` places on shard ``index`` (``torch.chunk`` along dim 0)."""
    chunks = torch.chunk(whole, shards)
    return chunks[index].numel() if index < len(chunks) else 0


def test_sdp2_x_tp2_matches_one_process(tmp_path):
    """FSDP shards each tp rank's (plain tensor) piece over its replicas: 4 ranks, each holding a quarter."""
    torch.manual_seed(0)
    reference = fit_and_collect(
        test_tp_trainer.TinyTPGPT(), str(tmp_path / "ref"), max_steps=test_tp_trainer.STEPS,
        record=RecordShards(str(tmp_path / "ref")), num_sanity_val_steps=0, use_distributed_sampler=False, **CLIP,
    )[0]
    torch.manual_seed(0)
    strategy = lightning_mp.SMPStrategy(
        tensor_parallel_degree=2, sharded_data_parallel_degree=2, microbatches=2, start_method="fork"
    )
    results = fit_and_collect(
        test_tp_trainer.TinyTPGPT(), str(tmp_path / "smp"), devices=4, strategy=strategy,
        max_steps=test_tp_trainer.STEPS, record=RecordShards(str(tmp_path / "smp")), num_sanity_val_steps=0,
        use_distributed_sampler=False, **CLIP,
    )
    _assert_tp_pieces_match(results, reference, "params", TOL)


def _assert_tp_pieces_match(results: list[dict], reference: dict, key: str, tolerance: dict) -> None:
    """tp2 x sdp2 (4 ranks): each rank's ``result[key]`` is this tp rank's piece of ``reference[key]``, every tensor,
    held as its FSDP shard (``held``)."""
    for rank, result in enumerate(results):
        grid = Topology(4, rank, 1, 2)
        assert set(result[key]) == set(reference[key])
        for name, value in result[key].items():
            spec = result["specs"][name]
            expected = reference[key][name]
            expected = expected if spec is None else shard(expected, spec, grid.tp_rank, 2)
            torch.testing.assert_close(value, expected, **tolerance, msg=name)
            assert result["held"][name] == _shard_numel(value, 2, grid.dp_rank), name


def test_token_weighted_loss_matches_one_process(tmp_path):
    """A padded LM whose step returns ``{"loss", "num_tokens"}``, 4 microbatches: both replicas read the whole batch
    (no distributed sampler), so their average is one process's token-normalised gradient."""
    reference = test_same_maths.fit(str(tmp_path / "ref"), "padded")[0]
    strategy = test_same_maths.smp(1, 4, sharded_data_parallel_degree=2)
    results = test_same_maths.fit(str(tmp_path / "smp"), "padded", strategy, devices=2)
    for result in results:
        torch.testing.assert_close(result["losses"], reference["losses"], **TOL)
        torch.testing.assert_close(result["logged"], reference["logged"], **TOL)
        test_same_maths.assert_state_equal(result["state"], reference["state"])


def test_token_weighted_loss_with_per_unit_gathers_is_refused(tmp_path):
    """Per unit, FSDP reduce-scatters each microbatch before the step could divide by its replica's token count:
    the step says so instead of training on the wrong average."""
    strategy = test_same_maths.smp(1, 2, sharded_data_parallel_degree=2, reshard_after_forward="always")
    with pytest.raises(Exception, match=r"token-weighted loss.*reshard_after_forward='always'.*'never'"):
        test_same_maths.fit(str(tmp_path / "smp"), "padded", strategy, devices=2)


class RecordPrecision(RecordShards):
    """Also the dtypes FSDP's collectives move (their input tensors) and, after each backward, the dtypes of the
    parameters the modules hold and of their gradients (gathered and local on a batch that does not end an
    accumulation window; the shards, reduce-scattered, on one that does)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.moved: dict[str, set[str]] = {name: set() for name in self.COLLECTIVES}
        self.after_backward: list[set[tuple[bool, str, str]]] = []

    def on_train_start(self, trainer, pl_module):
        super().on_train_start(trainer, pl_module)
        for name in self.COLLECTIVES:
            counted = getattr(dist, name)

            def recorded(output, input, *args, _name=name, _counted=counted, **kwargs):
                self.moved[_name].add(str(input.dtype))
                return _counted(output, input, *args, **kwargs)

            setattr(dist, name, recorded)

    def on_after_backward(self, trainer, pl_module):
        self.after_backward.append(
            {(isinstance(p, DTensor), str(p.dtype), str(p.grad.dtype)) for p in pl_module.parameters()}
        )

    def extra(self, trainer, pl_module):
        return {**super().extra(trainer, pl_module), "moved": self.moved, "after_backward": self.after_backward}


# bf16 keeps 8 significant bits (relative spacing 2**-8). The reference autocasts each matmul's fp32 weights to bf16
# (the same bits as FSDP's gathered bf16 parameters) but keeps the embedding's output, the residual stream,
# LayerNorm's weights and the gradients' accumulation in fp32, where FSDP's policy has them in bf16. Measured: losses
# (8.4 to 19.8) within 0.0019 relative (half a spacing), parameters (up to 4.1) within 3.1e-5 absolute after 3 SGD
# steps at lr 0.1; the tolerance is one spacing relative plus 1e-4 (a gradient rounded by 2**-8 moves a weight by
# about lr * |grad| * 2**-8 per step).
BF16_TOL = {"rtol": 2**-8, "atol": 1e-4}


@pytest.mark.parametrize(
    ("pp", "trainer_kwargs", "reshard_after_forward"),
    [(1, {"accumulate_grad_batches": 2}, "never"), (1, {"accumulate_grad_batches": 2}, "always"), (2, {}, "default")],
    ids=["sdp2", "sdp2-per-unit", "pp2xsdp2"],
)
def test_bf16_mixed_gathers_in_bf16_and_reduces_in_fp32(tmp_path, pp, trainer_kwargs, reshard_after_forward):
    """Under ``precision="bf16-mixed"`` FSDP's ``MixedPrecisionPolicy(bf16, fp32)`` takes effect on the engine's path:
    the shards' all-gather moves bf16, the modules compute with bf16 parameters and accumulate bf16 gradients, the
    reduce-scatter moves fp32 into fp32 gradients of the fp32 shards (the optimizer's master weights). Losses and
    every parameter against one process under the same plugin (``BF16_TOL``)."""
    options = {**CLIP, **trainer_kwargs, "precision": "bf16-mixed"}
    reference = _fit_lm(str(tmp_path / "ref"), None, 1, options)[0]
    results = _fit_lm(
        str(tmp_path / "smp"), _sdp(pp, 2, reshard_after_forward=reshard_after_forward), 2 * pp, options,
        record=RecordPrecision(str(tmp_path / "smp"), logged=True),
    )
    torch.testing.assert_close(_mean_losses(results, pp), reference["losses"], **BF16_TOL)
    for rank, result in enumerate(results):
        assert result["moved"] == {"all_gather_single": {"torch.bfloat16"}, "reduce_scatter_single": {"torch.float32"}}
        sharded = {(True, "torch.float32", "torch.float32")}
        if reshard_after_forward == "never":  # a window's first batch: gathered bf16 parameters and local bf16
            # gradients; its last: shards
            gathered = {(False, "torch.bfloat16", "torch.bfloat16")}
            # windows of 2 batches in an epoch of STEPS = 3: batches (0, 1), (2,) (the epoch's end steps), (3, 4)
            assert result["after_backward"] == [gathered, sharded, sharded, gathered, sharded], result["after_backward"]
        elif reshard_after_forward == "always":  # reduce-scattered during every batch's backward
            assert result["after_backward"] == [sharded] * 5, result["after_backward"]
        else:
            assert result["after_backward"] == [sharded] * STEPS, result["after_backward"]
        for name, value in result["params"].items():
            assert value.dtype == torch.float32, name
            torch.testing.assert_close(value, reference["params"][name], **BF16_TOL, msg=name)
            assert result["held"][name] == _shard_numel(value, 2, rank // pp), f"{name}: a shard"


def test_predict_uneven_validate_and_a_second_fit_in_the_same_processes(tmp_path):
    """sdp2 with the popen launcher (``tests/scripts/sdp_eval_refit.py``): ``fit``, ``predict`` with 3 batches on one
    replica and 2 on the other (one all-gather per loop, none per batch: no hang), ``validate``, then a second ``fit``
    to twice the steps (after the first one's teardown moved the module), against one process running the same."""
    sdp_eval_refit.run(str(tmp_path), "one")  # the reference, in this process
    done = subprocess.run(
        [sys.executable, "tests/scripts/sdp_eval_refit.py", str(tmp_path), "sdp"], cwd=ROOT, capture_output=True,
        text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    reference = torch.load(tmp_path / "one_0.pt", weights_only=False)
    ranks = [torch.load(tmp_path / f"sdp_{rank}.pt", weights_only=False) for rank in range(2)]
    assert len(ranks) == 2 and len(reference["losses"]) == 2 * STEPS
    torch.testing.assert_close(_mean_losses(ranks, 1), reference["losses"], **TOL)
    assert [len(rank["predictions"]) for rank in ranks] == [3, 2]
    # logits (up to 24) from parameters that agree to 1.2e-7 (the replicas' average rounds): 2.7e-6 measured
    predictions = ranks[0]["predictions"] + ranks[1]["predictions"]
    torch.testing.assert_close(predictions, reference["predictions"], rtol=1e-5, atol=1e-5)
    for rank in ranks:
        torch.testing.assert_close(rank["val_loss"], reference["val_loss"], **TOL)
        assert all(rank["sharded"]), "shards after the second fit"
        for name, value in rank["params"].items():
            torch.testing.assert_close(value, reference["params"][name], **TOL, msg=name)
