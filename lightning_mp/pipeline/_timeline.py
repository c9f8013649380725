"""Per-rank record of what the pipeline engine did and when: compute spans and message transfers.

The engine owns one :class:`TimelineRecorder` (``engine.timeline``). It is off by default and costs one
attribute check per event then. Switched on (``start()``), it keeps every event until ``stop()``:

- ``"forward"`` / ``"backward"``: a task held this rank's compute token (it computed) for one microbatch.
  ``name`` is the module FQN a served request ran, or ``"step"`` for the driver's own microbatch code
  (the user's ``training_step`` and the local modules it calls).
- ``"weight"``: a deferred weight pass of ``pipeline="zero_bubble"`` computed (``name`` as its backward's; [Note:
  zero-bubble] in ``_zero_bubble.py``); under that schedule ``"backward"`` spans are the input passes only.
- ``"send"``: a message left this rank (``name`` = ``"to stage <k>"``); the span is the time the backend took.
- ``"recv"``: a message arrived (``name`` = ``"from stage <k>"``); the span runs from its first frame's arrival
  to the rebuilt object (the wait *for* the message is not part of it).

Times are ``time.perf_counter()`` seconds of this process. Aligning ranks is the reader's job (e.g. subtract
each rank's ``perf_counter()`` taken right after a barrier): :class:`lightning_mp.callbacks.PipelineTimeline`
does that.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

__all__ = ["TimelineEvent", "TimelineRecorder"]


@dataclass(frozen=True)
class TimelineEvent:
    """One span on one rank.

    Attributes:
        category: ``"forward"``, ``"backward"``, ``"weight"``, ``"send"`` or ``"recv"``.
        name: module FQN (or ``"step"``) for compute; ``"to stage k"`` / ``"from stage k"`` for messages.
        microbatch: the microbatch index the work belongs to (0 for messages that belong to none).
        start_s: start, ``time.perf_counter()`` seconds.
        end_s: end, ``time.perf_counter()`` seconds.
        thread: name of the thread that did it.
    """

    category: str
    name: str
    microbatch: int
    start_s: float
    end_s: float
    thread: str

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


class TimelineRecorder:
    """Collects :class:`TimelineEvent` from every engine thread of one rank while switched on."""

    def __init__(self) -> None:
        self.enabled = False
        self._events: list[TimelineEvent] = []
        self._lock = threading.Lock()

    def start(self) -> None:
        """Drop what was recorded and record from now on."""
        with self._lock:
            self._events = []
            self.enabled = True

    def stop(self) -> list[TimelineEvent]:
        """Stop recording; return the events recorded since :meth:`start`, ordered by start time."""
        with self._lock:
            self.enabled = False
            events, self._events = self._events, []
        return sorted(events, key=lambda e: (e.start_s, e.end_s))

    def record(self, category: str, name: str, microbatch: int, start_s: float, end_s: float | None = None) -> None:
        """Add one span (``end_s`` defaults to now). Does nothing while off."""
        if not self.enabled:
            return
        end_s = time.perf_counter() if end_s is None else end_s
        event = TimelineEvent(category, name, microbatch, start_s, end_s, threading.current_thread().name)
        with self._lock:
            if self.enabled:
                self._events.append(event)
