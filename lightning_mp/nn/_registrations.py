"""Built-in registrations: ``nn.Linear`` and ``nn.Embedding`` (as SMP's ``DistributedLinear`` /
``DistributedEmbedding``).

A marked ``nn.Linear`` becomes column-parallel with a gathered output (its output stays replicated, so any
surrounding code keeps working; padded when ``out_features`` does not divide); a marked ``nn.Embedding`` becomes
vocab-parallel. Larger patterns (attention, MLP, whole blocks) avoid the gather: register them, or use a
model's translation (Hugging Face ``tp_plan``).
"""

from __future__ import annotations

from torch import nn

from lightning_mp.nn._embedding import DistributedEmbedding
from lightning_mp.nn._linear import DistributedLinear
from lightning_mp.tp import tp_register_with_module


def _linear_args(module: nn.Linear) -> tuple[tuple, dict]:
    args = (module.in_features, module.out_features, module.bias is not None)
    return args, {"gather_output": True, "vocab_padded": True}


def _embedding_args(module: nn.Embedding) -> tuple[tuple, dict]:
    unsupported = {
        "max_norm": module.max_norm is not None,
        "sparse": module.sparse,
        "scale_grad_by_freq": module.scale_grad_by_freq,
    }
    used = [name for name, on in unsupported.items() if on]
    if used:
        raise ValueError(f"nn.Embedding with {used} has no vocab-parallel counterpart; drop those options.")
    return (module.num_embeddings, module.embedding_dim, module.padding_idx), {}


def register_builtins() -> None:
    """Register the built-in counterparts (idempotent)."""
    tp_register_with_module(nn.Linear, DistributedLinear, init_hook=_linear_args)
    tp_register_with_module(nn.Embedding, DistributedEmbedding, init_hook=_embedding_args)
