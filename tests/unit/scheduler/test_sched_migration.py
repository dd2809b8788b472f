"""Several workers under one scheduler: placement, and sequences moving from a lost
worker's core to another's (swapped in from their spills, or recomputed), checked by
fake workers that share one spill store, against the tokens of an undisturbed run."""

from __future__ import annotations

import itertools

from spillway.services.scheduler.core import SchedulerCore
from spillway.services.scheduler.placement import Candidate, place
from spillway.services.scheduler.sequence import SequenceStatus
from tests.unit.scheduler.harness import (
    FakeWorker,
    Outcome,
    collect,
    expected_tokens,
    make_core,
    run_to_completion,
    submit,
    tick,
    worker_info,
)

BS = 4
NEW_TOKENS = 20


def _pair(**kwargs) -> tuple[SchedulerCore, SchedulerCore, FakeWorker, FakeWorker]:
    """Two cores of one scheduler (one arrival order), two workers, one spill store."""
    a, clock = make_core(block_size=BS, worker_id="wa", **kwargs)
    b = SchedulerCore(clock, a.config, arrivals=itertools.count(1000))
    a._arrivals = b._arrivals  # as the service shares one counter between its cores
    b.attach_worker(worker_info(block_size=BS, worker_id="wb", **_geometry(kwargs)))
    if a.config.spill_store:
        b.spill_store_reported(True, 1 << 40)
    worker_a, worker_b = FakeWorker(BS), FakeWorker(BS)
    worker_b.spilled = worker_a.spilled  # the spill store is shared: Redis
    worker_b.tier = worker_a.tier
    return a, b, worker_a, worker_b


def _geometry(kwargs: dict) -> dict:
    return {k: v for k, v in kwargs.items() if k in ("num_kv_blocks", "max_model_len")}


def _under_pressure() -> tuple[SchedulerCore, SchedulerCore, FakeWorker, dict[str, Outcome]]:
    """Six requests on worker a until KV pressure has spilled some; b is the other."""
    a, b, worker_a, worker_b = _pair(
        num_kv_blocks=14, spill_store=True, preemption_mode="spill", max_batch=6
    )
    for i in range(6):
        submit(a, f"r{i}", prompt_len=5 + i, max_tokens=NEW_TOKENS)
    outcomes: dict[str, Outcome] = {}
    while a.num_swapped == 0 or a.num_running < 2:
        collect(outcomes, tick(a, worker_a)[1])
    return a, b, worker_b, outcomes


def test_a_lost_workers_sequences_finish_on_another_with_undisturbed_tokens():
    a, b, worker_b, outcomes = _under_pressure()
    statuses = {s: a.sequence(s).status for s in outcomes}  # type: ignore[union-attr]
    assert SequenceStatus.SWAPPED in statuses.values()
    moved = a.evacuate()
    assert a.blocks is None and not a.has_work() and a.num_live == 0
    assert {s.request_id for s in moved} == {f"r{i}" for i in range(6)}
    assert all(not s.block_ids and s.state_slot is None for s in moved)
    swapped = {s.request_id for s in moved if s.status is SequenceStatus.SWAPPED}
    assert swapped and all(s.spilled is not None for s in moved if s.request_id in swapped)
    started = sum(1 for s in moved if s.status is not SequenceStatus.WAITING)
    assert b.adopt(moved, kv_layout="") == []
    b.check_integrity()
    assert b.stats.migrations == started and b.num_swapped == len(swapped)
    run_to_completion(b, worker_b, outcomes)
    for rid in (f"r{i}" for i in range(6)):
        assert outcomes[rid].finish_reason == "length"
        assert outcomes[rid].token_ids == expected_tokens(rid, NEW_TOKENS), rid
    # The spilled ones came back from the store on the other worker, not by recompute
    # (its own pressure may spill others too).
    restored = {r.seq_id for p in worker_b.plans for r in p.restores}
    assert swapped <= restored


def test_a_layout_the_new_worker_cannot_read_means_recompute():
    a, b, worker_b, outcomes = _under_pressure()
    moved = a.evacuate()
    b.adopt(moved, kv_layout="another model/bfloat16")
    assert b.num_swapped == 0
    drops = {(d.seq_id, d.spill_id) for d in b.take_spill_drops()}
    assert drops  # the spills nobody can read are let go
    run_to_completion(b, worker_b, outcomes)
    restored = {(r.seq_id, r.spill_id) for p in worker_b.plans for r in p.restores}
    assert not restored & drops  # (its own pressure may spill and restore others)
    for i in range(6):
        assert outcomes[f"r{i}"].token_ids == expected_tokens(f"r{i}", NEW_TOKENS)


def test_a_sequence_too_long_for_the_other_worker_ends_with_an_error():
    a, _ = make_core(block_size=BS, max_model_len=256)
    b = SchedulerCore(a.clock, a.config)
    b.attach_worker(worker_info(block_size=BS, worker_id="wb", max_model_len=16))
    submit(a, "long", prompt_len=20, max_tokens=4)
    submit(a, "short", prompt_len=5, max_tokens=4)
    tick(a, FakeWorker(BS))
    news = b.adopt(a.evacuate(), kv_layout="")
    assert [(d.request_id, d.finish_reason) for d in news] == [("long", "error")]
    assert news[0].error is not None and news[0].error.code == "context_length_exceeded"
    outcomes = run_to_completion(b, FakeWorker(BS))
    assert outcomes["short"].finish_reason == "length"


def test_placement_sees_the_prefix_cache_and_the_queue():
    core, _ = make_core(block_size=BS, num_kv_blocks=64)
    worker = FakeWorker(BS)
    prompt = [30 + i for i in range(17)]
    needed, hits, room = core.placement(prompt)
    assert (needed, hits, room) == (5, 0, 64)
    submit(core, "first", prompt=prompt, max_tokens=2)
    assert core.placement(prompt)[2] == 64 - 5  # the waiting one's blocks are spoken for
    run_to_completion(core, worker)
    _, hits, room = core.placement(prompt)
    assert hits == 4 and room == 64  # its full blocks stay cached, and evictable


def test_place_prefers_the_prefix_holder_with_room_then_the_most_room():
    def cand(w, hits, room, live=0, needed=5):
        return Candidate(w, needed, hits, room, live, max_batch=4)

    assert place([cand("a", 0, 10), cand("b", 0, 30)]) == "b"
    assert place([cand("a", 4, 10), cand("b", 0, 30)]) == "a"  # its cache saves the prefill
    assert place([cand("a", 4, 0), cand("b", 0, 30)]) == "b"  # it would have to wait
    assert place([cand("a", 4, 10, live=4), cand("b", 0, 30)]) == "b"  # its batch is full
    assert place([cand("a", 0, -8), cand("b", 0, -2)]) == "b"  # short everywhere
    assert place([cand("a", 0, 10, live=3), cand("b", 0, 10, live=1)]) == "b"


def test_placement_spreads_a_burst_over_equal_workers():
    a, b, _, _ = _pair(num_kv_blocks=64)
    cores = {"wa": a, "wb": b}
    for i in range(8):
        prompt = [40 + 3 * i + j for j in range(9)]
        chosen = place(
            [Candidate(w, *c.placement(prompt), c.num_live, c.max_batch) for w, c in cores.items()]
        )
        submit(cores[chosen], f"q{i}", prompt=prompt, max_tokens=2)
    assert (a.num_waiting, b.num_waiting) == (4, 4)


def test_the_spills_a_core_holds_are_its_swapped_sequences_until_they_resume():
    """What the lease lists for the spill store (a spill not listed is let go there)."""
    a, b, worker_b, outcomes = _under_pressure()
    swapped = {
        (s.request_id, s.spilled.spill_id)
        for s in (a.sequence(r) for r in outcomes)
        if s is not None and s.status is SequenceStatus.SWAPPED and s.spilled is not None
    }
    assert swapped and set(a.held_spills()) == swapped
    b.adopt(a.evacuate(), kv_layout="")
    assert set(b.held_spills()) == swapped and not set(a.held_spills())
    run_to_completion(b, worker_b, outcomes)
    assert not set(b.held_spills())
