"""GGUF files of every architecture we load, written from tiny random transformers models
as llama.cpp's converter writes them: greedy outputs token by token against transformers
loading the same file (`gguf_file=`), several prompts of different lengths in one batch;
a MoE file's experts kept in its blocks; other architectures refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf.constants import GGMLQuantizationType

from spillway.kernels.cpu.quantized_weight import QuantizedExperts
from spillway.services.cli.up import StartupError, check_servable_model
from spillway.services.worker.loading import load_runner
from spillway.services.worker.models.registry import check_servable, load_model_config
from spillway.services.worker.runner import ModelRunner
from spillway.shared.config import Settings, load_settings
from spillway.shared.gguf_arch import GGUF_ARCHITECTURES
from spillway.shared.gguf_file import parse_gguf
from spillway.shared.model_files import resolve_model
from tests.gguf_files import FAMILIES, write_header_only, write_tiny_gguf
from tests.unit.worker.plans import generate

# Lengths 7, 2, 4 and 1, started at different steps and prefilled in chunks of 3: rows of
# prefill and decode mixed in every step.
PROMPTS = [[5, 17, 300, 42, 9, 77, 120], [1, 200], [7, 7, 100, 3], [250]]
START_STEPS = [0, 1, 0, 2]
NEW_TOKENS = 8
# The smallest top-1 over top-2 logit gap of transformers' greedy steps we accept: below
# it float32 rounding of a different summation order could pick another token.
MIN_GAP = 1e-4
# gguf-py quantizes the model's weights to Q8_0 and Q4_0; Q4_K (Q4_K_M files' main type)
# is random blocks (tests/gguf_files.py).
KINDS = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K"]
# Mistral's weights drawn apart from Llama's (the same draw would repeat its file).
SEEDS = {"mistral": 1}
# More MoE files: gguf-py's Q5_1, and a mix as llama.cpp's Q4_K_M writes a MoE model's
# (down in Q6_K), with up in Q8_0 beside a Q4_K gate (an expert's gate/up of two formats).
Q = GGMLQuantizationType
MOE_MIXES = {
    "Q5_1": Q.Q5_1,
    "Q4_K_M": {"": Q.Q4_K, "ffn_up_exps": Q.Q8_0, "ffn_down_exps": Q.Q6_K, "attn_v": Q.Q6_K},
}
# A model's weights in memory over its file's tensor bytes, at most (the bound).
MEMORY_OVER_FILE = 1.3


def _transformers_greedy(path: Path) -> tuple[list[list[int]], float, str]:
    """transformers' greedy tokens for each prompt alone (run to NEW_TOKENS: EOS ignored,
    as our generation loop ignores it), the smallest logit gap of its steps, and the
    model_type it read the file as."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    model.generation_config.eos_token_id = None
    outputs, gap = [], float("inf")
    with torch.inference_mode():
        for prompt in PROMPTS:
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                output_scores=True, return_dict_in_generate=True, pad_token_id=0,
            )  # fmt: skip
            outputs.append(out.sequences[0, len(prompt) :].tolist())
            for scores in out.scores:
                top = scores[0].topk(2).values
                gap = min(gap, (top[0] - top[1]).item())
    return outputs, gap, model.config.model_type


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_batched_greedy_output_equals_transformers_on_the_same_gguf(tmp_path, family, kind):
    path = write_tiny_gguf(
        tmp_path / f"tiny-{family}-{kind}.gguf",
        family,
        GGMLQuantizationType[kind],
        seed=SEEDS.get(family, 0),
    )
    runner = _greedy_equals_transformers(path, family)
    if family == "qwen3moe":
        _assert_experts_in_blocks(runner, path)


@pytest.mark.parametrize("mix", list(MOE_MIXES))
def test_a_moe_file_s_experts_compute_from_its_blocks(tmp_path, mix):
    path = write_tiny_gguf(tmp_path / f"tiny-qwen3moe-{mix}.gguf", "qwen3moe", MOE_MIXES[mix])
    _assert_experts_in_blocks(_greedy_equals_transformers(path, "qwen3moe"), path)


def _greedy_equals_transformers(path: Path, family: str) -> ModelRunner:
    """Our greedy tokens (exact mode) are transformers' on the same file; the runner."""
    expected, gap, model_type = _transformers_greedy(path)
    assert gap > MIN_GAP, gap
    assert all(len(e) == NEW_TOKENS for e in expected)
    # transformers reads a Mistral written as llama.cpp writes it (`llama`) as a Llama.
    assert model_type == {"mistral": "llama"}.get(family, FAMILIES[family][1])
    settings = load_settings(model=str(path), kv_blocks=16, device="cpu", dtype="float32")
    runner = load_runner(settings)[0]
    got = generate(runner, PROMPTS, max_new_tokens=NEW_TOKENS, chunk=3, start_steps=START_STEPS)
    assert got == expected
    return runner


def _assert_experts_in_blocks(runner: ModelRunner, path: Path) -> None:
    """Every MoE layer's experts are the file's blocks in the file's formats (float32
    tensors only from an F32 file), and the weights take at most MEMORY_OVER_FILE times
    the file's tensor bytes."""
    tensors = parse_gguf(path).tensors
    types = {t.name: t.tensor_type.name.lower() for t in tensors}
    weights = runner.model.weights
    for i, layer in enumerate(weights.layers):
        assert layer.moe is not None
        parts = {p: types[f"blk.{i}.ffn_{p}_exps.weight"] for p in ("gate", "up", "down")}
        if parts["gate"] == "f32":
            assert isinstance(layer.moe.w_gate_up, torch.Tensor)
            continue
        gate_up, down = layer.moe.w_gate_up, layer.moe.w_down
        assert isinstance(gate_up, QuantizedExperts) and isinstance(down, QuantizedExperts)
        kinds = [parts["gate"]] + ([parts["up"]] if parts["up"] != parts["gate"] else [])
        assert [kind for kind, _ in gate_up.segments] == kinds
        assert [kind for kind, _ in down.segments] == [parts["down"]]
    file_bytes = sum(t.data.nbytes for t in tensors)
    assert weights.num_bytes() <= MEMORY_OVER_FILE * file_bytes, (weights.num_bytes(), file_bytes)


def test_the_config_reads_each_architecture_s_own_keys(tmp_path):
    """Qwen3-MoE's head width (attention.key_length), expert counts and width come from
    its keys, its top-k weights renormalised as llama.cpp does; Qwen's q/k norms."""
    path = write_tiny_gguf(tmp_path / "moe.gguf", "qwen3moe", GGMLQuantizationType.F32)
    config = load_model_config(resolve_model(str(path)))
    assert config.architecture == "qwen3_moe" and config.qk_norm
    assert (config.head_dim, config.num_heads, config.num_kv_heads) == (32, 4, 2)
    assert config.moe is not None and config.moe.norm_topk_prob
    assert (config.moe.num_experts, config.moe.top_k, config.moe.intermediate_size) == (4, 2, 768)
    assert config.moe.sparse_layers == (True, True)
    assert config.layer_windows == ()


@pytest.mark.parametrize("arch", ["gpt2", "gemma", "gemma3n", "glm4moe"])
def test_an_architecture_outside_the_table_is_refused_by_name_at_start_up(tmp_path, arch):
    path = write_header_only(tmp_path / f"{arch}.gguf", arch, block_count=2)
    supported = ", ".join(GGUF_ARCHITECTURES)
    message = rf"unsupported GGUF architecture '{arch}' \(supported: {supported}\)"
    with pytest.raises(ValueError, match=message):
        check_servable(resolve_model(str(path)))
    with pytest.raises(StartupError, match=message):
        check_servable_model(Settings(model=str(path)))
    settings = load_settings(model=str(path), kv_blocks=16, device="cpu", dtype="float32")
    with pytest.raises(ValueError, match=message):
        load_runner(settings)


def test_a_file_that_names_itself_mistral_honours_its_window(tmp_path):
    """Llama's tensor layout under `mistral` keys, `mistral.attention.sliding_window` 4 and
    prompts longer than it: transformers cannot load such a file, so the reference is
    transformers' Mistral on the same (F32) weights, each token from a whole forward."""
    from tests.gguf_files import tiny_transformers_model
    from tests.unit.worker.tiny_families import reference_greedy

    path = write_tiny_gguf(
        tmp_path / "tiny-mistral.gguf", "mistral", GGMLQuantizationType.F32, seed=1,
        arch="mistral",
    )  # fmt: skip
    config = load_model_config(resolve_model(str(path)))
    assert config.architecture == "mistral" and config.layer_windows == (4, 4)
    reference = tiny_transformers_model("mistral", seed=1).eval()
    expected = []
    for prompt in PROMPTS:
        tokens, gap = reference_greedy(reference, prompt, NEW_TOKENS)
        assert gap > MIN_GAP, gap
        expected.append(tokens)
    settings = load_settings(model=str(path), kv_blocks=16, device="cpu", dtype="float32")
    runner = load_runner(settings)[0]
    got = generate(runner, PROMPTS, max_new_tokens=NEW_TOKENS, chunk=3, start_steps=START_STEPS)
    assert got == expected
    # The window changes the outputs: the same weights without it (the `llama` file).
    llama = write_tiny_gguf(tmp_path / "tiny-llama.gguf", "mistral", GGMLQuantizationType.F32, 1)
    plain = load_runner(load_settings(model=str(llama), kv_blocks=16, device="cpu"))[0]
    unwindowed = generate(plain, PROMPTS, max_new_tokens=NEW_TOKENS, chunk=3,
                          start_steps=START_STEPS)  # fmt: skip
    assert unwindowed != expected


def test_a_llama_file_with_experts_is_refused_by_name(tmp_path):
    """Mixtral's llama.cpp layout: transformers loads no experts into a Llama."""
    path = write_header_only(tmp_path / "mixtral.gguf", "llama", block_count=2, expert_count=8)
    with pytest.raises(ValueError, match=r"'llama' with experts \(expert_count 8\)"):
        check_servable(resolve_model(str(path)))
    with pytest.raises(StartupError, match=r"'llama' with experts"):
        check_servable_model(Settings(model=str(path)))
