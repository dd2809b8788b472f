"""The fleet core with fake workers and a fake clock: placement, workers that die, hang,
drain or register anew, an outage of our own connection, gateways that die, the
scheduler's own drain. Every request's tokens are checked against the fake model: a
moved request must go on exactly where it was (no token lost or repeated)."""

from __future__ import annotations

from spillway.services.scheduler.fleet import HANDED_BACK, WORKER_LOST
from spillway.services.scheduler.fleet_events import (
    Aborted,
    BusReconnected,
    DrainExpired,
    DrainStarted,
    GatewayBeatHeard,
    LeaseHeard,
    Stopped,
)
from spillway.services.scheduler.lane import MAX_LOST_STEPS
from spillway.shared.protocol import GATEWAY_TIMEOUT_S, SchedulerLease
from tests.unit.scheduler.fleet_rig import FleetRig
from tests.unit.scheduler.harness import expected_tokens


def _one_worker(**kwargs) -> FleetRig:
    rig = FleetRig(**kwargs)
    rig.register("w1")
    return rig


def _two_workers(**kwargs) -> FleetRig:
    rig = _one_worker(**kwargs)
    rig.register("w2")
    return rig


def _placed(rig: FleetRig, request_id: str) -> str:
    return next(s.worker_id for s in rig.sent for r in s.plan.rows if r.seq_id == request_id)


def _run_until_tokens(rig: FleetRig, request_id: str, count: int) -> None:
    for _ in range(500):
        outcome = rig.outcomes.get(request_id)
        if outcome is not None and len(outcome.token_ids) >= count:
            return
        assert rig.deliver(), "nothing to deliver"
    raise AssertionError(f"{request_id} did not get {count} tokens")


def _start(rig: FleetRig, *request_ids: str, max_tokens: int, until: int) -> None:
    """Submit the requests together and run the fleet until each has `until` tokens."""
    for request_id in request_ids:
        rig.submit(request_id, max_tokens=max_tokens)
    rig.wake()
    for request_id in request_ids:
        _run_until_tokens(rig, request_id, until)


def _another_scheduler(rig: FleetRig) -> None:
    """A peer scheduler's lease is heard: the gateways have somewhere else to go."""
    rig.feed(
        LeaseHeard(SchedulerLease(scheduler_id="s2", interval_s=1.0, worker_id="wx", boot_id="b"))
    )


def test_a_burst_is_spread_over_the_workers_and_goes_out_in_one_step_each():
    rig = _two_workers()
    for i in range(8):
        assert rig.submit(f"r{i}", max_tokens=6) is None
    assert not rig.sent  # nothing goes out before the burst is in
    rig.wake()
    assert sorted(s.worker_id for s in rig.sent) == ["w1", "w2"]
    placed = {f"r{i}": _placed(rig, f"r{i}") for i in range(8)}
    assert sorted(placed.values()) == ["w1"] * 4 + ["w2"] * 4
    rig.run()
    for i in range(8):
        assert rig.finish(f"r{i}") == "length"
        assert rig.outcomes[f"r{i}"].token_ids == expected_tokens(f"r{i}", 6)


def test_the_requests_of_a_worker_that_dies_move_on_and_lose_no_token():
    rig = _two_workers()
    _start(rig, *(f"r{i}" for i in range(4)), max_tokens=12, until=3)
    on_w1 = [f"r{i}" for i in range(4) if _placed(rig, f"r{i}") == "w1"]
    assert on_w1
    w1 = rig.workers["w1"]
    w1.answers = w1.beats = False  # SIGKILL
    rig.tick(0.6)
    assert "w1" in rig.fleet.lanes  # not dropped before its timeout
    rig.tick(0.6)
    assert list(rig.fleet.lanes) == ["w2"]
    rig.run()
    for i in range(4):
        assert rig.finish(f"r{i}") == "length"
        assert rig.outcomes[f"r{i}"].token_ids == expected_tokens(f"r{i}", 12)
    for rid in on_w1:  # recomputed on w2 from its prompt and the tokens it had
        assert rig.rows_on("w2", rid)[0].start_pos == 0
    assert rig.fleet.stats().migrations == len(on_w1)


def test_with_no_other_worker_the_requests_of_a_dead_one_end_with_an_error():
    rig = _one_worker()
    _start(rig, "a", max_tokens=50, until=2)
    w1 = rig.workers["w1"]
    w1.answers = w1.beats = False
    rig.tick(1.2)
    assert rig.finish("a") == "error"
    error = rig.error_of("a")
    assert error is not None and error.status == 503 and error.code == "no_worker"
    refused = rig.submit("late")
    assert refused is not None and refused.code == "no_worker"


def test_with_another_scheduler_serving_the_requests_of_a_dead_only_worker_go_back():
    """The gateways resume them on the other scheduler, from what each client has,
    instead of ending them with no_worker."""
    rig = _one_worker()
    _another_scheduler(rig)
    _start(rig, "a", "b", max_tokens=50, until=2)
    w1 = rig.workers["w1"]
    w1.answers = w1.beats = False
    rig.tick(1.2)
    for rid in ("a", "b"):
        assert rig.finish(rid) == "error"
        assert rig.error_of(rid) == WORKER_LOST and WORKER_LOST.code == "handed_back"
    refused = rig.submit("late")  # new ones: no_worker, and the gateway goes elsewhere
    assert refused is not None and refused.code == "no_worker"


def test_a_hung_worker_is_given_up_and_driven_again_once_it_steps():
    rig = _two_workers(step_hang_s=2.0)
    _start(rig, "a", "b", max_tokens=10, until=2)
    hung = _placed(rig, "a")
    rig.workers[hung].answers = False  # its heartbeats go on
    rig.tick(1.0)
    assert hung in rig.fleet.lanes
    rig.tick(1.5)
    assert hung not in rig.fleet.lanes  # given up, though it beats
    rig.run()
    for rid in ("a", "b"):
        assert rig.outcomes[rid].token_ids == expected_tokens(rid, 10)
    assert [w.worker_id for w in rig.fleet.stats().workers] != [] and hung not in rig.fleet.lanes
    rig.tick(0.25)
    assert hung not in rig.fleet.lanes  # the same step count: still hung
    rig.workers[hung].num_steps += 1  # it finished the step that hung
    rig.tick(0.25)
    assert hung in rig.fleet.lanes


def test_no_worker_is_given_up_for_a_step_sent_before_our_connection_came_back():
    rig = _one_worker(step_hang_s=2.0)
    _start(rig, "a", max_tokens=10, until=2)
    rig.workers["w1"].answers = False  # nothing comes back: the bus, or the worker?
    rig.workers["w1"].replies.clear()
    rig.connected = False
    rig.tick(1.0)
    sent = len(rig.sent)
    rig.feed(BusReconnected())
    rig.connected = True
    rig.tick(1.5)  # the first step is 2.5 s old
    assert "w1" in rig.fleet.lanes
    assert len(rig.sent) == sent + 1  # heard after the outage: its sequences recomputed
    rig.tick(2.0)  # a step sent since the outage that hangs does count
    assert "w1" not in rig.fleet.lanes


def test_after_an_outage_the_worker_is_reattached_once_heard_and_its_requests_go_on():
    rig = _one_worker()
    _start(rig, "a", max_tokens=10, until=3)
    lost = list(rig.undelivered)
    assert lost
    rig.undelivered.clear()  # the replies in flight are gone with the connection
    rig.workers["w1"].replies.clear()
    rig.feed(BusReconnected())
    assert not rig.sent[-1:] or rig.sent[-1].ticket == lost[-1][1]  # nothing new yet
    rig.beat("w1")  # heard: the step state is unknown, so it is recomputed
    assert rig.sent[-1].ticket > lost[-1][1]
    rig.run()
    assert rig.finish("a") == "length"
    assert rig.outcomes["a"].token_ids == expected_tokens("a", 10)


def test_a_draining_worker_takes_no_new_request_and_its_requests_move_at_the_deadline():
    rig = _two_workers(drain_timeout_s=3.0)
    _start(rig, "a", max_tokens=200, until=2)
    draining = _placed(rig, "a")
    other = "w2" if draining == "w1" else "w1"
    rig.workers[draining].draining = True
    rig.beat(draining)
    assert not rig.fleet.lease().draining  # the other worker still takes requests
    for i in range(3):
        rig.submit(f"n{i}", max_tokens=4)
    rig.wake()
    for _ in range(30):
        rig.deliver()
    assert all(_placed(rig, f"n{i}") == other for i in range(3))
    rig.tick(3.1)
    assert draining not in rig.fleet.lanes
    rig.run()
    assert rig.finish("a") == "length"
    assert rig.outcomes["a"].token_ids == expected_tokens("a", 200)
    assert rig.rows_on(other, "a")


def test_a_draining_worker_alone_ends_what_still_runs_with_abort():
    rig = _one_worker(drain_timeout_s=1.0)
    _start(rig, "a", max_tokens=200, until=2)
    rig.workers["w1"].draining = True
    rig.beat("w1")
    assert rig.fleet.lease().draining  # its only worker drains: gateways go elsewhere
    rig.tick(1.1)
    rig.run()
    assert rig.finish("a") == "abort"


def test_a_worker_that_registers_anew_recomputes_its_requests_on_its_new_kv():
    rig = FleetRig()
    rig.register("w1", boot_id="first")
    _start(rig, "a", max_tokens=10, until=4)
    rig.register("w1", boot_id="first")  # the same process again: nothing changes
    before = len(rig.rows_on("w1", "a"))
    rig.deliver()
    assert rig.rows_on("w1", "a")[before].start_pos > 0
    rig.register("w1", boot_id="second")  # restarted: its KV is empty
    rig.run()
    assert rig.outcomes["a"].token_ids == expected_tokens("a", 10)
    assert any(r.start_pos == 0 for r in rig.rows_on("w1", "a")[before + 1 :])


def test_a_lost_step_is_planned_again_once_the_worker_is_heard():
    rig = _one_worker()
    _start(rig, "a", max_tokens=8, until=2)
    sent = len(rig.sent)
    assert rig.lose()
    assert len(rig.sent) == sent  # waits for a sign of life
    rig.beat("w1")
    assert len(rig.sent) == sent + 1
    rig.run()
    assert rig.outcomes["a"].token_ids == expected_tokens("a", 8)


def test_steps_lost_again_and_again_end_their_requests_with_the_bus_error():
    rig = _one_worker()
    rig.submit("a", max_tokens=8)
    rig.wake()
    for _ in range(MAX_LOST_STEPS):
        assert rig.lose(status=503)
        rig.beat("w1")
    assert rig.lose(status=503)
    assert rig.finish("a") == "error"
    error = rig.error_of("a")
    assert error is not None and error.status == 503


def test_a_silent_gateway_is_suspected_first_and_aborted_past_its_grace():
    rig = FleetRig()
    grace = rig.fleet.settings.gateway_grace_s
    rig.register("w1")
    rig.submit("dead", gateway_id="g1", max_tokens=5000)  # the submit is its first sign of life
    rig.submit("quiet", gateway_id="g2", max_tokens=5000)
    rig.submit("stalled", gateway_id="g3", max_tokens=5000)
    rig.wake()
    _run_until_tokens(rig, "dead", 2)
    rig.tick(GATEWAY_TIMEOUT_S + 0.1)
    rig.deliver()
    rig.feed(GatewayBeatHeard("g2"))  # g2 beats on; g1 and g3 are only suspected
    assert rig.gateways_suspected() == {"g1", "g3"}
    assert all(rig.finish(r) is None for r in ("dead", "quiet", "stalled"))
    before = len(rig.outcomes["stalled"].token_ids)
    rig.tick(grace - GATEWAY_TIMEOUT_S - 0.5)
    rig.deliver()
    rig.feed(GatewayBeatHeard("g2"))
    rig.feed(GatewayBeatHeard("g3"))  # its loop runs again: nothing was lost
    assert len(rig.outcomes["stalled"].token_ids) > before  # generation never paused
    rig.tick(0.6)  # g1 now silent past the grace
    rig.deliver()  # the step under way ends its tick with the news
    assert rig.finish("dead") == "abort"
    assert rig.finish("stalled") is None and rig.gateways_suspected() == set()
    assert rig.finish("quiet") != "abort"  # its gateway beat on throughout
    rig.feed(Aborted(["stalled"]))
    rig.run()
    assert rig.finish("stalled") == "abort"
    rig.feed(Aborted(["quiet"]))
    rig.run()
    assert rig.fleet.stats().kv_usage == 0.0


def test_a_draining_scheduler_hands_back_what_has_not_started_and_aborts_the_rest_late():
    rig = _one_worker(max_batch=1)
    _another_scheduler(rig)
    rig.submit("running", max_tokens=300)
    rig.submit("queued", max_tokens=5)
    rig.wake()
    _run_until_tokens(rig, "running", 2)
    rig.feed(DrainStarted())
    assert rig.fleet.lease().draining
    refused = rig.submit("late")
    assert refused is not None and refused.status == 503
    rig.deliver()
    assert rig.finish("queued") == "error"
    assert rig.error_of("queued") == HANDED_BACK
    assert rig.finish("running") is None
    rig.feed(DrainExpired())
    rig.run()
    assert rig.finish("running") == "abort"


def test_at_the_end_every_request_still_here_ends():
    rig = _two_workers()
    for i in range(4):
        rig.submit(f"r{i}", max_tokens=100)
    rig.wake()
    rig.deliver()
    rig.feed(Stopped())
    assert all(rig.finish(f"r{i}") == "error" for i in range(4))
    assert not rig.fleet.has_requests


def test_an_idle_fleet_sends_nothing_on_its_timers():
    rig = _two_workers()
    rig.submit("a", max_tokens=3)
    rig.wake()
    rig.run()
    rig.tick(0.5)  # the step telling the worker to forget "a" comes back
    sent, reports = len(rig.sent), rig.reports
    rig.tick(2.0)  # heartbeats and timers, nothing to do
    assert (len(rig.sent), rig.reports) == (sent, reports)
    assert not rig.fleet.ticking


def _waiting_on(rig: FleetRig, worker_id: str) -> int:
    return rig.fleet.lanes[worker_id].num_waiting


def test_a_joining_worker_takes_the_requests_waiting_behind_a_full_batch_in_order():
    rig = _one_worker(max_batch=2)
    _start(rig, "a", "b", max_tokens=12, until=2)
    # Waiting behind the full batch: "c" resumed (its first scheduler died after three
    # tokens), "d", and "e" and "f" behind them (a lower priority first, then arrival).
    rig.submit("c", max_tokens=8, output_token_ids=expected_tokens("c", 3))
    rig.submit("d", max_tokens=8)
    rig.submit("e", max_tokens=8, priority=1)
    rig.submit("f", max_tokens=8, priority=-1)
    rig.wake()
    assert _waiting_on(rig, "w1") == 4
    rig.register("w2")  # joins with an empty batch of two
    assert _waiting_on(rig, "w1") == 2
    assert [r.seq_id for r in rig.sent[-1].plan.rows] == ["f", "c"]
    assert rig.sent[-1].worker_id == "w2"
    rig.run()
    for rid in ("a", "b"):
        assert rig.outcomes[rid].token_ids == expected_tokens(rid, 12)
        assert not rig.rows_on("w2", rid)
    for rid in ("d", "e"):
        assert rig.outcomes[rid].token_ids == expected_tokens(rid, 8)
    assert rig.outcomes["f"].token_ids == expected_tokens("f", 8)
    assert not rig.rows_on("w1", "f") and not rig.rows_on("w1", "c")
    # The resumed request kept its tokens: only the later ones went out.
    assert rig.outcomes["c"].token_ids == expected_tokens("c", 8)[3:]
    assert rig.rows_on("w2", "c")[0].start_pos == 0
    assert rig.fleet.stats().migrations == 0  # nothing had KV to recompute


def test_nothing_waiting_moves_while_no_other_batch_has_room():
    rig = _two_workers(max_batch=2)
    for i in range(4):
        rig.submit(f"r{i}", max_tokens=10)
    rig.wake()
    _run_until_tokens(rig, "r0", 1)
    rig.submit("late1", max_tokens=4)
    rig.submit("late2", max_tokens=4)
    rig.wake()
    held = {w: [r for r in ("late1", "late2") if rig.fleet.lanes[w].sequence(r)]
            for w in ("w1", "w2")}  # fmt: skip
    rig.tick(0.5)
    assert sum(map(len, held.values())) == 2
    for worker_id, rids in held.items():
        for rid in rids:
            assert rig.fleet.lanes[worker_id].sequence(rid) is not None
            assert not rig.rows_on("w1", rid) and not rig.rows_on("w2", rid)
    rig.run()  # (once a batch thins out, what waits on the other may move there)
    for rid in ("late1", "late2"):
        assert rig.outcomes[rid].token_ids == expected_tokens(rid, 4)


def test_a_waiting_request_moves_only_to_a_worker_whose_blocks_hold_it():
    rig = _one_worker(max_batch=1)
    rig.submit("a", max_tokens=6)
    rig.submit("b", max_tokens=6, prompt=list(range(300, 340)))
    rig.wake()
    rig.register("w2", num_kv_blocks=4)  # room in its batch, not in its blocks (16 tokens)
    assert _waiting_on(rig, "w1") == 1
    rig.register("w3")
    assert _waiting_on(rig, "w1") == 0 and rig.fleet.lanes["w3"].sequence("b")
    rig.run()
    assert rig.outcomes["b"].token_ids == expected_tokens("b", 6)


def test_a_peer_scheduler_that_stopped_leasing_is_forgotten():
    """Each killed and restarted peer is a new scheduler id: a book that kept every one
    would grow for as long as the system runs."""
    rig = _one_worker()
    timeout_s = rig.fleet.replicas.timeout_s
    for i in range(5):  # five peers in turn, each killed before the next one starts
        rig.feed(LeaseHeard(SchedulerLease(scheduler_id=f"s{i}", interval_s=1.0, boot_id="b")))
        rig.tick(timeout_s + 0.5)
    rig.feed(LeaseHeard(SchedulerLease(scheduler_id="s9", interval_s=1.0, boot_id="b")))
    assert [lease.scheduler_id for lease in rig.fleet.replicas.known()] == ["s9"]
