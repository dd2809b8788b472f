"""The real SmolLM2 tokenizer, converted once per session, and transformers' own tokenizer
for the same GGUF file (the reference the gateway's tokenizer must agree with)."""

from __future__ import annotations

import contextlib
import os
import shutil

import pytest

from spillway.services.gateway.tokenizer import ModelTokenizer, load_tokenizer_folder
from spillway.shared.config import DEFAULT_MODEL, Settings
from spillway.shared.model_files import resolve_model
from spillway.shared.tokenizer_files import cache_folder, convert_tokenizer


@pytest.fixture(scope="session")
def converted(tmp_path_factory):
    source = resolve_model(DEFAULT_MODEL)
    folder = tmp_path_factory.mktemp("tokenizers") / "smollm2"
    reference = convert_tokenizer(source, folder)
    # Seed the user cache with this conversion so that a gateway started later in the same
    # session (the integration tests) need not convert again. Only a speed-up: a cache that
    # cannot be written is left alone.
    cached = cache_folder(source, Settings().cache_dir)
    if not (cached / "tokenizer.json").is_file():
        staging = cached.with_name(f".{cached.name}.{os.getpid()}.seed")
        with contextlib.suppress(OSError):
            shutil.copytree(folder, staging)
            staging.rename(cached)
        shutil.rmtree(staging, ignore_errors=True)
    return folder, reference


@pytest.fixture(scope="session")
def reference_tokenizer(converted):
    """transformers' tokenizer built from the GGUF file."""
    return converted[1]


@pytest.fixture(scope="session")
def tokenizer(converted) -> ModelTokenizer:
    return load_tokenizer_folder(converted[0])
