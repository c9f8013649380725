"""The example GPT under tensor parallelism: one registration and one mark, the model code unchanged.

``examples.gpt.Block`` is registered with its distributed counterpart (same parameter names, so the swap loads
the original weights by key); ``TPGPT`` marks the whole model, so at setup ``SMPStrategy`` swaps every
``Block`` for a :class:`lightning_mp.nn.DistributedTransformerLayer` (heads and MLP features split over the tp
group), the token and position embeddings for vocab-parallel ``DistributedEmbedding``\\ s, and the tied
``lm_head`` for a column-parallel ``DistributedLinear`` that shares the embedding's shard. LayerNorms stay
replicated. Run it with ``configs/gpt_tp2.yaml``.
"""

from __future__ import annotations

import lightning_mp
from examples.gpt import GPT, Block
from lightning_mp.nn import DistributedTransformerLayer


def _block_args(block: Block) -> tuple[tuple, dict]:
    sizes = (block.attn.n_embd, block.attn.n_head)
    return sizes, {"dropout": block.attn.dropout, "hidden": block.mlp.c_fc.out_features}


lightning_mp.tp_register_with_module(Block, DistributedTransformerLayer, init_hook=_block_args)


class TPGPT(GPT):
    """:class:`examples.gpt.GPT`, marked for tensor parallelism (same arguments)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        lightning_mp.set_tensor_parallelism(self)
