"""Every tool-call format through the whole system: a tiny random Llama with SmolLM2's
tokenizer plus every family's marker tokens, and one gateway per model family serving it
with the family's real chat template (tests/fixtures/chat_templates), from which the
gateway picks the format; one scheduler and one worker serve them all. The grammar forces
the call, so even a random model writes one; it must come back as the same call streamed
and not, its arguments valid under the schema. Unforced, the random model's text (rarely
a valid call) must come back as a response, never an error. (Marker tokens that are
special tokens are covered by the unit tests: here they are plain added tokens, so that
one worker serves every family.)"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import jsonschema
import pytest

from spillway.services.cli.launcher import ServiceGroup, wait_until
from spillway.shared.output_formats import (
    DS_CALL_BEGIN,
    DS_CALL_END,
    DS_CALLS_BEGIN,
    DS_CALLS_END,
    DS_SEP,
)
from tests.e2e.conftest import save_tiny_model

pytestmark = pytest.mark.slow

TEMPLATES = Path(__file__).parents[1] / "fixtures" / "chat_templates"
CHAT = "/v1/chat/completions"
ASK = [{"role": "user", "content": "Book a trip for me, please."}]
# No free text in the arguments: a random model's strings could run to any length.
TRIP = {
    "type": "object",
    "properties": {
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "window": {"type": "boolean"},
    },
    "required": ["days", "unit", "window"],
    "additionalProperties": False,
}
ZONE = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "book_trip", "parameters": TRIP}},
    {"type": "function", "function": {"name": "get_time", "parameters": ZONE}},
]
SCHEMAS = {"book_trip": TRIP, "get_time": ZONE}


@dataclass(frozen=True)
class Family:
    template: str
    words: list[str]  # the family's marker tokens
    body: dict = field(default_factory=dict)  # what a request of this family adds


FAMILIES = {
    "hermes": Family(
        "Qwen-Qwen3-0.6B.jinja",
        ["<tool_call>", "</tool_call>", "<think>", "</think>"],
        body={"chat_template_kwargs": {"enable_thinking": False}},
    ),
    "llama3_json": Family(
        "meta-llama-Llama-3.1-8B-Instruct.jinja",
        ["<|python_tag|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
    ),
    "mistral": Family(
        "mistralai-Mistral-Nemo-Instruct-2407.jinja",
        ["[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[INST]", "[/INST]"],
    ),
    "qwen3_xml": Family(
        "Qwen-Qwen3-Coder-30B-A3B-Instruct.jinja", ["<tool_call>", "</tool_call>"]
    ),
    # R1's prompt opens a think block, and the grammar starts after it: a strong bias on
    # the end marker closes it at once (it cannot appear in the call itself).
    "deepseek_v3": Family(
        "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
        [DS_CALLS_BEGIN, DS_CALLS_END, DS_CALL_BEGIN, DS_CALL_END, DS_SEP,
         "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"],
        body={"logit_bias": "</think>"},
    ),
    "granite": Family(
        "ibm-granite-granite-3.3-2B-Instruct.jinja",
        ["<|tool_call|>", "<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>"],
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, reference_tokenizer):
    """The tiny model, with every family's markers in its vocabulary."""
    import copy

    tokenizer = copy.deepcopy(reference_tokenizer)
    words = sorted({w for f in FAMILIES.values() for w in f.words})
    tokenizer.add_tokens(words)
    return save_tiny_model(tmp_path_factory.mktemp("formats-model"), tokenizer, 2048)


def family_dir(base: Path, folder: Path, family: Family) -> Path:
    """The model's folder as the family ships it: the family's chat template."""
    folder.mkdir(parents=True)
    for item in base.iterdir():
        if item.name != "chat_template.jinja":
            (folder / item.name).symlink_to(item)
    (folder / "chat_template.jinja").write_text((TEMPLATES / family.template).read_text())
    return folder


@pytest.fixture(scope="module")
def gateways(model_dir, tmp_path_factory, nats_url, redis_url):
    """A scheduler and a worker, and a gateway per family: name -> (client, tokenizer)."""
    from transformers import AutoTokenizer

    common = ("--nats-url", nats_url, "--redis-url", redis_url, "--namespace", "formats")
    group = ServiceGroup(*common)
    root = tmp_path_factory.mktemp("families")
    clients = {}
    try:
        # All load side by side; served once the worker has joined the scheduler.
        group.launch("scheduler", "--max-batch", "4")
        group.launch("worker", "--model", str(model_dir), "--kv-blocks", "64", "--dtype", "float32")
        started = {
            name: group.launch(
                "gateway", "--model", str(family_dir(model_dir, root / name, family)),
                "--port", "0", name=name,
            )
            for name, family in FAMILIES.items()
        }  # fmt: skip
        group.wait_ready()
        for name, child in started.items():
            clients[name] = httpx.Client(base_url=child.ready_detail.split()[0], timeout=300)
        first = next(iter(clients.values()))
        assert wait_until(lambda: first.get("/health").json()["workers"] == 1, 60), group.tail()
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        yield {name: (client, tokenizer) for name, client in clients.items()}
    finally:
        for client in clients.values():
            client.close()
        group.stop_all()


@pytest.fixture(params=sorted(FAMILIES))
def family(request, gateways):
    """(format name, Family, client, the model's tokenizer) for one served family."""
    client, tokenizer = gateways[request.param]
    return request.param, FAMILIES[request.param], client, tokenizer


def request_body(spec: Family, tokenizer, **fields) -> dict:
    body = {"messages": ASK, "tools": TOOLS, "max_tokens": 120, "temperature": 0, **fields}
    for key, value in spec.body.items():
        if key == "logit_bias":
            body[key] = {str(tokenizer.convert_tokens_to_ids(value)): 100}
        else:
            body[key] = value
    return body


def streamed_message(client: httpx.Client, body: dict) -> tuple[dict, str | None]:
    """The message a client builds from the stream, and the finish reason."""
    calls: dict[int, dict] = {}
    content, finish = "", None
    with client.stream("POST", CHAT, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line.removeprefix("data: "))["choices"]:
                delta = choice["delta"]
                content += delta.get("content") or ""
                for d in delta.get("tool_calls") or []:
                    call = calls.setdefault(d["index"], {"name": None, "arguments": ""})
                    if d.get("id"):
                        call["id"], call["name"] = d["id"], d["function"]["name"]
                    call["arguments"] += d["function"].get("arguments") or ""
                finish = choice.get("finish_reason") or finish
    return {"content": content, "calls": [calls[i] for i in sorted(calls)]}, finish


@pytest.mark.parametrize("choice", ["required", "named"])
def test_a_forced_call_comes_back_the_same_streamed_and_not(family, choice):
    name, spec, client, tokenizer = family
    forced = (
        "required"
        if choice == "required"
        else {"type": "function", "function": {"name": "get_time"}}
    )
    body = request_body(spec, tokenizer, tool_choice=forced, seed=3)
    r = client.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    (out,) = r.json()["choices"]
    assert out["finish_reason"] == "tool_calls", out
    message = out["message"]
    assert not message["content"]
    (call,) = message["tool_calls"]
    if choice == "named":
        assert call["function"]["name"] == "get_time"
    arguments = json.loads(call["function"]["arguments"])
    jsonschema.validate(arguments, SCHEMAS[call["function"]["name"]])
    if name == "mistral":
        assert len(call["id"]) == 9 and call["id"].isalnum()
    streamed, finish = streamed_message(client, body)
    assert finish == "tool_calls"
    assert streamed["content"] == ""
    assert [(c["name"], c["arguments"]) for c in streamed["calls"]] == [
        (call["function"]["name"], call["function"]["arguments"])
    ]


def test_unforced_random_text_is_a_response_never_an_error(family):
    _, spec, client, tokenizer = family
    for seed in range(3):
        body = request_body(spec, tokenizer, tool_choice="auto", temperature=1.0, seed=seed)
        body["max_tokens"] = 40
        r = client.post(CHAT, json=body)
        assert r.status_code == 200, r.text
        (out,) = r.json()["choices"]
        assert out["finish_reason"] in ("stop", "length", "tool_calls")
        message = out["message"]
        for call in message.get("tool_calls") or []:
            assert call["function"]["name"]
        streamed, finish = streamed_message(client, body)
        assert finish == out["finish_reason"]
        assert streamed["content"] == (message["content"] or "")
