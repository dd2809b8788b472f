"""vLLM's serving options and endpoints on a real gateway (the scheduler double on a real
NATS server): --served-model-name, --max-model-len, --chat-template, --allowed-origins,
/tokenize, /detokenize and the vllm: metric aliases."""

from __future__ import annotations

import httpx
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.gateway.conftest import serving_on_a_double

pytestmark = pytest.mark.asyncio(loop_scope="module")

NAMES = ["house-model", "alias-two"]
ORIGIN = "https://app.example"
TEMPLATE = (
    "{% for m in messages %}<<{{ m['role'] }}>>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<<assistant>>{% endif %}"
)
MSG = [{"role": "user", "content": "Say something."}]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gateway(nats_url, served_tokenizer, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    serving = serving_on_a_double(
        nats_url,
        served_tokenizer,
        "gw",
        served_model_name=NAMES,
        max_model_len=64,
        chat_template=str(template),
        allowed_origins=[ORIGIN],
    )
    async with (
        serving as (running, double),
        httpx.AsyncClient(base_url=running.url, timeout=30) as client,
    ):
        yield client, double


async def test_models_lists_every_served_name_with_the_cap(gateway):
    client, _ = gateway
    data = (await client.get("/v1/models")).json()["data"]
    assert [m["id"] for m in data] == NAMES
    assert {m["max_model_len"] for m in data} == {64}


async def test_the_model_field_is_checked_against_the_served_names(gateway):
    client, _ = gateway
    r = await client.post("/v1/completions", json={"model": NAMES[1], "prompt": "Hi"})
    assert r.status_code == 200 and r.json()["model"] == NAMES[1]
    r = await client.post("/v1/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


async def test_prompt_and_max_tokens_beyond_max_model_len_is_a_400_naming_it(gateway):
    client, _ = gateway
    r = await client.post("/v1/completions", json={"prompt": [42] * 40, "max_tokens": 30})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "max_tokens" and error["code"] == "context_length_exceeded"
    assert "64 tokens" in error["message"]
    r = await client.post("/v1/completions", json={"prompt": [42] * 40, "max_tokens": 20})
    assert r.status_code == 200


async def test_the_chat_template_file_replaces_the_models(gateway, served_tokenizer):
    client, double = gateway
    r = await client.post("/tokenize", json={"model": NAMES[0], "messages": MSG})
    assert r.status_code == 200, r.text
    expected = served_tokenizer.encode(
        "<<user>>Say something.\n<<assistant>>", add_special_tokens=False
    )
    assert r.json() == {
        "count": len(expected),
        "max_model_len": 64,
        "tokens": expected,
        "token_strs": None,
    }
    r = await client.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 3})
    assert r.status_code == 200
    assert double.submits[-1].prompt_token_ids == expected


async def test_tokenize_and_detokenize_round_trip(gateway, served_tokenizer):
    client, _ = gateway
    r = await client.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True})
    body = r.json()
    assert body["tokens"] == served_tokenizer.encode("Hello world")
    assert len(body["token_strs"]) == body["count"] == len(body["tokens"])
    r = await client.post("/detokenize", json={"tokens": body["tokens"]})
    assert r.json() == {"prompt": "Hello world"}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [("/tokenize", {"prompt": 5}, "prompt"),
     ("/tokenize", {"messages": []}, "messages"),
     ("/tokenize", {"prompt": "x", "model": "nope"}, "model"),
     ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
     ("/detokenize", {"tokens": "abc"}, "tokens")],
)  # fmt: skip
async def test_tokenizer_endpoints_name_the_bad_field(gateway, path, body, param):
    client, _ = gateway
    r = await client.post(path, json=body)
    assert r.status_code in (400, 404)
    assert r.json()["error"]["param"] == param
    assert (await client.post("/tokenize", json={"prompt": "ok"})).status_code == 200


async def test_cors_preflight_and_headers_for_an_allowed_origin(gateway):
    client, _ = gateway
    preflight = {
        "origin": ORIGIN,
        "access-control-request-method": "POST",
        "access-control-request-headers": "authorization, content-type",
    }
    r = await client.options("/v1/chat/completions", headers=preflight)
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in r.headers["access-control-allow-methods"]
    r = await client.options("/v1/chat/completions", headers={**preflight, "origin": "https://x.y"})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = await client.get("/v1/models", headers={"origin": ORIGIN})
    assert r.headers["access-control-allow-origin"] == ORIGIN


def _samples(text: str) -> dict[tuple[str, frozenset], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = {k: v for k, v in s.labels.items() if k != "model_name"}
            out[(s.name, frozenset(labels.items()))] = s.value
    return out


async def test_vllm_metric_aliases_carry_our_values(gateway):
    client, _ = gateway
    await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4})
    samples = _samples((await client.get("/metrics")).text)
    pairs = {
        "spillway_prompt_tokens_total": "vllm:prompt_tokens_total",
        "spillway_generation_tokens_total": "vllm:generation_tokens_total",
        "spillway_time_to_first_token_seconds_count": "vllm:time_to_first_token_seconds_count",
        "spillway_inter_token_latency_seconds_sum": "vllm:inter_token_latency_seconds_sum",
        "spillway_e2e_request_latency_seconds_count": "vllm:e2e_request_latency_seconds_count",
        "spillway_requests_running": "vllm:num_requests_running",
        "spillway_requests_waiting": "vllm:num_requests_waiting",
        "spillway_kv_cache_usage_ratio": "vllm:kv_cache_usage_perc",
    }
    for ours, theirs in pairs.items():
        mine = {labels: v for (name, labels), v in samples.items() if name == ours}
        alias = {labels: v for (name, labels), v in samples.items() if name == theirs}
        assert mine and mine == alias, (ours, mine, alias)
    assert samples[("vllm:prompt_tokens_total", frozenset())] > 0
