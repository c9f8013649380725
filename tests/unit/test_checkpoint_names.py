"""Temporary checkpoint names and Lightning's SLURM requeue, which reads versions out of ``ckpt_`` names."""

from pathlib import Path

from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

from lightning_mp.strategy._checkpoint._folder import _partial_path, _remove


def test_a_half_written_hpc_checkpoint_is_not_a_version_for_the_requeue(tmp_path: Path):
    (tmp_path / "hpc_ckpt_1.ckpt").mkdir()
    _partial_path(tmp_path / "hpc_ckpt_2.ckpt").mkdir()  # left by a save killed by SLURM's SIGKILL
    doomed = tmp_path / "hpc_ckpt_3.ckpt"
    doomed.mkdir()
    _remove(doomed)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hpc_ckpt-2.ckpt.partial", "hpc_ckpt_1.ckpt"]
    newest = _CheckpointConnector._CheckpointConnector__max_ckpt_version_in_folder(tmp_path, "hpc_ckpt_")
    assert newest == 1, "the requeued job would resume from a checkpoint that does not exist"
    assert _CheckpointConnector.hpc_save_path(tmp_path).endswith("hpc_ckpt_2.ckpt")
