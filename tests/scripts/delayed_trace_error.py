"""A delayed-init fit at pp=2 whose model reads a child's weight in its parent's forward (default popen launcher):
setup fails with one error, and the teardown of the still-meta model adds none."""

import lightning as L

import lightning_mp
from tests.trainer.test_delayed_trace import GateOnAChildsWeight, Lit

if __name__ == "__main__":
    strategy = lightning_mp.SMPStrategy(pipeline_parallel_degree=2, delayed_parameter_initialization=True)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=1, logger=False,
                        enable_progress_bar=False, enable_checkpointing=False)
    trainer.fit(Lit(GateOnAChildsWeight))
