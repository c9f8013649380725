"""Module-server pipeline engine, schedules and microbatch split/merge. Torch only, no Lightning.

Modules: ``_engine`` (the engine across steps, and one step's session composed of its roles), ``_core`` (what
every role of a session shares: failure, sending, round trips, compute token and grant order), ``_driver``
(stage 0 runs the microbatches), ``_server`` (receive loops, request workers, chains), ``_outputs`` (the owner's
store of remote outputs), ``_caller`` (remote calls, references and fetches), ``_messages`` (message kinds,
bodies, envelope, task), ``_install`` (placement, stubs and per-call hooks), ``_scheduler`` (compute token, grant
order, 1F1B priorities), ``_handles`` (remote values), ``_grads`` / ``_state`` / ``_rng`` (ordered gradients,
buffer updates, random streams), ``_timeline``, ``_microbatch``.
"""

from lightning_mp.pipeline._engine import PipelineEngine, PipelineError, PipelineSession
from lightning_mp.pipeline._handles import RemoteValue, materialize, owner_computes_loss
from lightning_mp.pipeline._messages import current_task, transport_messages
from lightning_mp.pipeline._microbatch import (
    MicrobatchSplit,
    MicrobatchSplitError,
    merge_microbatches,
    split_batch,
    split_microbatches,
)
from lightning_mp.pipeline._rng import global_generators, get_rng_states, same_rng_states, set_rng_states
from lightning_mp.pipeline._timeline import TimelineEvent

__all__ = [
    "MicrobatchSplit",
    "MicrobatchSplitError",
    "PipelineEngine",
    "PipelineError",
    "PipelineSession",
    "RemoteValue",
    "TimelineEvent",
    "current_task",
    "get_rng_states",
    "global_generators",
    "materialize",
    "merge_microbatches",
    "owner_computes_loss",
    "same_rng_states",
    "set_rng_states",
    "split_batch",
    "split_microbatches",
    "transport_messages",
]
