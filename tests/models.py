"""Tiny models shared by the equivalence tests: an MLP stack, a data-dependent branch, tied embeddings."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MLPStack(nn.Module):
    """Linear/Tanh blocks. (B, D) -> (B, D)."""

    def __init__(self, dim: int = 16, depth: int = 6) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(dim, dim), nn.Tanh()) for _ in range(depth)])
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(x)).squeeze(-1)  # (B,)

    @staticmethod
    def loss(model: nn.Module, batch) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(model(x), y)

    @staticmethod
    def batch(n: int = 8, dim: int = 16, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(n, dim, generator=g), torch.randn(n, generator=g)


class Branchy(nn.Module):
    """A data-dependent branch that calls one submodule twice, a None and a dict crossing stages."""

    def __init__(self, dim: int = 12) -> None:
        super().__init__()
        self.encoder = nn.Linear(dim, dim)
        self.block = nn.Sequential(nn.Linear(dim, dim), nn.GELU())
        self.gate = Gate(dim)
        self.out = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.encoder(x))
        h = self.block(h)
        if h.mean() > 0:  # data-dependent: taken for some microbatches only
            h = self.block(h)
        parts = self.gate({"h": h, "scale": 0.5, "mask": None})
        return self.out(parts["h"] * parts["g"]).squeeze(-1)

    @staticmethod
    def loss(model: nn.Module, batch) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(model(x), y)

    @staticmethod
    def batch(n: int = 8, dim: int = 12, seed: int = 1):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(n, dim, generator=g) + 0.3, torch.randn(n, generator=g)


class Gate(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, inputs: dict) -> dict:
        assert inputs["mask"] is None
        return {"h": inputs["h"], "g": torch.sigmoid(self.proj(inputs["h"])) * inputs["scale"], "n": 3}


class TinyLM(nn.Module):
    """Token embedding tied to the output head. (B, T) token ids -> (B, T, V) logits."""

    def __init__(self, vocab: int = 32, dim: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.GELU()) for _ in range(depth)])
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)  # (B, T, C)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)  # (B, T, V)

    @staticmethod
    def loss(model: nn.Module, batch) -> torch.Tensor:
        x, y = batch
        logits = model(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    @staticmethod
    def batch(n: int = 8, t: int = 6, vocab: int = 32, seed: int = 2):
        g = torch.Generator().manual_seed(seed)
        data = torch.randint(0, vocab, (n, t + 1), generator=g)
        return data[:, :-1], data[:, 1:]


def expand_placement(model: nn.Module, placement: dict[str, int]) -> dict[str, int]:
    """Every module's stage: the innermost entry of ``placement`` above it, else stage 0."""
    stage_of = {}
    for fqn, _ in model.named_modules(remove_duplicate=False):
        parts = fqn.split(".") if fqn else []
        stage = 0
        for depth in range(len(parts) + 1):
            prefix = ".".join(parts[:depth])
            if prefix in placement:
                stage = placement[prefix]
        stage_of[fqn] = stage
    return stage_of


class PlacedMLP(MLPStack):
    """MLPStack whose layer 1 is built inside ``with lightning_mp.partition(1)`` and head inside ``partition(0)``."""

    def __init__(self, dim: int = 16, depth: int = 6) -> None:
        import lightning_mp

        nn.Module.__init__(self)
        layers = []
        for index in range(depth):
            if index == 1:
                with lightning_mp.partition(1):
                    layers.append(nn.Sequential(nn.Linear(dim, dim), nn.Tanh()))
            else:
                layers.append(nn.Sequential(nn.Linear(dim, dim), nn.Tanh()))
        self.layers = nn.Sequential(*layers)
        with lightning_mp.partition(0):
            self.head = nn.Linear(dim, 1)
