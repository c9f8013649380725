"""``fit`` (optional), then ``validate``, ``test`` and ``predict`` with one pp=2 Trainer and the default (popen)
launcher, for ``tests/trainer/test_eval_loops.py``. Usage: ``eval_loops.py MODEL OUT_DIR FIT INFERENCE_MODE`` (0 or 1)."""

import sys

from tests.trainer.test_eval_loops import run_loops

if __name__ == "__main__":
    name, out_dir, fit, inference_mode = sys.argv[1:]
    run_loops(name, out_dir, 2, fit == "1", inference_mode == "1")
