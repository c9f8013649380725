"""The ``Trainer`` tests' one record callback and one fit helper: fit on CPU, collect what each rank recorded."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint


class RecordTraining(L.Callback):
    """Per rank, at the end of ``fit``: each step's loss and the final weights, in ``{out_dir}/{global_rank}.pt``.

    The saved dict holds ``losses`` (the loss each training step returned); with ``logged``, ``logged`` (the logged
    ``train_loss`` after each step); with ``weights="params"``, ``params`` (this rank's parameters, detached
    copies, an FSDP shard gathered whole); with ``weights="state"``, ``state`` (the state dict: full tensors under
    tp, a collective, so every rank
    records); with ``metrics``, ``metrics`` (the final ``callback_metrics`` as floats). A subclass adds entries
    through :meth:`on_step` (after each step's loss) and :meth:`extra` (at the end).
    """

    def __init__(self, out_dir: str, *, logged: bool = False, weights: str = "params", metrics: bool = False) -> None:
        if weights not in ("params", "state"):
            raise ValueError(f"weights={weights!r}: use 'params' or 'state'")
        self.out_dir, self.weights, self.metrics = str(out_dir), weights, metrics
        self.losses: list[float] = []
        self.logged: list[float] | None = [] if logged else None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))
        if self.logged is not None:
            self.logged.append(float(trainer.callback_metrics["train_loss"]))
        self.on_step(trainer, pl_module, batch_idx)

    def on_step(self, trainer: L.Trainer, pl_module: L.LightningModule, batch_idx: int) -> None:
        """After each step's loss is recorded; records nothing more here."""

    def extra(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        """More entries for the saved dict, at the end of ``fit``; none here."""
        return {}

    def on_train_end(self, trainer, pl_module):
        record: dict[str, Any] = {"losses": self.losses}
        if self.logged is not None:
            record["logged"] = self.logged
        if self.weights == "params":
            record["params"] = {n: _whole(p) for n, p in pl_module.named_parameters()}
        else:
            record["state"] = {k: _whole(v) for k, v in pl_module.state_dict().items()}
        if self.metrics:
            record["metrics"] = {k: float(v) for k, v in trainer.callback_metrics.items()}
        record.update(self.extra(trainer, pl_module))
        torch.save(record, os.path.join(self.out_dir, f"{trainer.global_rank}.pt"))


def _whole(param: torch.Tensor) -> torch.Tensor:
    """A detached copy of ``param``; of an FSDP shard (a DTensor), the whole (a collective over its mesh)."""
    from torch.distributed.tensor import DTensor

    return param.full_tensor().detach().clone() if isinstance(param, DTensor) else param.detach().clone()


def fit_and_collect(
    module: L.LightningModule,
    out_dir: str | os.PathLike,
    *,
    devices: int = 1,
    strategy: Any = None,
    max_steps: int = -1,
    record: L.Callback | None = None,
    callbacks: Iterable[L.Callback] = (),
    ckpt_path: Any = None,
    **trainer_kwargs: Any,
) -> list[Any]:
    """``Trainer.fit`` on CPU (no logger, progress bar or model summary); return what each rank recorded.

    Args:
        module: the model, built by the caller (after seeding, if the test seeds).
        out_dir: where ``record`` writes ``{rank}.pt``; made if missing.
        devices: processes; the result has one entry per global rank.
        strategy: a strategy object or name; ``None`` is ``"auto"``.
        max_steps: as ``Trainer``'s.
        record: the first callback, which saves ``{out_dir}/{global_rank}.pt`` at the end; by default
            ``RecordTraining(out_dir)``.
        callbacks: more callbacks, after ``record``; a ``ModelCheckpoint`` among them turns checkpointing on.
        ckpt_path: the checkpoint ``fit`` resumes from.
        trainer_kwargs: more ``Trainer`` arguments; they override the defaults above.

    Returns:
        ``torch.load`` of each rank's file, by global rank.
    """
    os.makedirs(out_dir, exist_ok=True)
    callbacks = [record if record is not None else RecordTraining(str(out_dir)), *callbacks]
    options = {
        "accelerator": "cpu",
        "logger": False,
        "enable_checkpointing": any(isinstance(c, ModelCheckpoint) for c in callbacks),
        "enable_progress_bar": False,
        "enable_model_summary": False,
        **trainer_kwargs,
    }
    trainer = L.Trainer(
        devices=devices, strategy=strategy if strategy is not None else "auto", max_steps=max_steps,
        callbacks=callbacks, **options,
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    return [torch.load(os.path.join(out_dir, f"{rank}.pt"), weights_only=False) for rank in range(devices)]
