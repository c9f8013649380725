"""``PartitionSummary``: what the automatic partitioner decided, as a table, a bar chart and a reusable plan."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn

from lightning_mp.partition import ModelTrace, PartitionPlan, holds_parameters

__all__ = ["PartitionSummary", "StageSummary", "summarize_stages"]


@dataclass(frozen=True)
class StageSummary:
    """One pipeline stage of a plan.

    Attributes:
        stage: stage index.
        modules: the modules worth naming on it (children of modules split over several stages).
        num_params: parameter elements it holds (shared parameters counted once).
        flops: forward FLOPs of one traced microbatch run on it (its modules' own FLOPs).
        activation_bytes: bytes of the outputs of its leaf modules for one microbatch (kept for backward).
        cost_share: its share of the plan's total cost, in [0, 1] (copies of replicated tied weights included).
        replicas: original FQNs of the replicated tied parameters it holds a copy of (``tied_weights="replicate"``),
            listed on every stage holding one, its first owner's included.
        replica_params: elements of those copies not counted in ``num_params`` (held as a copy, not first owner).
    """

    stage: int
    modules: list[str]
    num_params: int
    flops: float
    activation_bytes: int
    cost_share: float
    replicas: tuple[str, ...] = ()
    replica_params: int = 0


def summarize_stages(plan: PartitionPlan, trace: ModelTrace) -> list[StageSummary]:
    """Per-stage totals of ``trace`` under ``plan``."""
    params = [0] * plan.num_stages
    flops = [0.0] * plan.num_stages
    activations = [0] * plan.num_stages
    inclusive: dict[str, float] = {}
    for fqn in reversed(trace.modules):  # children before parents; an uncalled container sums its children
        record = trace.modules[fqn]
        inclusive[fqn] = record.flops if record.num_calls else sum(inclusive[c] for c in record.children)
    inclusive[""] = max(inclusive[""], trace.total_flops)  # work outside any module (e.g. the loss)
    for fqn, stage in plan.stage_of.items():
        record = trace.modules[fqn]
        params[stage] += record.num_params
        flops[stage] += max(0.0, inclusive[fqn] - sum(inclusive[c] for c in record.children))
        if not record.children:
            activations[stage] += record.activation_bytes
    shown = [[fqn for fqn in names if holds_parameters(trace, fqn)] for names in plan.display_modules()]
    copies = plan.replica_params(trace)
    return [
        StageSummary(
            s, shown[s], params[s], flops[s], activations[s], plan.stage_costs[s],
            tuple(fqn for fqn, stages in plan.replicated.items() if s in stages), copies[s],
        )
        for s in range(plan.num_stages)
    ]


class PartitionSummary(Callback):
    """Explain the partition at the start of fit/validate/test/predict, on global rank 0.

    Prints a table per stage (modules, parameters, FLOPs, activation bytes, cost share; module names without the
    prefix they all share, runs of numbered blocks folded: ``h.0-7``), and writes to the logger's directory
    (``trainer.log_dir``, else ``default_root_dir``): ``{filename}.png``, bar charts of parameters, forward FLOPs,
    activation memory and cost share per stage above the list of each stage's modules, and ``{filename}.json``, the
    plan, which ``SMPStrategy(partition_plan=...)`` can reuse.

    Args:
        filename: stem of the written files.
        chart: write the PNG (needs matplotlib).
    """

    shows_partition_table = True  # the strategy then leaves out its shorter table (it does not import callbacks)

    def __init__(self, filename: str = "partition", chart: bool = True) -> None:
        self.filename = filename
        self.chart = chart
        self._done = False
        self.stages: list[StageSummary] = []

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._summarize(trainer)

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._summarize(trainer)

    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._summarize(trainer)

    def on_predict_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._summarize(trainer)

    def _summarize(self, trainer: Trainer) -> None:
        if self._done:
            return
        self._done = True
        out_dir = trainer.log_dir or trainer.default_root_dir  # on every rank: `log_dir` is a collective
        self._write(trainer, out_dir)

    @rank_zero_only
    def _write(self, trainer: Trainer, out_dir: str) -> None:
        plan = getattr(trainer.strategy, "partition_plan", None)
        model_trace = getattr(trainer.strategy, "partition_trace", None)
        if plan is None or model_trace is None:
            rank_zero_warn(
                "PartitionSummary has nothing to show: it needs the 'smp' strategy with pipeline_parallel_degree > 1"
                " and a plan made in this run (not reused through `partition_plan`)."
            )
            return
        self.stages = summarize_stages(plan, model_trace)
        rank_zero_info("lightning_mp partition summary:\n" + _table(self.stages))
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, f"{self.filename}.json"), "w") as file:
            json.dump(plan.to_dict(), file, indent=1)
        if self.chart:
            _bar_chart(self.stages, os.path.join(out_dir, f"{self.filename}.png"))


def _table(stages: list[StageSummary]) -> str:
    prefix = common_prefix([m for s in stages for m in s.modules])
    replicated = any(s.replicas for s in stages)
    header = ("stage", f"modules ({prefix} omitted)" if prefix else "modules", "parameters", "GFLOPs", "activations MiB")
    header += ("cost",) + (("tied replicas",) if replicated else ())
    rows = [
        (
            str(s.stage),
            _short(compact_names(s.modules, prefix)),
            f"{s.num_params:,}" + (f" + {s.replica_params:,} replica" if s.replica_params else ""),
            f"{s.flops / 1e9:.3f}",
            f"{s.activation_bytes / 2**20:.2f}",
            f"{100 * s.cost_share:.1f}%",
        )
        + ((_short(list(s.replicas)) or "-",) if replicated else ())
        for s in stages
    ]
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    lines = [" | ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in (header, *rows)]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def common_prefix(names: list[str], share: float = 0.8) -> str:
    """The longest dotted prefix (``"model.transformer."``) that at least ``share`` of the module names start with
    and go on past with a named part (not a block number); ``""`` when there is none. Names outside it
    (``model.lm_head``) are shown whole."""
    names = [name for name in names if name != "<root>"]
    best = ""
    for name in names:
        parts = name.split(".")
        for end in range(len(parts) - 1, 0, -1):
            prefix = ".".join(parts[:end]) + "."
            if len(prefix) <= len(best):
                break
            inside = [n[len(prefix) :] for n in names if n.startswith(prefix)]
            if any(rest.split(".")[0].isdigit() for rest in inside):  # keep `h.0`, not a bare `0`
                continue
            if len(inside) >= max(2, share * len(names)):
                best = prefix
                break
    return best


def compact_names(modules: list[str], prefix: str = "") -> list[str]:
    """``modules`` without ``prefix``, runs of numbered siblings folded: ``h.0, h.1, h.2, ln_f`` -> ``h.0-2, ln_f``."""
    folded: list[tuple[str, int, int] | str] = []
    for name in modules:
        name = name[len(prefix) :] if prefix and name.startswith(prefix) else name
        parent, _, last = name.rpartition(".")
        previous = folded[-1] if folded else None
        if last.isdigit() and isinstance(previous, tuple) and previous[0] == parent and previous[2] + 1 == int(last):
            folded[-1] = (parent, previous[1], int(last))
        elif last.isdigit():
            folded.append((parent, int(last), int(last)))
        else:
            folded.append(name)
    return [
        item if isinstance(item, str) else f"{item[0] + '.' if item[0] else ''}{item[1]}" + (f"-{item[2]}" if item[2] > item[1] else "")
        for item in folded
    ]


def _short(modules: list[str], limit: int = 60) -> str:
    text = ", ".join(modules)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_PANELS = (  # (title, value of a stage); one bar chart each
    ("parameters (M)", lambda s: (s.num_params + s.replica_params) / 1e6),
    ("forward GFLOPs / microbatch", lambda s: s.flops / 1e9),
    ("activations MiB / microbatch", lambda s: s.activation_bytes / 2**20),
    ("share of cost (%)", lambda s: 100 * s.cost_share),
)


def _bar_chart(stages: list[StageSummary], path: str) -> None:
    """Per stage: parameters, compute, activation memory and cost share as bars; below, the modules of each stage."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prefix = common_prefix([m for s in stages for m in s.modules])
    listing = [
        textwrap.fill(f"stage {s.stage}: {', '.join(compact_names(s.modules, prefix)) or '-'}", 110,
                      subsequent_indent="    ")
        for s in stages
    ]
    text_lines = sum(entry.count("\n") + 1 for entry in listing) + 1
    figure = plt.figure(figsize=(12, 3.2 + 0.22 * text_lines))
    grid = figure.add_gridspec(2, len(_PANELS), height_ratios=[3.2, 0.22 * text_lines])
    labels = [str(s.stage) for s in stages]
    for column, (title, value) in enumerate(_PANELS):
        axes = figure.add_subplot(grid[0, column])
        values = [value(s) for s in stages]
        axes.bar(labels, values, color="#4878a8")
        mean = sum(values) / len(values)
        axes.axhline(mean, color="#c44e52", linestyle="--", linewidth=1)
        for index, v in enumerate(values):
            axes.text(index, v, f"{v:.3g}", ha="center", va="bottom", fontsize=7)
        axes.set_title(title, fontsize=9)
        axes.set_xlabel("stage", fontsize=8)
    costs = [s.cost_share for s in stages]
    figure.suptitle(
        f"Partition into {len(stages)} stages: max/mean stage cost = {max(costs) * len(costs) / sum(costs):.3f}"
        " (dashed: mean)" + (f"; '{prefix}' omitted from module names" if prefix else ""),
        fontsize=10,
    )
    text = figure.add_subplot(grid[1, :])
    text.axis("off")
    text.text(0, 1, "\n".join(listing), va="top", ha="left", family="monospace", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
