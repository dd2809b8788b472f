"""The two facts about the model the gateway checks requests against: its context length
and vocabulary size.

Reading them from a GGUF file means parsing all its metadata (seconds: the vocabulary
alone is tens of thousands of strings), so for a GGUF they are kept in the cache folder,
keyed by the file's content like the converted tokenizer, and read back at once afterwards.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from spillway.shared.model_config import load_base_config
from spillway.shared.model_files import ModelSource
from spillway.shared.tokenizer_files import cache_key


@dataclass(frozen=True)
class ModelFacts:
    context_length: int
    vocab_size: int


def load_model_facts(source: ModelSource, cache_dir: str | Path) -> ModelFacts:
    if source.kind != "gguf":
        return _read_facts(source)
    path = Path(cache_dir).expanduser() / "model_facts" / f"{cache_key(source)}.json"
    if path.is_file():
        return ModelFacts(**json.loads(path.read_text()))
    facts = _read_facts(source)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    staging.write_text(json.dumps(asdict(facts)))
    os.replace(staging, path)
    return facts


def _read_facts(source: ModelSource) -> ModelFacts:
    config = load_base_config(source)
    return ModelFacts(context_length=config.context_length, vocab_size=config.vocab_size)
