"""Spilling's health as the lease and /health tell it: a store that answers and refuses
writes, and spills refused lately, read as degraded, with the reason in words."""

from __future__ import annotations

from spillway.services.scheduler.preemption import RecentSpillFailures, spill_reason, spill_status
from spillway.shared.protocol import SpillStats

OOM = "OutOfMemoryError: command not allowed when used memory > 'maxmemory'."


def test_a_store_that_answers_and_refuses_writes_is_degraded_with_its_error():
    full = SpillStats(redis_ok=True, writable=False, redis_error=OOM)
    assert spill_status("spill", full) == "degraded"
    assert spill_reason("spill", full) == (
        f"redis refuses writes ({OOM}): victims are recomputed, not spilled"
    )
    down = SpillStats(redis_ok=False, writable=False, redis_error="ConnectionError: refused")
    assert spill_reason("auto", down).startswith("redis is unavailable (ConnectionError")
    assert spill_status("recompute", full) == "off" and spill_reason("recompute", full) == ""


def test_a_refused_spill_degrades_spilling_while_it_is_recent():
    healthy = SpillStats(redis_ok=True)
    failures = RecentSpillFailures(memory_s=10.0)
    failures.observe(0, "", now_s=0.0)
    assert failures.failing(0.0) == "" and spill_status("spill", healthy, "") == "ok"
    failures.observe(1, f"{OOM} b'\x00\x01\x02\x03\x04\x05\x06\x07\x08'", now_s=1.0)
    failing = failures.failing(2.0)
    assert "maxmemory" in failing and "\x00" not in failing  # no payload in the reason
    assert spill_status("spill", healthy, failing) == "degraded"
    assert "spills failed lately" in spill_reason("spill", healthy, failing)
    failures.observe(1, "", now_s=5.0)  # no new failure: the last one ages
    assert failures.failing(10.5) and not failures.failing(11.5)
    failures.observe(2, "", now_s=12.0)  # one without words still counts
    assert failures.failing(12.0) == "the store did not take the KV"
