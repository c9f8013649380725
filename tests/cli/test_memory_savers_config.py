"""The memory savers' shipped config (``configs/gpt_memory_savers.yaml``) trains through the CLI."""

from __future__ import annotations

import os


def test_memory_savers_config_trains_through_the_cli(tmp_path):
    """configs/gpt_memory_savers.yaml (every switch from YAML; run at pp=2 on 2 processes) via the CLI.

    The GPT builds its layers in ``__init__``; ``DelayedParameterInit`` in the config makes the CLI instantiate
    it under delayed init, so each rank materialises only its own stage.
    """
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    args = [
        sys.executable, "-m", "lightning_mp.cli", "fit", "--config", "configs/gpt_memory_savers.yaml",
        "--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1",
        "--trainer.default_root_dir", str(tmp_path),  # the config's ModelCheckpoint writes there
        "--data.init_args.max_bytes", "200000", "--model.init_args.n_layer", "2",
        "--trainer.devices", "2",  # pp=2 only: two processes keep the test short (sharding is tested above)
    ]
    env = {**os.environ, "PYTHONPATH": str(root)}
    result = subprocess.run(args, cwd=root, capture_output=True, text=True, timeout=420, env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "delayed init materialised stage 0" in output
    assert "activation checkpointing on" in output
    assert "shard_optimizer_state=True has no effect with one data-parallel replica" in output
