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

Which tensors are sharded is decided from the layout the region's children give (the same rule on every rank):

* a 4-D tensor is ``(B, heads, T, S)`` (every torch and transformers attention, SDPA's math path included):
  sharded on dim 1, the full tensor has ``tp`` times the heads;
* a tensor whose last dim is the local output width of one of the region's column-parallel children (a
  hidden activation between column and row): sharded on its last dim. If that width is also the region's
  replicated width (a column child's ``in_features``), the layout is ambiguous and the op raises;
* any other tensor is replicated (e.g. GPT-2's ``resid_dropout`` after the row-parallel ``c_proj``).

Random ops whose result depends only on the tensor's shape (``bernoulli_`` with a float ``p``, ``uniform_``,
``normal_``, ``rand_like``, ``native_dropout``, ...) are drawn in full. One that depends on the values of a
sharded tensor (``bernoulli`` of a probability tensor, ``multinomial``), or draws inside a fused kernel (CUDA's
flash attention with dropout; CPU's fused kernels take no dropout), raises, naming the op and the module (a seeded
op that drew nothing, such as a fused attention without dropout, is left alone).
Not covered: sequence-parallel activations (``optimize="memory"``) outside the attention weights, and random
ops outside regions on sharded tensors (a column-parallel layer called from a module of its own).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.hooks import RemovableHandle

from lightning_mp.pipeline._rng import _generators, _get_states, _same_states, _set_states
from lightning_mp.tp._sharding import TPGroup, shard_spec

__all__ = ["RandomStreams", "ShardedRandomRegion", "install_sharded_random", "remove_sharded_random"]

RandomStreams = Literal["one_process", "per_rank"]

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
        name: the region module's FQN (for errors).
        tp: the tensor-parallel group.
        local_widths: local output widths of the region's column-parallel children (sharded last dims).
        replicated_widths: input widths of those children (the region's replicated activations).
        fused_widths: local output widths of fused children (``parts > 1``, e.g. q/k/v: ``[q_r, k_r, v_r]`` is no
            slice of one tensor, so a random op on it raises).
        per_rank: draw sharded tensors from a stream of this tp rank's own (``streams="per_rank"``).
    """

    name: str
    tp: TPGroup
    local_widths: frozenset[int]
    replicated_widths: frozenset[int]
    fused_widths: frozenset[int] = frozenset()
    per_rank: bool = False

    def sharded_dim(self, shape: torch.Size, op: str) -> int | None:
        """The dim along which a tensor of local ``shape`` is split over the tp group, or ``None`` (replicated).

        Raises:
            ValueError: if the last dim is both a sharded and a replicated width of this region.
        """
        if len(shape) == 4:
            return 1
        if shape and shape[-1] in self.fused_widths - self.local_widths:
            raise ValueError(
                f"{op} in tensor-parallel region {self.name!r} on a tensor of shape {tuple(shape)}: its last dim is a"
                " fused column-parallel output (blocks such as q/k/v, each split), which is no slice of the tensor"
                " one process draws for. Draw it after splitting the blocks, or outside the region."
            )
        if shape and shape[-1] in self.local_widths:
            if shape[-1] in self.replicated_widths:
                raise ValueError(
                    f"{op} in tensor-parallel region {self.name!r} on a tensor of shape {tuple(shape)}: its last dim"
                    f" {shape[-1]} is both a sharded width (a column-parallel output) and the replicated width, so"
                    " which numbers one process would draw is ambiguous. Draw it outside the region (after the"
                    " row-parallel layer) or give the column-parallel layer another width."
                )
            return len(shape) - 1
        return None


_LOCAL = threading.local()


def _regions() -> list[ShardedRandomRegion]:
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
        region = _regions()[-1]
        dim = region.sharded_dim(args[0].shape, str(func))
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
    before = _get_states()  # e.g. a fused attention kernel: seeded, but draws only with dropout_p > 0
    out = func(*args, **kwargs)
    if _same_states(before, _get_states()):
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
    shared = _get_states()
    for generator in _generators():
        generator.manual_seed(seed)
    try:
        return func(*args, **kwargs)
    finally:
        _set_states(shared)


def _push(region: ShardedRandomRegion) -> None:
    """Enter a region on this thread (the draw mode is on while any region is)."""
    stack = _regions()
    if not stack:
        _LOCAL.mode = _ShardedDrawMode()
        _LOCAL.mode.__enter__()
    stack.append(region)


def _pop() -> None:
    stack = _regions()
    stack.pop()
    if not stack:
        _LOCAL.mode.__exit__(None, None, None)
        _LOCAL.mode = None


@dataclass
class _Installed:
    region: ShardedRandomRegion
    handles: tuple[RemovableHandle, RemovableHandle]


def _pre_hook(module: nn.Module, args: tuple) -> None:
    _push(module._lmp_sharded_random.region)


def _post_hook(module: nn.Module, args: tuple, output) -> None:
    _pop()


def install_sharded_random(root: nn.Module, tp: TPGroup, streams: RandomStreams = "one_process") -> list[str]:
    """Make random ops on sharded activations draw as ``streams`` says (see the Note); returns the regions' FQNs.

    A region is a module with a direct child that is a column-parallel ``DistributedLinear`` without
    ``gather_output``. Does nothing at ``tp.size == 1``. Installing again on a module changes its ``streams``.

    Args:
        root: the model after its tensor-parallel swap.
        tp: this rank's tensor-parallel group.
        streams: ``"one_process"``: draw the full tensor and keep this rank's slice (equal to tp=1).
            ``"per_rank"``: draw the local shard from a stream of this tp rank's own (Megatron's
            ``CudaRNGStatesTracker``): ``1 / tp`` of the numbers, independent masks, not equal to tp=1.

    Raises:
        ValueError: for another ``streams``.
    """
    from lightning_mp.nn._linear import DistributedLinear  # noqa: PLC0415 (nn imports tp)

    if streams not in ("one_process", "per_rank"):
        raise ValueError(f"`streams` must be 'one_process' or 'per_rank', got {streams!r}.")
    if tp.size == 1:
        return []
    names = []
    for fqn, module in root.named_modules():
        columns = [
            c for c in module.children()
            if isinstance(c, DistributedLinear) and c.parallel == "column" and not c.gather_output
        ]
        if not columns:
            continue
        region = ShardedRandomRegion(
            name=fqn,
            tp=tp,
            local_widths=frozenset(_local_width(c) for c in columns if _parts(c) == 1),
            replicated_widths=frozenset(c.in_features for c in columns),
            fused_widths=frozenset(_local_width(c) for c in columns if _parts(c) > 1),
            per_rank=streams == "per_rank",
        )
        installed = getattr(module, "_lmp_sharded_random", None)
        if installed is not None:
            installed.region = region
        else:
            pre = module.register_forward_pre_hook(_pre_hook)
            post = module.register_forward_hook(_post_hook, always_call=True)  # also when the call raises
            module._lmp_sharded_random = _Installed(region, (pre, post))
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


def _local_width(linear: nn.Module) -> int:
    return linear.weight.size(1 if linear.transposed else 0)


def _parts(linear: nn.Module) -> int:
    spec = shard_spec(linear.weight)
    return 1 if spec is None else spec.parts
