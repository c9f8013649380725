"""Tied weights replicated across pipeline stages (``tied_weights="replicate"`` / ``"auto"``).

Tier 1: the planner's choice (``auto`` colocates a tiny tie, replicates GPT-2's at 4 stages), errors, the plan's
record and its table. Tier 2 (``Trainer.fit``, fork): training with the tied weight copied on 2 and 3 stages equals
one process (loss, every parameter, with gradient clipping), the copies are bitwise equal after every step, and a
checkpoint resumes at another pipeline degree.
"""

from __future__ import annotations

import os
from datetime import timedelta

import lightning as L
import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_mp
from lightning_mp.partition import PartitionPlan, plan, stage_costs, trace
from lightning_mp.strategy._placement import load_plan
from lightning_mp.strategy._tied import original_names
from tests.models import TinyLM

STEPS, BATCH = 3, 8
CLIP = {"gradient_clip_val": 0.05, "gradient_clip_algorithm": "norm"}  # small enough to clip every step


class SharedMiddle(TinyLM):
    """TinyLM (embedding tied to the head) whose blocks 1, 2 and 3 also share one linear weight."""

    def __init__(self) -> None:
        super().__init__(depth=4)
        for block in self.blocks[2:]:
            block[1].weight = self.blocks[1][1].weight


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(
        n_layer=3, n_embd=16, n_head=2, vocab_size=32, n_positions=8, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,  # dropout streams differ from one process
    ))


def _gpt2_loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    logits = model(input_ids=x).logits  # (B, T, V)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


BUILDS = {"tinylm": (TinyLM, TinyLM.loss), "sharedmid": (SharedMiddle, TinyLM.loss), "gpt2": (_gpt2, _gpt2_loss)}


# ---- tier 1: planning ----------------------------------------------------------------------------------------


def _trace(name: str):
    torch.manual_seed(0)
    build, loss = BUILDS[name]
    model = build()
    batch = TinyLM.batch(n=4)
    return model, trace(model, lambda: loss(model, batch), grad_enabled=True)


def test_auto_colocates_a_tiny_tie_where_a_copy_does_not_pay():
    _, tr = _trace("tinylm")
    colocated = plan(tr, 2, tied_weights="colocate")
    replicated = plan(tr, 2, tied_weights="replicate")
    assert replicated.replicated == {"embed.weight": (0, 1)} and not colocated.replicated
    assert max(replicated.stage_costs) > max(colocated.stage_costs), "the copy costs more than it balances"
    assert plan(tr, 2, tied_weights="auto") == colocated


class SharedDepth(nn.Module):
    """Eight compute-heavy blocks; blocks 0, 3 and 7 use one weight (a block shared across depth)."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(8))
        self.blocks[3].weight = self.blocks[7].weight = self.blocks[0].weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


def test_auto_replicates_a_weight_shared_far_apart_and_colocates_gpt2s_embedding():
    """A copy pays where co-location pulls compute-heavy holders onto one stage; for GPT-2's embedding/head it costs
    the head's stage what co-locating the embedding costs, a gain under the 1% ``auto`` asks for."""
    import transformers as hf

    model, x = SharedDepth(), torch.randn(64, 32)
    tr = trace(model, lambda: model(x).sum(), grad_enabled=True)
    colocated, chosen = plan(tr, 4, tied_weights="colocate"), plan(tr, 4, tied_weights="auto")
    assert [colocated.stage_of[f"blocks.{i}"] for i in (0, 3, 7)] == [0, 0, 0], "three of eight blocks on one stage"
    assert chosen.replicated == {"blocks.0.weight": (0, 1, 3)}
    assert max(chosen.stage_costs) < 0.9 * max(colocated.stage_costs)

    with torch.device("meta"):  # the benchmark's GPT-2 (12 layers, width 256, the real vocabulary)
        model = hf.GPT2LMHeadModel(hf.GPT2Config(n_layer=12, n_embd=256, n_head=4, vocab_size=50257))
        ids = torch.randint(0, 1000, (8, 128))
    tr = trace(model, lambda: model(input_ids=ids, labels=ids).loss)
    colocated, replicated = plan(tr, 4, tied_weights="colocate"), plan(tr, 4, tied_weights="replicate")
    assert replicated.replicated == {"transformer.wte.weight": (replicated.stage_of["transformer.wte"], 3)}
    assert replicated.stage_of["lm_head"] == 3
    gain = 1 - max(replicated.stage_costs) / max(colocated.stage_costs)
    assert 0 < gain < 0.01
    assert plan(tr, 4, tied_weights="auto") == colocated
    # the copy is charged to the head's stage: the plan's costs are those of its placement, recomputed
    assert replicated.stage_costs == stage_costs(tr, replicated.stage_of, 4)
    uncharged = stage_costs(tr, replicated.stage_of, 4, charge_copies=False)
    assert replicated.stage_costs[3] > uncharged[3]


def test_manual_split_of_a_tie_is_an_error_under_colocate_and_a_copy_under_replicate():
    model, tr = _trace("tinylm")
    manual = {"head": 1, "blocks.3": 1}
    with pytest.raises(ValueError, match=r"share parameters.*'embed' -> 0.*'head' -> 1.*tied_weights='replicate'"):
        plan(tr, 2, manual=manual, tied_weights="colocate")
    for mode in ("replicate", "auto"):
        assert plan(tr, 2, manual=manual, tied_weights=mode).replicated == {"embed.weight": (0, 1)}


def test_plan_records_copies_round_trips_and_shows_them():
    model, tr = _trace("sharedmid")
    placed = plan(tr, 3, manual={"blocks.2": 1, "blocks.3": 2, "head": 2}, auto_partition=False,
                  tied_weights="replicate")
    assert placed.replicated == {"embed.weight": (0, 2), "blocks.1.1.weight": (0, 1, 2)}
    assert PartitionPlan.from_dict(placed.to_dict()) == placed
    table = placed.format_table(tr)
    assert "replicated (tied)" in table and "replica" in table
    assert placed.replica_params(tr) == [0, 16 * 16, 16 * 16 + 32 * 16]
    assert original_names(model) == {
        "head.weight": "embed.weight", "blocks.2.1.weight": "blocks.1.1.weight", "blocks.3.1.weight": "blocks.1.1.weight"
    }


def test_tied_weights_value_is_checked():
    _, tr = _trace("tinylm")
    with pytest.raises(ValueError, match="tied_weights must be one of"):
        plan(tr, 2, tied_weights="copy")
    with pytest.raises(ValueError, match="`tied_weights` must be"):
        lightning_mp.SMPConfig(tied_weights="copy")


# ---- tier 2: Trainer(strategy="smp") against one process ----------------------------------------------------


class TiedModule(L.LightningModule):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.net = BUILDS[name][0]()

    def training_step(self, batch, batch_idx):
        loss = BUILDS[self.name][1](self.net, batch)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        # Groups by module type, as the example GPT does: no weight decay for embeddings. The head's stage holds a
        # copy of the tied weight; it must land in the embedding's group there too, or the copies drift apart.
        # SGD: Adam turns the pure rounding noise of GPT-2's key-bias gradients (zero in exact maths) into lr-sized steps.
        embeddings = {id(p) for m in self.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
        params = list(self.parameters())
        groups = [{"params": [p for p in params if id(p) not in embeddings], "weight_decay": 0.05},
                  {"params": [p for p in params if id(p) in embeddings], "weight_decay": 0.0}]
        # a stage without an embedding leaves that group out (torch's DCP optimizer loader fails on an empty group)
        return torch.optim.SGD([g for g in groups if g["params"]], lr=0.1, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        parts = [TinyLM.batch(n=BATCH, seed=step) for step in range(2 * STEPS)]
        return DataLoader(TensorDataset(*(torch.cat(t) for t in zip(*parts))), batch_size=BATCH, shuffle=False)


class Record(L.Callback):
    """Per rank: losses, the tied copies after every step (under every name this rank holds), final parameters."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.losses: list[float] = []
        self.copies: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))
        if not hasattr(self, "tied"):
            names = original_names(BUILDS[pl_module.name][0]())
            self.tied = set(names) | set(names.values())
        tied = self.tied
        self.copies.append({n: p.detach().clone() for n, p in pl_module.named_parameters(prefix="", remove_duplicate=False)
                            if n.removeprefix("net.") in tied})

    def on_train_end(self, trainer, pl_module):
        params = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
        plan_data = trainer.strategy.partition_plan.to_dict() if hasattr(trainer.strategy, "partition_plan") else None
        torch.save({"losses": self.losses, "copies": self.copies, "params": params, "plan": plan_data},
                   os.path.join(self.out_dir, f"{trainer.global_rank}.pt"))


def _fit(name: str, out_dir: str, strategy="auto", devices: int = 1, max_steps: int = STEPS, ckpt_dir=None,
         ckpt_path=None, **trainer_kwargs) -> list[dict]:
    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(0)
    callbacks = [Record(out_dir)]
    if ckpt_dir is not None:
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=ckpt_dir, save_last=True))
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=max_steps, logger=False,
        enable_checkpointing=ckpt_dir is not None, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, callbacks=callbacks, use_distributed_sampler=False, **trainer_kwargs,
    )
    trainer.fit(TiedModule(name), ckpt_path=ckpt_path)
    return [torch.load(os.path.join(out_dir, f"{r}.pt"), weights_only=False) for r in range(devices)]


def _smp(pp: int, **kwargs) -> lightning_mp.SMPStrategy:
    return lightning_mp.SMPStrategy(pipeline_parallel_degree=pp, microbatches=2, start_method="fork", **kwargs)


def _assert_matches(results: list[dict], reference: dict, names: dict[str, str]) -> None:
    for result in results:
        torch.testing.assert_close(result["losses"], reference["losses"], rtol=1e-5, atol=1e-6)
        for name, value in result["params"].items():
            original = "net." + names.get(name.removeprefix("net."), name.removeprefix("net."))
            torch.testing.assert_close(value, reference["params"][original], rtol=1e-5, atol=1e-6, msg=name)
    held = {"net." + names.get(n.removeprefix("net."), n.removeprefix("net.")) for r in results for n in r["params"]}
    assert held == set(reference["params"]), "every parameter is held somewhere"


def _assert_copies_equal_every_step(results: list[dict], stages_of: dict[str, tuple[int, ...]], names) -> None:
    for step in range(len(results[0]["copies"])):
        for fqn, stages in stages_of.items():
            copies = [
                (rank, value) for rank, result in enumerate(results) for name, value in result["copies"][step].items()
                if names.get(name.removeprefix("net."), name.removeprefix("net.")) == fqn
            ]
            assert sorted({rank for rank, _ in copies}) == list(stages), f"{fqn} is held on stages {stages}"
            for rank, value in copies[1:]:
                assert torch.equal(value, copies[0][1]), f"step {step}: the copy of {fqn} on rank {rank} drifted"


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # before forking: a forked child can hang in OpenMP otherwise
    # ... and stays at one thread: a one-process fork (the pp=1 resume) would otherwise get ddp's policy of
    # cpu_count threads, and libgomp's pool inherited from a parent that ran parallel regions hangs the child.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize(
    ("name", "pp", "kwargs", "expected"),
    [
        ("tinylm", 2, {"partition": {"net.head": 1, "net.blocks.3": 1}, "tied_weights": "replicate"},
         {"embed.weight": (0, 1)}),
        ("gpt2", 2, {"tied_weights": "replicate"}, {"transformer.wte.weight": (0, 1)}),
        ("sharedmid", 3, {"partition": {"net.blocks.2": 1, "net.blocks.3": 2, "net.head": 2}, "auto_partition": False,
                          "tied_weights": "replicate"}, {"embed.weight": (0, 2), "blocks.1.1.weight": (0, 1, 2)}),
    ],
    ids=["tinylm-pp2-manual-split", "hf-gpt2-pp2-planned", "shared-middle-blocks-pp3"],
)
def test_replicated_tie_trains_as_one_process_with_clipping(tmp_path, name, pp, kwargs, expected):
    names = original_names(BUILDS[name][0]())
    reference = _fit(name, str(tmp_path / "ref"), **CLIP)[0]
    results = _fit(name, str(tmp_path / "smp"), _smp(pp, **kwargs), devices=pp, **CLIP)
    assert PartitionPlan.from_dict(results[0]["plan"]).replicated == {f"net.{k}": v for k, v in expected.items()}
    _assert_matches(results, reference, names)
    _assert_copies_equal_every_step(results, expected, names)


def test_replicated_checkpoint_keeps_one_copy_and_resumes_at_another_degree(tmp_path):
    """pp=2 with the head's copy on stage 1, saved (DCP), resumed at pp=1 and at pp=3; against one process."""
    split = {"partition": {"net.head": 1, "net.blocks.3": 1}, "tied_weights": "replicate"}
    names = original_names(TinyLM())
    _fit("tinylm", str(tmp_path / "ref1"), max_steps=STEPS, ckpt_dir=str(tmp_path / "ck_ref"))
    reference = _fit("tinylm", str(tmp_path / "ref2"), max_steps=2 * STEPS,
                     ckpt_path=str(tmp_path / "ck_ref" / "last.ckpt"))[0]
    _fit("tinylm", str(tmp_path / "first"), _smp(2, **split), devices=2, ckpt_dir=str(tmp_path / "ck"))
    saved = dcp.FileSystemReader(str(tmp_path / "ck" / "last")).read_metadata().state_dict_metadata
    assert "state_dict.net.embed.weight" in saved and "state_dict.net.head.weight" not in saved, "one copy, one name"
    assert not any("net.head.weight" in key for key in saved), "the optimizer state too"
    assert load_plan(str(tmp_path / "ck" / "last"), TiedModule("tinylm"), 2).replicated == {"net.embed.weight": (0, 1)}
    reused = _fit("tinylm", str(tmp_path / "reuse"), _smp(2, partition_plan=str(tmp_path / "ck" / "last")), devices=2,
                  max_steps=1)
    assert reused[0]["plan"]["replicated"] == {"net.embed.weight": [0, 1]}, "a saved plan replicates the same way"
    with pytest.raises(Exception, match="tied_weights='colocate'"):
        _fit("tinylm", str(tmp_path / "refused"),
             _smp(2, partition_plan=str(tmp_path / "ck" / "last"), tied_weights="colocate"), devices=2, max_steps=1)
    for pp in (1, 3):
        resumed = _fit("tinylm", str(tmp_path / f"pp{pp}"), _smp(pp, tied_weights="replicate", replan_on_resume=True),
                       devices=pp, max_steps=2 * STEPS, ckpt_path=str(tmp_path / "ck" / "last"))
        _assert_matches(resumed, reference, names)


def test_full_checkpoint_file_with_a_copy_is_one_devices_file(tmp_path):
    """``save_distributed_checkpoint=False`` at pp=2 with the head's copy on stage 1 writes one device's file."""
    split = {"partition": {"net.head": 1, "net.blocks.3": 1}, "tied_weights": "replicate"}
    _fit("tinylm", str(tmp_path / "ref"), ckpt_dir=str(tmp_path / "ck_ref"))
    _fit("tinylm", str(tmp_path / "smp"), _smp(2, save_distributed_checkpoint=False, **split), devices=2,
         ckpt_dir=str(tmp_path / "ck"))
    expected = torch.load(tmp_path / "ck_ref" / "last.ckpt", weights_only=False)
    got = torch.load(tmp_path / "ck" / "last.ckpt", weights_only=False)
    assert sorted(got["state_dict"]) == sorted(expected["state_dict"]), "every name of the tied weight, as on one device"
    for key, value in expected["state_dict"].items():
        torch.testing.assert_close(got["state_dict"][key], value, rtol=1e-5, atol=1e-6, msg=key)
    (optim,), (reference,) = got["optimizer_states"], expected["optimizer_states"]
    assert [len(g["params"]) for g in optim["param_groups"]] == [len(g["params"]) for g in reference["param_groups"]]
    assert sorted(optim["state"]) == sorted(reference["state"]), "one state per parameter, the copy's folded in"
    for index, state in reference["state"].items():
        torch.testing.assert_close(optim["state"][index]["momentum_buffer"], state["momentum_buffer"], rtol=1e-5,
                                   atol=1e-6, msg=str(index))


def _tie_missing_on_stage_1(rank: int, world_size: int) -> str:
    """Stage 1's model lacks the replicated parameter (a plan for another model): every rank raises, none waits."""
    from lightning_mp.strategy._tied import build_tied_weights
    from lightning_mp.topology import Topology

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    if rank == 1:
        model[0]._parameters["weight"] = None  # what the engine leaves of another stage's module
    stages = PartitionPlan(2, {"": 0, "0": 0, "1": 1}, (0.5, 0.5), replicated={"0.weight": (0, 1)})
    topology = Topology(world_size=2, rank=rank, pipeline_parallel_degree=2)
    try:
        build_tied_weights(model, stages, {}, topology, timeout=timedelta(seconds=20))
    except ValueError as err:
        return str(err)
    return "no error"


def test_a_replicated_parameter_missing_on_one_stage_fails_on_every_rank_at_once():
    from tests._dist import run_distributed

    messages = run_distributed(_tie_missing_on_stage_1, 2, start_method="fork")
    assert all("'0.weight' (on stages [0, 1]), but stage 1 holds no such parameter" in m for m in messages), messages
