"""Checkpoints that survive a crash, refuse another model's weights, and leave as plain state dicts.

* a rank killed by SIGKILL while writing leaves the previous ``last`` intact and the half-written one hidden and
  refused; the run resumes from the last good one and continues as the uninterrupted run;
* ``save_top_k`` rotation leaves exactly the kept folders (no temporary or half-deleted ones);
* loading another model's checkpoint names the missing / unexpected keys and shape mismatches, and loads the
  matching entries only with ``strict_loading = False``;
* ``lightning-mp consolidate`` writes ``.pt`` / ``.safetensors`` files that the unmodified model loads with
  ``load_state_dict(strict=True)`` in a process where lightning_mp cannot be imported; ``--hf`` writes a folder
  that ``from_pretrained`` loads; ``SMPStrategy(load_weights=...)`` starts another layout from those files.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import lightning_mp
from lightning_mp.strategy._checkpoint import is_complete_checkpoint, load_checkpoint
from tests._dist import assert_states_match
from tests.trainer.test_checkpoint_reshard import STEPS, _fit, _GPT, _GPT2, _strategy

ROOT = Path(__file__).resolve().parents[2]


def _kill_rank1_at_save(n: int):
    """Patch DCP's file writer: on global rank 1, the ``n``-th write finishes its files, then the rank is killed."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    original = FileSystemWriter.write_data
    calls = {"n": 0}

    def write_data(self, plan, planner):
        result = original(self, plan, planner)
        if dist.get_rank() == 1:
            calls["n"] += 1
            if calls["n"] == n:
                result.wait()
                os.kill(os.getpid(), signal.SIGKILL)
        return result

    return write_data


def test_killed_save_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    import lightning as L
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    from tests.trainer.test_tp_trainer import Record

    whole = _fit(_GPT, tmp_path / "whole", 2, _strategy(2, 1), steps=2 * STEPS)
    ckpt = tmp_path / "ckpt"
    # saves after every step: "epoch=0-step=k", then "last"; the 4th write is step 2's "last", over step 1's
    monkeypatch.setattr(FileSystemWriter, "write_data", _kill_rank1_at_save(4))
    os.makedirs(tmp_path / "killed")
    torch.manual_seed(0)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=_strategy(2, 1, timeout=timedelta(seconds=30)),
        max_steps=2 * STEPS, logger=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False,
        callbacks=[
            Record(str(tmp_path / "killed")),
            L.pytorch.callbacks.ModelCheckpoint(dirpath=str(ckpt), save_last=True, save_top_k=-1, every_n_train_steps=1),
        ],
    )
    with pytest.raises(Exception, match="signal|SIGKILL|exit"):  # rank 1 died mid-save
        trainer.fit(_GPT())
    monkeypatch.undo()
    assert sorted(p.name for p in ckpt.iterdir() if not p.name.startswith(".")) == [
        "epoch=0-step=1", "epoch=0-step=2", "last",
    ]
    assert is_complete_checkpoint(ckpt / "last")
    assert torch.load(ckpt / "last" / "meta.pt", weights_only=False)["global_step"] == 1, "step 1's, intact"
    partial = ckpt / ".last.partial"
    assert partial.is_dir() and not is_complete_checkpoint(partial), "the half-written one is kept aside"
    with pytest.raises(FileNotFoundError, match="partial"):
        load_checkpoint(partial, torch.nn.Linear(1, 1), [], strict=True, weights_only=False)
    resumed = _fit(_GPT, tmp_path / "resumed", 2, _strategy(2, 1), steps=2 * STEPS, ckpt_path=ckpt / "last")
    for whole_rank, part in zip(whole, resumed):
        assert part["losses"] == whole_rank["losses"][1:]
    assert_states_match([r["state"] for r in resumed], {k: v for r in whole for k, v in r["state"].items()}, exact=True)


def test_top_k_rotation_leaves_only_the_kept_folders(tmp_path):
    import lightning as L

    ckpt = tmp_path / "ckpt"

    class Rotating(L.pytorch.callbacks.ModelCheckpoint):
        def __init__(self):
            super().__init__(dirpath=str(ckpt), save_last=True, every_n_train_steps=1, save_top_k=1, monitor="step", mode="max")

    os.makedirs(tmp_path / "out")
    from tests.trainer.test_tp_trainer import Record

    torch.manual_seed(0)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=_strategy(2, 1), max_steps=STEPS, logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        callbacks=[Record(str(tmp_path / "out")), Rotating()], use_distributed_sampler=False,
    )
    trainer.fit(_GPT())
    names = sorted(p.name for p in ckpt.iterdir())
    assert names == ["epoch=0-step=3", "last"], names
    assert all(is_complete_checkpoint(ckpt / n) for n in names)


class _Wider(_GPT):
    """Another model: one more buffer and a wider MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("extra", torch.zeros(2))
        self.h[0].mlp.c_fc = torch.nn.Linear(16, 32)
        self.h[0].mlp.c_proj = torch.nn.Linear(32, 16)


class _Lenient(_Wider):
    def __init__(self) -> None:
        super().__init__()
        self.strict_loading = False


def test_another_models_checkpoint_lists_keys_and_shapes(tmp_path):
    ckpt = tmp_path / "ckpt"
    _fit(_GPT, tmp_path / "first", 1, _strategy(), ckpt_dir=ckpt)
    with pytest.raises(Exception) as err:  # raised in the forked rank; the parent reports its traceback
        _fit(_Wider, tmp_path / "wider", 1, _strategy(), steps=2 * STEPS, ckpt_path=ckpt / "last")
    message = str(err.value)
    assert "CheckpointMismatchError" in message
    assert "missing keys (1): ['extra']" in message
    assert "h.0.mlp.c_fc.weight: (64, 16) vs (32, 16)" in message
    results = _fit(_Lenient, tmp_path / "lenient", 1, _strategy(), steps=STEPS + 1, ckpt_path=ckpt / "last")
    assert len(results[0]["losses"]) == 1, "resumed with the matching entries"
    saved = torch.load(ckpt / "last" / "meta.pt", weights_only=False)
    assert saved["global_step"] == STEPS
    ckpt2 = tmp_path / "ckpt2"
    _fit(_Wider, tmp_path / "wider-first", 1, _strategy(), ckpt_dir=ckpt2)
    with pytest.raises(Exception, match=r"unexpected keys \(1\): \['extra'\]"):
        _fit(_GPT, tmp_path / "narrow", 1, _strategy(), steps=2 * STEPS, ckpt_path=ckpt2 / "last")


_LOAD_PLAIN = """
import sys
sys.modules["lightning_mp"] = None  # any import of lightning_mp fails
import torch
from examples.gpt import GPT
path = sys.argv[1]
if path.endswith(".safetensors"):
    from safetensors.torch import load_file
    state = load_file(path)
else:
    state = torch.load(path, weights_only=True)
model = GPT(vocab_size=33, block_size=8, n_layer=2, n_head=4, n_embd=16)
model.load_state_dict(state, strict=True)
torch.save({k: v.clone() for k, v in model.state_dict().items()}, sys.argv[2])
"""

_LOAD_HF = """
import sys
sys.modules["lightning_mp"] = None
import torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
torch.save({k: v.clone() for k, v in model.state_dict().items()}, sys.argv[2])
"""


def _cli(*args: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "lightning_mp.cli", "consolidate", *args], check=True, cwd=ROOT, timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def _load_elsewhere(script: str, path: Path, out: Path) -> dict:
    subprocess.run(
        [sys.executable, "-c", script, str(path), str(out)], check=True, cwd=ROOT, timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    return torch.load(out, weights_only=True)


def test_consolidate_and_load_weights_gpt(tmp_path):
    """Saved at pp2 x tp2 (fused q/k/v, padded vocabulary, tied head); consolidated; loaded without lightning_mp;
    and the file starts a tp2 run that matches a one-process run started from the same file."""
    ckpt = tmp_path / "ckpt"
    trained = _fit(_GPT, tmp_path / "first", 4, _strategy(2, 2), ckpt_dir=ckpt)
    full = {k: v for r in trained for k, v in r["state"].items()}
    for name in ("model.pt", "model.safetensors"):
        _cli(str(ckpt / "last"), str(tmp_path / name))
        loaded = _load_elsewhere(_LOAD_PLAIN, tmp_path / name, tmp_path / f"{name}.check")
        assert set(loaded) == set(full), "every name, the tied head's too"
        for key, value in full.items():
            torch.testing.assert_close(loaded[key], value, rtol=0, atol=0, msg=lambda m, k=key: f"{name} {k}: {m}")

    class FromFile(_GPT):
        def on_fit_start(self):
            if not isinstance(self.trainer.strategy, lightning_mp.SMPStrategy):
                self.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))

    reference = _fit(FromFile, tmp_path / "ref", 1)[0]
    results = _fit(FromFile, tmp_path / "tp2", 2, _strategy(1, 2, load_weights=str(tmp_path / "model.safetensors")))
    for result in results:
        torch.testing.assert_close(result["losses"], reference["losses"], rtol=1e-5, atol=1e-6)
    assert_states_match([r["state"] for r in results], reference["state"])


def test_consolidate_hf_and_load_weights_from_an_hf_folder(tmp_path):
    """GPT-2 saved at tp2; ``--hf`` writes a folder ``from_pretrained`` loads; that folder starts a pp2 run."""
    ckpt = tmp_path / "ckpt"
    trained = _fit(_GPT2, tmp_path / "first", 2, _strategy(1, 2), ckpt_dir=ckpt)[0]["state"]
    _cli(str(ckpt / "last"), str(tmp_path / "hf"), "--hf")
    loaded = _load_elsewhere(_LOAD_HF, tmp_path / "hf", tmp_path / "hf.check")
    for key, value in trained.items():
        torch.testing.assert_close(loaded[key[len("model.") :]], value, rtol=0, atol=0, msg=lambda m, k=key: f"{k}: {m}")

    class FromHF(_GPT2):
        def on_fit_start(self):
            if not isinstance(self.trainer.strategy, lightning_mp.SMPStrategy):
                from transformers import AutoModelForCausalLM

                self.model.load_state_dict(AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict())

    reference = _fit(FromHF, tmp_path / "ref", 1)[0]
    results = _fit(FromHF, tmp_path / "pp2", 2, _strategy(2, 1, load_weights=str(tmp_path / "hf")))
    for result in results:
        torch.testing.assert_close(result["losses"], reference["losses"], rtol=1e-5, atol=1e-6)
    assert_states_match([r["state"] for r in results], reference["state"])
