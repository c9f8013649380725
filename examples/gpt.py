"""A small GPT language model as a plain LightningModule.

This follows Karpathy's nanoGPT ``model.py``: a decoder-only transformer with
learned absolute position embeddings, pre-LayerNorm blocks, GELU MLPs and an
output head tied to the token embedding. It contains no parallelism code at
all; run it with ``Trainer(strategy="smp")`` (see ``configs/gpt_pp2.yaml``) to
have ``lightning_mp`` partition it into pipeline stages automatically.

The module tree is kept flat and nanoGPT-like on purpose, because the
partitioner works on it::

    GPT
    ├── wte      nn.Embedding(vocab_size, n_embd)      token embedding
    ├── wpe      nn.Embedding(block_size, n_embd)      position embedding
    ├── drop     nn.Dropout
    ├── h        nn.Sequential(Block, ..., Block)  (n_layer blocks; a Sequential, so that lightning_mp sends the
    │            blocks of one stage as one request: see [Note: sequential runs] in lightning_mp/pipeline/_install.py)
    │            └── ln_1, attn (CausalSelfAttention), ln_2, mlp (MLP)
    ├── ln_f     nn.LayerNorm(n_embd)
    └── lm_head  nn.Linear(n_embd, vocab_size, bias=False)  (weight tied to wte)

Notation used in the shape comments: ``B`` batch size, ``T`` sequence length
(``<= block_size``), ``C`` embedding width (``n_embd``), ``nh`` number of
heads, ``hs`` head size (``C // nh``), ``V`` vocabulary size.
"""

from __future__ import annotations

import functools
import math

import lightning.pytorch as pl
import torch
import torch.nn as nn
from torch.nn import functional as F


class CausalSelfAttention(nn.Module):
    """Multi-head masked self-attention.

    Args:
        n_embd: Embedding width ``C``.
        n_head: Number of attention heads; must divide ``n_embd``.
        dropout: Dropout probability on the attention weights and the output.
    """

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        assert n_embd % n_head == 0, "n_embd must be divisible by n_head"
        self.n_head = n_head
        self.n_embd = n_embd
        self.dropout = dropout
        # key, query, value projections for all heads, in one matmul
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        # output projection (a residual projection: scaled init, see GPT)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend causally over the sequence.

        Args:
            x: Input activations of shape ``(B, T, C)``.

        Returns:
            Output activations of shape ``(B, T, C)``.
        """
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C), heads side by side
        return self.resid_dropout(self.c_proj(y))  # (B, T, C)


class MLP(nn.Module):
    """Position-wise feed-forward network with a 4x hidden width.

    Args:
        n_embd: Embedding width ``C``.
        dropout: Dropout probability on the output.
    """

    def __init__(self, n_embd: int, dropout: float) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU()
        # residual projection: scaled init, see GPT
        self.c_proj = nn.Linear(4 * n_embd, n_embd)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MLP to every position.

        Args:
            x: Input activations of shape ``(B, T, C)``.

        Returns:
            Output activations of shape ``(B, T, C)``.
        """
        x = self.gelu(self.c_fc(x))  # (B, T, 4C)
        return self.dropout(self.c_proj(x))  # (B, T, C)


class Block(nn.Module):
    """A pre-LayerNorm transformer block: attention then MLP, both residual.

    Args:
        n_embd: Embedding width ``C``.
        n_head: Number of attention heads.
        dropout: Dropout probability.
    """

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run one block.

        Args:
            x: Input activations of shape ``(B, T, C)``.

        Returns:
            Output activations of shape ``(B, T, C)``.
        """
        x = x + self.attn(self.ln_1(x))  # (B, T, C)
        x = x + self.mlp(self.ln_2(x))  # (B, T, C)
        return x


def _warmup_cosine(step: int, warmup_steps: int, max_steps: int) -> float:
    """Learning-rate multiplier: linear warmup, then cosine decay to 10%.

    Args:
        step: Optimizer steps taken so far (0-based).
        warmup_steps: Steps of linear warmup from ``1 / warmup_steps`` to 1.
        max_steps: Total training steps; the multiplier reaches 0.1 there and
            stays at 0.1 afterwards. If ``<= 0`` (unknown length, e.g.
            ``Trainer(max_steps=-1)``) there is no decay after warmup.

    Returns:
        The factor applied to the base learning rate.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if max_steps <= 0:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


class GPT(pl.LightningModule):
    """A nanoGPT-style decoder-only transformer language model.

    Args:
        vocab_size: Number of token ids ``V`` (256 for raw bytes).
        block_size: Maximum sequence length ``T`` (size of the position table).
        n_layer: Number of transformer blocks.
        n_head: Number of attention heads per block.
        n_embd: Embedding width ``C``; must be divisible by ``n_head``.
        dropout: Dropout probability (0 disables dropout).
        learning_rate: Peak AdamW learning rate, reached after warmup.
        weight_decay: AdamW weight decay for the 2-D weights of linear layers.
            Biases, LayerNorm parameters and embeddings (including the output
            head, which shares the token embedding's weight) are not decayed.
        warmup_steps: Steps of linear learning-rate warmup; afterwards the
            rate follows a cosine down to 10% at ``trainer.max_steps``.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 128,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        learning_rate: float = 3e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 50,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.block_size = block_size

        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.h = nn.Sequential(*[Block(n_embd, n_head, dropout) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        # weight tying: the output head reuses the token embedding matrix
        self.lm_head.weight = self.wte.weight

        # init all weights, then scale the residual projections by 1/sqrt(2 * n_layer),
        # per the GPT-2 paper (each block adds two residual branches)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Compute next-token logits.

        Args:
            idx: Token ids, a LongTensor of shape ``(B, T)`` with
                ``T <= block_size``.

        Returns:
            Logits of shape ``(B, T, V)``; position ``t`` predicts token ``t + 1``.
        """
        B, T = idx.size()
        assert T <= self.block_size, f"sequence length {T} > block_size {self.block_size}"
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)  # (T,)

        tok_emb = self.wte(idx)  # (B, T, C)
        pos_emb = self.wpe(pos)  # (T, C)
        x = self.drop(tok_emb + pos_emb)  # (B, T, C)
        x = self.h(x)  # (B, T, C)
        x = self.ln_f(x)  # (B, T, C)
        return self.lm_head(x)  # (B, T, V)

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch  # (B, T), (B, T)
        logits = self(x)  # (B, T, V)
        # mean over all B*T positions; in nats per token (= per byte for ByteTextDataModule)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Next-token cross-entropy on one batch.

        Args:
            batch: ``(x, y)`` LongTensors of shape ``(B, T)``, ``y`` being ``x``
                shifted left by one token.
            batch_idx: Index of the batch in the epoch.

        Returns:
            The scalar mean loss over all ``B * T`` positions.
        """
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Next-token cross-entropy on one validation batch, logged as ``val_loss``.

        Args:
            batch: ``(x, y)`` LongTensors of shape ``(B, T)``.
            batch_idx: Index of the batch.

        Returns:
            The scalar mean loss over all ``B * T`` positions.
        """
        loss = self._loss(batch)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        """AdamW with weight decay on linear weights and a warmup-cosine schedule.

        Parameter groups are built from ``self.named_parameters()`` at call
        time, so they reflect whatever parameters the module holds then (a
        model-parallel strategy may have moved or re-created them). Shared
        parameters appear once; the tied ``wte``/``lm_head`` weight counts as
        an embedding and is not decayed.

        Returns:
            A Lightning optimizer config dict with a per-step LR scheduler.
        """
        # classify by the owning module; a parameter owned by a no-decay module
        # anywhere (e.g. the tied embedding) is not decayed
        no_decay = set()
        for module in self.modules():
            for pname, p in module.named_parameters(recurse=False):
                if isinstance(module, (nn.Embedding, nn.LayerNorm)) or pname == "bias":
                    no_decay.add(id(p))

        decay_params, no_decay_params = [], []
        for _, p in self.named_parameters():  # deduplicates shared parameters
            if not p.requires_grad:
                continue
            if id(p) in no_decay or p.dim() < 2:
                no_decay_params.append(p)
            else:
                decay_params.append(p)

        optimizer = torch.optim.AdamW(
            [
                {"params": decay_params, "weight_decay": self.hparams.weight_decay},
                {"params": no_decay_params, "weight_decay": 0.0},
            ],
            lr=self.hparams.learning_rate,
            betas=(0.9, 0.95),
        )
        max_steps = self.trainer.max_steps if self._trainer is not None else -1
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            functools.partial(
                _warmup_cosine, warmup_steps=max(1, self.hparams.warmup_steps), max_steps=max_steps
            ),
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
