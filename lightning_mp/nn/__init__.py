"""Distributed (tensor-parallel) modules, SMP's ``smp.nn``: each takes its :class:`~lightning_mp.tp.TPGroup`.

Also the translations that build them: :func:`translate_hf` (Hugging Face models) and the built-in registrations.
Built on :mod:`lightning_mp.tp`, which never imports this package.
"""

from lightning_mp.nn._base import TPModule, local_state_dicts
from lightning_mp.nn._embedding import DistributedEmbedding, vocab_parallel_cross_entropy, vocab_range
from lightning_mp.nn._hf import translate_hf
from lightning_mp.nn._linear import DistributedLinear
from lightning_mp.nn._moe import DistributedMoE, MoE, register_moe, route
from lightning_mp.nn._registrations import register_builtins
from lightning_mp.nn._transformer import (
    DistributedAttention,
    DistributedMLP,
    DistributedTransformer,
    DistributedTransformerLayer,
    DistributedTransformerLMHead,
)

__all__ = [
    "DistributedAttention",
    "DistributedEmbedding",
    "DistributedLinear",
    "DistributedMLP",
    "DistributedMoE",
    "MoE",
    "DistributedTransformer",
    "DistributedTransformerLMHead",
    "DistributedTransformerLayer",
    "TPModule",
    "local_state_dicts",
    "route",
    "translate_hf",
    "vocab_parallel_cross_entropy",
    "vocab_range",
]

register_builtins()
register_moe()
