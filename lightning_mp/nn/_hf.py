"""Hugging Face models under tensor parallelism, unmodified: their own ``tp_plan``, or a built-in translation.

:func:`translate_hf` is a :data:`~lightning_mp.tp._swap.Translation`: given a marked ``PreTrainedModel`` it
returns ``{module FQN: builder, or the reason there is none}``.

* A model whose class ships a plan (``model.tp_plan``: the class's ``_tp_plan`` merged with
  ``config.base_model_tp_plan``; Llama, Mistral, Qwen2, ...) is translated style by style, see ``_STYLES``.
  A style we do not support leaves that module unswapped, with the reason; the rest of the plan still applies.
  Style names are the installed transformers' (``colwise_rep`` was renamed ``colwise_gather_output``; both
  are read). Attention projections are checked against ``num_attention_heads`` / ``num_key_value_heads``.
  Plans are applied per sharded region (the parent of a column-parallel linear): a region is split whole or
  left replicated with the reason, and its replicated parameters have their gradients summed (see
  [Note: partial gradients]). A module whose class overrides ``forward`` (Gemma's scaled embedding) is left
  replicated with the reason, with whatever it is tied to.
* ``BertForMaskedLM`` / ``RobertaForMaskedLM`` (and their base models; no plan): a built-in plan with the same
  styles (q/k/v and the intermediate dense colwise, the attention and output dense rowwise, vocab-parallel
  word embeddings tied to a gathered MLM decoder).
* ``GPT2LMHeadModel`` / ``GPT2Model`` (no plan): ``Conv1D`` weights are ``(in, out)``, so they become
  ``DistributedLinear(transposed=True)`` and state dicts keep that layout; the fused ``c_attn`` is split
  per q/k/v block and the attention's ``split_size`` set to the local width.

Tied input/output embeddings stay tied: ``embedding_rowwise`` and ``colwise_gather_output`` on a ``(V, C)``
weight shard the same rows (:func:`~lightning_mp.tp._swap.swap_modules` re-ties them).
"""

from __future__ import annotations

import re

from torch import nn

from lightning_mp.nn._embedding import DistributedEmbedding
from lightning_mp.nn._linear import DistributedLinear
from lightning_mp.tp import Builder, TPGroup, check_divisible, load_from, mark

__all__ = ["SUPPORTED_STYLES", "translate_hf"]


def _check_forward(module: nn.Module, base: type[nn.Module]) -> None:
    """A subclass that overrides ``forward`` (Gemma's scaled embedding) would lose its maths in the swap."""
    if not isinstance(module, base):
        raise ValueError(f"style expects an nn.{base.__name__}, found {type(module).__name__}")
    if type(module).forward is not base.forward:
        raise ValueError(
            f"{type(module).__name__} overrides {base.__name__}.forward; the distributed {base.__name__} would drop"
            " that behaviour, so the module stays replicated"
        )


def _linear(**options) -> Builder:
    def build(module: nn.Module, tp: TPGroup) -> nn.Module:
        _check_forward(module, nn.Linear)
        new = DistributedLinear(module.in_features, module.out_features, module.bias is not None, tp=tp, **options)
        load_from(new, module)
        return new

    return build


def _embedding(module: nn.Module, tp: TPGroup) -> nn.Module:
    _check_forward(module, nn.Embedding)
    new = DistributedEmbedding(module.num_embeddings, module.embedding_dim, module.padding_idx, tp=tp)
    load_from(new, module)
    return new


def _replicated_with_grad_allreduce(module: nn.Module, tp: TPGroup) -> nn.Module:
    """A replicated module on sharded activations: each rank's gradient covers its shard, so they are summed
    (transformers' ``ReplicatedWithGradAllReduce`` all-reduces with SUM), see [Note: partial gradients]."""
    for param in module.parameters():
        mark(param, allreduce_grad="sum")
    module._lmp_distributed = True
    return module


_STYLES: dict[str, Builder] = {
    "colwise": _linear(parallel="column"),
    "rowwise": _linear(parallel="row"),
    "rowwise_split_input": _linear(parallel="row", input_is_parallel=False),
    "colwise_gather_output": _linear(parallel="column", gather_output=True, vocab_padded=True),
    "colwise_rep": _linear(parallel="column", gather_output=True, vocab_padded=True),
    "packed_colwise": _linear(parallel="column", parts=2),
    "embedding_rowwise": _embedding,
    "replicated_with_grad_allreduce": _replicated_with_grad_allreduce,
}
SUPPORTED_STYLES = tuple(_STYLES)


def _installed_styles() -> set[str] | None:
    """Style names the installed transformers knows (``None`` if it has no registry of them)."""
    try:
        from transformers.integrations import tensor_parallel  # noqa: F401  (registers the styles)
        from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES
    except ImportError:
        return None
    return set(getattr(ALL_PARALLEL_STYLES, "_global_mapping", {})) or None


def _is_hf(module: nn.Module) -> bool:
    return any(cls.__name__ == "PreTrainedModel" for cls in type(module).__mro__)


def translate_hf(module: nn.Module) -> dict[str, Builder | str] | None:
    """The swaps for a marked Hugging Face model, or ``None`` if ``module`` is not one we translate."""
    if not _is_hf(module):
        return None
    name = type(module).__name__
    if name in ("GPT2LMHeadModel", "GPT2Model"):
        return _gpt2(module)
    if name in _ENCODER_PLANS:
        return _from_plan(module, _encoder_plan(*_ENCODER_PLANS[name]), check_installed=False)
    plan = dict(getattr(module, "tp_plan", None) or {})
    if not plan:
        return None
    return _from_plan(module, plan)


# class name -> (prefix of the encoder, the tied MLM decoder or None)
_ENCODER_PLANS = {
    "BertForMaskedLM": ("bert.", "cls.predictions.decoder"),
    "BertModel": ("", None),
    "RobertaForMaskedLM": ("roberta.", "lm_head.decoder"),
    "RobertaModel": ("", None),
}


def _encoder_plan(prefix: str, decoder: str | None) -> dict[str, str]:
    """BERT / RoBERTa (no shipped plan): Megatron's split of every encoder layer, vocab-parallel embedding tied
    to a gathered MLM decoder (its bias, tied to ``predictions.bias``, stays replicated)."""
    layer = f"{prefix}encoder.layer.*."
    plan = {f"{prefix}embeddings.word_embeddings": "embedding_rowwise"}
    plan |= {f"{layer}attention.self.{name}": "colwise" for name in ("query", "key", "value")}
    plan |= {f"{layer}attention.output.dense": "rowwise", f"{layer}intermediate.dense": "colwise"}
    plan |= {f"{layer}output.dense": "rowwise"}
    if decoder is not None:
        plan[decoder] = "colwise_gather_output"
    return plan


def _from_plan(model: nn.Module, plan: dict[str, str], check_installed: bool = True) -> dict[str, Builder | str]:
    installed = _installed_styles() if check_installed else None
    config = getattr(model, "config", None)
    patterns = [(re.compile("^" + re.escape(key).replace(r"\*", r"\d+") + "$"), style) for key, style in plan.items()]
    out: dict[str, Builder | str] = {}
    styles: dict[str, str] = {}
    for fqn, _ in model.named_modules():
        style = next((style for pattern, style in patterns if pattern.match(fqn)), None)
        if style is None:
            continue
        styles[fqn] = style
        if installed is not None and style not in installed:
            out[fqn] = f"tp_plan style {style!r} is unknown to the installed transformers"
        elif style not in _STYLES:
            out[fqn] = f"tp_plan style {style!r} is not supported (supported: {', '.join(SUPPORTED_STYLES)})"
        elif re.search(r"attn|attention", fqn.rpartition(".")[0]) and config is not None:  # an attention projection
            out[fqn] = _with_head_check(_STYLES[style], config)
        else:
            out[fqn] = _STYLES[style]
    for region in sorted({fqn.rpartition(".")[0] for fqn, style in styles.items() if style in _SHARDING_STYLES} - {""}):
        _plan_region(model, region, out, config)
    return out


# [Note: partial gradients] Between a column-parallel linear that keeps its output sharded and the row-parallel
# one that reduces it, activations are sharded: a replicated parameter used there (Qwen3's per-head q_norm,
# Apertus' xIELU alpha_p, DiffLlama's lambdas) gets on each rank the gradient of its shard only, so its
# gradients are SUMMED over the tp group; one used on replicated activations has the full gradient already.
# The plan names some of them (``replicated_with_grad_allreduce``), not all: the region is the parent module of
# the sharding linears, and every replicated parameter in it that no planned swap takes is summed. A region
# whose plan cannot be applied whole, or whose module holds a per-head parameter the plan does not shard, is left
# replicated with the reason (its forward would mix local and full head layouts).
_SHARDING_STYLES = ("colwise", "packed_colwise")


def _plan_region(model: nn.Module, region: str, out: dict[str, Builder | str], config) -> None:
    """Refuse the planned swaps under ``region`` with the reason, or make them sum its unplanned parameters."""
    parent = model.get_submodule(region)
    inside = {fqn: entry for fqn, entry in out.items() if fqn.startswith(region + ".")}
    reason = _region_refusal(parent, region, inside, out.get(region), config)
    if reason is not None:
        out.update(dict.fromkeys(inside, reason))
        return
    planned = tuple(f"{fqn[len(region) + 1 :]}." for fqn in inside)
    partial = [p for name, p in parent.named_parameters() if not name.startswith(planned)]
    for fqn, entry in inside.items():
        if not isinstance(entry, str):
            out[fqn] = _summing(entry, partial)


def _region_refusal(parent: nn.Module, region: str, inside: dict, own_entry, config) -> str | None:
    where = f"sharded region {region!r} left replicated"
    refused = {fqn: entry for fqn, entry in inside.items() if isinstance(entry, str)}
    if isinstance(own_entry, str):
        return f"{where}: its own plan entry: {own_entry}"
    if refused:
        fqn, why = next(iter(refused.items()))
        return f"{where}: {fqn} cannot be swapped ({why})"
    heads = {getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)} - {None}
    for name, param in parent.named_parameters(recurse=False):
        if param.dim() >= 1 and param.size(0) in heads and param.size(0) > 1:
            return f"{where}: parameter {name!r} {tuple(param.shape)} is per head and the plan does not shard it"
    return None


def _summing(build: Builder, partial: list[nn.Parameter]) -> Builder:
    def build_and_mark(module: nn.Module, tp: TPGroup) -> nn.Module:
        new = build(module, tp)
        for param in partial:
            mark(param, allreduce_grad="sum")
        return new

    return build_and_mark


def _with_head_check(build: Builder, config) -> Builder:
    def checked(module: nn.Module, tp: TPGroup) -> nn.Module:
        heads = getattr(config, "num_attention_heads", None)
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        if heads:
            check_divisible("num_attention_heads", heads, tp.size)
            check_divisible("num_key_value_heads", kv_heads, tp.size)
        return build(module, tp)

    return checked


def _gpt2(model: nn.Module) -> dict[str, Builder | str]:
    prefix = "transformer." if hasattr(model, "transformer") else ""
    base = model.transformer if prefix else model
    out: dict[str, Builder | str] = {f"{prefix}wte": _embedding}
    for index, block in enumerate(base.h):
        out[f"{prefix}h.{index}.attn"] = _gpt2_attention
        out[f"{prefix}h.{index}.mlp.c_fc"] = _conv1d("column")
        out[f"{prefix}h.{index}.mlp.c_proj"] = _conv1d("row")
    if hasattr(model, "lm_head"):
        out["lm_head"] = _STYLES["colwise_gather_output"]
    return out


def _conv1d(parallel: str, parts: int = 1) -> Builder:
    def build(module: nn.Module, tp: TPGroup) -> nn.Module:
        in_features, out_features = module.weight.shape  # Conv1D: (in, out)
        new = DistributedLinear(in_features, out_features, tp=tp, parallel=parallel, parts=parts, transposed=True)
        load_from(new, module)
        return new

    return build


def _gpt2_attention(module: nn.Module, tp: TPGroup) -> nn.Module:
    """Swap ``c_attn`` (fused q/k/v, column) and ``c_proj`` (row) in place; the attention keeps its own code."""
    if getattr(module, "is_cross_attention", False):
        raise ValueError("GPT-2 cross-attention is not translated")
    check_divisible("n_head", module.num_heads, tp.size)
    c_attn, c_proj = _conv1d("column", parts=3)(module.c_attn, tp), _conv1d("row")(module.c_proj, tp)
    module.c_attn, module.c_proj = c_attn, c_proj
    module.split_size = module.embed_dim // tp.size
    module._lmp_distributed = True
    return module


