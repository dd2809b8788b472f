"""A property test of the fleet core: random orders of submits, aborts, replies handed
back in any order or lost, workers that die, hang and come back, drain, restart or join,
our own connection dropping, gateways that stop beating, and time passing. Whatever the
order, no request gets news after its end, every request taken ends exactly once (once a
healthy worker is there), and every token a request got is the one an undisturbed run
gives, in order (a moved request goes on where it was)."""

from __future__ import annotations

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from spillway.services.scheduler.fleet_events import (
    Aborted,
    BusReconnected,
    GatewayBeatHeard,
)
from tests.unit.scheduler.fleet_rig import FleetRig
from tests.unit.scheduler.harness import expected_tokens

WORKERS = ["w1", "w2", "w3"]

ops = st.one_of(
    st.tuples(st.just("submit"), st.integers(1, 30), st.sampled_from(["g1", "g2"])),
    st.tuples(st.just("abort"), st.integers(0, 20)),
    st.tuples(st.just("wake")),
    st.tuples(st.just("deliver"), st.integers(0, 3)),
    st.tuples(st.just("deliver"), st.integers(0, 3)),
    st.tuples(st.just("deliver"), st.integers(0, 3)),
    st.tuples(st.just("lose"), st.integers(0, 3), st.sampled_from([503, 504, 500])),
    st.tuples(st.just("kill"), st.sampled_from(WORKERS)),
    st.tuples(st.just("hang"), st.sampled_from(WORKERS)),
    st.tuples(st.just("revive"), st.sampled_from(WORKERS)),
    st.tuples(st.just("drain"), st.sampled_from(WORKERS)),
    st.tuples(st.just("restart"), st.sampled_from(WORKERS)),
    st.tuples(st.just("tick"), st.sampled_from([0.25, 0.5, 1.0, 2.5])),
    st.tuples(st.just("reconnect")),
    st.tuples(st.just("gateway_beat"), st.sampled_from(["g1", "g2"])),
)


@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    st.lists(st.integers(1, 30), min_size=1, max_size=6),
    st.lists(ops, min_size=1, max_size=60),
    st.booleans(),
    st.integers(8, 64),
)
# An idle tick's retirement made room to resume a preempted sequence, which then waited
# for a wake that never came.
@example(burst=[28, 1, 12], events=[("submit", 1, "g1")], run_ahead=False, blocks=8)
# A worker joins while another's batch is full and requests wait behind it: they move.
@example(
    burst=[30, 30, 30, 30],
    events=[
        ("kill", "w2"),
        ("tick", 1.5),
        ("submit", 5, "g1"),
        ("submit", 6, "g2"),
        ("submit", 7, "g1"),
        ("restart", "w2"),
        ("deliver", 0),
    ],
    run_ahead=True,
    blocks=64,
)
def test_every_request_ends_exactly_once_whatever_the_order_of_events(
    burst, events, run_ahead, blocks
):
    rig = FleetRig(
        worker_timeout_s=1.0,
        step_hang_s=1.5,
        drain_timeout_s=1.0,
        run_ahead=run_ahead,
        max_batch=4,
    )
    boots = dict.fromkeys(WORKERS, 0)

    def start(worker_id: str) -> None:
        boots[worker_id] += 1
        rig.register(worker_id, boot_id=f"b{boots[worker_id]}", num_kv_blocks=blocks)

    start("w1")
    start("w2")
    accepted: dict[str, int] = {}
    refused: list[str] = []
    for i, max_tokens in enumerate(burst):  # a burst, then anything in any order
        assert rig.submit(f"b{i}", max_tokens=max_tokens) is None
        accepted[f"b{i}"] = max_tokens
    rig.wake()
    for n, (kind, *args) in enumerate(events):
        if kind == "submit":
            rid = f"r{n}"
            error = rig.submit(rid, gateway_id=args[1], max_tokens=args[0])
            (refused.append(rid) if error else accepted.__setitem__(rid, args[0]))
        elif kind == "abort" and accepted:
            rig.feed(Aborted([list(accepted)[args[0] % len(accepted)]]))
        elif kind == "wake":
            rig.wake()
        elif kind == "deliver":
            rig.deliver(args[0])
        elif kind == "lose":
            rig.lose(args[0], status=args[1])
        elif kind in ("kill", "hang", "revive", "drain", "restart"):
            worker = rig.workers.get(args[0])
            if kind == "restart" or worker is None:
                start(args[0])
            elif kind == "kill":
                worker.answers = worker.beats = False
                worker.held.clear()  # a dead process runs nothing more
            elif kind == "hang":
                worker.answers = False
            elif kind == "revive" and worker.beats:
                rig.resume(args[0])
            elif kind == "drain":
                worker.draining = True
                rig.beat(args[0])
        elif kind == "tick":
            rig.tick(args[0])
        elif kind == "reconnect":
            rig.feed(BusReconnected())
        elif kind == "gateway_beat":
            rig.feed(GatewayBeatHeard(args[0]))

    # Heal: every worker left answers, and a fresh one joins; the rest must finish.
    for worker_id, worker in rig.workers.items():
        if worker.beats:
            rig.resume(worker_id)
    rig.register("w9", num_kv_blocks=64)
    rig.wake()
    rig.run(max_rounds=20000)

    assert not rig.fleet.has_requests
    for rid in refused:
        assert rid not in rig.outcomes  # a refused request gets no news
    for rid, max_tokens in accepted.items():
        outcome = rig.outcomes.get(rid)
        assert outcome is not None and outcome.finish_reason is not None, f"{rid} never ended"
        assert sum(d.finish_reason is not None for d in outcome.deltas) == 1
        assert outcome.token_ids == expected_tokens(rid, len(outcome.token_ids))
        if outcome.finish_reason == "length":
            assert len(outcome.token_ids) == max_tokens
    stats = rig.fleet.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_usage == 0.0
