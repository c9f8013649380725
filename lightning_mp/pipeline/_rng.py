"""Random streams per microbatch and module call, so that a layout never changes which random numbers a model draws.

[Note: microbatch RNG streams] Microbatches run concurrently (driver threads, served requests) while torch has one
global generator per device, so without care a dropout mask depends on thread timing: three same-seed runs of a
pipelined GPT-2 with dropout gave three loss curves. Each rank computes one task at a time (the compute token), so
the global generator can be made to behave as one generator per task: a task's generator state is saved when it
gives the token up and restored when it takes it again (:meth:`MicrobatchRNG.suspend` / :meth:`resume`).

Which stream a draw comes from must not depend on where the work runs either, or pp=2 would draw other masks than
pp=1. The unit that can move between stages is a call of a module with parameters, so every such call (and every
call of a direct child of an ``nn.Sequential``, which a Sequential run may send elsewhere) draws from its own
stream, seeded from ``(seed, step, microbatch, module FQN, n)`` for the n-th call of that module by that
microbatch (a recompute in backward, by activation checkpointing, draws what the forward call it repeats drew:
it finds that call by its caller's random state, which the checkpoint restored, as backward recomputes the calls
of a module that runs twice per microbatch in reverse order); on return, the caller's stream continues where it
was (:meth:`enter` / :meth:`exit`). The code of a
step outside such calls draws from the stream ``(seed, step, microbatch, "step")``. The keys are the same on every
layout, so the same seed and microbatch count give the same random numbers at any pipeline degree, and on every
run. They are not those of one process on the full batch (which draws the whole batch's mask at once); a
different microbatch count draws different masks. Outside steps the global generator is left as the step found
it, so code between steps (callbacks, data loading) draws what it would have drawn.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Hashable

import torch

__all__ = ["MicrobatchRNG"]


def _generators() -> list[torch.Generator]:
    """The CPU generator, and the current CUDA device's if CUDA is in use."""
    generators = [torch.default_generator]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        generators.append(torch.cuda.default_generators[torch.cuda.current_device()])
    return generators


def _get_states() -> list[torch.Tensor]:
    return [g.get_state() for g in _generators()]


def _same_states(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _set_states(states: list[torch.Tensor]) -> None:
    for generator, state in zip(_generators(), states):
        generator.set_state(state)


class MicrobatchRNG:
    """One random stream per (step, microbatch, module call) on top of torch's global generators.

    See [Note: microbatch RNG streams]. Thread-safe; one instance per engine.

    Args:
        seed: the run's base seed (Lightning's ``PL_GLOBAL_SEED`` or ``torch.initial_seed()``).
    """

    def __init__(self, seed: int) -> None:
        self.seed = int(seed)
        self._step: Hashable | None = None
        self._outside: list[torch.Tensor] | None = None
        self._counts: dict[tuple, int] = {}
        self._forward_calls: dict[tuple, list[tuple[list[torch.Tensor], int]]] = {}  # (microbatch, name) -> (caller's state, n)
        self._generation = 0  # one per step: a thread's saved states of an earlier step are never restored
        self._lock = threading.Lock()
        self._local = threading.local()

    @property
    def active(self) -> bool:
        return self._step is not None

    def start_step(self, step: Hashable) -> None:
        """Begin a step named ``step`` (the same name on every rank and every layout); saves the outside state."""
        self._outside = _get_states()
        self._step = step
        self._counts = {}
        self._forward_calls = {}
        self._generation += 1

    def end_step(self) -> None:
        """Give the global generators back the state they had before the step."""
        if self._outside is not None:
            _set_states(self._outside)
        self._step, self._outside = None, None

    def _seed_for(self, microbatch: int, name: str, count: int) -> int:
        text = repr((self.seed, self._step, microbatch, name, count)).encode()
        return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") & ((1 << 63) - 1)

    def _seed_stream(
        self, microbatch: int, name: str, recompute: bool = False, caller: list[torch.Tensor] | None = None
    ) -> None:
        key = (microbatch, name, recompute)
        # A recompute restores the random state its forward had, so the caller's state names the forward call it
        # repeats: backward recomputes the calls of a module that runs twice per microbatch in reverse order. The
        # forward keeps the caller's state itself (already a copy); only a recompute compares states.
        with self._lock:
            count = self._counts[key] = self._counts.get(key, 0) + 1
            if caller is not None and not recompute:
                self._forward_calls.setdefault((microbatch, name), []).append((caller, count))
            elif caller is not None:
                calls = self._forward_calls.get((microbatch, name), [])
                match = next((i for i, (states, _) in enumerate(calls) if _same_states(states, caller)), None)
                if match is not None:
                    count = calls.pop(match)[1]
        seed = self._seed_for(microbatch, name, count)
        for generator in _generators():
            generator.manual_seed(seed)

    # ---- module calls ----------------------------------------------------------------------------------------

    def enter(self, microbatch: int, name: str, recompute: bool = False) -> None:
        """A keyed module call starts: keep the caller's stream, switch to the call's own.

        ``recompute``: the call runs again in backward (activation checkpointing) and draws what the forward call
        it repeats drew, so the recomputed dropout masks are the forward's. That call is the forward call of this
        module and microbatch whose caller had the random state the recompute's caller has (the checkpoint
        restored it), the earliest such one first; without one (a recompute without preserved random state), the
        n-th recomputed call draws what the n-th forward call drew.
        """
        stack = self._stack()
        caller = _get_states()
        stack.append(caller)
        self._seed_stream(microbatch, name, recompute, caller)

    def exit(self) -> None:
        """The keyed call returned: the caller's stream continues where it was."""
        stack = self._stack()
        if stack:
            _set_states(stack.pop())

    def _stack(self) -> list[list[torch.Tensor]]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    # ---- task switches (the compute token) -------------------------------------------------------------------

    def suspend(self, task: Hashable) -> None:
        """The thread running ``task`` gives the compute token up: remember where its stream is."""
        if self.active:
            self._saved()[task] = _get_states()

    def resume(self, task: Hashable, microbatch: int, name: str) -> None:
        """The thread running ``task`` holds the token again: continue its stream, or start it as ``name``."""
        if not self.active:
            return
        states = self._saved().pop(task, None)
        if states is not None:
            _set_states(states)
        else:
            self._seed_stream(microbatch, name)

    def _saved(self) -> dict[Hashable, list[torch.Tensor]]:
        """This thread's suspended task states of the current step."""
        generation, saved = getattr(self._local, "saved", (None, None))
        if generation != self._generation:
            saved = {}
            self._local.saved = (self._generation, saved)
        return saved
