"""Outputs of remote calls that stay on the stage that made them ([Note: remote handles]).

[Note: remote handles] A call into a module on another stage sends its request and returns at once with a
:class:`RemoteValue`: a proxy for the output, which stays on the stage that computed it. Passing the proxy to a
later call on the *same* stage sends a reference (``_Ref``) instead of the data, and the owner resolves it to the
very object its earlier call returned, so a Python loop over remote blocks (``for block in self.h: x = block(x)``)
costs one one-way message per block, and the blocks' autograd graph stays on the owner in one piece. The value
crosses to the caller only when local code touches it:

- passing it to a local module (a global forward pre-hook fetches the handles among the arguments) or to
  ``autograd.Function.apply`` (wrapped to fetch them: autograd connects a Function only to tensor inputs), any torch
  function or tensor method on it (``__torch_function__``), arithmetic, comparisons, ``bool()``, ``.item()``,
  ``len()``, iteration, ``repr()``, ``isinstance()``, in-place ops, and sending it to a third stage (the caller
  fetches it and sends the data) all *fetch* it: one round trip, then the proxy holds the received value and
  behaves as it from then on. ``isinstance(proxy, torch.Tensor)`` stays ``False`` (a proxy claiming to be a
  tensor crashed torch's C++ argument unpacking, e.g. in ``autograd.Function.apply``);
- ``proxy[int | str]`` is another proxy for that part of the value (``outputs[0]``, ``outputs["logits"]``), and
  needs nothing from the owner.

A fetched value is an ordinary received tensor (structure) whose differentiable tensors are connected to the
caller's autograd graph by one remote node ([Note: remote autograd] in ``comm/_autograd.py``): its inputs are every
tensor the caller sent, as data, into the chain of calls that made the value, and its backward sends the output
gradients to the owner, which runs backward through the whole chain and returns the gradients of those inputs.
So a loop of ``k`` remote blocks ending in a fetch costs ``k`` one-way requests and one round trip forward, and
one round trip backward.

Once any part of an output has been fetched (``out[0]``), the whole output goes back as data, never as a
reference (the part may have been changed here in place), and a part fetched first is the same object in the whole
fetched later. The owner runs one microbatch's requests from one caller in the order they were sent ([Note: one
microbatch's requests run in arrival order] in ``_server.py``), so random streams, BatchNorm updates and in-place
changes follow the program, as on one process. It keeps the value until the microbatch that made it has finished
on the driver and its requests have run (or the step ends); a handle of a finished microbatch or of another step
fails at once when passed or touched. Python that inspects a value still works; it just pays for the fetch where
it inspects.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import sys
import threading
from collections.abc import Iterator
from typing import Any

import torch

from lightning_mp.pipeline._messages import send_held_calls
from lightning_mp.pipeline._recorded import (
    _META_ATTRIBUTES,
    _META_METHODS,
    _OWNER_FUNCTIONS,
    _REMOTE_TYPES,
    _SCALINGS,
    _SELF,
    _SMALL_ARGUMENTS_NBYTES,
    _VIEW_METHODS,
    _autocast_on,
    _fetch_metadata,
    _is_remote,
    _Op,
    _plain_index,
    _RecordedMethod,
    _step,
    owner_path,
    tree_leaves,
    tree_map,
)

__all__ = ["RemoteValue", "materialize", "owner_computes_loss", "recording_loss_scalings"]

_packing = threading.local()  # set while a request is packed for one stage: which handles may go as references
_loss_scalings = threading.local()  # ``on`` while the driver's loss function runs (``recording_loss_scalings``)


@contextlib.contextmanager
def recording_loss_scalings() -> Iterator[None]:
    """While active (the driver's ``loss_fn``), a loss recorded on a handle and scaled by a Python number
    (``loss / microbatches``, ``loss * grad_scale``) is scaled on its owner, so the driver can fetch it with its
    backward in one exchange ([Note: the loss's fetch and backward in one exchange] in ``_caller.py``). Elsewhere,
    in the user's step, such arithmetic fetches the loss, as any other: eager results, in-place changes after it
    included, and a ``torch.Tensor`` to inspect."""
    previous = getattr(_loss_scalings, "on", False)
    _loss_scalings.on = True
    try:
        yield
    finally:
        _loss_scalings.on = previous


class _PackingFor:
    """While active, ``RemoteValue``s owned by ``stage`` and not yet fetched pickle as references (``refs``)."""

    def __init__(self, session: Any, stage: int | None) -> None:
        self.session, self.stage = session, stage
        self.refs: list[RemoteValue] = []

    def __enter__(self) -> _PackingFor:
        self.previous = getattr(_packing, "current", None)
        _packing.current = self
        return self

    def __exit__(self, *exc: Any) -> None:
        _packing.current = self.previous


_unpacked = threading.local()  # references met while unpickling a message on this thread


def _make_ref(call_id: tuple[int, int], path: tuple, microbatch: int) -> _Ref:
    ref = _Ref(call_id, path, microbatch)
    refs = getattr(_unpacked, "refs", None)
    if refs is not None:
        refs.append(ref)
    return ref


def _identity(value: Any) -> Any:
    return value


def _replace(value: Any, key: Any, part: Any) -> Any:
    """``value`` with ``value[key]`` being ``part`` (the same object): a new tuple (or named tuple), else in place."""
    if isinstance(value, dict) and isinstance(key, int) and key not in value:  # ModelOutput: ``out[0]`` is a field
        key = list(value.keys())[key]
    if value[key] is part:
        return value
    if isinstance(value, tuple):
        items = list(value)
        items[key] = part
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    value[key] = part
    return value


class RemoteValue:
    """The output (or part of it: ``path``) of remote call ``call_id``, still on ``stage``.

    Behaves as the value itself wherever local code touches it, fetching it once at that moment (see [Note: remote
    handles]). ``isinstance`` fetches it and answers for the value's class, except that it is never a
    ``torch.Tensor``: torch's C++ checks would take a proxy that claimed to be one for a real tensor. So that code
    which needs a real tensor gets one, every call of a local module fetches the handles among its positional
    arguments first (``materialize_module_inputs``).
    """

    def __init__(self, session: Any, stage: int, call_id: tuple[int, int], microbatch: int, path: tuple = (),
                 parent: RemoteValue | None = None, upstream: dict | None = None, label: str = "") -> None:
        # set through ``__dict__``: ``__setattr__`` is a Python call per attribute, and a handle is made per remote call
        child = parent is not None
        self.__dict__.update(
            _rv_session=session,
            _rv_stage=stage,
            _rv_call_id=call_id,
            _rv_microbatch=microbatch,
            _rv_path=path,
            _rv_parent=parent,
            _rv_upstream=upstream if upstream is not None else {},  # call_id -> caller tensors sent as data
            _rv_label=label,
            _rv_grad_enabled=parent._rv_grad_enabled if child else True,  # the call's grad mode
            # shared by every part of one call's output: set once any part is fetched (a fetched part may be changed
            # here in place, so from then on no part of the output goes as a reference: the owner's copy may be
            # stale)
            _rv_touched=parent._rv_touched if child else [False],
            _rv_fetched=False,
            _rv_value=None,
            _rv_children={},
            _rv_lock=parent._rv_lock if child else threading.RLock(),  # one per call's output
            # [Note: the loss where the logits are]: the op this handle's path ends in; whether its path holds one;
            # whether fetching it fetches the output and applies the path's shape ops here
            _rv_op=None,
            _rv_has_op=parent._rv_has_op if child else False,
            _rv_local=parent._rv_local if child else False,
            _rv_tensor_known=False,  # the call's module class says its output is a tensor (``Caller.call_async``)
        )

    # ---- fetching -------------------------------------------------------------------------------------------

    def _rv_materialize(self) -> Any:
        if self._rv_fetched:
            return self._rv_value
        with self._rv_lock:
            if not self._rv_fetched:
                if not self._rv_owner_computes():
                    # a part of a fetched value, or shape ops: index / apply them here (a view of a tensor)
                    value = _step(self._rv_parent._rv_materialize(), self._rv_path[-1])
                else:
                    if self._rv_op is None:  # an op's result is a new value: nothing here can change the owner's
                        self._rv_touched[0] = True
                    self._rv_take(*self._rv_session.fetch(self))
                    return self._rv_value
                self._rv_value, self._rv_fetched = value, True
        return self._rv_value

    def _rv_owner_computes(self) -> bool:
        """Does fetching this (unfetched) handle ask its owner, rather than index or apply ops to a value here?"""
        return not (self._rv_fetched_above() or self._rv_local or (self._rv_has_op and self._rv_touched[0]))

    def _rv_take(self, depth: int, value: Any) -> None:
        """Hold ``value``, what the owner sent for this handle's path up to key ``depth`` (lock held)."""
        if depth < len(self._rv_path):  # the owner sent the value this is a part of (not a container)
            owner_of = self
            while len(owner_of._rv_path) > depth:
                owner_of = owner_of._rv_parent
            owner_of._rv_value, owner_of._rv_fetched = owner_of._rv_adopt(value), True
            value = _step(self._rv_parent._rv_materialize(), self._rv_path[-1])
        else:
            value = self._rv_adopt(value)
        self._rv_value, self._rv_fetched = value, True

    def _rv_loss_chain(self) -> list[RemoteValue] | None:
        """The handles whose values one exchange fetches with the backward of this one ([Note: the loss's fetch and
        backward in one exchange] in ``_caller.py``): the loss (the last function op before a run of scalings by
        Python numbers, ``_SCALINGS``), then each scaling up to this handle; only those small values come back, never
        the ops the loss was taken from (``log_softmax``'s output). ``None`` where this handle is no loss its owner
        would compute."""
        if (type(self) is not RemoteValue or self._rv_fetched or self._rv_op is None or self._rv_op.kind != "function"
                or not self._rv_grad_enabled or not self._rv_owner_computes()):
            return None
        chain = [self]
        while (chain[-1]._rv_op.target in _SCALINGS.values() and (parent := chain[-1]._rv_parent)._rv_op is not None
               and parent._rv_op.kind == "function"):
            chain.append(parent)
        return chain[::-1]

    def _rv_is_tensor(self) -> bool:
        """Is the value a tensor? Known from the module's class, else asked of the owner (one small round trip; the value
        stays there), unless the value is here."""
        if type(self) is not RemoteValue or self._rv_fetched or self._rv_touched[0] or self._rv_fetched_above():
            return isinstance(self._rv_materialize(), torch.Tensor)
        if self._rv_tensor_known:
            return True
        return _fetch_metadata(self, _Op("is_tensor", None, (), {}, torch.is_grad_enabled()))

    def _rv_fetched_above(self) -> bool:
        node = self._rv_parent
        while node is not None:
            if node._rv_fetched:
                return True
            node = node._rv_parent
        return False

    def _rv_adopt(self, value: Any) -> Any:
        """``value`` with the parts that were fetched before it (``h[0]`` fetched, then ``h``) replaced by those
        objects, so an in-place change made to a part stays visible through the whole, as in eager code."""
        for key, child in list(self._rv_children.items()):
            if child._rv_fetched:
                value = _replace(value, key, child._rv_value)
            elif child._rv_children:
                part = child._rv_adopt(_step(value, key))
                child._rv_value, child._rv_fetched = part, True
                value = _replace(value, key, part)
        return value

    def __reduce_ex__(self, protocol: int) -> Any:
        packing = getattr(_packing, "current", None)
        if packing is not None and packing.stage == self._rv_stage and not self._rv_touched[0]:
            packing.session.check_reference(self)
            packing.refs.append(self)
            return (_make_ref, (self._rv_call_id, owner_path(self._rv_path), self._rv_microbatch))
        return (_identity, (self._rv_materialize(),))

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_rv_"):
            object.__setattr__(self, name, value)
        else:  # ``h.requires_grad = False``, ``h.grad = None``: on the value, as eager code would
            setattr(self._rv_materialize(), name, materialize(value))

    # ---- parts without fetching -----------------------------------------------------------------------------

    def __getitem__(self, key: Any) -> Any:
        if self._rv_fetched or type(key) not in (int, str):
            if not self._rv_fetched and _plain_index(key) and self._rv_may_record(()):
                return self._rv_record(_Op("getitem", None, (key,), {}, torch.is_grad_enabled()))
            return self._rv_materialize()[key]
        with self._rv_lock:
            child = self._rv_children.get(key)
            if child is None:
                child = self._rv_children[key] = type(self)(
                    self._rv_session, self._rv_stage, self._rv_call_id, self._rv_microbatch, self._rv_path + (key,),
                    self, self._rv_upstream, self._rv_label,
                )
        return child

    # ---- ops recorded for the owner ([Note: the loss where the logits are]) -----------------------------------

    def _rv_may_record(self, tree: Any) -> bool:
        """Whether an op on this handle with the arguments ``tree`` may be recorded instead of fetching."""
        if type(self) is not RemoteValue or self._rv_fetched or self._rv_touched[0] or self._rv_fetched_above():
            return False
        if torch.is_inference_mode_enabled() or _autocast_on():
            return False
        nbytes = 0
        for leaf in tree_leaves(tree):
            if _is_remote(leaf):
                if (type(leaf) is not RemoteValue or leaf._rv_session is not self._rv_session
                        or leaf._rv_call_id != self._rv_call_id or leaf._rv_fetched):
                    return False
            elif isinstance(leaf, torch.Tensor):
                if type(leaf) is not torch.Tensor or leaf.requires_grad:
                    return False
                nbytes += leaf.nbytes
        return nbytes <= _SMALL_ARGUMENTS_NBYTES

    def _rv_record(self, op: _Op) -> RemoteValue:
        """A handle for ``op`` applied to this one's value; nothing is sent. Local tensor arguments (labels, class
        weights: small, see ``_rv_may_record``) are copied now, so an in-place change after this line does not
        reach the loss the owner computes later (eager code reads them at this line)."""
        if op.kind == "function":
            args, kwargs = tree_map(lambda t: t.clone() if type(t) is torch.Tensor else t, (op.args, op.kwargs))
            op = _Op(op.kind, op.target, args, kwargs, op.grad_enabled)
        child = RemoteValue(self._rv_session, self._rv_stage, self._rv_call_id, self._rv_microbatch,
                            self._rv_path + (op,), self, self._rv_upstream, self._rv_label)
        child._rv_op, child._rv_has_op, child._rv_local = op, True, op.kind in ("view", "getitem")
        child._rv_tensor_known = self._rv_tensor_known and child._rv_local  # a tensor's view or slice is one
        return child

    # ---- everything else fetches ----------------------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_rv_"):  # not set yet (copy/unpickle of a bare instance)
            raise AttributeError(name)
        if type(self) is RemoteValue and not self._rv_fetched:
            if name in _VIEW_METHODS or name in _META_METHODS:
                return _RecordedMethod(self, name)
            if name in _META_ATTRIBUTES and self._rv_may_record(()):
                return _fetch_metadata(self, _Op("meta_attr", name, (), {}, torch.is_grad_enabled()))
        return getattr(self._rv_materialize(), name)

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        """The value's class, fetching it, so ``isinstance`` answers for a remote dict, tuple, dataclass, ...; but
        never a tensor class: torch's C++ argument checks honour ``__class__`` and would read the proxy as a tensor
        (that crashed ``autograd.Function.apply``), so for a tensor value this stays ``RemoteValue``."""
        cls = type(self._rv_materialize())
        return RemoteValue if issubclass(cls, torch.Tensor) else cls

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _OWNER_FUNCTIONS:  # [Note: the loss where the logits are]
            first = next((v for v in tree_leaves((args, kwargs)) if _is_remote(v)), None)
            if first is not None and first._rv_may_record((args, kwargs)):
                args, kwargs = tree_map(lambda v: _SELF if v is first else v, (args, kwargs))
                return first._rv_record(_Op("function", func, args, kwargs, torch.is_grad_enabled()))
        return func(*materialize(args), **materialize(kwargs))

    def __setitem__(self, key: Any, value: Any) -> None:
        self._rv_materialize()[key] = materialize(value)

    def __len__(self) -> int:
        return len(self._rv_materialize())

    def __iter__(self) -> Any:
        return iter(self._rv_materialize())

    def __contains__(self, item: Any) -> bool:
        return item in self._rv_materialize()

    def __bool__(self) -> bool:
        return bool(self._rv_materialize())

    def __repr__(self) -> str:
        return repr(self._rv_materialize())

    def __str__(self) -> str:
        return str(self._rv_materialize())

    def __format__(self, spec: str) -> str:
        return format(self._rv_materialize(), spec)

    def __float__(self) -> float:
        return float(self._rv_materialize())

    def __int__(self) -> int:
        return int(self._rv_materialize())

    def __index__(self) -> int:
        return operator.index(self._rv_materialize())

    def __complex__(self) -> complex:
        return complex(self._rv_materialize())

    def __hash__(self) -> int:
        return object.__hash__(self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._rv_materialize()(*args, **kwargs)

    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        return self._rv_materialize().__array__(*args, **kwargs)


def _binary(name: str) -> Any:
    def method(self: RemoteValue, other: Any) -> Any:
        scaling = _SCALINGS.get(name)
        if (scaling is not None and getattr(_loss_scalings, "on", False) and type(other) in (int, float)
                and self._rv_op is not None
                and self._rv_op.kind == "function" and self._rv_may_record(())):  # a scaled loss: on the owner
            args = (other, _SELF) if name == "__rmul__" else (_SELF, other)
            return self._rv_record(_Op("function", scaling, args, {}, torch.is_grad_enabled()))
        return getattr(self._rv_materialize(), name)(materialize(other))

    method.__name__ = name
    return method


def _unary(name: str) -> Any:
    def method(self: RemoteValue) -> Any:
        return getattr(self._rv_materialize(), name)()

    method.__name__ = name
    return method


for _op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor", "lshift", "rshift"):
    for _name in (f"__{_op}__", f"__r{_op}__", f"__i{_op}__"):
        setattr(RemoteValue, _name, _binary(_name))
for _name in ("__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__divmod__", "__rdivmod__"):
    setattr(RemoteValue, _name, _binary(_name))
for _name in ("__neg__", "__pos__", "__abs__", "__invert__", "__round__", "__trunc__", "__floor__", "__ceil__"):
    setattr(RemoteValue, _name, _unary(_name))


class _Ref(RemoteValue):
    """On the owner: a reference to one of its own call outputs, as it arrived in a request.

    The engine replaces references in the request's arguments by the values before it runs the module (see
    ``resolve``); one left inside an object it cannot walk resolves the same way when touched.
    """

    def __init__(self, call_id: tuple[int, int], path: tuple, microbatch: int) -> None:
        self.__dict__.update(  # not through ``__setattr__`` (see ``RemoteValue.__init__``)
            _rv_call_id=call_id, _rv_path=path, _rv_microbatch=microbatch, _rv_fetched=False, _rv_value=None,
            _rv_resolver=None, _rv_lock=threading.Lock(),
        )

    def _rv_materialize(self) -> Any:
        if not self._rv_fetched:
            if self._rv_resolver is None:
                raise RuntimeError("internal: a reference to a remote output was touched before it was resolved")
            own = self.__dict__  # not through ``__setattr__`` (see ``RemoteValue.__init__``)
            own["_rv_value"] = self._rv_resolver(self._rv_call_id, self._rv_path, self._rv_microbatch)
            own["_rv_fetched"] = True
        return self._rv_value

    def __reduce_ex__(self, protocol: int) -> Any:
        return (_identity, (self._rv_materialize(),))

    def __getitem__(self, key: Any) -> Any:
        return self._rv_materialize()[key]


_REMOTE_TYPES.update((RemoteValue, _Ref))


def materialize(tree: Any) -> Any:
    """``tree`` (tuples, lists, dicts, and what else ``torch.utils._pytree`` walks) with every :class:`RemoteValue`
    replaced by its value (fetched where needed)."""
    if _is_remote(tree):
        return tree._rv_materialize()
    if type(tree) in (tuple, list, dict) and not tree:
        return tree
    return tree_map(lambda v: v._rv_materialize() if _is_remote(v) else v, tree)


def owner_computes_loss(value: Any) -> bool:
    """Whether ``value`` is a handle for a loss that its owner computes (a loss function recorded on a remote output,
    and the scalings by Python numbers recorded on it: [Note: the loss where the logits are]); scaling it by a Python
    number sends nothing, and a training step fetches it with its backward in one exchange."""
    return type(value) is RemoteValue and value._rv_loss_chain() is not None


def _fetch_module_inputs(module: Any, args: tuple) -> tuple | None:
    """Global forward pre-hook: a local module gets values, not handles, as its positional arguments (torch's global
    pre-hooks see no keyword arguments; handles there, or deeper in containers, fetch when touched). A loss module
    (``nn.CrossEntropyLoss``, ...) keeps them: its ``F`` function runs on the owner ([Note: the loss where the
    logits are]). A module with parameters then sends the one-way calls this thread still holds (a fetch took
    those held for the handle's stage along; [Note: coalesced one-way calls] in ``_core.py``)."""
    fetched = None
    for a in args:  # runs before every module call of the process: no generator, no call per argument
        if type(a) in _REMOTE_TYPES:
            if isinstance(module, torch.nn.modules.loss._Loss) and type(module).__module__ == "torch.nn.modules.loss":
                return None  # torch's own; a user's ``_Loss`` subclass may inspect its inputs: it gets values
            fetched = tuple(a._rv_materialize() if _is_remote(a) else a for a in args)
            break
    send_held_calls(module)
    return fetched


_fetch_module_inputs.draws_no_random_numbers = True  # type: ignore[attr-defined]  # see pipeline/_rng.py

_hook_lock = threading.Lock()
_hook_handle: Any = None


def _fetching_apply(original: Any) -> Any:
    """``torch.autograd.Function.apply`` that first fetches the handles among its arguments: autograd connects a
    Function's output only to its *tensor* inputs, and a handle is none, so without this a custom Function (or
    reentrant ``torch.utils.checkpoint``) given a handle would compute the right value with no gradient upstream."""

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        if any(_is_remote(a) for a in args) or any(_is_remote(v) for v in kwargs.values()):
            args, kwargs = materialize(args), materialize(kwargs)
        return original(cls, *args, **kwargs)

    apply._smp_fetches_handles = True  # type: ignore[attr-defined]
    return classmethod(apply)


def materialize_module_inputs() -> None:
    """Install (once per process) what makes local code that needs real tensors get them from handles: a global
    forward pre-hook fetching handles passed to local modules (remote modules' stubs replace ``__call__`` and skip
    module hooks, so their handle arguments still go as references), and ``Function.apply`` fetching its handle
    arguments (see ``_fetching_apply``)."""
    global _hook_handle
    with _hook_lock:
        if _hook_handle is None:
            from torch.nn.modules.module import register_module_forward_pre_hook

            _hook_handle = register_module_forward_pre_hook(_fetch_module_inputs)
            function = torch.autograd.function.Function
            current = function.__dict__["apply"]
            if not getattr(current.__func__, "_smp_fetches_handles", False):
                function.apply = _fetching_apply(current.__func__)
        _keep_handles_in_model_outputs()


# [Note: handles in Hugging Face outputs] A Hugging Face model builds a ``ModelOutput`` (a dataclass and a dict) from
# its last module's output: ``BaseModelOutputWithPast(last_hidden_state=self.norm(hidden))``. Its ``__post_init__``
# asks ``is_tensor`` of the first field when the others are None (a first field that is a dict or an iterable of
# (key, value) pairs is unpacked into the fields instead), and ``isinstance`` on a handle fetches it: the final hidden
# states crossed to the caller every microbatch, and went back by value to the head on the same stage. So when the
# first field is a handle whose value is a tensor, the wrapper runs ``__post_init__`` on a stand-in tensor and puts
# the handle back in its place: what eager code does with a tensor, and the handle goes on to the head by reference.
# Whether it is a tensor (``RemoteValue._rv_is_tensor``) comes from the called module's class where that says so (a
# final ``nn.LayerNorm``, ``Placement.returns_tensor``), else from the owner (a round trip of a few bytes; a custom
# norm). Installed with the other hooks when ``transformers`` is imported by then (a Hugging Face model is built
# before its engine).


def _handle_keeping_post_init(original: Any) -> Any:
    def __post_init__(self: Any) -> None:
        names = [field.name for field in dataclasses.fields(self)]
        first = self.__dict__.get(names[0])
        if (not _is_remote(first) or any(self.__dict__.get(name) is not None for name in names[1:])
                or not first._rv_is_tensor()):
            return original(self)
        self.__dict__[names[0]] = torch.empty(0)  # what ``__post_init__`` reads the first field from
        original(self)
        self[names[0]] = first  # sets the item and the attribute, as ``__post_init__`` does for a tensor

    __post_init__._smp_keeps_handles = True  # type: ignore[attr-defined]
    return __post_init__


def _keep_handles_in_model_outputs() -> None:
    """Wrap ``transformers``' ``ModelOutput.__post_init__`` (once) if it is imported: [Note: handles in Hugging Face
    outputs]."""
    generic = sys.modules.get("transformers.utils.generic")
    output_class = getattr(generic, "ModelOutput", None)
    if output_class is not None and not getattr(output_class.__post_init__, "_smp_keeps_handles", False):
        output_class.__post_init__ = _handle_keeping_post_init(output_class.__post_init__)


def resolve(tree: Any, refs: list[_Ref], resolver: Any) -> Any:
    """Owner side: give every reference its resolver, and replace those that ``tree``'s containers hold."""
    if not refs:
        return tree
    for ref in refs:
        ref.__dict__["_rv_resolver"] = resolver  # not through ``__setattr__``
    return materialize(tree)
