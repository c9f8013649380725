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
from torch import nn

__all__ = [
    "MicrobatchRNG",
    "draws_no_random_numbers",
    "get_rng_states",
    "global_generators",
    "same_rng_states",
    "set_rng_states",
]

# [Note: calls that draw no random numbers] A keyed call costs a save, a seed and a restore of the generators'
# states (about 25 us on a loaded 2-core CPU: at pp=1 the ten keyed calls of a 4-block MLP step were ~5% of the
# step, the gap between `smp` and `ddp`). A call that never draws needs no stream of its own: the caller's stream
# is where it was when the call returns, with or without keying, so every draw of the step comes from the same
# stream either way and the layout invariance holds. Which calls never draw is decided from the module's class,
# the same on every rank and layout: a module is draw-free when it and every module under it are exactly one of
# the torch.nn classes below (no subclass: it may override ``forward``), none has an instance-level ``forward`` or
# a forward hook, and no global module forward hook is registered. Dropout, RReLU and modules with a dropout
# argument (attention, transformer layers, RNNs) are not in the list; neither is any user-defined class. The
# decision is taken once, when the engine installs the model at setup: a module swapped in later (a Dropout put into
# a plain Sequential) or a forward hook registered after setup draws from its caller's stream, which may then differ
# between pipeline degrees.
_DRAW_FREE_CLASSES = frozenset(
    getattr(nn, name)
    for name in (
        # containers: their forward only calls their children
        "Sequential", "ModuleList", "ModuleDict", "Identity", "Flatten", "Unflatten",
        # linear maps, convolutions, embeddings
        "Linear", "Bilinear", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d",
        "Embedding", "EmbeddingBag",
        # normalisation (batch statistics are buffers, not random numbers)
        "LayerNorm", "GroupNorm", "RMSNorm", "LocalResponseNorm", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d",
        "SyncBatchNorm", "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d",
        # activations (RReLU draws its slopes in training: not here)
        "ReLU", "ReLU6", "LeakyReLU", "PReLU", "ELU", "SELU", "CELU", "GELU", "SiLU", "Mish", "Sigmoid", "Tanh",
        "Softplus", "Softsign", "Softshrink", "Hardshrink", "Tanhshrink", "Hardtanh", "Hardswish", "Hardsigmoid",
        "LogSigmoid", "GLU", "Threshold", "Softmax", "Softmax2d", "LogSoftmax", "Softmin",
        # pooling, padding, resampling
        "MaxPool1d", "MaxPool2d", "MaxPool3d", "AvgPool1d", "AvgPool2d", "AvgPool3d", "AdaptiveAvgPool1d",
        "AdaptiveAvgPool2d", "AdaptiveAvgPool3d", "AdaptiveMaxPool1d", "AdaptiveMaxPool2d", "AdaptiveMaxPool3d",
        "LPPool1d", "LPPool2d", "ZeroPad1d", "ZeroPad2d", "ZeroPad3d", "ConstantPad1d", "ConstantPad2d",
        "ConstantPad3d", "ReflectionPad1d", "ReflectionPad2d", "ReplicationPad1d", "ReplicationPad2d",
        "Upsample", "PixelShuffle", "PixelUnshuffle",
    )
    if hasattr(nn, name)
)


def draws_no_random_numbers(module: nn.Module) -> bool:
    """Whether no call of ``module`` can draw a random number (see [Note: calls that draw no random numbers]).

    Conservative: ``False`` for any class outside a fixed list of deterministic ``torch.nn`` classes, for an
    instance whose ``forward`` was replaced, and for modules with forward hooks (a hook may draw).
    """
    from torch.nn.modules import module as module_globals  # noqa: PLC0415

    hooks = [*module_globals._global_forward_pre_hooks.values(), *module_globals._global_forward_hooks.values()]
    if any(not getattr(hook, "draws_no_random_numbers", False) for hook in hooks):  # ours say so (remote handles')
        return False
    return all(
        type(m) in _DRAW_FREE_CLASSES and "forward" not in vars(m) and not m._forward_pre_hooks and not m._forward_hooks
        for m in module.modules()
    )


def global_generators() -> list[torch.Generator]:
    """The CPU generator, and the current CUDA device's if CUDA is in use."""
    generators = [torch.default_generator]
    # CUDA initialised implies available; ``is_available()`` alone asks the driver (or, CPU-only, three Python
    # calls) on every task switch and keyed call
    if torch.cuda.is_initialized():
        generators.append(torch.cuda.default_generators[torch.cuda.current_device()])
    return generators


def get_rng_states() -> list[torch.Tensor]:
    return [g.get_state() for g in global_generators()]


def same_rng_states(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def set_rng_states(states: list[torch.Tensor]) -> None:
    for generator, state in zip(global_generators(), states):
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
        self._outside = get_rng_states()
        self._step = step
        self._counts = {}
        self._forward_calls = {}
        self._generation += 1

    def end_step(self) -> None:
        """Give the global generators back the state they had before the step."""
        if self._outside is not None:
            set_rng_states(self._outside)
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
                match = next((i for i, (states, _) in enumerate(calls) if same_rng_states(states, caller)), None)
                if match is not None:
                    count = calls.pop(match)[1]
        seed = self._seed_for(microbatch, name, count)
        for generator in global_generators():
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
        caller = get_rng_states()
        stack.append(caller)
        self._seed_stream(microbatch, name, recompute, caller)

    def exit(self) -> None:
        """The keyed call returned: the caller's stream continues where it was."""
        stack = self._stack()
        if stack:
            set_rng_states(stack.pop())

    def _stack(self) -> list[list[torch.Tensor]]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    # ---- task switches (the compute token) -------------------------------------------------------------------

    def suspend(self, task: Hashable) -> None:
        """The thread running ``task`` gives the compute token up: remember where its stream is."""
        if self.active:
            self._saved()[task] = get_rng_states()

    def resume(self, task: Hashable, microbatch: int, name: str) -> None:
        """The thread running ``task`` holds the token again: continue its stream, or start it as ``name``."""
        if not self.active:
            return
        states = self._saved().pop(task, None)
        if states is not None:
            set_rng_states(states)
        else:
            self._seed_stream(microbatch, name)

    def _saved(self) -> dict[Hashable, list[torch.Tensor]]:
        """This thread's suspended task states of the current step."""
        generation, saved = getattr(self._local, "saved", (None, None))
        if generation != self._generation:
            saved = {}
            self._local.saved = (self._generation, saved)
        return saved
