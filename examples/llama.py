"""A small random-init Llama from ``transformers`` as a LightningModule (no download), tensor-parallel through
transformers' own ``tp_plan``.

The model is ``transformers.LlamaForCausalLM`` built from a ``LlamaConfig`` (byte vocabulary of 256 by default,
tied input/output embeddings). With ``tensor_parallel=True`` the whole model is marked with
``lightning_mp.set_tensor_parallelism``; under ``SMPStrategy(tensor_parallel_degree=k)`` the strategy then reads
``model.tp_plan`` (q/k/v/gate/up column-parallel, o/down row-parallel, vocab-parallel embedding and a gathered
``lm_head`` sharing its shard) and swaps those modules at setup. Without the strategy it is a plain Llama.
Run it with ``configs/llama_tp2.yaml``.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch.nn import functional as F

import lightning_mp


class LlamaLM(pl.LightningModule):
    """Next-token language model around ``transformers.LlamaForCausalLM``.

    Args:
        vocab_size: ``V``.
        hidden_size: ``C``.
        intermediate_size: MLP width.
        num_hidden_layers: number of decoder layers.
        num_attention_heads: query heads; must divide by the tp degree to be split.
        num_key_value_heads: key/value heads (grouped-query attention); must divide by the tp degree.
        max_position_embeddings: longest sequence.
        tie_word_embeddings: share the input embedding and the output head.
        learning_rate: AdamW learning rate.
        tensor_parallel: mark the model for tensor parallelism.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        hidden_size: int = 128,
        intermediate_size: int = 256,
        num_hidden_layers: int = 4,
        num_attention_heads: int = 4,
        num_key_value_heads: int = 2,
        max_position_embeddings: int = 128,
        tie_word_embeddings: bool = True,
        learning_rate: float = 1e-3,
        tensor_parallel: bool = True,
    ) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        self.save_hyperparameters()
        config = LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=num_attention_heads,
            num_key_value_heads=num_key_value_heads,
            max_position_embeddings=max_position_embeddings,
            tie_word_embeddings=tie_word_embeddings,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
        )
        self.model = LlamaForCausalLM(config)
        if tensor_parallel:
            lightning_mp.set_tensor_parallelism(self.model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Args: idx: ``(B, T)`` token ids. Returns: logits ``(B, T, V)``."""
        return self.model(input_ids=idx).logits

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch  # (B, T), (B, T)
        logits = self(x)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.learning_rate)
