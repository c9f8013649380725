"""Random ops on sharded activations draw what one process would draw for the full tensor.

[Note: random numbers under tensor parallelism] The ranks of a tp group run the same module calls, so each call
draws from the same keyed stream on every rank (``pipeline/_rng.py``): on replicated activations (dropout on the
residual stream) every rank draws one process's mask, as it must. On a *sharded* activation (the attention weights
``(B, nh / tp, T, S)`` between the column- and row-parallel projections) the same stream gives every rank the mask
of the first ``nh / tp`` heads: the shards' masks are copies of each other, and the stream then sits elsewhere than
one process's (which drew ``nh`` heads), so every later draw of the call differs too.

Here, inside a *tensor-parallel region* (the call of a module with a column-parallel child that does not gather
its output: an attention, an MLP), a random op whose tensor is sharded draws the **full** tensor from the same
stream, and keeps this rank's slice. So a model with dropout trains as on one process (the same masks, and the
same stream afterwards), at any tp degree. Megatron takes the other way: its ``CudaRNGStatesTracker``
(``megatron/core/tensor_parallel/random.py``) gives each tp rank an independent "model-parallel" stream inside
its regions, which draws only the local shard (``1 / tp`` of the numbers) but cannot equal one process; it is
the option ``tp_random_streams="per_rank"`` here (each rank's stream seeded from one number of the call's stream
and the tp rank), for layers where the full-size draw costs too much (``benchmarks/tp_dropout.py``).

The dispatch mode that does this is on only while a region *can draw*: the region module is in training and
one of its dropout rates (and its descendants') is above 0: ``p`` of an ``nn.Dropout``-like module, or a float
attribute whose name holds "drop" (``attention_dropout``, ``dropout``, ``attn_pdrop``, ``drop_path_rate``). A
region without one (eval, dropout 0) runs without the mode, at no cost; a random op in it whose rate has another
name draws from the shared stream (every rank the same numbers for its shard).

Which tensors are sharded is decided from where the op sits in the region's call and the layout the region's
children give (the same rule on every rank). When a tensor is not certainly sharded, it is treated as
replicated (the shared stream: every rank draws the same mask, so replicated activations stay equal):

* before the region's first column-parallel child has run in this call: replicated (e.g. an embedding dropout
  in a model whose root holds a column-parallel head);
* a 4-D tensor whose dim 1 is one of the region's local head counts (the region module's ``head_dim`` or
  ``head_size`` attribute dividing a column child's local width per part): the attention weights
  ``(B, heads, T, S)``, sharded on dim 1, the full tensor has ``tp`` times the heads. Without a head size (an
  MLP on channels-last ``(B, H, W, C)`` activations) the rule below applies to every tensor;
* a tensor whose last dim is the local output width of one of the region's column-parallel children (a hidden
  activation between column and row): sharded on its last dim. If that width is also the region's replicated
  width (a column child's ``in_features``: GPT-2's ``c_fc`` at tp=4, its fused ``c_attn`` at tp=3), which
  one it is cannot be told from the shape: it is drawn from the shared stream; after a row-parallel child ran
  (and no column-parallel one since: GPT-2's ``resid_dropout`` after ``c_proj``) silently, as it is the row's
  replicated output, otherwise with a warning once on global rank 0 naming the region and the op;
* any other tensor is replicated.

Random ops whose result depends only on the tensor's shape (``bernoulli_`` with a float ``p``, ``uniform_``,
``normal_``, ``rand_like``, ``native_dropout``, ...) are drawn in full. One that depends on the values of a
sharded tensor (``bernoulli`` of a probability tensor, ``multinomial``), or draws inside a fused kernel (CUDA's
flash attention with dropout; CPU's fused kernels take no dropout), raises, naming the op and the module (a seeded
op that drew nothing, such as a fused attention without dropout, is left alone).
Not covered: random ops that take a shape rather than a tensor (``torch.rand(x.shape)``, ``randn``,
``randint``, ``randperm``: every rank draws the same numbers, as without this module), sequence-parallel
activations (``optimize="memory"``) outside the attention weights, and random ops outside regions on sharded tensors (a column-parallel layer called from a module of its own).
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.modules.dropout import _DropoutNd
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.hooks import RemovableHandle

from lightning_mp.pipeline import global_generators, get_rng_states, same_rng_states, set_rng_states
from lightning_mp.tp._sharding import TPGroup, shard_spec

__all__ = [
    "RandomStreams",
    "ShardedRandomRegion",
    "install_sharded_random",
    "register_parallel_linear",
    "remove_sharded_random",
]

RandomStreams = Literal["one_process", "per_rank"]
_LINEAR_TYPES: tuple[type[nn.Module], ...] = ()  # filled by lightning_mp.nn (nn builds on tp, not tp on nn)


def register_parallel_linear(cls: type[nn.Module]) -> None:
    """Let :func:`install_sharded_random` find regions around instances of ``cls``.

    ``cls`` is a tensor-parallel linear layer with the attributes of
    :class:`~lightning_mp.nn.DistributedLinear`: ``parallel`` (``"column"`` or ``"row"``), ``gather_output``,
    ``in_features``, ``transposed`` and a ``weight`` carrying its :class:`~lightning_mp.tp.ShardSpec`.
    """
    global _LINEAR_TYPES
    if cls not in _LINEAR_TYPES:
        _LINEAR_TYPES = (*_LINEAR_TYPES, cls)

_aten = torch.ops.aten
# Random ops whose numbers depend only on the shape (and dtype) of their first argument.
_SHAPE_ONLY = {
    _aten.bernoulli_.float, _aten.uniform_.default, _aten.normal_.default, _aten.exponential_.default,
    _aten.geometric_.default, _aten.cauchy_.default, _aten.log_normal_.default, _aten.random_.default,
    _aten.random_.to, getattr(_aten.random_, "from"), _aten.bernoulli.p, _aten.rand_like.default,
    _aten.randn_like.default, _aten.randint_like.default, _aten.randint_like.low_dtype,
}


@dataclass(frozen=True)
class ShardedRandomRegion:
    """The layout of one tensor-parallel region's activations (see [Note: random numbers under tensor parallelism]).

    Attributes:
        name: the region module's FQN (for errors and warnings).
        tp: the tensor-parallel group.
        local_widths: local output widths of the region's column-parallel children (sharded last dims).
        replicated_widths: input widths of those children (the region's replicated activations).
        fused_widths: local output widths of fused children (``parts > 1``, e.g. q/k/v: ``[q_r, k_r, v_r]`` is no
            slice of one tensor, so a random op on it raises).
        local_heads: the region's local head counts (dim 1 of its 4-D attention weights); empty when unknown.
        per_rank: draw sharded tensors from a stream of this tp rank's own (``streams="per_rank"``).
    """

    name: str
    tp: TPGroup
    local_widths: frozenset[int]
    replicated_widths: frozenset[int]
    fused_widths: frozenset[int] = frozenset()
    local_heads: frozenset[int] = frozenset()
    per_rank: bool = False

    def sharded_dim(self, shape: torch.Size, op: str, *, warn: bool = True) -> int | None:
        """The dim along which a tensor of local ``shape`` (made after a column-parallel child ran) is split over
        the tp group, or ``None`` (replicated, or not certainly sharded: then warns once on global rank 0 if
        ``warn``; the region's call passes ``warn=False`` after a row-parallel child ran, whose output is
        replicated).

        Raises:
            ValueError: if the last dim is only a fused column-parallel output width.
        """
        if len(shape) == 4 and shape[1] in self.local_heads:
            return 1
        last = shape[-1] if shape else None
        if last in self.replicated_widths:
            if warn and last in self.local_widths | self.fused_widths:
                _warn_once(
                    (self.name, op),
                    f"{op} in tensor-parallel region {self.name!r} on a tensor of shape {tuple(shape)}: its last dim"
                    f" {last} is both a sharded width (a column-parallel output) and the replicated width, so it is"
                    " drawn as replicated (the same mask on every tp rank); if it is sharded, its mask is not one"
                    " process's. Draw it outside the region or give the column-parallel layer another width.",
                )
            return None
        if last in self.fused_widths - self.local_widths:
            raise ValueError(
                f"{op} in tensor-parallel region {self.name!r} on a tensor of shape {tuple(shape)}: its last dim is a"
                " fused column-parallel output (blocks such as q/k/v, each split), which is no slice of the tensor"
                " one process draws for. Draw it after splitting the blocks, or outside the region."
            )
        if last in self.local_widths:
            return len(shape) - 1
        return None


_WARNED: set[tuple[str, str]] = set()


def _warn_once(key: tuple[str, str], message: str) -> None:
    if key in _WARNED:
        return
    _WARNED.add(key)
    if not dist.is_initialized() or dist.get_rank() == 0:
        warnings.warn(message, stacklevel=2)


@dataclass
class _RegionCall:
    """One call of a region: whether a column-parallel child has run, and whether a row-parallel one ran since."""

    region: ShardedRandomRegion
    can_draw: bool = True
    column_ran: bool = False
    row_ran_since: bool = False

    def sharded_dim(self, tensor: Tensor, op: str) -> int | None:
        if not self.column_ran:
            return None
        return self.region.sharded_dim(tensor.shape, op, warn=not self.row_ran_since)


_LOCAL = threading.local()


def _regions() -> list[_RegionCall]:
    stack = getattr(_LOCAL, "regions", None)
    if stack is None:
        stack = _LOCAL.regions = []
    return stack


class _ShardedDrawMode(TorchDispatchMode):
    """Random ops on sharded tensors (the innermost region's layout) drawn in full and sliced, or per rank."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded not in func.tags or not args or not isinstance(args[0], Tensor):
            return func(*args, **kwargs)
        call = _regions()[-1]
        region = call.region
        dim = call.sharded_dim(args[0], str(func))
        if dim is None:
            return func(*args, **kwargs)
        if region.per_rank:
            return _draw_per_rank(func, args, kwargs, region)
        return _draw_full(func, args, kwargs, dim, region)


def _draw_full(func, args: tuple, kwargs: dict, dim: int, region: ShardedRandomRegion):
    """Run ``func`` on the full tensor that ``args[0]`` is this rank's slice of, and keep the slice."""
    local = args[0]
    full_shape = list(local.shape)
    full_shape[dim] *= region.tp.size
    start = region.tp.rank * local.size(dim)

    def keep(full: Tensor) -> Tensor:
        return full.narrow(dim, start, local.size(dim))

    full = torch.empty(full_shape, dtype=local.dtype, device=local.device)
    if func is _aten.native_dropout.default:  # (input, p, train): mask * scale drawn in full, times the input
        scaled, mask = func(torch.ones_like(full), *args[1:], **kwargs)
        return local * keep(scaled), keep(mask).contiguous()
    p = args[1] if func is _aten.bernoulli_.Tensor else None
    if func in _SHAPE_ONLY or (p is not None and p.numel() == 1):
        out = func(full, *args[1:], **kwargs)
        if func._schema.name.endswith("_"):  # in place: fill the local tensor
            return local.copy_(keep(full))
        return keep(out).contiguous()
    before = get_rng_states()  # e.g. a fused attention kernel: seeded, but draws only with dropout_p > 0
    out = func(*args, **kwargs)
    if same_rng_states(before, get_rng_states()):
        return out
    raise ValueError(
        f"{func} in tensor-parallel region {region.name!r} drew random numbers inside a kernel or from the values of"
        f" a sharded tensor of shape {tuple(local.shape)}, so this rank cannot draw its slice of one process's draw."
        " Use an attention implementation that draws its dropout with a separate op (transformers'"
        " attn_implementation='eager', or SDPA's math backend), or move the op onto replicated activations."
    )


def _draw_per_rank(func, args: tuple, kwargs: dict, region: ShardedRandomRegion):
    """Run ``func`` on the local tensor from a stream of this tp rank's own (Megatron's tracker behaviour).

    The stream is seeded from one number of the call's shared stream and the tp rank, so it is reproducible and
    layout-independent at one tp degree; the shared stream then continues alike on every rank.
    """
    (number,) = torch.randint(1 << 62, (1,)).tolist()
    seed = (number * 1_000_003 + region.tp.rank) & ((1 << 63) - 1)
    shared = get_rng_states()
    for generator in global_generators():
        generator.manual_seed(seed)
    try:
        return func(*args, **kwargs)
    finally:
        set_rng_states(shared)


def _push(region: ShardedRandomRegion, can_draw: bool = True) -> _RegionCall:
    """Enter a region on this thread; returns the call's record. The draw mode is on while a region that
    ``can_draw`` is (a call that cannot draw pays no dispatch, yet keeps its layout for a random op inside)."""
    stack = _regions()
    call = _RegionCall(region, can_draw=can_draw)
    if can_draw and not any(c.can_draw for c in stack):
        _LOCAL.mode = _ShardedDrawMode()
        _LOCAL.mode.__enter__()
    stack.append(call)
    return call


def _pop() -> None:
    stack = _regions()
    call = stack.pop()
    if call.can_draw and not any(c.can_draw for c in stack):
        _LOCAL.mode.__exit__(None, None, None)
        _LOCAL.mode = None


@dataclass
class _Installed:
    region: ShardedRandomRegion
    handles: tuple[RemovableHandle, ...]
    draw_rates: tuple[tuple[nn.Module, str], ...]  # (module, attribute) pairs that say how much it drops

    def can_draw(self, module: nn.Module) -> bool:
        """``module`` in training and one of its dropout rates above 0 (see :func:`_draw_rates`)."""
        return module.training and any(m.training and getattr(m, a) > 0 for m, a in self.draw_rates)


def _draw_rates(module: nn.Module) -> tuple[tuple[nn.Module, str], ...]:
    """The dropout rates in ``module`` and below: ``p`` of each ``nn.Dropout``-like module, and every float
    attribute whose name holds "drop" (``attention_dropout``, ``dropout``, ``attn_pdrop``, ``drop_path_rate``)."""
    rates = []
    for m in module.modules():
        if isinstance(m, _DropoutNd):
            rates.append((m, "p"))
        rates.extend((m, name) for name, v in vars(m).items() if "drop" in name.lower() and type(v) is float)
    return tuple(rates)


def _pre_hook(module: nn.Module, args: tuple) -> None:
    installed = module._lmp_sharded_random
    _push(installed.region, installed.can_draw(module))


def _post_hook(module: nn.Module, args: tuple, output) -> None:
    _pop()


def _column_ran(module: nn.Module, args: tuple, output) -> None:
    stack = _regions()
    if stack:
        stack[-1].column_ran, stack[-1].row_ran_since = True, False


def _row_ran(module: nn.Module, args: tuple, output) -> None:
    stack = _regions()
    if stack:
        stack[-1].row_ran_since = True


def install_sharded_random(root: nn.Module, tp: TPGroup, streams: RandomStreams = "one_process") -> list[str]:
    """Make random ops on sharded activations draw as ``streams`` says (see the Note); returns the regions' FQNs.

    A region is a module with a direct child that is a column-parallel ``DistributedLinear`` without
    ``gather_output``; its calls draw this way while it can draw (see the Note). Does nothing at ``tp.size == 1``. Installing again on a module changes its ``streams``.

    Args:
        root: the model after its tensor-parallel swap.
        tp: this rank's tensor-parallel group.
        streams: ``"one_process"``: draw the full tensor and keep this rank's slice (equal to tp=1).
            ``"per_rank"``: draw the local shard from a stream of this tp rank's own (Megatron's
            ``CudaRNGStatesTracker``): ``1 / tp`` of the numbers, independent masks, not equal to tp=1.

    Raises:
        ValueError: for another ``streams``.
    """
    if streams not in ("one_process", "per_rank"):
        raise ValueError(f"`streams` must be 'one_process' or 'per_rank', got {streams!r}.")
    if tp.size == 1:
        return []
    names = []
    for fqn, module in root.named_modules():
        columns = [
            c for c in module.children()
            if isinstance(c, _LINEAR_TYPES) and c.parallel == "column" and not c.gather_output
        ]
        if not columns:
            continue
        region = _region_of(fqn, module, columns, tp, per_rank=streams == "per_rank")
        installed = getattr(module, "_lmp_sharded_random", None)
        if installed is not None:
            installed.region = region
        else:
            rows = [c for c in module.children() if isinstance(c, _LINEAR_TYPES) and c.parallel == "row"]
            handles = (
                module.register_forward_pre_hook(_pre_hook),
                module.register_forward_hook(_post_hook, always_call=True),  # also when the call raises
                *(c.register_forward_hook(_column_ran) for c in columns),
                *(c.register_forward_hook(_row_ran) for c in rows),
            )
            module._lmp_sharded_random = _Installed(region, handles, _draw_rates(module))
        names.append(fqn)
    return names


def remove_sharded_random(root: nn.Module) -> list[str]:
    """Undo :func:`install_sharded_random`: random ops in ``root``'s regions draw from the shared stream again
    (every tp rank the same numbers for its own shard). Returns the FQNs of the regions removed."""
    names = []
    for fqn, module in root.named_modules():
        installed = getattr(module, "_lmp_sharded_random", None)
        if installed is not None:
            for handle in installed.handles:
                handle.remove()
            del module._lmp_sharded_random
            names.append(fqn)
    return names


def _region_of(fqn: str, module: nn.Module, columns: list, tp: TPGroup, *, per_rank: bool) -> ShardedRandomRegion:
    """The layout of ``module``'s activations from its column-parallel children (and its head size, if any)."""
    head_size = getattr(module, "head_dim", None) or getattr(module, "head_size", None)
    part_widths = [_local_width(c) // _parts(c) for c in columns]
    heads = [w // head_size for w in part_widths if isinstance(head_size, int) and w % head_size == 0]
    return ShardedRandomRegion(
        name=fqn,
        tp=tp,
        local_widths=frozenset(_local_width(c) for c in columns if _parts(c) == 1),
        replicated_widths=frozenset(c.in_features for c in columns),
        fused_widths=frozenset(_local_width(c) for c in columns if _parts(c) > 1),
        local_heads=frozenset(heads),
        per_rank=per_rank,
    )


def _local_width(linear: nn.Module) -> int:
    return linear.weight.size(1 if linear.transposed else 0)


def _parts(linear: nn.Module) -> int:
    spec = shard_spec(linear.weight)
    return 1 if spec is None else spec.parts
