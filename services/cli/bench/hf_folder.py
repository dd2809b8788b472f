"""A Hugging Face folder of the bench's model, for a peer that loads no GGUF (vLLM).

A GGUF file is read by transformers' GGUF loader (its quantized tensors dequantized to
float32, the values our exact mode and the transformers peer compute with) and saved as
safetensors with its config and tokenizer, once, into the cache folder keyed by the file's
content. A folder that already holds config.json is used as it is.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import shutil
import uuid
from pathlib import Path

from spillway.shared.model_files import ModelSource
from spillway.shared.tokenizer_files import cache_folder, load_tokenizer

# Bumped when the layout of a converted folder changes, so old folders are not reused.
FORMAT = 1
_CHUNK = 16 << 20


def hf_folder(source: ModelSource, cache_dir: str | Path) -> Path:
    """The folder a Hugging Face loader reads `source` from: its own for an HF model, a
    converted copy in `cache_dir`/hf-models/ for a GGUF file (converted on first use)."""
    if source.kind == "hf":
        return source.path
    if source.kind != "gguf":
        raise ValueError(f"a {source.kind} model has no weights to write as a folder")
    folder = Path(cache_dir).expanduser() / "hf-models" / content_key(source.path)
    if not (folder / "config.json").is_file():
        convert(source, folder, cache_dir)
    return folder


def content_key(path: Path) -> str:
    """The file's name and a hash of its whole content: weights change anywhere in it."""
    digest = hashlib.sha256(f"spillway-hf-folder-{FORMAT}".encode())
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return f"{path.stem}-{digest.hexdigest()[:16]}"


def convert(source: ModelSource, folder: Path, cache_dir: str | Path) -> None:
    """Writes the float32 weights, config and tokenizer of the GGUF `source` into
    `folder`, atomically (a concurrent conversion of the same file just loses the race)."""
    import torch
    from transformers import AutoModelForCausalLM

    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = folder.parent / f".{folder.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    try:
        # The GGUF loader and the writer draw progress bars of their own; the bench's
        # output stays a table.
        with contextlib.redirect_stderr(io.StringIO()):
            model = AutoModelForCausalLM.from_pretrained(
                str(source.path.parent), gguf_file=source.path.name, dtype=torch.float32
            )
            plain_float32(model)
            model.save_pretrained(str(staging))
        # The tokenizer as the bench and the server read it (converted once, cached).
        load_tokenizer(source, cache_dir)
        for path in cache_folder(source, cache_dir).iterdir():
            if path.is_file():
                shutil.copy2(path, staging / path.name)
        try:
            staging.rename(folder)
        except OSError:
            if not (folder / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def plain_float32(model) -> None:
    """Makes the loaded model savable as an ordinary float32 checkpoint: transformers
    marks a model it read from GGUF as GGUF-quantized, which it refuses to save, though
    its weights were dequantized into plain float32 tensors. A transformers that kept
    weights in GGUF blocks is refused here, not written as a checkpoint vLLM misreads."""
    import torch

    odd = {str(t.dtype) for t in model.state_dict().values() if t.dtype != torch.float32}
    if odd:
        raise ValueError(f"transformers kept GGUF weights as {sorted(odd)}, not float32")
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
