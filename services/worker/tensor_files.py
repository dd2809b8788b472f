"""The tensors of a Hugging Face safetensors folder, by name (every shard, checked against
the index when there is one)."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def safetensors_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    out: dict[str, torch.Tensor] = {}
    for file in files:
        out.update(load_file(str(file)))
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        missing = set(json.loads(index.read_text())["weight_map"]) - set(out)
        if missing:
            raise FileNotFoundError(f"safetensors shards missing tensors: {sorted(missing)[:5]}")
    return out
