"""The gateway's tokenizer agrees with transformers on the same GGUF file: chat template
ids, plain encoding, decoding; the conversion is cached; per-token bytes are exact."""

from __future__ import annotations

import json
import shutil

import pytest

from spillway.services.gateway.chat_template import ChatTemplate, ChatTemplateError
from spillway.services.gateway.tokenizer import load_tokenizer, load_tokenizer_folder
from spillway.shared import tokenizer_files as tokenizer_module
from spillway.shared.config import DEFAULT_MODEL
from spillway.shared.model_files import ModelSource, resolve_model

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2 + 2?"},
    ],
    [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one, with ümlauts and 日本語 and 🎉 please"},
    ],
    [
        {"role": "system", "content": "Multi\nline\n\nsystem prompt with   spaces  "},
        {"role": "user", "content": "  leading and trailing whitespace  "},
        {"role": "assistant", "content": "<|im_end|> is special"},
        {"role": "user", "content": "1234567890 and code: def f(x):\n    return x**2"},
    ],
]

TEXTS = [
    "Hello world",
    "  two leading spaces",
    "numbers 12345 and 3.14159",
    "emoji 🎉🚀👍🏽 and CJK 你好世界 and Arabic مرحبا",
    "tabs\tand\nnewlines\r\n",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
    "",
]


@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=range(len(CONVERSATIONS)))
def test_chat_template_ids_equal_transformers(tokenizer, reference_tokenizer, conversation):
    want = reference_tokenizer.apply_chat_template(
        conversation, add_generation_prompt=True, tokenize=True
    )
    if not isinstance(want, list):  # transformers 5 returns a BatchEncoding
        want = want["input_ids"]
    assert tokenizer.encode_chat(conversation) == want


def test_default_system_prompt_is_added_without_a_system_message(tokenizer):
    text = tokenizer.render_chat([{"role": "user", "content": "Hi"}])
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("text", TEXTS)
def test_encode_and_decode_equal_transformers(tokenizer, reference_tokenizer, text):
    ids = tokenizer.encode(text)
    assert ids == reference_tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=False) == reference_tokenizer.decode(ids)
    assert tokenizer.decode(ids) == reference_tokenizer.decode(ids, skip_special_tokens=True)


def test_special_tokens_and_vocabulary(tokenizer):
    assert tokenizer.special_tokens["bos_token"] == "<|im_start|>"
    assert tokenizer.special_tokens["eos_token"] == "<|im_end|>"
    assert tokenizer.vocab_size == 49152
    assert tokenizer.decode([2]) == ""  # special: left out of output text


def test_token_bytes_rebuild_a_character_split_over_tokens(tokenizer):
    text = "a 🎉 b 世界"
    ids = tokenizer.encode(text)
    assert b"".join(tokenizer.token_bytes(i) for i in ids) == text.encode()
    assert tokenizer.token_bytes(2) == b"<|im_end|>"
    assert tokenizer.token_bytes(tokenizer.encode(" hello")[0]) == b" hello"


def test_conversion_is_cached_and_reused(converted, tmp_path, monkeypatch):
    folder, _ = converted
    source = resolve_model(DEFAULT_MODEL)
    cached = tmp_path / "tokenizers" / tokenizer_module.cache_key(source)
    shutil.copytree(folder, cached)

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted again although the cache holds the tokenizer")

    monkeypatch.setattr(tokenizer_module, "convert_tokenizer", no_conversion)
    loaded = load_tokenizer(source, tmp_path)
    assert loaded.encode("cached") == load_tokenizer_folder(folder).encode("cached")
    assert loaded.chat_template is not None


def test_hf_folder_reads_template_from_tokenizer_config(converted, tmp_path):
    folder, _ = converted
    shutil.copy(folder / "tokenizer.json", tmp_path / "tokenizer.json")
    template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    config = {"bos_token": {"content": "<|im_start|>"}, "eos_token": "<|im_end|>"}
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({**config, "chat_template": template})
    )
    (tmp_path / "config.json").write_text("{}")
    tok = load_tokenizer(ModelSource("tiny", "hf", tmp_path), tmp_path / "cache")
    assert tok.special_tokens["bos_token"] == "<|im_start|>"
    assert tok.render_chat([{"role": "user", "content": "x"}]) == "[user]x"
    assert not (tmp_path / "cache").exists()  # a folder with tokenizer.json needs no cache


def test_template_raise_exception_is_a_chat_template_error():
    template = ChatTemplate(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}ok",
        {"bos_token": "<s>"},
    )
    assert template.render([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ChatTemplateError, match="user first"):
        template.render([{"role": "assistant", "content": "x"}])


def test_template_sandbox_refuses_unsafe_attribute_access():
    template = ChatTemplate("{{ messages.__class__.__mro__ }}", {})
    with pytest.raises(ChatTemplateError):
        template.render([])


def test_template_sees_special_tokens_and_tojson_keeps_unicode():
    template = ChatTemplate("{{ bos_token }}{{ messages[0] | tojson }}", {"bos_token": "<s>"})
    out = template.render([{"role": "user", "content": "é<b>"}])
    assert out == '<s>{"role": "user", "content": "é<b>"}'
