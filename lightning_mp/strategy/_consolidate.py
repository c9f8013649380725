"""From a checkpoint folder to one plain state dict (``lightning-mp consolidate``), and from any plain weights to
an ``smp`` run (``SMPStrategy(load_weights=...)``).

A checkpoint folder already holds every parameter under its original FQN with its full shape (see [Note: shards
in checkpoints] in ``_shards.py``), so consolidating is one DCP read of the ``state_dict`` entries on one process
(no process group, no lightning_mp needed to use the result): tp pieces are stitched by DCP, pipeline stages were
saved under disjoint keys. A parameter shared by several modules is stored once under its original FQN; the
checkpoint's ``meta.pt`` records its other names, which consolidation writes again so that the unmodified
model loads the file with ``load_state_dict(strict=True)``. With ``hf=True`` the LightningModule's transformers
model is written as a Hugging Face folder (its config, recorded at save, and ``model.safetensors`` under its own
keys, tied copies left out as ``save_pretrained`` does), which ``from_pretrained`` loads.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

__all__ = ["consolidate", "hf_info", "read_weights"]

_META = "meta.pt"
_PLAN_KEY = "lightning_mp"  # as strategy/_placement.PLAN_KEY
_PREFIX = "state_dict."


def hf_info(module: nn.Module) -> dict[str, Any] | None:
    """The first transformers model inside ``module``: ``{"prefix", "architecture", "config"}`` (None if none)."""
    if "transformers.modeling_utils" not in sys.modules:  # no transformers model can exist yet
        return None
    from transformers import PreTrainedModel

    for fqn, sub in module.named_modules():
        if isinstance(sub, PreTrainedModel):
            return {"prefix": fqn + "." if fqn else "", "architecture": type(sub).__name__, "config": sub.config.to_dict()}
    return None


def _read_state_dict(folder: Path) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Every ``state_dict`` tensor of a checkpoint folder, whole, on CPU; and its ``meta.pt`` (lightning_mp's part)."""
    if not (folder / _META).is_file() or not (folder / ".metadata").is_file():
        raise FileNotFoundError(
            f"{folder} is not a complete lightning_mp checkpoint folder (it needs {_META} and .metadata; a save that"
            " died half-way leaves a hidden '.<name>.partial' folder instead)."
        )
    metadata = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    request = {
        key[len(_PREFIX) :]: torch.empty(md.size, dtype=md.properties.dtype)
        for key, md in metadata.items()
        if key.startswith(_PREFIX) and isinstance(md, TensorStorageMetadata)
    }
    with warnings.catch_warnings():  # DCP warns on every single-process load, even when asked for one
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load({"state_dict": request}, checkpoint_id=str(folder), no_dist=True)
    meta = torch.load(folder / _META, map_location="cpu", weights_only=False)
    return request, meta.get(_PLAN_KEY, {}) if isinstance(meta, dict) else {}


def consolidate(folder: str | Path, out: str | Path, hf: bool = False) -> Path:
    """Write the model of the checkpoint ``folder`` as one plain state dict at ``out``.

    ``out`` ending in ``.safetensors``: a safetensors file; otherwise ``torch.save`` of a dict of tensors. With
    ``hf``: ``out`` is a folder with ``config.json`` and ``model.safetensors`` of the LightningModule's
    transformers model, under that model's keys.

    Raises:
        FileNotFoundError: ``folder`` is not a complete checkpoint folder.
        ValueError: ``hf`` for a checkpoint of a model without a transformers model inside.
    """
    state, info = _read_state_dict(Path(folder))
    out = Path(out)
    aliases: Mapping[str, str] = info.get("tied_names", {})  # other name -> original FQN
    if not hf:
        for other, original in aliases.items():
            if other not in state and original in state:
                state[other] = state[original]
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.suffix == ".safetensors":
            _save_safetensors(_unshared(state), out)
        else:
            torch.save(state, out)
        return out
    hf_meta = info.get("hf")
    if not hf_meta:
        raise ValueError(
            f"{folder} holds no transformers model (none was found in the LightningModule when it was saved);"
            " consolidate without --hf for a plain state dict."
        )
    from transformers import AutoConfig

    prefix = hf_meta["prefix"]
    weights = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    config_dict = dict(hf_meta["config"])
    config = AutoConfig.for_model(config_dict.pop("model_type"), **config_dict)
    config.architectures = [hf_meta["architecture"]]
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    _save_safetensors(_unshared(weights), out / "model.safetensors")
    return out


def _save_safetensors(state: dict[str, Tensor], path: Path) -> None:
    """``safetensors.torch.save_file``, leaving the file with the mode ``torch.save`` gives (0666 less the umask;
    safetensors writes 0600)."""
    from safetensors.torch import save_file

    save_file(state, str(path), metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o666 & ~umask)


def _unshared(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """safetensors refuses tensors that share memory: a copy of each repeated one."""
    seen: set[int] = set()
    out = {}
    for key, value in state.items():
        ptr = value.untyped_storage().data_ptr()
        out[key] = value.contiguous().clone() if ptr in seen else value.contiguous()
        seen.add(ptr)
    return out


def read_weights(path: str | Path, hf_prefix: str = "") -> dict[str, Tensor]:
    """Whole tensors from ``path``: a plain state dict (``.pt``/``.bin``/``.safetensors``), a Lightning checkpoint
    file (its ``state_dict``), a lightning_mp checkpoint folder, or a Hugging Face folder (``config.json`` and
    ``*.safetensors`` or ``pytorch_model*.bin``; keys get ``hf_prefix``, the transformers model's FQN + ".").

    Raises:
        FileNotFoundError: nothing readable at ``path``.
    """
    path = Path(path)
    if path.is_dir() and (path / _META).is_file():
        return _read_state_dict(path)[0]
    if path.is_dir():
        files = sorted(path.glob("*.safetensors")) or sorted(path.glob("pytorch_model*.bin"))
        if not files:
            raise FileNotFoundError(f"{path} has no *.safetensors or pytorch_model*.bin weights.")
        state: dict[str, Tensor] = {}
        for file in files:
            state.update(_read_file(file))
        return {hf_prefix + k: v for k, v in state.items()}
    if not path.is_file():
        raise FileNotFoundError(f"No weights at {path}: pass a state dict file, a Lightning .ckpt, or a folder.")
    state = _read_file(path)
    if isinstance(state.get("state_dict"), Mapping):  # a Lightning checkpoint
        state = dict(state["state_dict"])
    return {k: v for k, v in state.items() if isinstance(v, Tensor)}


def _read_file(path: Path) -> dict[str, Any]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    loaded = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    if not isinstance(loaded, Mapping):
        raise ValueError(f"{path} holds a {type(loaded).__name__}, not a state dict.")
    return dict(loaded)


def main(argv: list[str]) -> None:
    """``lightning-mp consolidate CKPT_DIR OUT [--hf]``."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="lightning-mp consolidate",
        description="Write a lightning_mp checkpoint folder as one plain state dict (.pt, or .safetensors by"
        " extension), or with --hf as a Hugging Face folder that from_pretrained loads.",
    )
    parser.add_argument("checkpoint", help="a checkpoint folder written with save_distributed_checkpoint=True")
    parser.add_argument("out", help="output file (.pt / .safetensors) or, with --hf, output folder")
    parser.add_argument("--hf", action="store_true", help="write Hugging Face keys and config")
    args = parser.parse_args(argv)
    written = consolidate(args.checkpoint, args.out, hf=args.hf)
    print(json.dumps({"written": str(written)}))
