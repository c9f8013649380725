"""Operations recorded on a remote handle instead of fetching its value ([Note: the loss where the logits are]).

A handle's path (``_handles.py``) is a sequence of keys from its call's output: an index into a container, or one of
the operations recorded here (:class:`_Op`), which the owner applies to its own value (``follow``) when the
handle is fetched or passed back to it, so only their result travels (a loss's scalar instead of the logits).
"""

from __future__ import annotations

import operator
import types
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree

if TYPE_CHECKING:
    from lightning_mp.pipeline._handles import RemoteValue

__all__ = ["follow", "owner_path", "walk_containers"]

_REMOTE_TYPES: set[type] = set()  # RemoteValue and the owner's reference to its own output (``_handles.py``)


def _is_remote(value: Any) -> bool:
    return type(value) in _REMOTE_TYPES  # ``type()``, not ``__class__``: that would fetch


# [Note: walking arguments without pytree's per-leaf calls] Every recorded op and every fetch walks its arguments:
# which leaves are handles, copies of the labels, ``_SELF`` in place of the handle, the owner form, the owner's
# resolution. ``torch.utils._pytree.tree_map`` costs about 10 Python calls per leaf and node (flatten, node type,
# named-tuple test, unflatten), which made recording a loss (``F.mse_loss(handle, y)`` then ``loss / M``) about a
# third of the driver's Python calls per step (cProfile, the 2-stage benchmark at M=8). ``tree_map`` and
# ``tree_leaves`` below walk exactly the plain ``tuple``, ``list`` and ``dict`` themselves and hand any other node
# that pytree walks (named tuples, ``OrderedDict``, ``deque``, registered classes such as Hugging Face's
# ``ModelOutput``) to pytree, with handles as leaves (``is_leaf=_is_remote``): the same leaves, in the same order
# (pytree's: a dict's insertion order), the same rebuilt containers, and ``fn`` called once per leaf in that order.
_PLAIN_LEAVES = set((
    int, float, bool, complex, str, bytes, type(None), type(Ellipsis), slice, torch.Tensor, torch.nn.Parameter,
    torch.dtype, torch.device, types.FunctionType, types.BuiltinFunctionType,
))  # never pytree nodes (``torch.Size`` is one: pytree walks it); this module's own classes join below


def _pytree_node(value: Any) -> bool:
    """Whether pytree walks into ``value`` (asked of values that are no exact tuple, list, dict or plain leaf)."""
    return not pytree.tree_is_leaf(value, is_leaf=_is_remote)


def tree_map(fn: Any, tree: Any) -> Any:
    """``pytree.tree_map(fn, tree, is_leaf=_is_remote)``, with plain containers walked here (see [Note: walking
    arguments without pytree's per-leaf calls])."""
    kind = type(tree)
    if kind is tuple:
        return tuple([tree_map(fn, v) for v in tree])
    if kind is list:
        return [tree_map(fn, v) for v in tree]
    if kind is dict:
        return {k: tree_map(fn, v) for k, v in tree.items()}
    if kind in _PLAIN_LEAVES or kind in _REMOTE_TYPES or not _pytree_node(tree):
        return fn(tree)
    return pytree.tree_map(fn, tree, is_leaf=_is_remote)


def tree_leaves(tree: Any, leaves: list | None = None) -> list:
    """``pytree.tree_leaves(tree, is_leaf=_is_remote)``, with plain containers walked here (see [Note: walking
    arguments without pytree's per-leaf calls])."""
    if leaves is None:
        leaves = []
    kind = type(tree)
    if kind is tuple or kind is list:
        for v in tree:
            tree_leaves(v, leaves)
    elif kind is dict:
        for v in tree.values():
            tree_leaves(v, leaves)
    elif kind in _PLAIN_LEAVES or kind in _REMOTE_TYPES or not _pytree_node(tree):
        leaves.append(tree)
    else:
        leaves.extend(pytree.tree_leaves(tree, is_leaf=_is_remote))
    return leaves


# [Note: the loss where the logits are] A causal LM's loss is a few ops on the head's output: ``logits.reshape(-1,
# logits.size(-1))`` then ``F.cross_entropy(..., labels)`` (Hugging Face: ``.float()``, ``.view(-1, V)``,
# ``labels.to(logits.device)``, ``F.cross_entropy``). Fetching the logits for them sends ``B x T x V`` values to the
# caller and their gradient back, every microbatch. So a handle *records* such ops instead of fetching:
#
# - shape ops (``reshape``, ``view``, ``flatten``, ``float``, ``contiguous``, ``transpose``, ``permute``,
#   ``squeeze``, ``unsqueeze``, indexing with slices) and the functions of ``_OWNER_FUNCTIONS`` (``F``'s losses,
#   ``log_softmax``; also through ``nn.CrossEntropyLoss`` and the other ``_Loss`` modules, which the fetch pre-hook
#   leaves alone) return a new handle whose path ends in the op (``_Op``), sending nothing. Recorded only when the
#   op's other tensor arguments are local, need no gradient and hold at most ``_SMALL_ARGUMENTS_NBYTES`` (labels,
#   class weights), any other handle among them is a part of the same output, no part of the output has been
#   fetched yet, and no autocast or inference mode is on (the owner would not see them); otherwise the handle
#   fetches, as before. The functions are deterministic and draw no random numbers, so where they run does not
#   change a bit of their result.
# - metadata (``size()``, ``shape``, ``dim()``, ``numel()``, ``dtype``, ``device``, ``ndim``) comes back as a real
#   value at once through a fetch of just that value (one small round trip; the owner's output stays there).
# - fetching a handle whose path ends in a function op (the loss) asks the owner to apply the whole path and sends
#   back only the result (a scalar), connected to autograd like any fetch: its backward sends one scalar gradient
#   to the owner, which runs backward through the loss, the head and the chain of calls before it. A handle whose
#   path ends in a shape op, fetched itself, fetches the output and applies its ops here (so it is a view of the
#   fetched output, as in eager code). A recorded op passed to a call on the owner goes as a reference: the owner
#   applies it to its own output (``lm_head(hidden[:, -k:, :])`` sends no hidden states).
#
# - a loss scaled by a Python number (``loss / microbatches``, ``loss * grad_scale``: ``_SCALINGS``) is recorded too,
#   on a handle whose path ends in a function op: the same operator then runs on the owner, so the result is the same
#   bits, and the driver can fetch the scaled loss and run its backward on the owner in one exchange ([Note: the
#   loss's fetch and backward in one exchange] in ``_caller.py``).
#
# The owner applies a recorded op when its result is fetched or referenced, not when the caller recorded it: the
# same result unless a call made in between changed the output in place on the owner (a module doing ``x.relu_()``
# on its input after the loss was taken from it, in one microbatch): then the loss sees the change.

_SMALL_ARGUMENTS_NBYTES = 1 << 20  # local tensors an op may carry to the owner (labels); larger ones: fetch instead
_VIEW_METHODS = frozenset((
    "reshape", "view", "flatten", "float", "contiguous", "transpose", "permute", "squeeze", "unsqueeze",
))
_META_METHODS = frozenset(("size", "dim", "numel"))
_META_ATTRIBUTES = frozenset(("shape", "dtype", "device", "ndim"))
_OWNER_FUNCTIONS = frozenset((
    F.cross_entropy, F.nll_loss, F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss, F.binary_cross_entropy,
    F.binary_cross_entropy_with_logits, F.kl_div, F.log_softmax,
))

_SCALINGS = {"__mul__": operator.mul, "__rmul__": operator.mul, "__truediv__": operator.truediv}


class _SelfValue:
    """In a recorded function's arguments: the value the op is applied to."""

    def __reduce__(self) -> str:
        return "_SELF"


_SELF = _SelfValue()


class _PathArg:
    """In an op's arguments (owner form): another part of the same output, named by its path from the output."""

    def __init__(self, path: tuple) -> None:
        self.path = path


class _Op:
    """One operation recorded on a handle, a key of its path (see [Note: the loss where the logits are]).

    ``kind``: ``"view"`` (a shape method), ``"getitem"``, ``"meta"`` / ``"meta_attr"`` / ``"is_tensor"`` (metadata), or
    ``"function"`` (``target`` called with ``_SELF`` standing for the value). Caller form: other handles among
    the arguments are ``RemoteValue``s; owner form (``owner``): ``_PathArg``s.
    """

    __slots__ = ("kind", "target", "args", "kwargs", "grad_enabled")

    def __init__(self, kind: str, target: Any, args: tuple, kwargs: dict, grad_enabled: bool) -> None:
        self.kind, self.target, self.args, self.kwargs, self.grad_enabled = kind, target, args, kwargs, grad_enabled

    def __reduce__(self) -> Any:
        return (_Op, (self.kind, self.target, self.args, self.kwargs, self.grad_enabled))

    def owner(self) -> _Op:
        def convert(v: Any) -> Any:
            return _PathArg(owner_path(v._rv_path)) if _is_remote(v) else v

        args, kwargs = tree_map(convert, (self.args, self.kwargs))
        return _Op(self.kind, self.target, args, kwargs, self.grad_enabled)

    def apply(self, value: Any, root: Any) -> Any:
        """The op on ``value``; ``root``: the owner's whole output (owner form), ``None`` here (caller form)."""

        def resolve_arg(v: Any) -> Any:
            if type(v) is _PathArg:
                return follow(root, v.path)
            if type(v) is _SelfValue:
                return value
            return v._rv_materialize() if _is_remote(v) else v

        args, kwargs = tree_map(resolve_arg, (self.args, self.kwargs))  # _PathArg, _SelfValue: leaves
        with torch.set_grad_enabled(self.grad_enabled):
            if self.kind == "function":
                return self.target(*args, **kwargs)
            if self.kind == "getitem":
                return value[args[0]]
            if self.kind == "is_tensor":
                return isinstance(value, torch.Tensor)
            if self.kind in ("meta", "meta_attr") and not hasattr(value, self.target):  # e.g. a tuple's ``shape``
                return _NoAttribute(type(value).__name__)
            attribute = getattr(value, self.target)
            return attribute if self.kind == "meta_attr" else attribute(*args, **kwargs)


class _NoAttribute:
    """A metadata op's result when the value has no such attribute (``shape`` of a tuple): the caller raises
    ``AttributeError`` for it (``_fetch_metadata``), as the value would, so ``hasattr(handle, "shape")`` is False."""

    __slots__ = ("type_name",)

    def __init__(self, type_name: str) -> None:
        self.type_name = type_name

    def __reduce__(self) -> Any:
        return (_NoAttribute, (self.type_name,))


_PLAIN_LEAVES.update((_SelfValue, _PathArg, _Op, _NoAttribute))


def _fetch_metadata(handle: RemoteValue, op: _Op) -> Any:
    """The value of the metadata ``op`` on ``handle``'s value (one small round trip; the value stays on its owner).

    Raises:
        AttributeError: the value has no attribute ``op.target`` (as the value itself would raise).
    """
    value = handle._rv_record(op)._rv_materialize()
    if type(value) is _NoAttribute:
        raise AttributeError(f"{value.type_name!r} object has no attribute {op.target!r}")
    return value


def owner_path(path: tuple) -> tuple:
    """``path`` as sent to the owner: recorded ops in owner form."""
    return tuple(key.owner() if type(key) is _Op else key for key in path)


def _autocast_on() -> bool:
    return any(torch.is_autocast_enabled(device) for device in ("cpu", "cuda"))


class _RecordedMethod:
    """``handle.reshape`` and the like: calling it records the op (or fetches, where it may not be recorded)."""

    def __init__(self, handle: RemoteValue, name: str) -> None:
        self.handle, self.name = handle, name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        handle = self.handle
        if not handle._rv_may_record((args, kwargs)):
            return getattr(handle._rv_materialize(), self.name)(*args, **kwargs)
        if self.name in _META_METHODS:
            return _fetch_metadata(handle, _Op("meta", self.name, args, kwargs, torch.is_grad_enabled()))
        return handle._rv_record(_Op("view", self.name, args, kwargs, torch.is_grad_enabled()))

    def __getattr__(self, name: str) -> Any:
        return getattr(getattr(self.handle._rv_materialize(), self.name), name)


def _step(value: Any, key: Any) -> Any:
    """Caller side: one key of a handle's path applied to a value held here (an index, or a recorded op)."""
    return key.apply(value, None) if type(key) is _Op else value[key]


def follow(root: Any, path: tuple) -> Any:
    """Owner side: ``root`` (an output of this stage) with every key of ``path`` (owner form) applied."""
    value = root
    for key in path:
        value = key.apply(value, root) if type(key) is _Op else value[key]
    return value


def walk_containers(value: Any, path: tuple) -> tuple[int, Any]:
    """Owner side of a fetch of ``value[path[0]][path[1]]...`` (owner form): apply recorded ops, index only into
    tuples, lists and dicts (incl. Hugging Face's ``ModelOutput``); return ``(how many keys were used, the value
    reached)``. The caller indexes the rest itself, so a part of a tensor or of any other object is a view of, or a
    reference into, the whole, as in eager code (``c = y[0]`` is a view of ``y``)."""
    root = value
    for depth, key in enumerate(path):
        if type(key) is _Op:
            value = key.apply(value, root)
            continue
        if not isinstance(value, (tuple, list, dict)):
            return depth, value
        value = value[key]
    return len(path), value


def _plain_index(key: Any) -> bool:
    """Whether ``key`` indexes by position only (ints, slices of ints, ``None``, ``...``, tuples of those)."""
    if type(key) is tuple:
        return all(_plain_index(k) for k in key)
    if type(key) is slice:
        return all(type(b) in (int, type(None)) for b in (key.start, key.stop, key.step))
    return key is None or key is Ellipsis or type(key) is int
