"""Random and malformed payloads on every NATS subject a service of a running system
listens on, public and internal, plus well-formed but hostile step plans sent in the
worker's own scheduler's name. Every request gets an answer that is not a 500, no
service dies or restarts, and afterwards the system gives the very same greedy output
it gave before. It runs on the system of the fault-injection tests, after them: a
system that came back from every fault.

Payloads come from hypothesis (derandomized: the same cases on every run): raw bytes,
any JSON, and bodies shaped by each message's own JSON schema, fitting it and breaking
it (schemathesis generates those from a small OpenAPI document of the messages).
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any

import httpx
import nats
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel
from schemathesis.generation.modes import GenerationMode

from spillway.services.gateway.schemas import ChatCompletionRequest, CompletionRequest
from spillway.shared.bus import SENDER_HEADER
from spillway.shared.protocol import (
    AbortRequest,
    DeltaBatch,
    Heartbeat,
    SchedulerLease,
    StatsRequest,
    StepPlan,
    StepResult,
    SubmitRequest,
    WorkerInfo,
)
from tests.clients import until
from tests.e2e.conftest import FAULTS_KV_BLOCKS
from tests.e2e.conftest import FAULTS_NS as NS

pytestmark = pytest.mark.slow

REF = "#/components/schemas/{model}"
EXAMPLES = 80  # per subject and strategy family
MIN_MESSAGES = 1100
REPLY_TIMEOUT_S = 10.0
VOCAB = 49152  # the tiny model's, shared with SmolLM2's tokenizer
GREEDY = {"prompt": "The fuzz test says", "max_tokens": 12, "temperature": 0, "ignore_eos": True}


def _document(models: list[type[BaseModel]]) -> dict[str, Any]:
    """One POST operation per message model: schemathesis turns each into bodies."""
    schemas: dict[str, Any] = {}
    paths = {}
    for model in models:
        schema = model.model_json_schema(ref_template=REF)
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
        body = {
            "content": {"application/json": {"schema": {"$ref": REF.format(model=model.__name__)}}}
        }
        paths[f"/{model.__name__}"] = {
            "post": {
                "requestBody": {"required": True, **body},
                "responses": {"200": {"description": "ok"}},
            }
        }
    return {
        "openapi": "3.1.0",
        "info": {"title": "spillway messages", "version": "1"},
        "paths": paths,
        "components": {"schemas": schemas},
    }


MODELS: list[type[BaseModel]] = [
    ChatCompletionRequest,
    CompletionRequest,
    AbortRequest,
    StatsRequest,
    SubmitRequest,
    WorkerInfo,
    Heartbeat,
    StepPlan,
    DeltaBatch,
    SchedulerLease,
]
SCHEMA = schemathesis.openapi.from_dict(_document(MODELS))

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5)
    ),
    max_leaves=20,
)


def _encode(body: Any) -> bytes:
    if isinstance(body, bytes):
        return body
    if isinstance(body, str):
        return body.encode("utf-8", "surrogatepass")
    return json.dumps(body, default=str).encode("utf-8", "surrogatepass")


def payloads(*models: type[BaseModel]) -> st.SearchStrategy[bytes]:
    shaped = [
        SCHEMA[f"/{m.__name__}"]["POST"].as_strategy(mode).map(lambda case: case.body)
        for m in models
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    ]
    return st.one_of(st.binary(max_size=300), JSON, *shaped).map(_bounded).map(_encode)


def _bounded(body: Any) -> Any:
    """Generations stay short: a valid body asks for a few tokens, not a whole context."""
    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(key), int) and not isinstance(body.get(key), bool):
                body[key] = max(1, min(body[key], 4)) if body[key] > 0 else body[key]
        if isinstance(body.get("n"), int) and not isinstance(body.get("n"), bool):
            body["n"] = min(body["n"], 2)
        generates = {"prompt_token_ids", "prompt", "messages"} & set(body)
        if generates and "max_tokens" not in body and "max_completion_tokens" not in body:
            body["max_tokens"] = 4
    return body


@st.composite
def hostile_plans(draw, num_blocks: int, vocab: int) -> bytes:
    """Well-formed plans aimed at the worker's limits: block ids and positions around the
    edges, tokens in and out of the vocabulary, sequences it may or may not know."""
    seq = st.sampled_from(["h1", "h2", "h3"])
    block = st.integers(-2, num_blocks + 2)
    sampling = st.fixed_dictionaries(
        {"temperature": st.floats(0, 2), "top_k": st.integers(0, 50), "seed": st.integers(0, 99)}
    )
    plan = {
        "step_id": draw(st.integers(1, 10**6)),
        "finished_seq_ids": draw(st.lists(seq, max_size=2)),
        "new_seqs": draw(
            st.lists(
                st.fixed_dictionaries(
                    {"seq_id": seq, "sampling": sampling, "block_ids": st.lists(block, max_size=4)}
                ),
                max_size=2,
            )
        ),
        "updated_seqs": draw(
            st.lists(
                st.fixed_dictionaries(
                    {"seq_id": seq, "new_block_ids": st.lists(block, max_size=2)}
                ),
                max_size=2,
            )
        ),
        "rows": draw(
            st.lists(
                st.fixed_dictionaries(
                    {
                        "seq_id": seq,
                        "token_ids": st.lists(st.integers(-1, vocab + 1), min_size=1, max_size=40),
                        "start_pos": st.integers(-1, 80),
                        "sample": st.booleans(),
                        "output_index": st.integers(0, 3),
                    }
                ),
                max_size=3,
            )
        ),
    }
    return json.dumps(plan).encode()


class Target:
    """What the fuzzer aims at: the system's ids, learned from the bus itself."""

    def __init__(self) -> None:
        self.scheduler_id = ""
        self.worker_id = ""
        self.gateway_id = ""
        self.num_blocks = FAULTS_KV_BLOCKS
        self.vocab = VOCAB


async def _discover(nc, client: httpx.AsyncClient) -> Target:
    target = Target()

    async def on_lease(msg) -> None:
        lease = SchedulerLease.model_validate_json(msg.data)
        if lease.worker_id:
            target.scheduler_id, target.worker_id = lease.scheduler_id, lease.worker_id

    async def on_deltas(msg) -> None:
        target.gateway_id = msg.subject.split(".")[2]

    subs = [
        await nc.subscribe(f"{NS}.sched.heartbeat", cb=on_lease),
        await nc.subscribe(f"{NS}.gateway.*.deltas", cb=on_deltas),
    ]
    await nc.flush()
    await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
    await until(lambda: target.scheduler_id and target.gateway_id, 30)
    for sub in subs:
        await sub.unsubscribe()
    return target


async def test_every_subject_survives_random_and_hostile_payloads(faults_system, nats_url):
    nc = await nats.connect(nats_url)
    async with httpx.AsyncClient(base_url=faults_system.url, timeout=120) as client:
        before = (await client.post("/v1/completions", json=GREEDY)).json()["choices"][0]["text"]
        pids = faults_system.service_pids()
        target = await _discover(nc, client)
        sid, wid, gid = target.scheduler_id, target.worker_id, target.gateway_id

        as_owner = {SENDER_HEADER: sid}  # past the worker's ownership check
        requests = [  # (subject, payloads, headers)
            (f"{NS}.llm.generate", payloads(ChatCompletionRequest, CompletionRequest), {}),
            (f"{NS}.llm.abort", payloads(AbortRequest), {}),
            (f"{NS}.llm.models", payloads(StatsRequest), {}),
            (f"{NS}.sched.submit", payloads(SubmitRequest), {}),
            (f"{NS}.sched.{sid}.submit", payloads(SubmitRequest), {}),
            (f"{NS}.sched.{sid}.register", payloads(WorkerInfo), {}),
            (f"{NS}.worker.register", payloads(WorkerInfo), {}),
            (f"{NS}.sched.stats", payloads(StatsRequest), {}),
            (f"{NS}.spill.stats", payloads(StatsRequest), {}),
            (f"{NS}.worker.{wid}.step", payloads(StepPlan), {}),
            (f"{NS}.worker.{wid}.step", payloads(StepPlan), as_owner),
            (f"{NS}.worker.{wid}.step", hostile_plans(target.num_blocks, target.vocab), as_owner),
        ]
        publishes = {
            f"{NS}.sched.abort": payloads(AbortRequest),
            f"{NS}.worker.heartbeat": payloads(Heartbeat),
            f"{NS}.gateway.{gid}.deltas": payloads(DeltaBatch),
            f"{NS}.worker.discover": payloads(StatsRequest),
            f"{NS}.sched.heartbeat": payloads(SchedulerLease),
        }
        sent: Counter[str] = Counter()
        failures: list[str] = []
        loop = asyncio.get_running_loop()

        def fuzz(subject: str, strategy, send) -> None:
            """Runs hypothesis (synchronous) on a thread; each example is sent from the
            test's event loop."""

            @settings(
                max_examples=EXAMPLES,
                deadline=None,
                database=None,
                derandomize=True,
                suppress_health_check=list(HealthCheck),
            )
            @given(data=strategy)
            def run(data: bytes) -> None:
                problem = asyncio.run_coroutine_threadsafe(send(subject, data), loop).result(60)
                sent[subject] += 1
                if problem:
                    failures.append(f"{subject} {data[:200]!r}: {problem}")

            run()

        async def ask(subject: str, data: bytes, headers: dict[str, str]) -> str | None:
            try:
                reply = await nc.request(subject, data, timeout=REPLY_TIMEOUT_S, headers=headers)
            except nats.errors.TimeoutError:
                return "no reply"
            status = (reply.headers or {}).get("Spillway-Error")
            if status == "500":
                return f"500: {reply.data[:300]!r}"
            if subject.endswith(".step") and status is None:
                result = StepResult.model_validate_json(reply.data)
                if result.error is not None and result.error.status >= 500:
                    return f"step failed: {result.error.message}"
            return None

        async def tell(subject: str, data: bytes) -> None:
            await nc.publish(subject, data)

        for subject, strategy, headers in requests:
            await asyncio.to_thread(fuzz, subject, strategy, lambda s, d, h=headers: ask(s, d, h))
        for subject, strategy in publishes.items():
            await asyncio.to_thread(fuzz, subject, strategy, tell)
        await nc.flush()

        assert not failures, failures[:5]
        total = sum(sent.values())
        print(f"{total} messages on {len(sent)} subjects")
        assert total >= MIN_MESSAGES

        # No service died or restarted; the system still gives the same greedy output.
        assert faults_system.service_pids() == pids
        health = await client.get("/health")
        assert health.status_code == 200, health.text
        after = (await client.post("/v1/completions", json=GREEDY)).json()["choices"][0]["text"]
        assert after == before
    await nc.close()
