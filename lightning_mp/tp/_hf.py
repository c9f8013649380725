"""Hugging Face translations (placeholder, filled in below)."""

from __future__ import annotations

from torch import nn


def translate_hf(module: nn.Module):
    return None
