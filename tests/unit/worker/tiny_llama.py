"""A tiny random Llama saved as a Hugging Face folder: fast to load, exercises the
safetensors path with untied embeddings."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from spillway.services.worker.loading import load_runner
from spillway.services.worker.runner import ModelRunner
from spillway.shared.config import load_settings
from tests.tiny_llama_config import TINY_LLAMA_SHAPES, tiny_llama_config

TINY_VOCAB = 256


def save_tiny_llama(folder: Path, tie_word_embeddings: bool = False) -> Path:
    from transformers import LlamaForCausalLM

    config = tiny_llama_config(TINY_VOCAB, 512, tie_word_embeddings=tie_word_embeddings)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    # Random init is near-uniform; a wider spread makes greedy choices clear-cut.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    model.save_pretrained(folder)
    return folder


def tiny_runner(folder: Path, kv_blocks: int = 64, **settings_: object) -> ModelRunner:
    settings = load_settings(
        model=str(folder), kv_blocks=kv_blocks, device="cpu", dtype="float32", **settings_
    )
    runner, _model_id = load_runner(settings)
    return runner


TINY_SYNTHETIC_CONFIG = {
    "model_type": "llama",
    "vocab_size": TINY_VOCAB,
    **TINY_LLAMA_SHAPES,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "eos_token_id": 2,
}


def write_synthetic_config(folder: Path, **changes: object) -> Path:
    """A config.json for `--model synthetic:<path>`: the tiny shapes, weights made at load."""
    path = folder / "config.json"
    path.write_text(json.dumps({**TINY_SYNTHETIC_CONFIG, **changes}))
    return path
