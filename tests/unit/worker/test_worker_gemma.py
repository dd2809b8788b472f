"""Gemma 2 and Gemma 3 beyond the tests every family shares (test_worker_families.py for
folders, test_worker_gguf_archs.py for GGUF files of each tensor type against
transformers loading the same file): the GGUF keys transformers' loader ignores, read as
llama.cpp reads them and held against transformers' Gemma on the same weights; what the
config takes from a file's metadata; a chat through the runner."""

from __future__ import annotations

import json

import pytest
import torch
from gguf.constants import GGMLQuantizationType

from spillway.services.gateway.model_facts import load_model_facts
from spillway.services.gateway.tokenizer import load_tokenizer_folder
from spillway.services.worker.loading import load_runner
from spillway.services.worker.models.registry import load_model_config
from spillway.shared.config import DEFAULT_MODEL, Settings, load_settings
from spillway.shared.model_config import load_base_config
from spillway.shared.model_files import resolve_model
from spillway.shared.tokenizer_files import cache_folder, load_tokenizer
from tests.gguf_files import tiny_transformers_model, write_header_only, write_tiny_gguf
from tests.unit.worker.plans import generate
from tests.unit.worker.test_worker_gguf_archs import MIN_GAP, NEW_TOKENS, PROMPTS, START_STEPS
from tests.unit.worker.tiny_families import load_reference, reference_greedy, save_tiny_family

F32 = GGMLQuantizationType.F32


def _served(path) -> list[list[int]]:
    settings = load_settings(model=str(path), kv_blocks=16, device="cpu", dtype="float32")
    runner = load_runner(settings)[0]
    return generate(runner, PROMPTS, max_new_tokens=NEW_TOKENS, chunk=3, start_steps=START_STEPS)


def _greedy(model) -> list[list[int]]:
    out = []
    for prompt in PROMPTS:
        tokens, gap = reference_greedy(model, prompt, NEW_TOKENS)
        assert gap > MIN_GAP, gap
        out.append(tokens)
    return out


@pytest.mark.parametrize(
    ("family", "changes"),
    [
        ("gemma2", {"attn_logit_softcapping": 2.0, "final_logit_softcapping": 5.0}),
        ("gemma3", {"rope_scaling": {"rope_type": "linear", "factor": 8.0}}),
    ],
)
def test_keys_transformers_gguf_loader_ignores_are_honoured(tmp_path, family, changes):
    """transformers' GGUF loader reads neither Gemma 2's soft-caps nor Gemma 3's rope
    scaling: it takes Gemma's config defaults (caps 50 and 30, no scaling), which every
    real Gemma 2 file and Gemma 3 1B share, but not Gemma 3 4B and up (linear, 8).
    llama.cpp reads both, and so do we: a file holding other values is held against
    transformers' Gemma on the same (F32) weights with those values, and the same weights
    under the defaults come out otherwise."""
    path = write_tiny_gguf(tmp_path / f"{family}.gguf", family, F32, **changes)
    expected = _greedy(tiny_transformers_model(family, **changes))
    assert _served(path) == expected
    defaults = write_tiny_gguf(tmp_path / f"{family}-defaults.gguf", family, F32)
    assert _served(defaults) != expected


def test_the_config_reads_llama_cpp_s_gemma_keys(tmp_path):
    """Gemma 2: windows on every other layer (from layer 0), soft-caps from the file;
    Gemma 3: a full-attention layer every 6th, q/k norms, the sliding layers at base
    10000 and the others at the file's; both: GeGLU, embeddings times sqrt(hidden), the
    sandwich norms, the softmax scale head_dim ** -0.5 (their query_pre_attn_scalar)."""
    g2 = load_model_config(resolve_model(str(write_tiny_gguf(tmp_path / "2.gguf", "gemma2", F32))))
    assert (g2.architecture, g2.layer_windows, g2.qk_norm) == ("gemma2", (4, None), False)
    assert (g2.attn_logit_softcap, g2.final_logit_softcap) == (50.0, 30.0)
    assert g2.sliding_rope_theta is None
    g3 = load_model_config(resolve_model(str(write_tiny_gguf(tmp_path / "3.gguf", "gemma3", F32))))
    assert (g3.architecture, g3.layer_windows, g3.qk_norm) == (
        "gemma3_text", (4, 4, 4, 4, 4, None), True,
    )  # fmt: skip
    assert (g3.rope_theta, g3.sliding_rope_theta) == (1e6, 10000.0)
    assert (g3.attn_logit_softcap, g3.final_logit_softcap) == (None, None)
    for c in (g2, g3):
        assert (c.hidden_act, c.sandwich_norms, c.head_dim) == ("gelu_pytorch_tanh", True, 256)
        assert c.embedding_scale == 128**0.5 and c.attention_scale == 256**-0.5


@pytest.mark.parametrize(("arch", "blocks", "scalar"), [
    ("gemma2", 46, 4608 // 32), ("gemma2", 42, 128), ("gemma3", 62, 5376 // 32),
    ("gemma3", 48, 128),
])  # fmt: skip
def test_the_27b_models_scale_attention_by_the_width_over_heads(tmp_path, arch, blocks, scalar):
    """llama.cpp's rule, the checkpoints' query_pre_attn_scalar: (hidden / heads) ** -0.5
    for the 27B models (46 blocks for Gemma 2, 62 for Gemma 3), head_dim ** -0.5 for the
    others. Gemma 2's window and soft-caps default to 4096, 50 and 30 when a file has
    none; a Gemma 3 file without a window is refused."""
    hidden = 4608 if arch == "gemma2" else 5376
    keys = {
        "block_count": blocks, "embedding_length": hidden, "attention.head_count": 32,
        "attention.head_count_kv": 16, "attention.key_length": 128, "vocab_size": 256,
    }  # fmt: skip
    path = write_header_only(tmp_path / f"{arch}.gguf", arch, **keys)
    if arch == "gemma3":
        with pytest.raises(ValueError, match=r"no attention\.sliding_window"):
            load_model_config(resolve_model(str(path)))
        keys["attention.sliding_window"] = 1024
        path = write_header_only(tmp_path / f"{arch}-window.gguf", arch, **keys)
    config = load_model_config(resolve_model(str(path)))
    assert config.attention_scale == scalar**-0.5
    if arch == "gemma2":
        assert config.layer_windows[:2] == (4096, None)
        assert (config.attn_logit_softcap, config.final_logit_softcap) == (50.0, 30.0)


# Gemma's turns, with the markers as added tokens of SmolLM2's vocabulary.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n{{ message['content'] | trim }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def test_a_chat_through_the_runner_equals_transformers(tmp_path):
    """A Gemma 3 folder with SmolLM2's tokenizer and a Gemma chat template: what the
    gateway reads (context length, vocabulary, EOS from generation_config.json, the
    template) and the runner's greedy answer to a chat longer than the window, equal to
    transformers' on the rendered prompt."""
    from transformers import PreTrainedTokenizerFast

    source = resolve_model(DEFAULT_MODEL)
    load_tokenizer(source, Settings().cache_dir)  # converts the GGUF's tokenizer once
    tok = PreTrainedTokenizerFast.from_pretrained(str(cache_folder(source, Settings().cache_dir)))
    tok.add_tokens(["<start_of_turn>", "<end_of_turn>"], special_tokens=True)
    tok.chat_template = CHAT_TEMPLATE
    end_of_turn = tok.convert_tokens_to_ids("<end_of_turn>")
    folder = save_tiny_family(tmp_path, "gemma3_text", vocab_size=len(tok))
    (folder / "generation_config.json").write_text(f'{{"eos_token_id": [2, {end_of_turn}]}}')
    tok.save_pretrained(folder)

    config = load_base_config(resolve_model(str(folder)))
    assert config.eos_token_ids == (2, end_of_turn)
    facts = load_model_facts(resolve_model(str(folder)), tmp_path / "cache")
    assert (facts.context_length, facts.vocab_size) == (512, len(tok))
    messages = [
        {"role": "user", "content": "Where shall we go this weekend?"},
        {"role": "assistant", "content": "Somewhere by the sea."},
        {"role": "user", "content": "Which one?"},
    ]
    gateway = load_tokenizer_folder(folder)
    prompt = gateway.encode_chat(messages)
    assert prompt == tok(tok.apply_chat_template(messages, add_generation_prompt=True,
                         tokenize=False), add_special_tokens=False)["input_ids"]  # fmt: skip
    assert len(prompt) > 4 * 4  # the window is 4
    want, gap = reference_greedy(load_reference(folder), prompt, 8)
    assert gap > 1e-3
    settings = load_settings(model=str(folder), kv_blocks=64, device="cpu", dtype="float32")
    runner = load_runner(settings)[0]
    assert generate(runner, [prompt], 8, chunk=5) == [want]
    assert gateway.decode(want, skip_special_tokens=False) == tok.decode(want)


def test_an_image_text_gemma3_checkpoint_serves_its_language_model(tmp_path):
    """model_type gemma3 (Gemma3ForConditionalGeneration, as Gemma 3 4B and up ship): its
    text_config with the keys equal to Gemma3TextConfig's defaults left out (as
    transformers 4 wrote it), its language model's weights under `language_model.`, the
    vision tower and projector beside them, left out. Text prompts' greedy tokens equal
    transformers' image-text model's on the same folder."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from spillway.shared.model_config import _GEMMA3_TEXT_DEFAULTS
    from tests.unit.worker.tiny_families import _uncached_greedy

    text = dict(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=4,
        sliding_window_pattern=2, query_pre_attn_scalar=24, initializer_range=0.2,
        rope_scaling={"rope_type": "linear", "factor": 2.0}, tie_word_embeddings=False,
    )  # fmt: skip
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        image_size=28, patch_size=14,
    )  # fmt: skip
    config = Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=511,
        boi_token_index=509, eoi_token_index=510, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "language_model" in name and name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    saved = json.loads(path.read_text())
    sparse = {k: v for k, v in saved["text_config"].items() if _GEMMA3_TEXT_DEFAULTS.get(k) != v}
    assert len(sparse) < len(saved["text_config"])
    path.write_text(json.dumps({**saved, "text_config": sparse}))

    reference = Gemma3ForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float32)
    expected = []
    for prompt in PROMPTS:
        tokens, gap = _uncached_greedy(reference.eval(), prompt, NEW_TOKENS)
        assert gap > MIN_GAP, gap
        expected.append(tokens)
    c = load_model_config(resolve_model(str(tmp_path)))
    assert (c.architecture, c.layer_windows, c.final_logit_softcap) == (
        "gemma3_text", (4, None, 4), None,
    )  # fmt: skip
    assert _served(tmp_path) == expected
