"""The placement table: stage | top-most modules | parameters | cost, with runs of numbered siblings folded."""

from __future__ import annotations

from lightning_mp.partition._trace import ModelTrace

__all__ = ["holds_parameters"]

_MAX_TABLE_ENTRIES = 6


def _parent_of(fqn: str) -> str:
    return fqn.rpartition(".")[0]


def _abbreviate(fqns: list[str]) -> str:
    """Joins names, collapsing runs of indexed siblings: ``h.0 .. h.3 (4 modules)``."""
    entries: list[str] = []
    run: list[str] = []

    def flush() -> None:
        if len(run) >= 3:
            entries.append(f"{run[0]} .. {run[-1]} ({len(run)} modules)")
        else:
            entries.extend(run)
        run.clear()

    for fqn in fqns:
        indexed = fqn.rpartition(".")[2].isdigit()
        if not (indexed and run and _parent_of(run[-1]) == _parent_of(fqn)):
            flush()
        if indexed:
            run.append(fqn)
        else:
            entries.append(fqn if fqn else "<root>")
    flush()
    if len(entries) > _MAX_TABLE_ENTRIES:
        hidden = len(entries) - _MAX_TABLE_ENTRIES + 1
        entries = entries[: _MAX_TABLE_ENTRIES - 1] + [f"... (+{hidden} more)"]
    return ", ".join(entries) if entries else "-"


def _render_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[c]) for row in [header, *rows]) for c in range(len(header))]

    def line(cells: tuple[str, ...]) -> str:
        return " | ".join(cell.ljust(width) for cell, width in zip(cells, widths)).rstrip()

    rule = "-+-".join("-" * width for width in widths)
    return "\n".join([line(header), rule, *(line(row) for row in rows)])


def holds_parameters(trace: ModelTrace, fqn: str) -> bool:
    """Whether the module (or one below it) holds parameters. Stateless modules (activations, torchmetrics
    objects) run on whichever stage calls them, so placement tables leave them out. ``"<root>"`` always shows."""
    record = trace.modules.get(fqn)
    if record is None:
        return True
    if record.num_params > 0 or any(fqn in shared.holders for shared in trace.shared_parameters):
        return True
    return any(holds_parameters(trace, child) for child in record.children)
