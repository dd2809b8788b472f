"""The model's limits are read from the GGUF once, then from the cache."""

from __future__ import annotations

from spillway.services.gateway import model_facts
from spillway.services.gateway.model_facts import ModelFacts, load_model_facts
from spillway.shared.config import DEFAULT_MODEL
from spillway.shared.model_files import ModelSource, resolve_model


def test_gguf_facts_are_read_once_then_cached(tmp_path, monkeypatch):
    calls = []

    def read(source: ModelSource) -> ModelFacts:
        calls.append(source)
        return ModelFacts(context_length=8192, vocab_size=49152)

    monkeypatch.setattr(model_facts, "_read_facts", read)
    source = resolve_model(DEFAULT_MODEL)
    first = load_model_facts(source, tmp_path)
    second = load_model_facts(source, tmp_path)
    assert first == second == ModelFacts(8192, 49152)
    assert len(calls) == 1
    assert len(list((tmp_path / "model_facts").glob("*.json"))) == 1


def test_hf_folder_facts_come_from_config_json(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4,'
        ' "hidden_size": 64, "intermediate_size": 128, "vocab_size": 321,'
        ' "max_position_embeddings": 1024}'
    )
    facts = load_model_facts(ModelSource("tiny", "hf", tmp_path), tmp_path / "cache")
    assert facts == ModelFacts(context_length=1024, vocab_size=321)
    assert not (tmp_path / "cache").exists()
