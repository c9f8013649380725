"""How well the automatic partitioner balances pipeline stages, against the best contiguous split and two baselines.

Run (CPU only, well under a minute, nothing downloaded; needs ``transformers``, e.g. ``pip install
"transformers>=4.40"``)::

    python benchmarks/partition_balance.py

What it measures. Every model is traced once with ``lightning_mp.partition.trace`` on the ``meta`` device (no
weights are allocated) and split into 2, 4 and 8 stages by four methods. Every split is scored with the planner's
own cost model, ``lightning_mp.partition.stage_costs``: per module, (1 - w) x its share of the FLOPs + w x its share
of the memory (parameter bytes x optimizer-state factor 3, plus a leaf's output bytes), w = ``MEMORY_WEIGHT`` = 0.2,
the default. Models:

- GPT-2, BERT and RoBERTa: Hugging Face ``transformers`` classes with their pretraining heads (``GPT2LMHeadModel``,
  ``BertForMaskedLM``, ``RobertaForMaskedLM``), unmodified, random init, 12 layers of width 256 and the real
  vocabularies, on one microbatch of 8 x 128 tokens. Their output layer is tied to the word embedding.
- ``hetero``: a convolutional stem on a 128 x 128 image, a 4-layer transformer encoder over its patches and a
  1M x 64 embedding over categorical ids, joined by one head.
- ``neumf``: NeuMF, the neural collaborative filtering model of He et al. 2017, in MLPerf's NCF shape, with 2M-user
  and 1M-item tables (four tables, 2.1 GiB of fp32 weights).

The *leaf sequence* is the modules without children in first-call order, plus one pseudo-leaf per module with
children that carries its self cost (FLOPs not spent in its children, its own parameters, children never called),
placed just before its descendants; together they cover the whole cost of the model.

Table columns: balance ratios, max stage cost / mean stage cost (1.000 is perfect; a stage may hold several parts):

- ``ours``: ``lightning_mp.partition.plan`` with default settings (``tied_weights="colocate"``: tied modules on one
  stage).
- ``ours+rep``: ``plan(..., tied_weights="auto")``, the strategy's default: the replicated plan (a copy of the tied
  weight on every stage using it, gradients summed) when its largest stage cost is lower, each copy's training
  memory (parameter bytes x 3) charged to its stage, and the gain is above 1%; otherwise the same as ``ours``.
  ``*``: it replicated.
- ``replicate``: ``plan(..., tied_weights="replicate")``, the replicated plan ``auto`` weighed (copies charged).
- ``optimal``: the exact min-max contiguous split of the leaf sequence (dynamic programme), the lower bound for
  contiguous plans. It ignores tied weights: nothing is charged for a tied module away from its weight.
- ``tied opt``: the same with each group of modules sharing a parameter merged into one part (at whichever
  member's position is best): the best contiguous split that respects ties. A plan may beat it slightly by moving
  whole subtrees with the tied module. ``-`` for models without ties.
- ``param-split``: contiguous parts of the leaf sequence with balanced parameter counts (DeepSpeed's
  ``partition_method="parameters"``: min-max on parameter counts, parts filled greedily from the left).
- ``layer-split``: contiguous parts with equal numbers of leaves (DeepSpeed's ``partition_method="uniform"``).
  Both baselines ignore ties too; their splits are scored as replicated plans (a copy charged where a tied module
  sits away from its weight), as DeepSpeed runs them with ``TiedLayerSpec``.
- ``ours/opt-1``, ``rep/opt-1``: how far ours and ours+rep are above optimal.

The goal lines check ours within 5% of optimal on every row and ours below both baselines on the ``hetero`` and
``neumf`` rows, and name the structural reason where a goal cannot hold (a tied group or a single module that is
heavier than a stage's fair share); then ours+rep within 5% of optimal and never worse than ours, naming the floor
of replicated plans where it cannot hold: the costliest leaf that holds a tied weight plus that weight's copy (a
stage running it pays for the weight, owner or copy, and the owner's own cost is at least the copy's).

Last, the example GPT of ``configs/gpt_pp2.yaml`` (one microbatch of 8 x 128 bytes) is planned on 2 stages and real
forward+backward steps are timed on one process and one thread, every moment attributed to the stage of the module
running then (forward hooks and full backward hooks on the modules at stage boundaries; the rest, the loss
included, runs on stage 0 with the root). The measured split is printed next to the plan's predicted stage costs
and their compute-only part.
"""

from __future__ import annotations

import itertools
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from lightning_mp.partition import ModelTrace, plan, stage_costs, trace  # noqa: E402

MEMORY_WEIGHT = 0.2  # the planner's default
NUM_STAGES = (2, 4, 8)
GOAL_VS_OPTIMAL = 0.05
BASELINE_GOAL_MODELS = ("hetero", "neumf")
BATCH, SEQ = 8, 128  # one microbatch of the transformer models


# ----------------------------------------------------------------------------- models


class HybridNet(nn.Module):
    """A heterogeneous model: a convolutional stem reads an image, a transformer encoder reads its patch tokens,
    a large embedding reads categorical ids (say, user and tag ids); one linear head reads both.

    Args:
        width: channels of the last convolution = transformer width ``C``.
        num_layers: transformer encoder layers.
        num_ids: rows of the id embedding.
        id_dim: width of the id embedding ``E``.
        num_classes: outputs of the head ``K``.
    """

    def __init__(self, width: int = 256, num_layers: int = 4, num_ids: int = 1_000_000, id_dim: int = 64,
                 num_classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 64, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(64, 128, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(128, width, 3, stride=2, padding=1), nn.ReLU(),
        )
        layer = nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=4 * width, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False)
        self.ids = nn.Embedding(num_ids, id_dim)
        self.ids_proj = nn.Linear(id_dim, width)
        self.head = nn.Linear(2 * width, num_classes)

    def forward(self, image: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Maps an image ``(B, 3, H, W)`` and ids ``(B, L)`` to logits ``(B, K)``."""
        x = self.stem(image)  # (B, C, H/8, W/8)
        x = self.encoder(x.flatten(2).transpose(1, 2)).mean(1)  # (B, C)
        e = self.ids_proj(self.ids(ids).mean(1))  # (B, C)
        return self.head(torch.cat([x, e], dim=-1))  # (B, K)


class NeuMF(nn.Module):
    """Neural matrix factorisation (He et al. 2017, "Neural Collaborative Filtering"): a GMF branch (element-wise
    product of user and item embeddings) and an MLP tower over other user and item embeddings, fused by a linear
    head into one logit per (user, item) pair. The defaults are MLPerf's NCF reference (``mf_dim=64``,
    ``layers=[256, 256, 128, 64]``: MLP embeddings of 128, a 256 -> 256 -> 128 -> 64 tower) with larger tables.

    Args:
        num_users: rows of each user table.
        num_items: rows of each item table.
        mf_dim: width ``F`` of the GMF embeddings.
        layers: the MLP tower's widths, its input (two concatenated embeddings of ``layers[0] // 2``) first.
    """

    def __init__(self, num_users: int = 2_000_000, num_items: int = 1_000_000, mf_dim: int = 64,
                 layers: Sequence[int] = (256, 256, 128, 64)) -> None:
        super().__init__()
        self.gmf_user = nn.Embedding(num_users, mf_dim)
        self.gmf_item = nn.Embedding(num_items, mf_dim)
        self.mlp_user = nn.Embedding(num_users, layers[0] // 2)
        self.mlp_item = nn.Embedding(num_items, layers[0] // 2)
        tower: list[nn.Module] = []
        for width, out in zip(layers, layers[1:]):
            tower += [nn.Linear(width, out), nn.ReLU()]
        self.mlp = nn.Sequential(*tower)
        self.head = nn.Linear(mf_dim + layers[-1], 1)

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        """Maps user ids ``(B,)`` and item ids ``(B,)`` to interaction logits ``(B,)``."""
        gmf = self.gmf_user(users) * self.gmf_item(items)  # (B, F)
        mlp = self.mlp(torch.cat([self.mlp_user(users), self.mlp_item(items)], dim=-1))  # (B, layers[-1])
        return self.head(torch.cat([gmf, mlp], dim=-1)).squeeze(-1)  # (B,)


def _trace_hf(name: str) -> ModelTrace:
    import transformers as hf

    builders = {
        "gpt2": lambda: hf.GPT2LMHeadModel(hf.GPT2Config(n_layer=12, n_embd=256, n_head=4, vocab_size=50257)),
        "bert": lambda: hf.BertForMaskedLM(
            hf.BertConfig(num_hidden_layers=12, hidden_size=256, num_attention_heads=4, intermediate_size=1024)
        ),
        "roberta": lambda: hf.RobertaForMaskedLM(
            hf.RobertaConfig(num_hidden_layers=12, hidden_size=256, num_attention_heads=4, intermediate_size=1024,
                             vocab_size=50265, max_position_embeddings=514)
        ),
    }
    hf.logging.set_verbosity_error()  # e.g. "loss_type=None ... using the default loss": the default is meant
    for device in ("meta", "cpu"):
        with torch.device(device):
            model = builders[name]()
            ids = torch.randint(0, 1000, (BATCH, SEQ))
        try:
            return trace(model, lambda: model(input_ids=ids, labels=ids).loss)
        except RuntimeError as error:
            if device == "cpu":
                raise
            print(f"note: {name} does not run on the meta device with transformers {hf.__version__} "
                  f"({error.__cause__}); traced on CPU instead (same costs, real weights allocated)")
    raise AssertionError("unreachable")


def _trace_hetero() -> ModelTrace:
    with torch.device("meta"):
        model = HybridNet()
        image, ids = torch.randn(32, 3, 128, 128), torch.randint(0, 1000, (32, 16))
        labels = torch.randint(0, 1000, (32,))
    return trace(model, lambda: F.cross_entropy(model(image, ids), labels))


def _trace_neumf() -> ModelTrace:
    with torch.device("meta"):
        model = NeuMF()
        users, items = torch.randint(0, 1000, (4096,)), torch.randint(0, 1000, (4096,))
        labels = torch.rand(4096)
    return trace(model, lambda: F.binary_cross_entropy_with_logits(model(users, items), labels))


MODELS: dict[str, Callable[[], ModelTrace]] = {
    "gpt2": lambda: _trace_hf("gpt2"),
    "bert": lambda: _trace_hf("bert"),
    "roberta": lambda: _trace_hf("roberta"),
    "hetero": _trace_hetero,
    "neumf": _trace_neumf,
}


# ----------------------------------------------------------------------------- leaf sequence


@dataclass
class _Unit:
    """One entry of the leaf sequence: a leaf module, or a module's self part (pseudo-leaf)."""

    fqn: str
    members: list[str]  # the module and its children's subtrees that were never called
    cost: float  # normalised, as stage_costs counts it
    num_params: int


def _leaf_sequence(tr: ModelTrace) -> list[_Unit]:
    """Leaves in first-call order, each module with children as a pseudo-leaf just before its descendants."""
    records = tr.modules
    own = stage_costs(tr, {fqn: i for i, fqn in enumerate(records)}, len(records), memory_weight=MEMORY_WEIGHT,
                      charge_copies=False)
    own_cost = dict(zip(records, own))
    first: dict[str, float] = {}
    for fqn in reversed(records):  # children before parents
        calls = [first[c] for c in records[fqn].children if first[c] < math.inf]
        if records[fqn].first_call is not None:
            calls.append(records[fqn].first_call)
        first[fqn] = min(calls, default=math.inf)
    first[""] = -1.0  # the root runs the step
    units: dict[str, _Unit] = {}
    for fqn, record in records.items():  # parents before children
        head = fqn
        while first[head] == math.inf:  # never called: goes with the nearest called ancestor
            head = records[head].parent
        unit = units.setdefault(head, _Unit(head, [], 0.0, 0))
        unit.members.append(fqn)
        unit.cost += own_cost[fqn]
        unit.num_params += record.num_params
    return sorted(units.values(), key=lambda u: (first[u.fqn], u.fqn.count(".") if u.fqn else -1))


def _stage_of(tr: ModelTrace, blocks: Sequence[Sequence[_Unit]], starts: Sequence[int]) -> dict[str, int]:
    """Every FQN -> stage, for contiguous parts of a sequence of blocks (groups of units) beginning at ``starts``."""
    stage_of = {}
    bounds = list(starts) + [len(blocks)]
    for stage, (start, end) in enumerate(zip(bounds, bounds[1:])):
        for block in blocks[start:end]:
            stage_of.update({fqn: stage for unit in block for fqn in unit.members})
    assert stage_of.keys() == tr.modules.keys()
    return stage_of


def _tied_sequences(tr: ModelTrace, units: list[_Unit]) -> list[list[list[_Unit]]]:
    """The leaf sequence with the units of each tied group merged into one block, at each member's position."""
    unit_of = {fqn: u for u in units for fqn in u.members}
    groups = [list({id(unit_of[f]): unit_of[f] for f in group}.values()) for group in tr.shared_groups]
    groups = [g for g in groups if len(g) > 1]
    tied = {id(u) for g in groups for u in g}
    assert len(tied) == sum(map(len, groups)), "a unit in two tied groups"
    sequences = []
    for anchors in itertools.product(*groups):
        block_at = {id(anchor): group for anchor, group in zip(anchors, groups)}
        sequences.append([block_at.get(id(u), [u]) for u in units if id(u) in block_at or id(u) not in tied])
    return sequences


# ----------------------------------------------------------------------------- splits


def _min_max_starts(weights: Sequence[float], num_parts: int) -> list[int]:
    """Exact min-max contiguous split (O(parts x n^2) DP); returns the start index of each part."""
    n = len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    best = [prefix[i] if i >= 1 else math.inf for i in range(n + 1)]
    cuts: list[list[int]] = []
    for parts in range(2, num_parts + 1):
        new, cut = [math.inf] * (n + 1), [0] * (n + 1)
        for i in range(parts, n + 1):
            for p in range(parts - 1, i):
                value = max(best[p], prefix[i] - prefix[p])
                if value < new[i]:
                    new[i], cut[i] = value, p
        best = new
        cuts.append(cut)
    starts, end = [], n
    for cut in reversed(cuts):
        end = cut[end]
        starts.append(end)
    return [0] + starts[::-1]


def _greedy_starts(weights: Sequence[float], num_parts: int, cap: float) -> list[int]:
    """Fills parts from the left up to ``cap`` (leaving one item per remaining part), as DeepSpeed's probe."""
    starts, load = [0], 0.0
    for i, w in enumerate(weights):
        must_cut = len(weights) - i == num_parts - len(starts)
        if i > starts[-1] and len(starts) < num_parts and (load + w > cap or must_cut):
            starts.append(i)
            load = 0.0
        load += w
    return starts


def _param_split(units: list[_Unit], num_parts: int) -> list[int]:
    counts = [float(u.num_params) for u in units]
    starts = _min_max_starts(counts, num_parts)
    bounds = starts + [len(units)]
    cap = max(sum(counts[a:b]) for a, b in zip(bounds, bounds[1:]))
    return _greedy_starts(counts, num_parts, cap)


def _layer_split(units: list[_Unit], num_parts: int) -> list[int]:
    return [round(k * len(units) / num_parts) for k in range(num_parts)]


# ----------------------------------------------------------------------------- balance table


@dataclass
class _Row:
    """Balance ratios (max stage cost / mean stage cost) of one model at one number of stages."""

    model: str
    num_stages: int
    ours: float
    auto: float
    auto_replicated: bool
    forced: float  # plan(..., tied_weights="replicate")
    optimal: float
    tied_optimal: float | None  # None: the model shares no parameters between modules
    param_split: float
    layer_split: float
    floor: float  # the costliest unit (or tied group) alone, x stages: no plan goes below it
    floor_what: str
    tie: float  # the costliest tied group alone, x stages; 0 without ties
    tie_what: str
    copy_floor: float  # the costliest tied leaf plus its weight's copy, x stages: no replicated plan goes below it
    copy_floor_what: str

    @property
    def vs_optimal(self) -> float:
        return self.ours / self.optimal - 1.0


def _balance(tr: ModelTrace, stage_of: dict[str, int], num_stages: int, charge_copies: bool = True) -> float:
    """Max stage cost / mean stage cost of the model without copies (costs are normalised by it: mean 1/stages)."""
    costs = stage_costs(tr, stage_of, num_stages, memory_weight=MEMORY_WEIGHT, charge_copies=charge_copies)
    return max(costs) * num_stages


def _best_balance(tr: ModelTrace, sequences: list[list[list[_Unit]]], num_stages: int) -> float:
    """The exact min-max contiguous split of the best of ``sequences``, scored with ``stage_costs`` (no copies)."""
    return min(
        _balance(tr, _stage_of(tr, blocks, _min_max_starts([sum(u.cost for u in b) for b in blocks], num_stages)),
                 num_stages, charge_copies=False)
        for blocks in sequences
    )


def _copy_floor(tr: ModelTrace, units: list[_Unit]) -> tuple[float, str]:
    """The costliest leaf holding a tied weight plus that weight's copy (0 without ties)."""
    unit_of = {fqn: u for u in units for fqn in u.members}
    best, what = 0.0, ""
    for shared in tr.shared_parameters:
        one_copy = MEMORY_WEIGHT * shared.num_bytes * 3.0 / _total_bytes(tr)
        for holder in shared.holders[1:]:
            unit = unit_of[holder]
            if shared.holders[0] not in unit.members and unit.cost + one_copy > best:
                best = unit.cost + one_copy
                what = f"{unit.fqn} ({100 * unit.cost:.1f}%) + a copy of {shared.fqn} ({100 * one_copy:.1f}%)"
    return best, what


def _total_bytes(tr: ModelTrace) -> float:
    """The cost model's memory total: parameter bytes x 3 plus the leaves' output bytes."""
    return sum(r.param_bytes * 3.0 + (r.activation_bytes if not r.children else 0) for r in tr.modules.values())


def _rows(name: str, tr: ModelTrace) -> tuple[list[_Row], float]:
    """The table rows of one model, and the slowest ``plan`` call in seconds."""
    units = _leaf_sequence(tr)
    tied = _tied_sequences(tr, units) if tr.shared_groups else None
    blocks = tied[0] if tied else [[u] for u in units]
    heaviest = max(blocks, key=_block_cost)
    heaviest_tie = max((b for b in blocks if len(b) > 1), key=_block_cost, default=[])
    copy_floor, copy_floor_what = _copy_floor(tr, units)
    rows, seconds = [], 0.0
    for n in NUM_STAGES:
        start = time.perf_counter()
        ours = plan(tr, n, memory_weight=MEMORY_WEIGHT)
        seconds = max(seconds, time.perf_counter() - start)
        start = time.perf_counter()
        auto = plan(tr, n, memory_weight=MEMORY_WEIGHT, tied_weights="auto")
        seconds = max(seconds, time.perf_counter() - start)
        rows.append(
            _Row(
                model=name,
                num_stages=n,
                ours=_balance(tr, ours.stage_of, n),
                auto=_balance(tr, auto.stage_of, n),
                auto_replicated=bool(auto.replicated),
                forced=_balance(tr, plan(tr, n, memory_weight=MEMORY_WEIGHT, tied_weights="replicate").stage_of, n),
                optimal=_best_balance(tr, [[[u] for u in units]], n),
                tied_optimal=_best_balance(tr, tied, n) if tied else None,
                param_split=_balance(tr, _stage_of(tr, [[u] for u in units], _param_split(units, n)), n),
                layer_split=_balance(tr, _stage_of(tr, [[u] for u in units], _layer_split(units, n)), n),
                floor=_block_cost(heaviest) * n,
                floor_what=_describe(heaviest),
                tie=_block_cost(heaviest_tie) * n,
                tie_what=_describe(heaviest_tie),
                copy_floor=copy_floor * n,
                copy_floor_what=copy_floor_what,
            )
        )
    return rows, seconds


def _block_cost(block: Sequence[_Unit]) -> float:
    return sum(u.cost for u in block)


def _describe(block: Sequence[_Unit]) -> str:
    return " + ".join(u.fqn for u in block) + f" ({100 * _block_cost(block):.1f}% of the cost)"


def _format(rows: list[_Row]) -> str:
    header = ("model", "stages", "ours", "ours+rep", "replicate", "optimal", "tied opt", "param-split", "layer-split",
              "ours/opt-1", "rep/opt-1")
    lines = [
        (r.model, str(r.num_stages), f"{r.ours:.3f}", f"{r.auto:.3f}" + ("*" if r.auto_replicated else " "),
         f"{r.forced:.3f}",
         f"{r.optimal:.3f}", "-" if r.tied_optimal is None else f"{r.tied_optimal:.3f}", f"{r.param_split:.3f}",
         f"{r.layer_split:.3f}", f"{100 * r.vs_optimal:+.1f}%", f"{100 * (r.auto / r.optimal - 1):+.1f}%")
        for r in rows
    ]
    widths = [max(len(row[c]) for row in [header, *lines]) for c in range(len(header))]

    def line(cells: tuple[str, ...]) -> str:
        return " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(header), "-+-".join("-" * w for w in widths), *map(line, lines)])


def _goal_vs_optimal(r: _Row) -> str:
    where = f"{r.model}, {r.num_stages} stages"
    if r.vs_optimal <= GOAL_VS_OPTIMAL:
        return f"ok    {where}: ours {100 * r.vs_optimal:+.1f}% vs optimal"
    if r.tied_optimal is not None and r.tied_optimal > r.optimal * (1 + GOAL_VS_OPTIMAL):
        from_tied = 100 * (r.ours / r.tied_optimal - 1)
        return (
            f"MISS  {where}: ours {100 * r.vs_optimal:+.1f}% vs optimal; structural: the tied group {r.tie_what} "
            f"must share a stage, so the best tie-respecting contiguous split is {r.tied_optimal:.3f} (the group "
            f"alone: {r.tie:.3f}); ours is {from_tied:+.1f}% from it"
        )
    return f"MISS  {where}: ours {100 * r.vs_optimal:+.1f}% vs optimal"


def _goal_vs_baselines(r: _Row) -> str:
    where = f"{r.model}, {r.num_stages} stages"
    scores = f"ours {r.ours:.3f}, param-split {r.param_split:.3f}, layer-split {r.layer_split:.3f}"
    best = min(r.param_split, r.layer_split)
    at_floor = f"the bottleneck is {r.floor_what} alone, {r.floor:.3f} x the mean stage"
    if r.ours < best - 1e-6:
        margin = 100 * (best / r.ours - 1)
        note = f" (by {margin:.1f}%: {at_floor})" if margin < 1 and r.ours <= r.floor + 1e-6 else ""
        return f"ok    {where}: {scores}{note}"
    if best >= r.optimal - 1e-6 and r.ours <= best + 1e-6:
        why = at_floor if r.optimal <= r.floor + 1e-6 else "that baseline happens to hit the optimal contiguous split"
        return f"TIE   {where}: {scores}; no contiguous plan beats {best:.3f}: {why}"
    return f"MISS  {where}: {scores}"


def _goal_replicate(r: _Row) -> str:
    where = f"{r.model}, {r.num_stages} stages"
    vs = 100 * (r.auto / r.optimal - 1)
    worse = r.auto > r.ours + 1e-9
    verdict = f"ours+rep {vs:+.1f}% vs optimal, {100 * (r.auto / r.ours - 1):+.2f}% vs ours"
    if worse:
        return f"MISS  {where}: {verdict} (worse than colocating)"
    if vs <= 100 * GOAL_VS_OPTIMAL:
        return f"ok    {where}: {verdict}"
    if r.copy_floor > r.optimal * (1 + GOAL_VS_OPTIMAL):
        return (
            f"MISS  {where}: {verdict}; structural: {r.copy_floor_what} must share a stage in any replicated plan "
            f"({r.copy_floor:.3f} x the mean stage alone); ours+rep is {100 * (r.auto / r.copy_floor - 1):+.1f}% "
            "from that floor"
        )
    return f"MISS  {where}: {verdict}"


def _check_goals(rows: list[_Row]) -> list[str]:
    lines = [_goal_vs_optimal(r) for r in rows]
    lines += [_goal_vs_baselines(r) for r in rows if r.model in BASELINE_GOAL_MODELS]
    lines += [_goal_replicate(r) for r in rows if r.tied_optimal is not None]
    return lines


# ----------------------------------------------------------------------------- measured GPT step


def _gpt_step_split(repeats: int = 10) -> None:
    """Plans the example GPT on 2 stages and prints the predicted and the measured per-stage split of one step."""
    from examples.gpt import GPT

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = GPT(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=128, dropout=0.0)
    data = torch.randint(0, 256, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    x, y = data[:, :-1], data[:, 1:]  # (B, T) each

    def loss() -> torch.Tensor:
        logits = model(x)  # (B, T, V)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    model_trace = trace(model, loss)
    p = plan(model_trace, 2, memory_weight=MEMORY_WEIGHT)
    compute_only = stage_costs(model_trace, p.stage_of, 2, memory_weight=0.0)
    clock = _StageClock(model, p.stage_of)
    steps = []  # per step: [phase][stage] seconds
    for step in range(repeats + 2):  # the first two warm up
        model.zero_grad(set_to_none=True)
        clock.start()
        value = loss()
        clock.phase = 1
        value.backward()
        if step >= 2:
            steps.append(clock.stop())
    clock.remove()
    fwd, bwd = ([statistics.median(s[phase][k] for s in steps) for k in range(2)] for phase in (0, 1))
    total = [f + b for f, b in zip(fwd, bwd)]
    print(f"\nExample GPT (configs/gpt_pp2.yaml model; one microbatch of {BATCH} x {SEQ} bytes) on 2 stages, measured "
          f"on one process, 1 thread, median of {repeats} steps:")
    print(p.format_table(model_trace))
    print(f"\nstage | predicted cost (w={MEMORY_WEIGHT}) | predicted, compute only | measured fwd ms | bwd ms | "
          "fwd+bwd ms | measured share")
    for k in range(2):
        print(f"{k:5} | {100 * p.stage_costs[k]:22.1f}% | {100 * compute_only[k]:22.1f}% | {1e3 * fwd[k]:15.1f} | "
              f"{1e3 * bwd[k]:6.1f} | {1e3 * total[k]:10.1f} | {100 * total[k] / sum(total):13.1f}%")


class _StageClock:
    """Attributes the wall time of a single-process step to stages and phases (0 forward, 1 backward).

    Hooks on the modules whose stage differs from their parent's push that stage while their forward
    (forward pre-hook .. forward hook) or backward (full backward pre-hook .. full backward hook) runs;
    all other time (the root's own code, the loss) belongs to stage 0 with the root.
    """

    def __init__(self, model: nn.Module, stage_of: dict[str, int]) -> None:
        self.num_stages = max(stage_of.values()) + 1
        self.handles = []
        for fqn, module in model.named_modules():
            if fqn and stage_of[fqn] != stage_of[fqn.rpartition(".")[0]]:
                stage = stage_of[fqn]
                self.handles += [
                    module.register_forward_pre_hook(lambda *_, s=stage: self._push(s)),
                    module.register_forward_hook(lambda *_: self._pop()),
                    module.register_full_backward_pre_hook(lambda *_, s=stage: self._push(s)),
                    module.register_full_backward_hook(lambda *_: self._pop()),
                ]

    def start(self) -> None:
        self.seconds = [[0.0] * self.num_stages for _ in range(2)]
        self.stack, self.phase = [0], 0
        self.last = time.perf_counter()

    def stop(self) -> list[list[float]]:
        self._tick()
        return self.seconds

    def _tick(self) -> None:
        now = time.perf_counter()
        self.seconds[self.phase][self.stack[-1]] += now - self.last
        self.last = now

    def _push(self, stage: int) -> None:
        self._tick()
        self.stack.append(stage)

    def _pop(self) -> None:
        self._tick()
        self.stack.pop()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


# ----------------------------------------------------------------------------- main


def main() -> None:
    rows, slowest = [], {}
    for name, make_trace in MODELS.items():
        model_rows, slowest[name] = _rows(name, make_trace())
        rows += model_rows
    print(f"Stage balance, max stage cost / mean stage cost (1.000 = perfect); memory_weight={MEMORY_WEIGHT}, "
          "optimizer_state_factor=3.0\n")
    print(_format(rows))
    print("\nparam-split and layer-split ignore tied weights, as optimal does; where they put tied modules on "
          "different stages they are\nscored as replicated plans (a copy charged to each further stage). * = "
          "tied_weights='auto' replicated.")
    print("\nGoals:")
    print("\n".join(_check_goals(rows)))
    print("\nSlowest plan() per model: " + ", ".join(f"{k} {1e3 * v:.0f} ms" for k, v in slowest.items()))
    _gpt_step_split()


if __name__ == "__main__":
    main()
