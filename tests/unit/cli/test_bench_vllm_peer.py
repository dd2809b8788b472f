"""The vLLM peer of `spillway bench --compare`, without vLLM: its option, the Hugging Face
folder written from a GGUF file, and its script run end to end by this Python against a
stand-in `vllm` package that records what the script asks of it."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from gguf.constants import GGMLQuantizationType

from spillway.services.cli.bench import command
from spillway.services.cli.bench.hf_folder import hf_folder
from spillway.services.cli.bench.peers import run_vllm_peer
from spillway.services.cli.bench.workload import BenchRequest
from spillway.services.cli.main import build_parser
from spillway.shared.model_files import ModelSource, resolve_model
from spillway.shared.tokenizer_files import load_tokenizer, load_tokenizer_folder
from tests.gguf_files import write_tiny_llama

# A stand-in for vLLM's offline API: each request's "output" is its last prompt token
# counted up, one a new token; every call is appended to $FAKE_VLLM_LOG as JSON. It also
# prints to stdout, as vLLM's logging does.
FAKE_VLLM = """
import json, os

__version__ = "0.0-fake"


def _log(entry):
    with open(os.environ["FAKE_VLLM_LOG"], "a") as f:
        f.write(json.dumps(entry) + "\\n")


class SamplingParams:
    def __init__(self, **kwargs):
        self.kwargs = kwargs


class _Completion:
    def __init__(self, token_ids):
        self.token_ids = token_ids


class _Answer:
    def __init__(self, token_ids):
        self.outputs = [_Completion(token_ids)]


class LLM:
    def __init__(self, **kwargs):
        print("INFO engine log line on stdout")
        _log({"init": kwargs})

    def generate(self, prompts, params, use_tqdm=True):
        _log({"prompts": prompts, "params": [p.kwargs for p in params]})
        return [
            _Answer([p["prompt_token_ids"][-1] + k for k in range(s.kwargs["max_tokens"])])
            for p, s in zip(prompts, params)
        ]
"""

REQUESTS = [
    BenchRequest(0, [5, 6, 7], 3, 0.0),
    BenchRequest(1, [9, 10], 2, 0.0),
    BenchRequest(2, [20, 21, 22, 23], 4, 0.0),
]


def test_the_vllm_option_names_a_python():
    assert build_parser().parse_args(["bench"]).vllm is None
    args = build_parser().parse_args(["bench", "--compare", "--vllm", "/peers/vllm/bin/python"])
    assert args.vllm == "/peers/vllm/bin/python"


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch) -> Path:
    """This Python, with the stand-in `vllm` importable; returns the call log's path."""
    package = tmp_path / "fake" / "vllm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent(FAKE_VLLM))
    log = tmp_path / "vllm-calls.jsonl"
    monkeypatch.setenv("PYTHONPATH", str(package.parent))
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    return log


def _calls(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def _model_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "hf"
    folder.mkdir()
    config = {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 256}
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    return folder


@pytest.mark.parametrize(("batch", "groups"), [(None, [[0, 1, 2]]), (1, [[0], [1], [2]])])
def test_the_peer_script_submits_each_group_at_once_greedy_and_answers_in_order(
    tmp_path, fake_vllm, batch, groups
):
    """All requests in one `LLM.generate` for P1, one at a time at concurrency 1; every one
    greedy, exactly its max tokens (ignore_eos), in float32, with no tokenizer; the
    answer's ids in request order, read past the engine's own lines on stdout."""
    folder = _model_folder(tmp_path)
    result = run_vllm_peer(sys.executable, str(folder), REQUESTS, batch, env=dict(os.environ))
    assert result.error is None, result.error
    assert result.output_ids == [[7, 8, 9], [10, 11], [23, 24, 25, 26]]
    assert (result.input_tokens, result.output_tokens) == (9, 9)
    assert result.duration_s > 0 and "vLLM 0.0-fake" in result.note

    init, warm_up, *runs = _calls(fake_vllm)
    assert init["init"]["model"] == str(folder) and init["init"]["dtype"] == "float32"
    # Token ids in and out: no tokenizer loaded (the benchmarks' random models have none).
    assert init["init"]["skip_tokenizer_init"] is True
    assert init["init"]["max_model_len"] == 8  # the longest prompt and its new tokens
    assert init["init"]["max_num_seqs"] == len(groups[0])
    # The largest group's keys and values (2 layers, 2 KV heads of 64, float32), each
    # sequence rounded up a block of 128 tokens, fit in what the script asks for.
    per_token = 2 * 2 * 2 * 64 * 4
    need = max(sum(len(REQUESTS[i].prompt_ids) + REQUESTS[i].max_tokens + 128 for i in g)
               for g in groups)  # fmt: skip
    assert (
        per_token * need
        <= init["init"]["kv_cache_memory_bytes"]
        < 2 * per_token * need + (64 << 20)
    )
    assert len(warm_up["prompts"]) == 1  # a short request before the clock starts
    assert [[p["prompt_token_ids"] for p in run["prompts"]] for run in runs] == [
        [REQUESTS[i].prompt_ids for i in g] for g in groups
    ]
    params = [p for run in runs for p in run["params"]]
    assert params == [
        {"temperature": 0.0, "max_tokens": r.max_tokens, "min_tokens": r.max_tokens,
         "ignore_eos": True, "detokenize": False}
        for r in REQUESTS
    ]  # fmt: skip


def test_a_peer_script_that_fails_is_a_failed_row_not_a_crash(tmp_path, monkeypatch):
    """Without vLLM in the Python given (here: this one, no stand-in) the row says why."""
    monkeypatch.delenv("PYTHONPATH", raising=False)
    result = run_vllm_peer(sys.executable, str(_model_folder(tmp_path)), REQUESTS)
    assert result.error is not None and "No module named 'vllm'" in result.error


def test_a_gguf_model_becomes_a_float32_hugging_face_folder_once(tmp_path, monkeypatch):
    """The folder holds the very float32 values transformers reads from the GGUF file (the
    transformers peer's weights), its config and the bench's tokenizer; a second call finds
    it without converting again."""
    from transformers import AutoModelForCausalLM

    path = write_tiny_llama(tmp_path / "tiny.gguf", GGMLQuantizationType.Q4_1)
    source = resolve_model(str(path))
    cache = tmp_path / "cache"
    folder = hf_folder(source, cache)
    assert folder.parent == cache / "hf-models"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in folder.iterdir()
    }
    ours = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    theirs = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    assert getattr(ours.config, "quantization_config", None) is None
    expected = theirs.state_dict()
    got = ours.state_dict()
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    text = "Hello there, a tokenizer test."
    assert load_tokenizer_folder(folder).encode(text) == load_tokenizer(source, cache).encode(text)

    def no_second_conversion(*args):
        raise AssertionError("converted again")

    monkeypatch.setattr("spillway.services.cli.bench.hf_folder.convert", no_second_conversion)
    assert hf_folder(source, cache) == folder


def test_a_hugging_face_folder_is_used_as_it_is_and_a_synthetic_model_is_refused(tmp_path):
    folder = _model_folder(tmp_path)
    assert hf_folder(ModelSource("hf", "hf", folder), tmp_path / "cache") == folder
    assert not (tmp_path / "cache").exists()
    synthetic = resolve_model("synthetic:llama-3-8b")
    result = command.vllm_peer(sys.executable, synthetic, REQUESTS, None, None)
    assert result.name == "vLLM" and "no Hugging Face folder" in (result.error or "")


def test_the_bench_hands_vllm_the_converted_folder(tmp_path, fake_vllm, monkeypatch):
    """`--vllm` with a GGUF model: the peer runs on the folder written from it."""
    path = write_tiny_llama(tmp_path / "tiny.gguf", GGMLQuantizationType.Q8_0)
    monkeypatch.setenv("SPILLWAY_CACHE_DIR", str(tmp_path / "cache"))
    result = command.vllm_peer(sys.executable, resolve_model(str(path)), REQUESTS, 2, None)
    assert result.error is None, result.error
    model = _calls(fake_vllm)[0]["init"]["model"]
    assert Path(model).parent == tmp_path / "cache" / "hf-models"
    assert (Path(model) / "model.safetensors").is_file()
