"""Tied weights replicated across pipeline stages through ``Trainer.fit`` (fork): training with the tied weight
copied on 2 and 3 stages equals one process (loss, every parameter, with gradient clipping), the copies are
bitwise equal after every step, and a checkpoint resumes at another pipeline degree."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_mp
from lightning_mp.partition import PartitionPlan
from lightning_mp.strategy._placement import load_plan
from lightning_mp.strategy._tied import original_names
from tests._fit import RecordTraining, fit_and_collect
from tests.models import TinyLM
from tests.unit.test_tied import BUILDS

STEPS, BATCH = 3, 8
CLIP = {"gradient_clip_val": 0.05, "gradient_clip_algorithm": "norm"}  # small enough to clip every step


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


class Record(RecordTraining):
    """Per rank: losses, the tied copies after every step (under every name this rank holds), final parameters."""

    def __init__(self, out_dir: str) -> None:
        super().__init__(out_dir)
        self.copies: list[dict[str, torch.Tensor]] = []

    def on_step(self, trainer, pl_module, batch_idx):
        if not hasattr(self, "tied"):
            names = original_names(BUILDS[pl_module.name][0]())
            self.tied = set(names) | set(names.values())
        tied = self.tied
        self.copies.append({n: p.detach().clone() for n, p in pl_module.named_parameters(prefix="", remove_duplicate=False)
                            if n.removeprefix("net.") in tied})

    def extra(self, trainer, pl_module):
        plan_data = trainer.strategy.partition_plan.to_dict() if hasattr(trainer.strategy, "partition_plan") else None
        return {"copies": self.copies, "plan": plan_data}


def _fit(name: str, out_dir: str, strategy="auto", devices: int = 1, max_steps: int = STEPS, ckpt_dir=None,
         ckpt_path=None, **trainer_kwargs) -> list[dict]:
    torch.manual_seed(0)
    callbacks = [] if ckpt_dir is None else [L.pytorch.callbacks.ModelCheckpoint(dirpath=ckpt_dir, save_last=True)]
    return fit_and_collect(
        TiedModule(name), out_dir, devices=devices, strategy=strategy, max_steps=max_steps, record=Record(out_dir),
        callbacks=callbacks, ckpt_path=ckpt_path, num_sanity_val_steps=0, use_distributed_sampler=False,
        **trainer_kwargs,
    )


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
