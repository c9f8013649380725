"""Byte-level language-modelling data from local text files.

No download: by default the data is the Python standard library's own ``.py``
sources, which exist wherever Python does.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

#: File suffixes collected when a path is a directory.
TEXT_SUFFIXES = (".py", ".txt", ".md")
#: Directory names never descended into for the default (stdlib) corpus.
_STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


class TrainWindows(Dataset):
    """Fixed-length training windows at pseudo-random offsets.

    Window ``i`` starts at ``i * block_size + shift[i]`` with ``shift[i]`` drawn
    once in ``[0, block_size)`` from ``seed``, so windows cover the whole stream
    without being aligned to a grid, and the dataset is deterministic. The
    DataLoader shuffles the order.

    Args:
        data: The byte stream, a uint8 tensor of shape ``(N,)``.
        block_size: Window length ``T``.
        seed: Seed for the per-window shifts.
    """

    def __init__(self, data: torch.Tensor, block_size: int, seed: int) -> None:
        self.data = data
        self.block_size = block_size
        n = (len(data) - block_size - 1) // block_size
        if n <= 0:
            raise ValueError(f"training split has {len(data)} bytes, too few for block_size={block_size}")
        g = torch.Generator().manual_seed(seed)
        self.offsets = torch.arange(n) * block_size + torch.randint(0, block_size, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Return window ``i``.

        Returns:
            ``(x, y)`` LongTensors of shape ``(T,)``, ``y`` being ``x`` shifted by one byte.
        """
        o = int(self.offsets[i])
        chunk = self.data[o : o + self.block_size + 1].long()  # (T + 1,)
        return chunk[:-1], chunk[1:]


class ValWindows(Dataset):
    """Non-overlapping consecutive windows: window ``i`` starts at ``i * block_size``.

    Args:
        data: The byte stream, a uint8 tensor of shape ``(N,)``.
        block_size: Window length ``T``.
    """

    def __init__(self, data: torch.Tensor, block_size: int) -> None:
        self.data = data
        self.block_size = block_size
        self.n = (len(data) - 1) // block_size
        if self.n <= 0:
            raise ValueError(f"validation split has {len(data)} bytes, too few for block_size={block_size}")

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Return window ``i``.

        Returns:
            ``(x, y)`` LongTensors of shape ``(T,)``, ``y`` being ``x`` shifted by one byte.
        """
        o = i * self.block_size
        chunk = self.data[o : o + self.block_size + 1].long()  # (T + 1,)
        return chunk[:-1], chunk[1:]


class ByteTextDataModule(pl.LightningDataModule):
    """Raw bytes of local text files as a next-byte prediction task.

    Every byte is one token (vocabulary of 256), so the model's cross-entropy
    is in **nats per byte**. An untrained model predicting uniformly scores
    ``ln 256 = 5.55``; a unigram byte model on Python source is around 3.1;
    each nat per byte is ``1 / ln 2 = 1.44`` bits per byte.

    The files are read in sorted path order and concatenated (each followed by
    a newline) until ``max_bytes`` have been read. The last ``val_fraction``
    of that byte stream is the validation split, a contiguous tail so that it
    does not overlap the training text.

    Batches are ``(x, y)`` LongTensors of shape ``(batch_size, block_size)``
    where ``y[:, t]`` is the byte that follows ``x[:, t]`` in the stream
    (``y`` is ``x`` shifted left by one byte). Both loaders drop the last
    partial batch, so every batch splits evenly into pipeline microbatches
    when ``batch_size`` is divisible by their number.

    Args:
        paths: Text files and/or directories. Directories are searched
            recursively for ``*.py``, ``*.txt`` and ``*.md`` files. ``None``
            uses the ``.py`` files of the Python standard library (skipping
            ``site-packages`` and test directories).
        block_size: Sequence length ``T`` of each sample.
        batch_size: Samples per batch ``B``.
        val_fraction: Fraction of the byte stream held out (from its end) for
            validation.
        max_bytes: Cap on the total number of bytes read.
        num_workers: DataLoader worker processes.
        seed: Seed for the (fixed) offsets of the training windows.
    """

    def __init__(
        self,
        paths: list[str] | None = None,
        block_size: int = 128,
        batch_size: int = 16,
        val_fraction: float = 0.05,
        max_bytes: int = 20_000_000,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        self.save_hyperparameters()
        self.paths = paths
        self.block_size = block_size
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.max_bytes = max_bytes
        self.num_workers = num_workers
        self.seed = seed
        self.train_data: torch.Tensor | None = None  # uint8 (N_train,)
        self.val_data: torch.Tensor | None = None  # uint8 (N_val,)

    def _files(self) -> list[Path]:
        """List the input files in a deterministic (sorted) order."""
        if self.paths is None:
            root = Path(sysconfig.get_paths()["stdlib"])
            files = []
            for dirpath, dirnames, filenames in os.walk(root):
                dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP_DIRS]
                files += [Path(dirpath) / f for f in filenames if f.endswith(".py")]
            return sorted(files)

        files = []
        for p in map(Path, self.paths):
            if p.is_file():
                files.append(p)
            elif p.is_dir():
                files += sorted(f for f in p.rglob("*") if f.suffix in TEXT_SUFFIXES and f.is_file())
            else:
                raise ValueError(f"ByteTextDataModule: path does not exist: {p}")
        return files

    def _read(self) -> torch.Tensor:
        """Read and concatenate the files, up to ``max_bytes``.

        Returns:
            A uint8 tensor of shape ``(N,)``.
        """
        buf = bytearray()
        for f in self._files():
            remaining = self.max_bytes - len(buf)
            if remaining <= 0:
                break
            with open(f, "rb") as fh:
                buf += fh.read(remaining)
            if len(buf) < self.max_bytes:
                buf += b"\n"
        if not buf.strip():
            where = self.paths if self.paths is not None else "the Python standard library"
            raise ValueError(f"ByteTextDataModule: no text found in {where} (looked for {TEXT_SUFFIXES})")
        return torch.frombuffer(buf, dtype=torch.uint8).clone()

    def setup(self, stage: str | None = None) -> None:
        """Read the text and split it into training and validation streams."""
        if self.train_data is not None:
            return
        data = self._read()  # (N,)
        n_val = max(self.block_size + 1, int(len(data) * self.val_fraction))
        self.train_data, self.val_data = data[:-n_val], data[-n_val:]

    def train_dataloader(self) -> DataLoader:
        """Shuffled random-offset windows, batches of ``(B, T)``."""
        return DataLoader(
            TrainWindows(self.train_data, self.block_size, self.seed),
            batch_size=self.batch_size,
            shuffle=True,
            drop_last=True,
            num_workers=self.num_workers,
        )

    def val_dataloader(self) -> DataLoader:
        """Consecutive windows from the start of the validation tail, in order.

        The set of batches is fixed; limit it with ``Trainer(limit_val_batches=...)``.
        """
        return DataLoader(
            ValWindows(self.val_data, self.block_size),
            batch_size=self.batch_size,
            shuffle=False,
            drop_last=True,
            num_workers=self.num_workers,
        )
