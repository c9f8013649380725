"""How worker processes end: process groups torn down while Python is whole.

[Note: exit-time abort] Rarely (about one spawned worker in 30 to 60 under the full test suite on 2 CPU cores,
never when run alone), a worker that had finished its fit aborted at interpreter exit with "terminate called
without an active exception", after Lightning's and our ``atexit`` handlers had destroyed every process group.
The same message is PyTorch's known symptom of c10d/gloo objects that die during interpreter finalisation
(pytorch/pytorch#190489, the abandoned fix pytorch/pytorch#179291). Two measures, both cheap:

1. At exit, every ``SMPStrategy`` stops its transports' threads (``Transport.close``); after
   ``destroy_process_group()``, it drops its engine, transports and device
   mesh, and a garbage collection runs, so no process group outlives the ``atexit`` phase through our objects.
2. Workers started by our spawn/fork launcher leave with ``os._exit`` once their work returned without error
   (results already sent, streams flushed, groups destroyed), as ``multiprocessing``'s fork workers always do.
   A worker that raised exits as before. ``atexit`` handlers registered by user code do not run in those
   workers; the popen launcher (the default, and the ``lightning-mp`` CLI) is unchanged.

[Note: exit without the interpreter's last collections] After the ``atexit`` handlers, CPython's finalisation runs
several full garbage collections over every object still alive. The imported libraries alone (``import
lightning_mp`` loads over 3,000 modules, transformers among them; 415,000 tracked objects) make that take seconds
in each rank (measured on the busy 2-core machine: 7.4 s from the last line of a script that only imports them to
the end of its process; 0.6 s with ``gc.freeze()`` first). Our ``atexit`` hook, after its own collection, freezes
what is left (``gc.freeze``), so those collections skip it, as an ``atexit``-time ``os._exit`` would. What it gives
up: an object in a reference cycle still alive then is not finalised (its ``__del__`` does not run), as in a process
that leaves with ``os._exit``; everything else is finalised as before.
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

from lightning_mp.strategy._roll_call import stop_answering

__all__ = ["SpawnLauncher", "release_at_exit"]

_STRATEGIES: weakref.WeakSet = weakref.WeakSet()
_HOOK_REGISTERED = False


def release_at_exit(strategy: Any) -> None:
    """Destroy every process group and drop ``strategy``'s references to them at exit (see the Note above).

    ``strategy`` must have the methods ``_close_transports()`` and ``_release_process_groups()``.
    """
    global _HOOK_REGISTERED
    _STRATEGIES.add(strategy)
    if not _HOOK_REGISTERED:
        _HOOK_REGISTERED = True
        atexit.register(_destroy_and_collect)


def _destroy_and_collect() -> None:
    stop_answering()  # before the store can go: see [Note: roll call after a failed collective] in _roll_call.py
    for strategy in list(_STRATEGIES):  # their transports' threads end while the groups they use still exist
        strategy._close_transports()
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass
    for strategy in list(_STRATEGIES):
        strategy._release_process_groups()
    gc.collect()
    gc.freeze()  # see [Note: exit without the interpreter's last collections]


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
