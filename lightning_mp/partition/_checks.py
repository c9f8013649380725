"""Checks of stage numbers, manual placements and the invariants every plan keeps (see ``_plan.py``)."""

from __future__ import annotations

import difflib
from collections.abc import Mapping

from lightning_mp.partition._trace import ModelTrace

_ROOT = ""


def _check_num_stages(num_stages: int) -> None:
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(
            f"num_stages must be an integer >= 1, got {num_stages!r}; "
            "set the number of pipeline stages to 1 or more"
        )


def _check_stage(stage: int, num_stages: int, description: str) -> None:
    """Raises if ``stage`` is not an int in ``[0, num_stages)``; ``description`` shows the value."""
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < num_stages:
        raise ValueError(
            f"{description} is not a valid stage for num_stages={num_stages}; use an integer "
            f"in 0..{num_stages - 1}"
        )


def _check_manual(trace: ModelTrace, manual: Mapping[str, int], num_stages: int) -> None:
    for fqn, stage in manual.items():
        if fqn not in trace.modules:
            close = difflib.get_close_matches(fqn, list(trace.modules), n=3)
            hint = f"did you mean {', '.join(repr(c) for c in close)}? " if close else ""
            raise ValueError(
                f"manual placement names unknown module {fqn!r}; {hint}use module names as "
                "in model.named_modules() ('' for the root)"
            )
        _check_stage(stage, num_stages, f"manual placement {fqn!r} -> {stage!r}")
    if manual.get(_ROOT, 0) != 0:
        raise ValueError(
            f"manual placement puts the root module ('') on stage {manual[_ROOT]}; the root runs "
            "the training step and always stays on stage 0; place its children instead"
        )


def _with_aliases(trace: ModelTrace, manual: Mapping[str, int]) -> dict[str, int]:
    """A placement of one name of a module object places all its names (``self.lin1 = self.lin0``)."""
    expanded = dict(manual)
    for group in trace.alias_groups:
        named = [fqn for fqn in group if fqn in manual]
        if not named:
            continue
        stages = {manual[fqn] for fqn in named}
        if len(stages) > 1:
            raise ValueError(
                f"manual placement puts one module, registered as {named}, on stages {sorted(stages)}; a module"
                " object runs on one stage: name one of its names only"
            )
        for fqn in group:
            expanded.setdefault(fqn, manual[named[0]])
    return expanded


def _apply_manual(
    trace: ModelTrace, stage_of: dict[str, int], manual: Mapping[str, int]
) -> dict[str, int]:
    """Overrides ``stage_of`` with ``manual``: the innermost entry wins for its subtree."""
    result: dict[str, int] = {}
    placed: set[str] = set()
    for fqn, record in trace.modules.items():  # parents before children
        if fqn in manual:
            result[fqn] = manual[fqn]
            placed.add(fqn)
        elif record.parent in placed:
            result[fqn] = result[record.parent]
            placed.add(fqn)
        else:
            result[fqn] = stage_of[fqn]
    return result


def _check_whole(trace: ModelTrace, stage_of: Mapping[str, int], whole: frozenset[str]) -> None:
    for fqn in sorted(whole):
        inside = {m: stage_of[m] for m in trace.modules if m == fqn or m.startswith(f"{fqn}.")}
        if len(set(inside.values())) > 1:
            where = ", ".join(f"{m!r} -> {s}" for m, s in inside.items() if s != stage_of[fqn])
            raise ValueError(
                f"the manual placement splits module {fqn!r} (stage {stage_of[fqn]}) over stages ({where}); it runs"
                " as one piece (tensor parallelism swaps it whole, its intermediate activations are sharded): place"
                f" {fqn!r} and all of its submodules on one stage"
            )


def _check_shared_groups(trace: ModelTrace, stage_of: Mapping[str, int]) -> None:
    for group in trace.shared_groups:
        if len({stage_of[fqn] for fqn in group}) > 1:
            where = ", ".join(f"{fqn!r} -> {stage_of[fqn]}" for fqn in group)
            raise ValueError(
                f"modules that share parameters are placed on different stages ({where}); "
                "with tied_weights='colocate' shared parameters need one stage: place all of them on the same "
                "stage in the manual map, or use tied_weights='replicate' (a copy on each stage, gradients summed)"
            )


def _check_aliases_together(trace: ModelTrace, stage_of: Mapping[str, int]) -> None:
    holding = {m for group in trace.shared_groups for m in group}
    for group in trace.alias_groups:
        if holding.intersection(group) and len({stage_of[fqn] for fqn in group}) > 1:
            where = ", ".join(f"{fqn!r} -> {stage_of[fqn]}" for fqn in group)
            raise ValueError(
                f"one module object with parameters, registered as several names, is placed on different stages"
                f" ({where}); a module runs on one stage: place all its names on the same stage"
            )


def _check_no_empty_stage(stage_of: Mapping[str, int], num_stages: int) -> None:
    used = set(stage_of.values())
    for stage in range(num_stages):
        if stage not in used:
            raise ValueError(
                f"stage {stage} has no modules; the placement uses stages {sorted(used)} of "
                f"num_stages={num_stages}; place a module on stage {stage} in the manual map, "
                "enable auto_partition, or use fewer pipeline stages"
            )
