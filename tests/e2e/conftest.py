"""The systems the end-to-end tests drive: started with `spillway up`, real NATS and Redis.

- `system`: the default model (SmolLM2-135M-Instruct, GGUF) in namespace "e2e", traces
  exported to a real OTLP receiver in the test process.
- `tiny_system`: a tiny random Llama saved by the test as a Hugging Face folder, in
  namespace "other", on the same NATS and Redis (the namespace isolation check), with
  an API key and other non-default options.
"""

from __future__ import annotations

import signal

import httpx
import pytest
import torch

from spillway.services.cli.launcher import System, pid_alive, wait_until
from tests.e2e.keys import TINY_API_KEY
from tests.e2e.otlp_sink import OtlpSink


def pytest_collection_modifyitems(items):
    for item in items:
        if "/e2e/" in str(item.fspath):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="package", autouse=True)
def one_math_thread():
    """Here the test process computes its references on the cores the launched services
    use too. With two math threads every op waits at a barrier for the thread that a
    service pushed off its core: on two busy cores a transformers reference ran ten
    times slower than on one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def otlp_sink():
    sink = OtlpSink()
    yield sink
    sink.close()


@pytest.fixture(scope="session")
def system(nats_url, redis_url, otlp_sink):
    s = System(
        "--namespace", "e2e",
        "--nats-url", nats_url,
        "--redis-url", redis_url,
        "--otlp-endpoint", otlp_sink.url,
        "--kv-blocks", "512",
        "--max-batch", "32",
    )  # fmt: skip
    yield s
    code = s.stop()
    assert code == 0, s.tail()


@pytest.fixture(scope="session")
def client(system):
    with httpx.Client(base_url=system.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="session")
def reference_tokenizer():
    from transformers import AutoTokenizer

    from spillway.shared.model_files import resolve_model

    src = resolve_model("SmolLM2-135M-Instruct")
    return AutoTokenizer.from_pretrained(str(src.path.parent), gguf_file=src.path.name)


def save_tiny_model(folder, tokenizer, context: int):
    """A tiny random Llama with the SmolLM2 tokenizer, saved as a Hugging Face folder."""
    import torch
    from transformers import GenerationConfig, LlamaForCausalLM

    from tests.tiny_llama_config import tiny_llama_config

    torch.manual_seed(1234)
    config = tiny_llama_config(len(tokenizer), context)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(folder, safe_serialization=True)
    GenerationConfig(bos_token_id=1, eos_token_id=2).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, reference_tokenizer):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), reference_tokenizer, 1024)


@pytest.fixture(scope="session")
def long_tiny_model_dir(tmp_path_factory, reference_tokenizer):
    """The tiny Llama with an 8k context: its generations run long enough (thousands of
    cheap steps) to be in flight when a test kills something."""
    folder = tmp_path_factory.mktemp("tiny-llama-8k")
    return save_tiny_model(folder, reference_tokenizer, 8192)


@pytest.fixture(scope="session")
def tiny_system(nats_url, redis_url, tiny_model_dir, tmp_path_factory):
    """Also writes every span to `trace_file` and logs JSON (what `spillway trace` and a
    log collector read)."""
    trace_file = tmp_path_factory.mktemp("traces") / "spans.jsonl"
    s = System(
        "--model", str(tiny_model_dir),
        "--namespace", "other",
        "--nats-url", nats_url,
        "--redis-url", redis_url,
        "--kv-blocks", "128",
        "--block-size", "32",
        "--dtype", "float32",
        "--api-key", TINY_API_KEY,
        "--trace-file", str(trace_file),
        "--log-format", "json",
    )  # fmt: skip
    s.trace_file = trace_file
    yield s
    s.stop()


FAULTS_NS = "faults"
FAULTS_KV_BLOCKS = 600


@pytest.fixture(scope="session")
def faults_system(long_tiny_model_dir, nats_url, redis_url):
    """The system the fault-injection and fuzzing tests hit (in that order: it must come
    back from every fault). Stopping it at the end must exit 0 and leave no process."""
    s = start_faults_system(long_tiny_model_dir, nats_url, redis_url)
    yield s
    pids = s.all_descendants()
    assert s.stop(signal.SIGTERM) == 0, s.tail()
    assert wait_until(lambda: not any(pid_alive(p) for p in pids), timeout=10)


def start_faults_system(model_dir, nats_url: str, redis_url: str) -> System:
    return System(
        "--model", str(model_dir),
        "--namespace", FAULTS_NS,
        "--nats-url", nats_url,
        "--redis-url", redis_url,
        "--kv-blocks", str(FAULTS_KV_BLOCKS),
        "--block-size", "32",
        "--max-batch", "2",
        "--dtype", "float32",
        # A restarted service comes back only after the dead one's heartbeats lapsed
        # (worker_timeout_s is 2): a worker that registers sooner takes the dead one's
        # requests over (recomputed), and these tests replay the single-worker outcome.
        env={"SPILLWAY_DRAIN_TIMEOUT_S": "2", "SPILLWAY_RESTART_BACKOFF_S": "3"},
    )  # fmt: skip
