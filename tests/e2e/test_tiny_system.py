"""A second system on the same NATS and Redis: a Hugging Face folder model in its own
namespace. Ends by killing its worker (health must turn 503) and stopping it with Ctrl-C.

The tests run in file order; the last two take the system down.
"""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import nats
import pytest
import redis
import torch

from services.cli.launcher import pid_alive, wait_until
from shared.protocol import SpillDrop, SpillRecord, SpillRef, encode
from shared.spill_keys import SpillKeys
from tests.e2e.keys import TINY_API_KEY

AUTH = {"Authorization": f"Bearer {TINY_API_KEY}"}

pytestmark = pytest.mark.slow


def test_hf_folder_generates_the_same_tokens_as_transformers(tiny_system, tiny_model_dir):
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # the request ignores EOS too
    prompt = [1, 504, 3781, 282, 4649, 314]
    config = GenerationConfig(do_sample=False, max_new_tokens=20, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        want = model.generate(torch.tensor([prompt]), generation_config=config)[0, len(prompt) :]
    with httpx.Client(base_url=tiny_system.url, timeout=60, headers=AUTH) as c:
        r = c.post(
            "/v1/completions",
            json={
                "prompt": prompt,
                "max_tokens": 20,
                "temperature": 0,
                "ignore_eos": True,
                "logprobs": 0,
                "return_tokens_as_token_ids": True,
            },
        )
        assert r.status_code == 200, r.text
        models = c.get("/v1/models").json()
    got = [int(t.removeprefix("token_id:")) for t in r.json()["choices"][0]["logprobs"]["tokens"]]
    assert got == want.tolist()
    assert [m["id"] for m in models["data"]] == [tiny_model_dir.name]


def test_each_service_announced_itself_before_ready(tiny_system):
    lines = tiny_system.lines
    ready_at = next(i for i, line in enumerate(lines) if line.startswith("ready: "))
    for service in ("gateway", "scheduler", "worker", "spillstore"):
        assert any(line.startswith(f"spillway-{service} ready") for line in lines[:ready_at])


def test_api_key_guards_v1_routes_only(tiny_system):
    with httpx.Client(base_url=tiny_system.url, timeout=30) as c:
        denied = c.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2})
        assert denied.status_code == 401
        assert denied.json()["error"]["message"]
        wrong = c.get("/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        assert c.get("/v1/models", headers=AUTH).status_code == 200
        assert c.get("/health").status_code == 200
        assert c.get("/metrics").status_code == 200


async def test_namespaces_keep_two_systems_apart(system, tiny_system, nats_url, redis_url):
    nc = await nats.connect(nats_url)
    try:
        for ns, model_id in (("e2e", "SmolLM2-135M-Instruct"), ("other", None)):
            r = await nc.request(f"{ns}.llm.models", b"", timeout=10)
            ids = [m["id"] for m in json.loads(r.data)["data"]]
            assert len(ids) == 1
            if model_id:
                assert ids == [model_id]
            else:
                assert ids != ["SmolLM2-135M-Instruct"]
        # Each spill store accounts only its own namespace's spills.
        store = redis.Redis.from_url(redis_url)
        key = SpillKeys("e2e").block_group("probe", 1, 0)
        store.set(key, b"x" * 100)
        record = SpillRecord(seq_id="probe", spill_id=1, worker_id="w", num_bytes=100, num_keys=1)
        await nc.publish("e2e.spill.recorded", encode(record))
        try:
            e2e = json.loads((await nc.request("e2e.spill.stats", b"{}", timeout=10)).data)
            other = json.loads((await nc.request("other.spill.stats", b"{}", timeout=10)).data)
        finally:
            drop = SpillDrop(spills=[SpillRef(seq_id="probe", spill_id=1)])
            await nc.publish("e2e.spill.drop", encode(drop))
            await nc.flush()
        assert e2e["redis_ok"] and other["redis_ok"]
        assert e2e["sequences"] == {"probe:1": 100} and other["sequences"] == {}
        assert wait_until(lambda: not store.exists(key), timeout=10)
    finally:
        await nc.close()


def test_health_turns_503_within_5s_of_the_last_worker_dying(tiny_system):
    with httpx.Client(base_url=tiny_system.url, timeout=5) as c:
        assert c.get("/health").status_code == 200
        worker = tiny_system.service_pids()["worker"]
        os.kill(worker, signal.SIGKILL)
        killed = time.monotonic()
        assert wait_until(lambda: c.get("/health").status_code == 503, timeout=5.0)
        print(f"health 503 after {time.monotonic() - killed:.2f}s")
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=AUTH)
        assert r.status_code == 503
        assert r.json()["error"]["message"]


def test_ctrl_c_stops_everything_with_exit_code_0(tiny_system):
    pids = tiny_system.all_descendants()
    assert pids
    assert tiny_system.stop(signal.SIGINT) == 0
    assert wait_until(lambda: not any(pid_alive(p) for p in pids), timeout=5)
