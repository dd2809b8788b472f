"""A short soak (bench/soak.py) in the suite: mixed traffic against `spillway up --workers
2` beside a second scheduler while every fault is injected once (worker and scheduler
SIGKILL, NATS and Redis restarts, Redis refusing writes, the gateway stopped 3 s), and
every invariant holds: each request ended once, greedy streams equal their fault-free
runs, no token lost or repeated, nothing held at idle, the metrics match the clients,
RSS flat after the warm-up, no ERROR line but for a fault."""

from __future__ import annotations

import pytest

from bench.soak import KV_BLOCKS, run

pytestmark = pytest.mark.slow

# The suite's budget allows two minutes for the whole of it: the system's start and the
# references before, the drain and the idle check after. 60 s of traffic still fit every
# fault once (about 9 s apart, each held at most half of that) with a fault-free stretch
# after the last. (A drop lost in the NATS restart once left a spill in the store's ledger
# past the idle check of so short a soak; the scheduler's lease now lists what it holds.)
MINUTES = 1.0


def test_a_short_soak_with_every_fault_keeps_every_invariant() -> None:
    # The bench's small KV pools: requests are preempted and spilled, so the scheduler
    # kill may find some swapped out, whose spills the store must then expire (the idle
    # check counts every spill key left).
    result = run(MINUTES, lanes=6, model=None, kv_blocks=KV_BLOCKS)
    print(result.text)
    failed = [v for v in result.verdicts if not v.ok]
    assert not failed, "\n".join(
        f"{v.name}: {v.detail}\n  " + "\n  ".join(v.examples) for v in failed
    )
    assert len(result.verdicts) == 7
    assert len(result.injected) == 6 and all(f.recovery_s is not None for f in result.injected)
