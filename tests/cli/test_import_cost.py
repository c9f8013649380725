"""``transformers`` is not a core dependency: ``lightning_mp`` imports (and registers ``"smp"``) without it, and
none of its modules tries to import it before a Hugging Face model, plan or consolidation is used.

With ``transformers`` installed, ``import lightning.pytorch`` loads it anyway (torchmetrics 1.9's
``functional/text/bert.py`` imports it at module level), so the subprocess below hides it: its distribution
metadata (what torchmetrics checks) and its modules (an import finder that refuses them and records who asked).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

_HIDE_TRANSFORMERS_AND_IMPORT = textwrap.dedent(
    """
    import importlib.metadata, sys, traceback

    def hidden(name):
        return name == "transformers" or name.startswith("transformers.")

    _version = importlib.metadata.version
    def version(name):
        if name.lower() == "transformers":
            raise importlib.metadata.PackageNotFoundError(name)
        return _version(name)
    importlib.metadata.version = version

    asked = []
    class Refuse:
        def find_spec(self, name, path=None, target=None):
            if hidden(name):
                frames = [f for f in traceback.extract_stack()[:-1] if "importlib" not in f.filename]
                asked.append(f"{frames[-1].filename}:{frames[-1].lineno}")
                raise ModuleNotFoundError(f"No module named {name!r} (hidden by the test)", name=name)
            return None
    sys.meta_path.insert(0, Refuse())

    import lightning_mp, lightning_mp.cli, lightning_mp.nn, lightning_mp.strategy
    from lightning.pytorch.strategies import StrategyRegistry
    assert "smp" in StrategyRegistry, "the strategy is registered"
    ours = [where for where in asked if "lightning_mp" in where]
    assert not ours, f"lightning_mp asked for transformers at import: {ours}"
    assert not any(hidden(name) for name in sys.modules), "a transformers module was loaded"
    print("ok", len(asked))
    """
)


def test_import_lightning_mp_needs_no_transformers():
    result = subprocess.run(
        [sys.executable, "-c", _HIDE_TRANSFORMERS_AND_IMPORT], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("ok"), result.stdout
