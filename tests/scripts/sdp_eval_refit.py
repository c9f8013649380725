"""Under sharded data parallelism (sdp2, the popen launcher), one Trainer in the same processes: ``fit``, then
``predict`` with a different number of batches per replica, ``validate``, and a second ``fit`` that continues to
twice the steps. ``python tests/scripts/sdp_eval_refit.py OUT_DIR sdp|one`` (``one``: one process, no strategy,
every replica's predict batches; also :func:`run` in the calling process) writes ``OUT_DIR/{mode}_{rank}.pt``: each
loss, the predictions, the validation loss and every parameter (whole) after the second fit."""

import sys

import lightning as L
import torch
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

import lightning_mp
from tests.models import TinyLM
from tests.trainer.test_strategy import STEPS, Wrapped

PREDICT_BATCHES = (3, 2)  # per replica: an all-gather per batch would leave replica 0 waiting for replica 1


class UnevenPredict(Wrapped):
    def __init__(self) -> None:
        super().__init__("tiedlm")
        self.losses: list[float] = []

    def predict_dataloader(self) -> DataLoader:
        x, _ = TinyLM.batch(n=4 * sum(PREDICT_BATCHES), seed=99)
        starts = [4 * sum(PREDICT_BATCHES[:r]) for r in range(len(PREDICT_BATCHES) + 1)]
        mine = slice(0, starts[-1]) if self.trainer.world_size == 1 else slice(*starts[self.global_rank :][:2])
        return DataLoader(TensorDataset(x[mine]), batch_size=4)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))

    def on_validation_batch_end(self, outputs, batch, batch_idx, dataloader_idx=0):
        self.state_dict()  # as an EMA or logging callback does mid-loop: FSDP's state-dict hook reshards the stage


def whole(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def run(out_dir: str, mode: str) -> None:
    """``mode`` ``"sdp"`` (2 processes through the popen launcher) or ``"one"`` (this process)."""
    torch.manual_seed(0)
    sdp = mode == "sdp"
    strategy = lightning_mp.SMPStrategy(sharded_data_parallel_degree=2, microbatches=2) if sdp else "auto"
    trainer = L.Trainer(
        accelerator="cpu", devices=2 if sdp else 1, strategy=strategy, max_steps=STEPS, logger=False,
        enable_progress_bar=False, use_distributed_sampler=False, enable_checkpointing=False, num_sanity_val_steps=0,
        enable_model_summary=False,
    )
    model = UnevenPredict()
    trainer.fit(model)
    predictions = trainer.predict(model)
    val_loss = trainer.validate(model)[0]["val_loss"]
    trainer.fit_loop.epoch_loop.max_steps = 2 * STEPS
    trainer.fit(model)
    torch.save(
        {
            "losses": model.losses, "predictions": predictions, "val_loss": val_loss,
            "params": {n: whole(p) for n, p in model.named_parameters()},
            "sharded": [isinstance(p, DTensor) for p in model.parameters()],
        },
        f"{out_dir}/{mode}_{trainer.global_rank}.pt",
    )


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2])
