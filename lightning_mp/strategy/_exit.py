"""How worker processes end: process groups torn down while Python is whole.

[Note: exit-time abort] Rarely (about one spawned worker in 30 to 60 under the full test suite on 2 CPU cores,
never when run alone), a worker that had finished its fit aborted at interpreter exit with "terminate called
without an active exception", after Lightning's and our ``atexit`` handlers had destroyed every process group.
The same message is PyTorch's known symptom of c10d/gloo objects that die during interpreter finalisation
(pytorch/pytorch#190489, the abandoned fix pytorch/pytorch#179291). Two measures, both cheap:

1. At exit, after ``destroy_process_group()``, every ``SMPStrategy`` drops its engine, transports and device
   mesh, and a garbage collection runs, so no process group outlives the ``atexit`` phase through our objects.
2. Workers started by our spawn/fork launcher leave with ``os._exit`` once their work returned without error
   (results already sent, streams flushed, groups destroyed), as ``multiprocessing``'s fork workers always do.
   A worker that raised exits as before. ``atexit`` handlers registered by user code do not run in those
   workers; the popen launcher (the default, and the ``lightning-mp`` CLI) is unchanged.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import sys
import weakref
from typing import Any

import torch.distributed as dist
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from typing_extensions import override

__all__ = ["SpawnLauncher", "release_at_exit"]

_STRATEGIES: weakref.WeakSet = weakref.WeakSet()
_HOOK_REGISTERED = False


def release_at_exit(strategy: Any) -> None:
    """Destroy every process group and drop ``strategy``'s references to them at exit (see the Note above).

    ``strategy`` must have a ``_release_process_groups()`` method.
    """
    global _HOOK_REGISTERED
    _STRATEGIES.add(strategy)
    if not _HOOK_REGISTERED:
        _HOOK_REGISTERED = True
        atexit.register(_destroy_and_collect)


def _destroy_and_collect() -> None:
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass
    for strategy in list(_STRATEGIES):
        strategy._release_process_groups()
    gc.collect()


class SpawnLauncher(_MultiProcessingLauncher):
    """Lightning's spawn/fork launcher, whose workers exit with ``os._exit(0)`` after a successful run."""

    @override
    def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
        super()._wrapping_function(*args, **kwargs)  # an error propagates: the worker fails as usual
        _destroy_and_collect()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
