"""The ``lightning-mp`` console script with the shipped configs, small and bounded.

Every shipped config has one clean, bounded run in the suite that must print no warning of ours: a warning raised
from ``lightning_mp/`` or ``examples/``, or one of torch's and Lightning's that only our wrapping causes
(``CAUSED_BY_US``). Lightning's and torch's own notices (a missing TensorBoard, their deprecations) are left, as
under any strategy; the failure message lists what was seen.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def _cli() -> list[str]:
    script = shutil.which("lightning-mp", path=os.path.dirname(sys.executable))
    assert script is not None, "the `lightning-mp` console script is installed with the package"
    return [script]


def _run(args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(_cli() + args, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


WARNING_LINE = re.compile(r"^(?P<path>\S+?\.py):(?P<line>\d+): (?P<message>.*)$", re.MULTILINE)
CAUSED_BY_US = (
    "has been overridden after learning rate scheduler initialization",  # torch, a scheduler moved onto ZeRO-1
    "torch.distributed is disabled",  # DCP, a single-process load of a checkpoint folder
    "sync_dist=True",  # Lightning, a LightningModule of examples/ logging without it at dp > 1
)
# Configs whose bounded run is a test of its own, which checks its warnings too (the rest run in
# test_a_clean_run_of_a_shipped_config_prints_no_warning_of_ours).
RUN_ELSEWHERE = {
    "gpt_pp2": "test_gpt_pp2_short_fit",
    "gpt_pp2_timeline": "test_gpt_pp2_timeline_config_writes_the_trace_and_prints_the_bubble",
    "gpt_tp2": "tests/cli/test_tp_configs.py",
    "llama_tp2": "tests/cli/test_tp_configs.py",
}
BOUNDS = {  # a few steps; the 403 M parameter config keeps its layout and features at a width CI can run
    "gpt_large_pp4_delayed": ["--model.init_args.n_layer", "4", "--model.init_args.n_embd", "128"],
}


def warnings_of_ours(output: str) -> list[str]:
    """The warning lines of ``output`` raised by our code, or by torch/Lightning because of our wrapping."""
    ours = []
    for match in WARNING_LINE.finditer(output):
        path = match["path"]
        from_us = path.startswith((str(ROOT / "lightning_mp"), str(ROOT / "examples")))
        if from_us or any(text in match["message"] for text in CAUSED_BY_US):
            ours.append(match.group(0))
    return ours


def test_warnings_of_ours_are_recognised():
    output = (
        f"{ROOT}/lightning_mp/strategy/_strategy.py:10: UserWarning: ours\n"
        "/venv/lightning/pytorch/trainer/connectors/logger_connector/result.py:433: It is recommended to use"
        " `self.log('val_loss', ..., sync_dist=True)` when logging on epoch level\n"
        "/venv/lightning/pytorch/utilities/_pytree.py:21: `isinstance(treespec, LeafSpec)` is deprecated\n"
    )
    assert warnings_of_ours(output) == output.splitlines()[:2]


def test_configs_exist():
    names = {path.name for path in CONFIGS}
    assert {"gpt_pp2.yaml", "gpt_pp2_dp2.yaml", "gpt_pp2_timeline.yaml", "gpt_single.yaml"} <= names


_PRINT_EACH_CONFIG = """
import contextlib, io, json, sys
from lightning_mp.cli import main
results = {}
for config in sys.argv[1:]:
    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(["fit", "--config", config, "--print_config"])
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (exit_.code is not None)
    results[config] = {"returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue()}
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def printed_configs() -> dict[str, dict]:
    """``lightning-mp fit --config CONFIG --print_config`` (its entry point, ``lightning_mp.cli.main``) for every
    shipped config in one process: each result's return code, stdout and stderr, by config path."""
    result = subprocess.run([sys.executable, "-c", _PRINT_EACH_CONFIG, *map(str, CONFIGS)], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.parametrize("config", CONFIGS, ids=[path.stem for path in CONFIGS])
def test_shipped_config_parses(printed_configs, config):
    result = printed_configs[str(config)]
    assert result["returncode"] == 0, result["stderr"][-3000:]
    assert "class_path:" in result["stdout"]


def test_help_lists_consolidate():
    result = _run(["--help"], timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "consolidate CKPT_DIR OUT [--hf]" in " ".join(result.stdout.split())


def test_consolidate_writes_files_as_torch_save_does_and_quietly(tmp_path):
    """Modes as a plain ``torch.save`` (safetensors writes 0600), and no DCP warning about a missing process group."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from lightning_mp.strategy._consolidate import consolidate

    folder = tmp_path / "last"
    dcp.save({"state_dict": {"w": torch.arange(6.0).reshape(2, 3)}}, checkpoint_id=str(folder), no_dist=True)
    torch.save({}, folder / "meta.pt")
    torch.save({}, tmp_path / "plain.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in ("model.pt", "model.safetensors"):
            consolidate(folder, tmp_path / name)
            assert (tmp_path / name).stat().st_mode == (tmp_path / "plain.pt").stat().st_mode, name


def test_a_wrong_strategy_value_on_the_command_line_is_reported_alone():
    result = _run(
        ["fit", "--config", "configs/gpt_pp2.yaml", "--trainer.strategy.init_args.partition", '{"h.0": 5}'], timeout=120
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Union" not in result.stderr and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        "error: trainer.strategy (lightning_mp.SMPStrategy): Stage 5 for 'h.0' is out of range: stages are 0..1 for"
        " `pipeline_parallel_degree=2`."
    )


def test_strategy_by_name_parses():
    result = _run(
        ["fit", "--config", "configs/gpt_single.yaml", "--trainer.strategy", "smp", "--print_config"], timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "strategy: smp" in result.stdout


def test_strategy_help_shows_every_config_field_with_its_docstring():
    result = _run(["fit", "--trainer.strategy.help", "lightning_mp.SMPStrategy"], timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    text = " ".join(result.stdout.split())  # the help is wrapped to the terminal's width
    assert "--trainer.strategy.pipeline_parallel_degree PIPELINE_PARALLEL_DEGREE Number of pipeline stages" in text
    assert "--trainer.strategy.start_method {popen,spawn,fork} How the processes start" in text
    assert "remote_handles" not in text, "an engine switch, not a knob"


def test_gpt_pp2_short_fit(tmp_path):
    result = _run(
        [
            "fit",
            "--config", "configs/gpt_pp2.yaml",
            "--trainer.max_steps", "4",
            "--trainer.val_check_interval", "4",
            "--trainer.limit_val_batches", "2",
            "--trainer.log_every_n_steps", "1",
            "--trainer.default_root_dir", str(tmp_path),
            "--data.init_args.max_bytes", "400000",
        ]
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert not warnings_of_ours(output), "\n".join(warnings_of_ours(output))
    assert "lightning_mp partition summary" in output and "Epoch 0" in output, "partition table and progress bar"
    metrics_files = list(tmp_path.rglob("metrics.csv"))
    assert len(metrics_files) == 1
    rows = list(csv.DictReader(metrics_files[0].open()))
    train = [float(r["train_loss"]) for r in rows if r.get("train_loss")]
    val = [float(r["val_loss"]) for r in rows if r.get("val_loss")]
    assert len(train) == 4 and len(val) == 1
    assert all(0.0 < loss < 6.0 for loss in train + val)
    assert len(list(tmp_path.rglob("partition.png"))) == 1, "the config's PartitionSummary drew the chart"
    run = tmp_path / "version_0"  # the config's folder holds its runs (no doubled lightning_logs/)
    assert metrics_files[0] == run / "metrics.csv"
    assert (run / "checkpoints" / "last" / "meta.pt").is_file(), "the config saves last, as the README says"
    assert f"named without '.ckpt': {run / 'checkpoints'}/last and" in output, "the message names where it lands"
    assert not list(tmp_path.rglob("*.ckpt")), "DCP folders are not named like checkpoint files"


def test_gpt_pp2_timeline_config_writes_the_trace_and_prints_the_bubble(tmp_path):
    result = _run(["fit", "--config", "configs/gpt_pp2_timeline.yaml", "--trainer.default_root_dir", str(tmp_path)])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert not warnings_of_ours(output), "\n".join(warnings_of_ours(output))
    assert "lightning_mp pipeline timeline, training step 3" in output and "mean bubble" in output
    assert len(list(tmp_path.rglob("pipeline_timeline_step3.png"))) == 1
    (trace_file,) = tmp_path.rglob("pipeline_timeline_step3.json")
    assert f"PipelineTimeline wrote {trace_file}" in output, "it says where its files are"
    assert {e["pid"] for e in json.loads(trace_file.read_text())["traceEvents"]} == {0, 1}


def test_fit_then_validate_in_the_same_processes():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "tests/scripts/fit_then_validate.py"], cwd=ROOT, capture_output=True, text=True,
        timeout=300, env=env,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    # the two processes share stdout, so their lines may interleave with Lightning's tables
    losses = dict(re.findall(r"RANK (\d) VAL_LOSS (\d+\.\d{6})", result.stdout))
    assert sorted(losses) == ["0", "1"] and losses["0"] == losses["1"], "both stages report the same loss"


CLEAN_RUNS = [path for path in CONFIGS if path.stem not in RUN_ELSEWHERE]


def test_configs_run_elsewhere_exist():
    """A renamed config does not drop out of the clean runs unnoticed."""
    assert set(RUN_ELSEWHERE) <= {path.stem for path in CONFIGS}


@pytest.mark.parametrize("config", CLEAN_RUNS, ids=[path.stem for path in CLEAN_RUNS])
def test_a_clean_run_of_a_shipped_config_prints_no_warning_of_ours(tmp_path, config):
    bounds = BOUNDS.get(config.stem, ["--trainer.max_steps", "2"])
    result = _run(
        [
            "fit", "--config", str(config), *bounds,
            "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1",
            "--trainer.default_root_dir", str(tmp_path), "--data.init_args.max_bytes", "200000",
        ],
        timeout=600,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    ours = warnings_of_ours(output)
    assert not ours, "warnings of ours:\n" + "\n".join(ours)
