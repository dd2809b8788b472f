"""Hours of mixed traffic with a fault injected every few minutes, and proof that nothing
was lost:

    python -m bench.soak [--minutes 30] [--lanes 6] [--model DIR]

Starts its own NATS and Redis (on free ports, so it can kill and restart them), a second
scheduler (`spillway serve scheduler --speculative ngram`) and then `spillway up
--workers 2` beside it on the same bus (its scheduler plain, so requests run both with
and without n-gram speculation, by where the gateway places them), on the e2e tests'
tiny Llama with an 8k context unless --model is given (on two cores it runs thousands of
cheap steps, so faults land mid-stream). It first runs each greedy request's fault-free
reference, then `--lanes` clients send, in turn, every kind of bench/soak_traffic.py
(streams, n-gram-friendly streams, forced tool calls, JSON-schema outputs, n=2, clients
that leave mid-stream, short deadlines, NATS request/reply and NATS streams) while
bench/soak_faults.py's schedule injects worker SIGKILL, scheduler SIGKILL, NATS restart,
Redis restart, Redis refusing writes and gateway SIGSTOP in turn (every 2.5 minutes; a
short soak fits each once). Each fault's recovery is timed: from its lifting until
/health is ok with two workers, two schedulers and the spill store writable, and a short
request is served.

At the end the traffic stops and bench/soak_checks.py's invariants are checked; the
tables (requests by kind, faults with their recovery, RSS over time) and the verdicts
are printed, and the exit status is 1 when one fails.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import nats
import redis

from bench.failover import tiny_model
from bench.soak_checks import (
    RssSample,
    Verdict,
    ended_once,
    error_lines,
    errors_logged_for_faults,
    greedy_equal,
    idle,
    metrics_match,
    rss_bounded,
    tokens_whole,
)
from bench.soak_faults import FAULTS, Injected, Planned, schedule
from bench.soak_report import report
from bench.soak_traffic import (
    DISCONNECT_AFTER,
    KINDS,
    Outcome,
    Request,
    absorb,
    absorb_sse,
    gap,
    reference_bodies,
    request,
)
from spillway.services.cli.launcher import ServiceGroup, System
from spillway.services.cli.servers import ServerProcess, port_open, start_nats, start_redis
from spillway.shared.spill_keys import SpillKeys
from tests.e2e.pressure import metrics

NS = "soak"
REQUEST_TIMEOUT_S = 120.0  # a request not ended by then counts as hung (an error)
# A NATS stream silent this long has lost its messages (core NATS delivers at most once:
# a message published while its subscriber is away is gone).
NATS_IDLE_S = 30.0
RECOVERY_TIMEOUT_S = 120.0
IDLE_TIMEOUT_S = 90.0
IDLE_GAUGES = (
    "spillway_requests_running",
    "spillway_requests_waiting",
    "spillway_requests_swapped",
    "spillway_kv_cache_usage_ratio",
    "spillway_spill_store_sequences",
    "spillway_spill_store_used_bytes",
)
# The system under test: small KV pools (blocks of 16 tokens) so that the lanes preempt
# one another and spill; the spill store forgets a dead worker's spills soon enough for
# the idle check of a short soak.
SYSTEM_ENV = {
    "SPILLWAY_RESTART_BACKOFF_S": "1",
    "SPILLWAY_SPILL_ORPHAN_TIMEOUT_S": "10",
    "SPILLWAY_DRAIN_TIMEOUT_S": "5",
}

SPEC_ENV = {"SPILLWAY_SPEC_DRAFT_COST": "0.1"}
# Per worker, 16 tokens each: small, so that the lanes preempt one another and spill.
KV_BLOCKS = 24


def common_args(model: Path, nats_url: str, redis_url: str, kv_blocks: int) -> list[str]:
    return [
        "--model", str(model), "--namespace", NS,
        "--nats-url", nats_url, "--redis-url", redis_url,
        "--kv-blocks", str(kv_blocks), "--block-size", "16", "--max-batch", "4",
        "--dtype", "float32",
    ]  # fmt: skip


@dataclass
class Rig:
    """Everything the soak started, and the handles its faults need."""

    nats: ServerProcess
    redis: ServerProcess
    group: ServiceGroup  # the second scheduler
    system: System  # spillway up --workers 2
    t0: float = 0.0  # monotonic start of the traffic
    wall0: float = 0.0
    killed_workers: int = 0
    probes: list[Outcome] = field(default_factory=list)  # the recovery checks' requests

    def now(self) -> float:
        return time.monotonic() - self.t0

    def pids(self) -> dict[int, str]:
        """Every service process now, by pid: its role."""
        out = {pid: s for s, pid in self.system.service_pids().items() if s != "worker"}
        out.update({pid: "worker" for pid in self.system.worker_pids()})
        spec = self.group.children.get("scheduler")
        if spec is not None and spec.alive:
            out[spec.proc.pid] = "scheduler"
        return out

    def redis_client(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis.url, socket_timeout=5)


# --- the clients -------------------------------------------------------------------------


async def http_call(client: httpx.AsyncClient, req: Request, out: Outcome) -> None:
    if not req.stream:
        r = await client.post(req.path, json=req.body)
        out.status = r.status_code
        absorb(out, r.json(), streamed=False)
        return
    async with client.stream("POST", req.path, json={**req.body, "stream": True}) as r:
        out.status = r.status_code
        if r.status_code != 200:
            absorb(out, json.loads(await r.aread()), streamed=False)
            return
        chunks = 0
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            absorb_sse(out, line.removeprefix("data: "))
            chunks += 1
            if req.kind == "disconnect" and chunks >= DISCONNECT_AFTER and not out.finishes:
                out.disconnected = True
                return  # leaving the block closes the connection: the gateway aborts


async def nats_call(nc, req: Request, out: Outcome) -> None:
    subject = f"{NS}.llm.generate"
    if not req.stream:
        msg = await nc.request(subject, json.dumps(req.body).encode(), timeout=REQUEST_TIMEOUT_S)
        _nats_message(out, msg, streamed=False)
        return
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    try:
        await nc.publish(subject, json.dumps({**req.body, "stream": True}).encode(), inbox)
        while True:
            msg = await sub.next_msg(timeout=NATS_IDLE_S)
            if _nats_message(out, msg, streamed=True):
                # Anything more on the inbox would be a second ending.
                with contextlib.suppress(nats.errors.TimeoutError):
                    await sub.next_msg(timeout=0.2)
                    out.after_done += 1
                return
    finally:
        await sub.unsubscribe()


def _nats_message(out: Outcome, msg, streamed: bool) -> bool:
    """Absorbs one llm.generate message; True when it ends the request."""
    headers = msg.headers or {}
    body = json.loads(msg.data)
    if "Spillway-Error" in headers:
        out.status = int(headers["Spillway-Error"])
        out.error = body.get("error", body)
        return True
    absorb(out, body, streamed=streamed)
    if streamed and headers.get("Spillway-Done") == "1":
        out.done_marks += 1
        return True
    return not streamed


@dataclass
class Traffic:
    outcomes: list[Outcome] = field(default_factory=list)
    counter: itertools.count = field(default_factory=itertools.count)
    stop: asyncio.Event = field(default_factory=asyncio.Event)


async def lane(rig: Rig, lane_id: int, client: httpx.AsyncClient, nc, traffic: Traffic) -> None:
    sent = 0
    while not traffic.stop.is_set():
        n = next(traffic.counter)
        kind = KINDS[(lane_id + sent) % len(KINDS)]
        sent += 1
        req = request(kind, n // len(KINDS))
        out = Outcome(
            kind,
            rig.now(),
            reference=req.reference,
            choices=req.choices,
            max_tokens=req.body["max_tokens"],
        )
        traffic.outcomes.append(out)
        try:
            call = nats_call(nc, req, out) if req.path == "nats" else http_call(client, req, out)
            await asyncio.wait_for(call, REQUEST_TIMEOUT_S)
        except (TimeoutError, nats.errors.TimeoutError):
            out.error = {"code": "client_timeout", "message": "no end within the timeout"}
        except (httpx.HTTPError, nats.errors.Error, json.JSONDecodeError) as e:
            out.error = {"code": "client_error", "message": f"{type(e).__name__}: {e}"}
        out.ended_s = rig.now()


# --- the faults ----------------------------------------------------------------------------


def _health(url: str) -> dict[str, Any]:
    try:
        r = httpx.get(f"{url}/health", timeout=3)
        return r.json() if r.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return {}


def members(h: dict[str, Any], fault: str) -> set[str]:
    """The schedulers (for a scheduler's kill) or the workers (for a worker's) /health
    names. Only the killed kind counts: a dead scheduler's workers vanish from /health
    too, until they register with the other one."""
    if fault == "scheduler_kill":
        return {s["id"] for s in h.get("schedulers", [])}
    return {w for s in h.get("schedulers", []) for w in s["workers"]}


PROBE = {"prompt": "ping", "max_tokens": 2, "temperature": 0}


def serving(url: str, gone: set[str] = frozenset(), probes: list[Outcome] | None = None) -> bool:
    """Two workers, two schedulers (none of them one in `gone`, a killed process's), the
    spill store writable, and a short request served (its outcome added to `probes`)."""
    h = _health(url)
    if h.get("status") != "ok" or h.get("workers") != 2 or len(h.get("schedulers", [])) != 2:
        return False
    named = {s["id"] for s in h["schedulers"]} | {w for s in h["schedulers"] for w in s["workers"]}
    if named & gone:
        return False
    if h.get("spill", {}).get("status") != "ok":
        return False
    out = Outcome("probe", 0.0, max_tokens=PROBE["max_tokens"])
    if probes is not None:
        probes.append(out)
    try:
        r = httpx.post(f"{url}/v1/completions", json=PROBE, timeout=10)
        absorb(out, r.json(), streamed=False)
    except (httpx.HTTPError, ValueError) as e:
        out.error = {"code": "client_error", "message": f"{type(e).__name__}: {e}"}
        return False
    return r.status_code == 200


def inject(rig: Rig, fault: str) -> Any:
    """Starts `fault`; returns what lifting it needs."""
    if fault == "worker_kill":
        pids = sorted(rig.system.worker_pids())
        victim = pids[rig.killed_workers % len(pids)]
        rig.killed_workers += 1
        os.kill(victim, signal.SIGKILL)
    elif fault == "scheduler_kill":
        os.kill(rig.system.service_pids()["scheduler"], signal.SIGKILL)
    elif fault == "nats_restart":
        rig.nats.proc.kill()
        rig.nats.proc.wait()
    elif fault == "redis_restart":
        rig.redis.proc.kill()
        rig.redis.proc.wait()
    elif fault == "redis_refuses_writes":
        r = rig.redis_client()
        r.config_set("maxmemory-policy", "noeviction")
        r.config_set("maxmemory", "1")
    elif fault == "gateway_stop":
        pid = rig.system.service_pids()["gateway"]
        os.kill(pid, signal.SIGSTOP)
        return pid
    return None


def lift(rig: Rig, fault: str, handle: Any) -> None:
    if fault == "nats_restart":
        port = int(rig.nats.url.rsplit(":", 1)[1])
        rig.nats.proc = subprocess.Popen(
            rig.nats.proc.args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 10
        while not port_open("127.0.0.1", port) and time.monotonic() < deadline:
            time.sleep(0.05)
    elif fault == "redis_restart":
        port = int(rig.redis.url.rsplit(":", 1)[1].split("/")[0])
        old = rig.redis
        rig.redis = start_redis(port=port)
        old.workdir.cleanup()
    elif fault == "redis_refuses_writes":
        rig.redis_client().config_set("maxmemory", "0")
    elif fault == "gateway_stop":
        os.kill(handle, signal.SIGCONT)


async def faults(rig: Rig, plan: list[Planned], injected: list[Injected], say) -> None:
    url = rig.system.url
    for p in plan:
        await asyncio.sleep(max(0.0, p.at_s - rig.now()))
        # A killed process is replaced once /health names none of the members seen
        # before it (its lease, or its worker's, lapsed) but still two of each.
        before = members(await asyncio.to_thread(_health, url), p.fault)
        at = rig.now()
        handle = await asyncio.to_thread(inject, rig, p.fault)
        say(f"{at:7.1f}s  injected {p.fault} (held {p.hold_s:g}s)")
        await asyncio.sleep(p.hold_s)
        await asyncio.to_thread(lift, rig, p.fault, handle)
        f = Injected(p.fault, at, rig.now())
        injected.append(f)
        deadline = time.monotonic() + RECOVERY_TIMEOUT_S
        gone: set[str] = set()
        if p.fault.endswith("_kill"):
            gone = before - members(await asyncio.to_thread(_health, url), p.fault)
            while not gone and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
                gone = before - members(await asyncio.to_thread(_health, url), p.fault)
        while time.monotonic() < deadline:
            if await asyncio.to_thread(serving, url, gone, rig.probes):
                f.recovered_s = rig.now()
                break
            await asyncio.sleep(0.25)
        shown = f"{f.recovery_s:.1f}s" if f.recovery_s is not None else "NOT recovered"
        say(f"{rig.now():7.1f}s  {p.fault}: serving again {shown} after it was lifted")


async def sample_rss(rig: Rig, samples: list[RssSample], every_s: float, stop) -> None:
    while not stop.is_set():
        t = rig.now()
        for pid, role in (await asyncio.to_thread(rig.pids)).items():
            rss = _rss(pid)
            if rss is not None:
                samples.append(RssSample(t, role, pid, rss))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)


def _rss(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# --- the run -------------------------------------------------------------------------------


def references(url: str) -> dict[str, tuple[list[int], list[float]]]:
    """Each greedy body's fault-free run (one at a time, before any fault)."""
    out = {}
    for key, body in reference_bodies().items():
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S)
        r.raise_for_status()
        logprobs = r.json()["choices"][0]["logprobs"]
        tokens = [int(t.removeprefix("token_id:")) for t in logprobs["tokens"]]
        out[key] = (tokens, [gap(t) for t in logprobs["top_logprobs"]])
    return out


def counters(url: str) -> tuple[dict[str, float], float]:
    m = metrics(url)
    prefix = 'spillway_requests_finished_total{finish_reason="'
    finished = {k[len(prefix) : -2]: v for k, v in m.items() if k.startswith(prefix)}
    return finished, m.get("spillway_generation_tokens_total", 0.0)


# What the system did under the soak, from /metrics at the end (the whole run).
FIGURES = {
    "n-gram draft tokens accepted": ("spillway_spec_decode_accepted_tokens_total",),
    "preemptions (spill)": ('spillway_preemptions_total{mode="spill"}',),
    "preemptions (recompute)": ('spillway_preemptions_total{mode="recompute"}',),
    "spills refused": ("spillway_spill_failures_total",),
    "swap-ins": ("spillway_swap_ins_total",),
    "requests moved to another worker": ("spillway_migrations_total",),
}


def system_figures(m: dict[str, float]) -> dict[str, float]:
    return {name: sum(m.get(k, 0.0) for k in keys) for name, keys in FIGURES.items()}


def settle(rig: Rig) -> tuple[dict[str, float], list[str]]:
    """The idle gauges and the spill keys left (the index's fields named with it), once
    both are zero (or at the timeout)."""
    keys = SpillKeys(NS)
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while True:
        try:
            m = metrics(rig.system.url)
            gauges = {g: m.get(g, 0.0) for g in IDLE_GAUGES}
            client = rig.redis_client()
            spill = sorted(k.decode() if isinstance(k, bytes) else k
                           for k in client.scan_iter(keys.pattern()))  # fmt: skip
            if keys.index() in spill:
                fields = sorted(f.decode() if isinstance(f, bytes) else f
                                for f in client.hkeys(keys.index()))  # fmt: skip
                spill[spill.index(keys.index())] = f"{keys.index()} ({', '.join(fields)})"
        except (httpx.HTTPError, redis.RedisError) as e:
            gauges, spill = {f"unreadable: {e}": 1.0}, []
        if (not any(gauges.values()) and not spill) or time.monotonic() > deadline:
            return gauges, spill
        time.sleep(0.5)


async def drive(rig: Rig, duration_s: float, lanes: int, plan: list[Planned], say):
    injected: list[Injected] = []
    samples: list[RssSample] = []
    traffic = Traffic()
    stop_sampling = asyncio.Event()

    async def quiet(_: Exception) -> None:  # the restarts are the soak's own doing
        pass

    nc = await nats.connect(
        rig.nats.url, max_reconnect_attempts=-1, reconnect_time_wait=0.5, error_cb=quiet
    )
    async with httpx.AsyncClient(base_url=rig.system.url, timeout=REQUEST_TIMEOUT_S) as client:
        rig.t0, rig.wall0 = time.monotonic(), time.time()
        sampler = asyncio.ensure_future(
            sample_rss(rig, samples, max(1.0, duration_s / 90), stop_sampling)
        )
        workers = [asyncio.ensure_future(lane(rig, i, client, nc, traffic)) for i in range(lanes)]
        injector = asyncio.ensure_future(faults(rig, plan, injected, say))
        await asyncio.sleep(duration_s)
        traffic.stop.set()
        say(f"{rig.now():7.1f}s  traffic stops; waiting for the requests in flight")
        await asyncio.wait(workers, timeout=REQUEST_TIMEOUT_S + 10)
        await injector
        stop_sampling.set()
        await sampler
    await nc.close()
    return traffic.outcomes, injected, samples


@dataclass
class Result:
    verdicts: list[Verdict]
    injected: list[Injected]
    text: str

    @property
    def ok(self) -> bool:
        return all(v.ok for v in self.verdicts)


def run(
    minutes: float,
    lanes: int,
    model: Path | None,
    kv_blocks: int,
    dump: Path | None = None,
    faults: tuple[str, ...] = FAULTS,
    interval_s: float | None = None,
) -> Result:
    duration_s = minutes * 60
    plan = schedule(duration_s, faults, interval_s)
    interval = plan[1].at_s - plan[0].at_s if len(plan) > 1 else duration_s

    def say(line: str) -> None:
        print(line, flush=True)

    nats_server, redis_server = start_nats(), start_redis()
    group: ServiceGroup | None = None
    system: System | None = None
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        try:
            model = model or tiny_model(Path(tmp))
            args = common_args(model, nats_server.url, redis_server.url, kv_blocks)
            group = ServiceGroup(*args, env=SYSTEM_ENV)
            # Drafts priced low, so that they pay on a busy CPU and speculation runs.
            group.start("scheduler", "--speculative", "ngram", env=SPEC_ENV)
            system = System("--workers", "2", *args, env=SYSTEM_ENV)
            rig = Rig(nats_server, redis_server, group, system)
            if not _wait(lambda: serving(system.url), 120):
                raise RuntimeError(f"the system did not serve:\n{system.tail()}")
            say(f"serving at {system.url}: {_health(system.url)['schedulers']}")
            refs = references(system.url)
            before_finished, before_tokens = counters(system.url)
            say(f"{len(refs)} references computed; {minutes:g} minutes of traffic, "
                f"{lanes} lanes, a fault every {interval:.0f}s")  # fmt: skip
            outcomes, injected, samples = asyncio.run(drive(rig, duration_s, lanes, plan, say))
            end_s = rig.now()
            gauges, spill_keys = settle(rig)
            after_finished, after_tokens = counters(system.url)
            finished = {k: v - before_finished.get(k, 0.0) for k, v in after_finished.items()}
            figures = system_figures(metrics(system.url))
            logs = Path(system.log.name).read_text(errors="replace")
            group.log.flush()
            logs += Path(group.log.name).read_text(errors="replace")
            warmup = min(300.0, duration_s / 3)
            verdicts = [
                ended_once(outcomes, injected, end_s),
                greedy_equal(outcomes, refs, injected, end_s),
                tokens_whole(outcomes, injected, end_s),
                idle(gauges, spill_keys),
                # The recovery probes count in the gateway's metrics too.
                metrics_match(outcomes + rig.probes, finished, after_tokens - before_tokens),
                rss_bounded(samples, warmup, end_s),
                errors_logged_for_faults(error_lines(logs, rig.wall0), injected, end_s),
            ]
            text = report(outcomes, injected, samples, verdicts, figures)
            if dump is not None:
                dump.write_text(json.dumps({
                    "outcomes": [dataclasses.asdict(o) for o in outcomes],
                    "injected": [dataclasses.asdict(f) for f in injected],
                    "references": refs,
                    "finished": finished,
                }))  # fmt: skip
                dump.with_suffix(".log").write_text(logs)  # every service's log
            return Result(verdicts, injected, text)
        finally:
            if system is not None:
                system.stop(signal.SIGTERM)
            if group is not None:
                group.stop_all()
            nats_server.stop()
            redis_server.stop()


def _wait(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.5)
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--lanes", type=int, default=6, help="clients sending at once")
    parser.add_argument("--model", type=Path, help="a Hugging Face folder (default: tiny)")
    parser.add_argument("--kv-blocks", type=int, default=KV_BLOCKS,
                        help="per worker, 16 tokens each (small: the lanes preempt one "
                        "another, and spill)")  # fmt: skip
    parser.add_argument(
        "--dump",
        type=Path,
        help="write every outcome here (JSON), and the services' logs beside it (.log)",
    )
    parser.add_argument("--faults", default=",".join(FAULTS),
                        help="which faults, in turn (comma-separated; default: all)")  # fmt: skip
    parser.add_argument("--interval", type=float, help="seconds between faults "
                        "(default: 150, or fewer to fit each fault once)")  # fmt: skip
    args = parser.parse_args(argv)
    faults = tuple(f for f in args.faults.split(",") if f)
    try:
        schedule(args.minutes * 60, faults, args.interval)
    except ValueError as e:
        parser.error(str(e))
    result = run(
        args.minutes, args.lanes, args.model, args.kv_blocks, args.dump, faults, args.interval
    )
    print(result.text, flush=True)
    print("all invariants hold" if result.ok else "AN INVARIANT FAILED", flush=True)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
