"""The tensor-parallel zoo: every Hugging Face causal LM whose config ships a ``base_model_tp_plan`` (and the
built-in translations GPT-2, BERT, RoBERTa), built tiny, at tp=2 against the same model on one process.

All families run in ONE 2-process gloo group, one after the other: build (same seed on both ranks), keep a
deep copy as the one-process reference, swap (``translate_hf``), forward, backward, reduce the replicated
gradients as the strategy does, compare logits, loss and every parameter's gradient under its original FQN.

Each family ends as

* ``matches``: at least one module swapped; logits, loss and every gradient within ``TOLERANCE`` (relative
  2-norm error, per tensor, against at least ``FLOOR`` x the largest gradient norm; modules left unswapped
  stay replicated and are compared too) in float32, or, where float32 exceeds it and the family runs in
  float64, within ``FLOAT64_TOLERANCE`` in float64 with every op in float64 (rounding amplified by an
  ill-conditioned model shrinks with the precision; a defect does not);
* ``refused``: nothing swapped; the swap names why (everything stays replicated and exact);
* ``skipped``: the family cannot be built tiny (the reason is printed);
* ``WRONG``: anything else (a mismatch, or a crash after the swap). A silent mismatch is a defect.

Run (3 to 6 minutes on 2 busy CPU cores for the whole zoo)::

    PYTHONPATH=$PWD python scripts/tp_zoo.py                  # every family
    PYTHONPATH=$PWD python scripts/tp_zoo.py --part 0/3       # the third CI runs (tests/distributed/test_tp_zoo.py)
    PYTHONPATH=$PWD python scripts/tp_zoo.py --families llama,qwen3
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import logging
import os
import tempfile
import warnings
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.overrides import TorchFunctionMode

import lightning_mp
from lightning_mp.tp import TPGroup, reduce_replicated_grads, shard, shard_spec
from lightning_mp.nn._hf import translate_hf
from lightning_mp.tp._swap import swap_modules

TOLERANCE = 1e-5
"""Worst relative error (``|a - b| / |b|``, 2-norms, per tensor) a matching family may show in float32."""

FLOAT64_TOLERANCE = 1e-10
"""The same in float64, which decides a family beyond ``TOLERANCE`` in float32 that can run in float64: an
ill-conditioned model amplifies rounding (Gemma4, scaling 1 on normalised q and k: 4e-5 in float32, 1e-13 in
float64, against 4e-7 and 3e-16 for Llama); a defect does not shrink with the precision."""

FLOOR = 1e-3
"""A gradient smaller than ``FLOOR`` x the model's largest gradient norm is compared against that instead."""

MAX_ELEMENTS = 20_000_000
"""A family still bigger than this when built tiny (sub-models at full size, e.g. audio/vision towers) is skipped."""

BUILT_IN = {"gpt2": "GPT2LMHeadModel", "bert": "BertForMaskedLM", "roberta": "RobertaForMaskedLM"}
"""Families without a shipped plan that ``translate_hf`` translates itself."""

TINY = {
    "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2,
    "hidden_size": 32, "n_embd": 32, "d_model": 32,
    "num_attention_heads": 4, "n_head": 4, "num_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8,
    "intermediate_size": 64, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "n_inner": 64, "ffn_hidden_size": 64,
    "vocab_size": 64, "max_position_embeddings": 64, "n_positions": 64,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
    "rotary_dim": 4, "vocab_size_per_layer_input": 64, "hidden_size_per_layer_input": 8,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "use_cache": False,
}
"""The tiny shape: 2 layers, width 32, 4 heads of 8, 2 kv heads, vocabulary 64 (keys a config has are set)."""


@dataclass
class Row:
    """One family's outcome (the same on every rank)."""

    family: str
    model_class: str
    verdict: str
    swapped: int = 0
    unswapped: dict[str, str] = field(default_factory=dict)
    logits_error: float = float("nan")
    grad_error: float = float("nan")
    worst_grad: str = ""
    dtype: str = "float32"
    reason: str = ""


def families() -> dict[str, str]:
    """``{model_type: causal-LM class name}``: the installed transformers' families with a plan, and the
    built-in translations, sorted by name."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    found = dict(BUILT_IN)
    for model_type, class_name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        try:
            config_cls = CONFIG_MAPPING[model_type]
        except (KeyError, ValueError):
            continue
        if getattr(config_cls, "base_model_tp_plan", None) and isinstance(class_name, str):
            found[model_type] = class_name
    return dict(sorted(found.items()))


def _tiny_config(model_type: str):
    from transformers import CONFIG_MAPPING

    config_cls = CONFIG_MAPPING[model_type]
    defaults = config_cls().to_dict()
    config = config_cls(**{k: v for k, v in TINY.items() if k in defaults})
    for sub in [config, *(getattr(config, name) for name in ("text_config",) if hasattr(config, name))]:
        _shrink(sub)
    config._attn_implementation = "eager"
    return config


def _shrink(config) -> None:
    """Set the tiny sizes, zero every dropout, trim per-layer lists to the layer count."""
    keys = config.to_dict()
    for key, value in TINY.items():
        if key in keys and not isinstance(keys[key], (dict, list)):
            setattr(config, key, value)
    for key, value in keys.items():
        if isinstance(value, float) and ("dropout" in key or "pdrop" in key):
            setattr(config, key, 0.0)
        if isinstance(value, list) and len(value) > 2 and key.endswith(("layer_types", "_layers", "_pattern")):
            setattr(config, key, value[:2])
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = list(config.layer_types)[:2]



def tiny_model(model_type: str, class_name: str, seed: int = 0):
    """The family's model, tiny, in float32 (``ValueError`` with the reason if it cannot be built).

    float32, as trained (the MoE families' grouped matmul has no float64); ``check_family`` moves it to float64
    where float32 alone cannot decide.
    """
    import transformers

    torch.manual_seed(seed)
    try:
        if model_type in BUILT_IN:
            config = transformers.AutoConfig.for_model(model_type)
            _shrink(config)
            config._attn_implementation = "eager"
        else:
            config = _tiny_config(model_type)
        model = getattr(transformers, class_name)(config).float().eval()
    except Exception as err:  # noqa: BLE001 (any failure of a family's own code is its reason)
        raise ValueError(_first_line(err)) from err
    size = sum(t.numel() for t in (*model.parameters(), *model.buffers()))
    if size > MAX_ELEMENTS:
        raise ValueError(f"still {size:,} elements built tiny (> {MAX_ELEMENTS:,}): parts of its config are not shrunk")
    return model


def _relative(actual: torch.Tensor | None, expected: torch.Tensor | None, floor: float = 0.0) -> float:
    """``|a - b| / max(|b|, floor)`` (2-norms); a missing gradient counts as zeros."""
    if actual is None and expected is None:
        return 0.0
    actual = torch.zeros_like(expected) if actual is None else actual
    expected = torch.zeros_like(actual) if expected is None else expected
    diff = (actual.double() - expected.double()).norm().item()
    return diff / max(expected.double().norm().item(), floor, 1e-30) if diff else 0.0


def _compare(model, ref, out, ref_out, tp: TPGroup) -> tuple[float, float, str]:
    """Worst relative error of logits (and loss), of gradients, and the worst gradient's FQN."""
    logits = out.logits if hasattr(out, "logits") else out[0]
    ref_logits = ref_out.logits if hasattr(ref_out, "logits") else ref_out[0]
    logits_error = max(_relative(logits.detach(), ref_logits.detach()), _relative(out.loss, ref_out.loss))
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    params = dict(model.named_parameters(remove_duplicate=False))
    if set(params) != set(ref_params):
        missing = sorted(set(ref_params) ^ set(params))[:3]
        raise RuntimeError(f"parameter names differ from the original's: {missing}")
    # a gradient that is zero in exact arithmetic (a key bias under softmax, a router under normalised top-k)
    # is float32 noise on both sides: measured against FLOOR x the model's largest gradient instead
    floor = FLOOR * max((p.grad.norm().item() for p in ref_params.values() if p.grad is not None), default=0.0)
    worst, worst_name = 0.0, ""
    for name, param in params.items():
        expected, spec = ref_params[name].grad, shard_spec(param)
        if expected is not None and spec is not None:
            expected = shard(expected, spec, tp.rank, tp.size)
        error = _relative(param.grad, expected, floor)
        if error > worst:
            worst, worst_name = error, f"{name} (|g| {0 if expected is None else expected.norm().item():.1e})"
    return logits_error, worst, worst_name


class _Float64Everywhere(TorchFunctionMode):
    """Every float32 a model's code asks for (``.float()``, ``dtype=torch.float32``: an eager softmax's or a
    norm's upcast) is float64 instead, so that a float64 model computes in float64 throughout."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        func = torch.Tensor.double if func is torch.Tensor.float else func
        args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        kwargs = {k: torch.float64 if v is torch.float32 else v for k, v in (kwargs or {}).items()}
        return func(*args, **kwargs)


def check_family(model_type: str, class_name: str, tp: TPGroup) -> Row:
    """Build, swap, forward, backward and compare one family on this rank (every rank calls it together): in
    float32, and again in float64 where float32 exceeds ``TOLERANCE`` and the family runs in float64."""
    row = _check_family(model_type, class_name, tp, torch.float32)
    if row.verdict == "WRONG" and row.grad_error > TOLERANCE and row.logits_error <= TOLERANCE:
        wide = _check_family(model_type, class_name, tp, torch.float64)
        if wide.verdict != "skipped":  # skipped: no float64 path (a grouped matmul of experts); float32 decides
            wide.dtype = f"float64 (float32: {row.grad_error:.1e})"
            return wide
    return row


def _check_family(model_type: str, class_name: str, tp: TPGroup, dtype: torch.dtype) -> Row:
    row = Row(model_type, class_name, "WRONG", dtype=str(dtype).removeprefix("torch."))
    tolerance = FLOAT64_TOLERANCE if dtype == torch.float64 else TOLERANCE
    ids = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with _Float64Everywhere() if dtype == torch.float64 else contextlib.nullcontext():
        try:
            model = tiny_model(model_type, class_name).to(dtype)
            ref = copy.deepcopy(model)
            ref_out = _reference(ref, ids)
        except ValueError as err:
            row.verdict, row.reason = "skipped", str(err)
            return row
        lightning_mp.set_tensor_parallelism(model)
        try:
            return _swap_and_compare(row, model, ref, ref_out, ids, tp, tolerance)
        except Exception as err:  # noqa: BLE001 (a crash after the swap is a WRONG row with its message)
            row.reason = _first_line(err)
            return row


def _swap_and_compare(row: Row, model, ref, ref_out, ids: torch.Tensor, tp: TPGroup, tolerance: float) -> Row:
    """Swap ``model``, run it, compare it with ``ref`` (one process) and fill ``row``'s errors and verdict."""
    report = swap_modules(model, tp, translations=[translate_hf])
    row.swapped, row.unswapped = len(report.swapped), dict(report.skipped)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    reduce_replicated_grads(list(model.parameters()), tp.group)  # as the strategy does after backward
    row.logits_error, row.grad_error, row.worst_grad = _compare(model, ref, out, ref_out, tp)
    errors = torch.tensor([row.logits_error, row.grad_error], dtype=torch.float64)
    dist.all_reduce(errors, op=dist.ReduceOp.MAX, group=tp.group)
    row.logits_error, row.grad_error = errors.tolist()
    if max(row.logits_error, row.grad_error) > tolerance:
        row.reason = f"worst gradient {row.worst_grad}" if row.grad_error > tolerance else "logits or loss differ"
    elif row.swapped:
        row.verdict = "matches"
    else:
        row.verdict, row.reason = "refused", "; ".join(sorted(set(row.unswapped.values())))[:200] or "no plan"
    return row


def _reference(ref, ids: torch.Tensor):
    """The one-process forward and backward (``ValueError`` if the tiny family does not run at all)."""
    try:
        out = ref(input_ids=ids, labels=ids)
        out.loss.backward()
    except Exception as err:  # noqa: BLE001 (the family's own code fails tiny: it is skipped, with the reason)
        raise ValueError(f"the tiny model does not run on one process: {_first_line(err)}") from err
    return out


def _first_line(err: Exception) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0][:150]}" if str(err) else type(err).__name__


def select(part: str | None, names: str | None) -> dict[str, str]:
    """The families to run: all, ``names`` (comma-separated model types), or part ``i/n`` (every n-th)."""
    every = families()
    if names:
        unknown = sorted(set(names.split(",")) - set(every))
        if unknown:
            raise ValueError(f"unknown families {unknown}; known: {', '.join(every)}")
        return {k: every[k] for k in names.split(",")}
    if part:
        index, count = (int(x) for x in part.split("/"))
        if not 0 <= index < count:
            raise ValueError(f"--part {part!r}: expected i/n with 0 <= i < n, e.g. 0/3")
        return {k: v for i, (k, v) in enumerate(every.items()) if i % count == index}
    return every


def _worker(rank: int, init_file: str, chosen: dict[str, str], out_file: str) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=2, timeout=timedelta(seconds=120)
    )
    try:
        tp = TPGroup.of(dist.group.WORLD)
        rows = []
        for model_type, class_name in chosen.items():
            rows.append(check_family(model_type, class_name, tp))
            gc.collect()  # the models of a family hold reference cycles: free them before the next
        if rank == 0:
            torch.save(rows, out_file)
    finally:
        dist.destroy_process_group()


def run_zoo(chosen: dict[str, str]) -> list[Row]:
    """Run ``chosen`` (``{model_type: class name}``) on 2 gloo processes; the rows in order."""
    with tempfile.TemporaryDirectory() as tmp:
        out_file = os.path.join(tmp, "rows.pt")
        mp.start_processes(
            _worker, args=(os.path.join(tmp, "rendezvous"), chosen, out_file), nprocs=2, start_method="spawn"
        )
        return torch.load(out_file, weights_only=False)


def table(rows: list[Row]) -> str:
    """A Markdown table of ``rows`` and a count per verdict."""
    lines = [
        "| family | class | swapped | left unswapped (why) | dtype | logits rel. err | worst grad rel. err | verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        unswapped = "; ".join(sorted({why[:90] for why in r.unswapped.values()}))
        unswapped = f"{len(r.unswapped)}: {unswapped}" if r.unswapped else "0"
        verdict = f"{r.verdict} ({r.reason})" if r.reason and r.verdict != "matches" else r.verdict
        lines.append(
            f"| {r.family} | {r.model_class} | {r.swapped} | {unswapped} | {r.dtype} | {r.logits_error:.1e} |"
            f" {r.grad_error:.1e} | {verdict} |"
        )
    counts = {v: sum(r.verdict == v for r in rows) for v in ("matches", "refused", "WRONG", "skipped")}
    built = len(rows) - counts["skipped"]
    lines.append(
        f"\n{len(rows)} families: {counts['matches']} match, {counts['refused']} refused, {counts['WRONG']} wrong,"
        f" {counts['skipped']} cannot be built tiny; matched {counts['matches']}/{built} of those built"
        f" ({counts['matches'] / max(built, 1):.0%})."
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", help="i/n: run every n-th family starting at i (CI runs 0/3)")
    parser.add_argument("--families", help="comma-separated model types (e.g. llama,qwen3)")
    args = parser.parse_args()
    print(table(run_zoo(select(args.part, args.families))))


if __name__ == "__main__":
    main()
