"""Swap marked modules for their distributed counterparts, loading shards from the original weights.

Recipe (:func:`swap_modules`):

1. **Choose.** Walk the tree top-down carrying the innermost mark. A marked, enabled module with a
   registration (or an entry in a model translation, e.g. a Hugging Face ``tp_plan``) is built as its
   distributed counterpart (constructors only allocate local shards: no communication), which then loads
   this rank's shards from the original's state dict. Its subtree is not visited further. A build that fails
   (indivisible size, unsupported option) is recorded with the reason and the walk goes on into its children.
2. **Keep ties.** A parameter the original shared between modules (tied embeddings) must stay one parameter:
   if every module that holds it is swapped and their new parameters have the same shard layout, they are
   tied again; otherwise the swaps that would break the tie are dropped, with the reason.
3. **Install** the built modules in their parents and report what was swapped and what was not (and why).
4. **Random ops** on the activations that the swap shards draw one process's numbers (see
   [Note: random numbers under tensor parallelism] in ``tp/_random.py``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from lightning_mp.init import defer_load, find_record
from lightning_mp.tp._random import install_sharded_random
from lightning_mp.tp._registry import Registration, TPMark, registration_for, tp_mark
from lightning_mp.tp._sharding import TPGroup, shard_spec

__all__ = ["Builder", "SwapReport", "Translation", "swap_modules", "whole_swaps"]

Builder = Callable[[nn.Module, TPGroup], nn.Module]
"""Build the distributed counterpart of a module (raises ``ValueError`` with the reason if it cannot)."""

Translation = Callable[[nn.Module], "dict[str, Builder | str] | None"]
"""For a marked module without a registration: ``{relative FQN: builder, or the reason it has none}``."""


@dataclass
class SwapReport:
    """What a swap did.

    Attributes:
        swapped: FQN -> distributed class name.
        skipped: FQN -> why a marked module was not swapped.
    """

    swapped: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)

    def warning(self) -> str | None:
        """One message naming every marked module that was not swapped, or ``None``."""
        if not self.skipped:
            return None
        lines = "\n".join(f"  {fqn or '<root>'}: {why}" for fqn, why in sorted(self.skipped.items()))
        return (
            f"lightning_mp: {len(self.skipped)} module(s) marked for tensor parallelism stay unswapped (replicated"
            f" on every tensor-parallel rank; training still works):\n{lines}"
        )


def build_registered(
    module: nn.Module, registration: Registration, tp: TPGroup, kwargs: dict, defaults: dict | None = None
) -> nn.Module:
    """Build ``registration.dist_cls`` for ``module``, load its shards and attach the hooks.

    ``kwargs`` (the mark's) go to the constructor as given; ``defaults`` (the strategy's, e.g. ``optimize``)
    only where the constructor takes them and neither the mark nor the init hook set them.
    """
    if registration.init_hook is None:
        raise ValueError(
            f"{registration.dist_cls.__name__} is registered for {type(module).__name__} without an init_hook; give"
            " one that reads the sizes from the module (see [Note: hooks take the module])."
        )
    args, init_kwargs = registration.init_hook(module)
    accepted = _keyword_names(registration.dist_cls)
    extra = {k: v for k, v in (defaults or {}).items() if k in accepted}
    dist_module = registration.dist_cls(*args, **{**extra, **init_kwargs, **kwargs, "tp": tp})
    load_from(dist_module, module)
    if registration.forward_hook is not None:
        hook = registration.forward_hook
        dist_module.register_forward_pre_hook(lambda m, a, k: hook(a, k), with_kwargs=True)
    if registration.return_hook is not None:
        ret = registration.return_hook
        dist_module.register_forward_hook(lambda m, a, out: ret(out))
    return dist_module


def _keyword_names(cls: type) -> set[str]:
    """Names ``cls.__init__`` takes by keyword (a ``**kwargs`` catch-all does not count: defaults are opt-in)."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {p.name for p in inspect.signature(cls.__init__).parameters.values() if p.kind in kinds}


def load_from(dist_module: nn.Module, original: nn.Module) -> None:
    """Load the original's weights (full shapes) into ``dist_module`` (its shards), on the original's device/dtype.

    An original built under delayed parameter initialisation (still on meta) is loaded later, when the model is
    materialised: :func:`lightning_mp.init.defer_load` (each full tensor is made, sliced into ``dist_module``
    and freed in turn, so the weights are the eager swap's bitwise).

    Raises:
        ValueError: if the keys differ (the distributed class must use the original's parameter names).
    """
    first = next(original.parameters(), None)
    if first is not None and first.is_meta and find_record(original) is not None:
        if first.is_floating_point():
            dist_module.to(dtype=first.dtype)
        defer_load(dist_module, original)
        return
    if first is not None:
        dist_module.to(device=first.device, dtype=first.dtype if first.is_floating_point() else None)
    state = original.state_dict()
    missing, unexpected = dist_module.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"{type(dist_module).__name__} does not have the parameter names of {type(original).__name__}: missing"
            f" {missing[:4]}, unexpected {unexpected[:4]}."
        )


def swap_modules(
    root: nn.Module,
    tp: TPGroup,
    translations: Iterable[Translation] = (),
    owns: Callable[[str], bool] | None = None,
    defaults: dict | None = None,
) -> SwapReport:
    """Swap every marked module of ``root`` that has a distributed counterpart (see the module docstring).

    Args:
        root: the model; changed in place.
        tp: this rank's tensor-parallel group.
        translations: per-model translations for marked modules without a registration (Hugging Face plans).
        owns: ``fqn -> bool``, whether this rank holds the module (pipeline stages); others are left alone.
        defaults: constructor keywords for the registered classes that take them (e.g. ``{"optimize": ...}``).
    """
    walk = _Walk(tp, list(translations), owns or (lambda fqn: True), dict(defaults or {}))
    walk.visit(root, "", None)
    _keep_ties(root, walk.built, walk.report)
    for fqn, module in walk.built.items():
        _install(root, fqn, module)
        walk.report.swapped[fqn] = type(module).__name__
    _report_marked_without_swap(root, walk.report)
    install_sharded_random(root, tp)
    return walk.report


def whole_swaps(root: nn.Module, translations: Iterable[Translation] = ()) -> list[str]:
    """FQNs of the modules with submodules that :func:`swap_modules` would replace whole, found without building.

    Such a module must run on one pipeline stage: its distributed counterpart passes sharded activations between
    its column- and row-parallel parts (a transformer block's MLP hidden features), which a stage boundary inside
    it would cut (see [Note: partition algorithm]). Every candidate counts, also one whose build would fail (an
    indivisible head count): keeping it whole is then merely coarser.

    Args:
        root: the model, marked and not swapped yet; not changed.
        translations: as for :func:`swap_modules`.
    """
    walk = _Walk(None, list(translations), lambda fqn: True, {}, dry_run=True)
    walk.visit(root, "", None)
    return [fqn for fqn, module in walk.built.items() if next(module.children(), None) is not None]


@dataclass
class _Walk:
    tp: TPGroup | None
    translations: list[Translation]
    owns: Callable[[str], bool]
    defaults: dict
    dry_run: bool = False  # choose only: the module itself stands for its counterpart
    built: dict[str, nn.Module] = field(default_factory=dict)
    report: SwapReport = field(default_factory=SwapReport)
    planned: dict[str, Builder | str] = field(default_factory=dict)
    translated: list[str] = field(default_factory=list)

    def visit(self, module: nn.Module, fqn: str, mark: TPMark | None) -> None:
        mark = tp_mark(module) or mark
        if getattr(module, "_lmp_distributed", False):  # already a distributed module
            return
        if mark is not None and mark.enabled and not self.owns(fqn):
            self.translate(module, fqn)  # another stage's root: its plan still applies to the owned children
        elif mark is not None and mark.enabled:
            candidate = self.candidate(module, fqn, mark)
            if isinstance(candidate, nn.Module):
                self.built[fqn] = candidate
                return
            if candidate is not None:
                self.report.skipped[fqn] = candidate
        for name, child in module.named_children():
            self.visit(child, f"{fqn}.{name}" if fqn else name, mark)

    def candidate(self, module: nn.Module, fqn: str, mark: TPMark) -> nn.Module | str | None:
        """The built counterpart, the reason there is none, or ``None`` (nothing applies to this module)."""
        translated = _inside(fqn, dict.fromkeys(self.translated))
        registration = None if translated else registration_for(module)
        if registration is None:
            self.translate(module, fqn)
        if self.dry_run:
            return module if registration is not None or callable(self.planned.get(fqn)) else None
        try:
            if registration is not None:
                return build_registered(module, registration, self.tp, mark.kwargs, self.defaults)
            entry = self.planned.get(fqn)  # inside a translated model only its plan applies
            return entry if entry is None or isinstance(entry, str) else entry(module, self.tp)
        except ValueError as err:
            return str(err)

    def translate(self, module: nn.Module, fqn: str) -> None:
        """Plan the swaps inside a model a translation knows (once per translated subtree)."""
        if _inside(fqn, dict.fromkeys(self.translated)) or registration_for(module) is not None:
            return
        for translate in self.translations:
            plan = translate(module)
            if plan:
                self.planned.update({f"{fqn}.{k}" if fqn else k: v for k, v in plan.items()})
                self.translated.append(fqn)
                return


def _keep_ties(root: nn.Module, built: dict[str, nn.Module], report: SwapReport) -> None:
    positions: dict[int, list[str]] = {}
    for mod_fqn, module in root.named_modules(remove_duplicate=False):
        for name, param in module.named_parameters(recurse=False):
            positions.setdefault(id(param), []).append(f"{mod_fqn}.{name}" if mod_fqn else name)
    originals = {name: p for p in root.parameters() for name in positions.get(id(p), [])}
    _reuse_replicated(built, positions, originals)
    changed = True
    while changed:
        changed = False
        for names in (n for n in positions.values() if len(n) > 1):
            owners = [_owner(name, built) for name in names]
            current = [originals[n] if o is None else _new_param(built[o], n, o) for o, n in zip(owners, names)]
            if all(p is current[0] for p in current):  # untouched, or kept whole as the original object
                continue
            if all(o is not None for o in owners) and all(p is not None for p in current) and _same_layout(current):
                continue  # every user swapped alike: tied again below
            for owner in {o for o in owners if o is not None}:
                del built[owner]
                report.skipped[owner] = (
                    f"shares weight {names[0]!r} with {[n for n in names if _owner(n, {owner: None}) is None]}, which"
                    " would not be split the same way (swap all of its users alike, or none)"
                )
            changed = True
            break
    for names in (n for n in positions.values() if len(n) > 1):
        owners = [_owner(name, built) for name in names]
        if all(o is not None for o in owners):
            first = _new_param(built[owners[0]], names[0], owners[0])
            for owner, name in zip(owners[1:], names[1:]):
                parent_name, _, pname = name[len(owner) + 1 if owner else 0 :].rpartition(".")
                holder = built[owner].get_submodule(parent_name) if parent_name else built[owner]
                holder._parameters[pname] = first


def _reuse_replicated(built: dict[str, nn.Module], positions: dict[int, list[str]], originals: dict) -> None:
    """A shared parameter that a swapped module keeps whole (replicated) is the original object again."""
    for names in (n for n in positions.values() if len(n) > 1):
        for name in names:
            owner = _owner(name, built)
            new = None if owner is None else _new_param(built[owner], name, owner)
            if new is not None and shard_spec(new) is None and new.shape == originals[name].shape:
                parent_name, _, pname = name[len(owner) + 1 if owner else 0 :].rpartition(".")
                holder = built[owner].get_submodule(parent_name) if parent_name else built[owner]
                holder._parameters[pname] = originals[name]


def _owner(name: str, built: dict) -> str | None:
    for fqn in built:
        if fqn == "" or name.startswith(fqn + "."):
            return fqn
    return None


def _new_param(module: nn.Module, name: str, owner: str) -> torch.Tensor | None:
    try:
        return module.get_parameter(name[len(owner) + 1 if owner else 0 :])
    except AttributeError:
        return None


def _same_layout(params: list[torch.Tensor]) -> bool:
    def key(p: torch.Tensor) -> tuple:
        spec = shard_spec(p)
        return (tuple(p.shape), None if spec is None else (spec.dim, spec.full_size, spec.parts))

    return len({key(p) for p in params}) == 1


def _install(root: nn.Module, fqn: str, module: nn.Module) -> None:
    if not fqn:
        raise ValueError("The root module itself cannot be swapped; mark its children instead.")
    parent_name, _, name = fqn.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, name, module)


def _report_marked_without_swap(root: nn.Module, report: SwapReport) -> None:
    """An explicitly marked module with parameters, none of them distributed, is named with the reason."""
    for fqn, module in root.named_modules():
        mark = tp_mark(module)
        if mark is None or not mark.enabled or fqn in report.skipped or next(module.parameters(), None) is None:
            continue
        if any(shard_spec(p) is not None for p in module.parameters()) or _inside(fqn, report.swapped):
            continue
        if any(_inside(s, {fqn: None}) for s in report.skipped):
            continue
        report.skipped[fqn] = f"no registration for {type(module).__name__} (register one with tp_register_with_module)"


def _inside(fqn: str, roots: dict) -> bool:
    return any(fqn == r or fqn.startswith(r + ".") or r == "" for r in roots)
