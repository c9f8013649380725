"""Distributed (tensor-parallel) modules, SMP's ``smp.nn``: each takes its :class:`~lightning_mp.tp.TPGroup`."""

from lightning_mp.nn._base import TPModule
from lightning_mp.nn._embedding import DistributedEmbedding, vocab_parallel_cross_entropy, vocab_range
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
    "route",
    "vocab_parallel_cross_entropy",
    "vocab_range",
]

register_builtins()
register_moe()
