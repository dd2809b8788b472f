"""--max-model-len caps what the worker tells its scheduler it serves; a cap beyond the
model's positions is refused at start, by the option's name; --chat-template's file (or
inline text) replaces the model's."""

from __future__ import annotations

import pytest

from spillway.services.worker.info import worker_info
from spillway.services.worker.loading import load_runner
from spillway.shared.config import load_settings
from spillway.shared.serving import chat_template_text, served_context_length, served_names


def _settings(model_dir, **more):
    return load_settings(
        model=str(model_dir), kv_blocks=64, block_size=16, device="cpu", dtype="float32",
        spill_store=False, **more,
    )  # fmt: skip


def test_the_worker_reports_the_capped_length(tiny_llama_dir):
    runner, _ = load_runner(_settings(tiny_llama_dir, max_model_len=100))
    assert runner.max_model_len == 100
    assert worker_info("w1", "m", runner).max_model_len == 100
    uncapped, _ = load_runner(_settings(tiny_llama_dir))
    assert uncapped.max_model_len == 512  # the model's positions (the KV holds 1024)


def test_a_cap_beyond_the_model_is_refused_by_name(tiny_llama_dir):
    with pytest.raises(ValueError, match="--max-model-len 4096"):
        load_runner(_settings(tiny_llama_dir, max_model_len=4096))


def test_chat_template_file_or_inline(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages }}")
    assert chat_template_text(str(path)) == "{{ messages }}"
    assert chat_template_text("{% for m in messages %}x{% endfor %}").startswith("{%")
    assert chat_template_text(None) is None
    with pytest.raises(ValueError, match="--chat-template"):
        chat_template_text(str(tmp_path / "missing.jinja"))


def test_served_names_and_context():
    assert served_names(None, "m") == ["m"]
    assert served_names(["a", "b", "a"], "m") == ["a", "b"]
    assert served_context_length(512, None) == 512
    assert served_context_length(512, 64) == 64
