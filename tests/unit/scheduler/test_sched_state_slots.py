"""State slots of a hybrid model's worker in the pure core: a bounded pool the core never
over-commits, slots held exactly while blocks are, rows sorted by slot, the recurrent
state spilled with the blocks at the confirmed tokens and restored on swap-in, recompute
from zero, no prefix hits. The fake worker models each slot's state as (sequence, tokens
consumed) and fails a row that does not continue it."""

from __future__ import annotations

import pytest

from spillway.services.scheduler.state_slots import StateSlots
from spillway.shared.protocol import SpillOutcome, StepPlan, StepResult
from tests.unit.scheduler.harness import (
    FakeWorker,
    LaneDriver,
    collect,
    expected_tokens,
    make_core,
    run_to_completion,
    submit,
    tick,
    worker_info,
)

BS = 4
SLOT_BYTES = 1000


class HybridWorker(FakeWorker):
    """A FakeWorker with a state pool of `num_slots` slots and `num_snapshots` snapshots,
    each state modelled as the tokens it has consumed: a spill fails unless the state
    stands at the spill's tokens, a restore or a snapshot copy puts a state back (which
    must be the sequence's own prefix: a wrong hit fails), and a row that does not
    continue its slot's state is reported lost (skipped), as the real worker does."""

    def __init__(self, block_size: int, num_slots: int, num_snapshots: int = 0) -> None:
        super().__init__(block_size)
        self.num_slots = num_slots
        self.state: dict[int, tuple[int, ...]] = {}
        self.snapshots: dict[int, tuple[int, ...]] = {}
        self.num_snapshots = num_snapshots
        self.slot_of: dict[str, int] = {}
        self.spilled_state: dict[tuple[str, int], tuple[int, ...]] = {}
        self.lost_states = 0
        self.state_spills = 0
        self.copies = 0
        self.tier_states: dict[str, tuple[int, ...]] = {}

    def prefix(self, seq_id: str, n: int) -> tuple[int, ...]:
        return tuple(self.expected(seq_id, p) for p in range(n))

    def step(self, plan: StepPlan) -> StepResult:
        spill_ok = {}
        for spill in plan.spills:  # before anything else, as the real worker does
            assert spill.state_slot is not None, "a hybrid spill without its state"
            held = self.state.get(spill.state_slot)
            spill_ok[spill.seq_id] = held == self.prefix(spill.seq_id, spill.state_tokens)
            if spill_ok[spill.seq_id]:
                assert held is not None
                self.spilled_state[(spill.seq_id, spill.spill_id)] = held
                self.state_spills += 1
        for block in plan.prefix_stores:
            if block.snapshot is not None:
                self.tier_states[block.block_hash] = self.snapshots[block.snapshot]
        for new in plan.new_seqs:
            assert new.state_slot is not None
            self.slot_of[new.seq_id] = new.state_slot
        for load in plan.prefix_loads:  # the state stored after the last block
            assert load.state_slot is not None
            held = self.tier_states[load.blocks[-1].block_hash]
            assert held == self.prefix(load.seq_id, load.state_tokens), "a wrong tier state"
            self.state[load.state_slot] = held
        slots = [self.slot_of[r.seq_id] for r in plan.rows]
        assert slots == sorted(slots), f"rows not in slot order: {slots}"
        assert len(set(slots)) == len(slots) and all(0 <= s < self.num_slots for s in slots)
        for restore in plan.restores:
            held = self.spilled_state.get((restore.seq_id, restore.spill_id))
            if held is not None and restore.state_slot is not None:
                assert len(held) == restore.state_tokens
                self.state[restore.state_slot] = held
        for copy in plan.state_copies:
            held = self.snapshots[copy.snapshot]
            assert held == self.prefix(copy.seq_id, copy.num_tokens), "a wrong snapshot hit"
            self.state[self.slot_of[copy.seq_id]] = held
            self.copies += 1
        lost = [
            r.seq_id
            for r in plan.rows
            if r.start_pos > 0
            and self.state.get(self.slot_of[r.seq_id]) != self.prefix(r.seq_id, r.start_pos)
        ]
        self.lost_states += len(lost)
        kept = [r for r in plan.rows if r.seq_id not in lost]
        result = super().step(plan.model_copy(update={"rows": kept}))
        result.lost_seq_ids = sorted({*result.lost_seq_ids, *lost})
        result.spills = [
            SpillOutcome(seq_id=o.seq_id, spill_id=o.spill_id, ok=o.ok and spill_ok[o.seq_id])
            for o in result.spills
        ]
        return result

    def _run_row(self, row):
        slot = self.slot_of[row.seq_id]
        before = self.state.get(slot, ()) if row.start_pos > 0 else ()
        tokens = [self.last_token[row.seq_id]] if row.feed_last else list(row.token_ids)
        out = super()._run_row(row)
        for snap in row.state_snapshots:
            assert 0 <= snap.snapshot < self.num_snapshots
            self.snapshots[snap.snapshot] = (*before, *tokens[: snap.num_tokens])
        self.state[slot] = (*before, *tokens)
        return out


def _hybrid_core(num_slots: int, num_snapshots: int = 0, **kwargs):
    core, _ = make_core(**kwargs)
    geometry = ("num_kv_blocks", "block_size", "worker_id")
    info = worker_info(**{k: v for k, v in kwargs.items() if k in geometry})
    core.attach_worker(
        info.model_copy(
            update={
                "num_state_slots": num_slots,
                "state_slot_bytes": SLOT_BYTES,
                "num_state_snapshots": num_snapshots,
            }
        )
    )
    if kwargs.get("spill_store"):
        core.spill_store_reported(True, 1 << 40)
    return core


def _submit_all(core, n=6, prompt_len=7, max_tokens=20):
    for i in range(n):
        submit(core, f"r{i}", prompt=[200 + 17 * i + j for j in range(prompt_len)],
               max_tokens=max_tokens)  # fmt: skip


def _check(outcomes, n=6, max_tokens=20):
    for i in range(n):
        assert outcomes[f"r{i}"].token_ids == expected_tokens(f"r{i}", max_tokens)
        assert outcomes[f"r{i}"].finish_reason == "length"


def test_the_core_never_runs_more_sequences_than_the_worker_has_slots():
    core = _hybrid_core(2, num_kv_blocks=256, block_size=BS)
    worker = HybridWorker(BS, num_slots=2)
    _submit_all(core)
    outcomes = run_to_completion(core, worker)
    _check(outcomes)
    assert max(len(p.rows) for p in worker.plans) == 2
    assert core.stats.preemptions == {"recompute": 0, "spill": 0}
    assert not core.pool.slots.in_use  # every slot back


@pytest.mark.parametrize("mode", ["spill", "recompute", "auto"])
def test_pressure_on_blocks_and_slots_gives_every_request_its_tokens(mode):
    core = _hybrid_core(
        3, num_kv_blocks=14, block_size=BS, spill_store=True, preemption_mode=mode,
        prefix_cache=True,
    )  # fmt: skip
    worker = HybridWorker(BS, num_slots=3)
    _submit_all(core)
    outcomes = run_to_completion(core, worker)
    _check(outcomes)
    assert sum(core.stats.preemptions.values()) > 0 and worker.lost_states == 0
    if mode == "spill":
        assert (
            core.stats.preemptions["spill"] > 0
            and worker.state_spills == core.stats.preemptions["spill"]
        )
        assert all(r.state_slot is not None for p in worker.plans for r in p.restores)
        assert core.stats.swap_ins > 0
    if mode == "recompute":
        assert not any(p.spills for p in worker.plans)
    # No prefix hit ever skipped a state: every recompute started at position 0.
    assert all(n.seq_id for p in worker.plans for n in p.new_seqs)
    assert all(d.num_cached_tokens in (None, 0) for o in outcomes.values() for d in o.deltas)
    assert not core.pool.slots.in_use


def test_auto_counts_the_state_bytes_in_a_spill():
    core = _hybrid_core(
        3, num_kv_blocks=14, block_size=BS, spill_store=True, preemption_mode="auto"
    )
    seen = []
    core.policy.choose = lambda tokens, num_bytes, now: seen.append(num_bytes) or "spill"  # type: ignore[method-assign]
    _submit_all(core)
    run_to_completion(core, HybridWorker(BS, num_slots=3))
    block_bytes = core.worker.block_bytes  # type: ignore[union-attr]
    assert seen and all((b - SLOT_BYTES) % max(block_bytes, 1) == 0 for b in seen)
    assert all(b >= SLOT_BYTES for b in seen)


def test_with_steps_run_ahead_a_victim_in_flight_is_recomputed_not_spilled_ahead():
    core = _hybrid_core(
        3, num_kv_blocks=14, block_size=BS, spill_store=True, preemption_mode="spill",
        run_ahead=True,
    )  # fmt: skip
    worker = HybridWorker(BS, num_slots=3)
    _submit_all(core)
    outcomes = LaneDriver(core, worker).run()
    _check(outcomes)
    # Every spill that went out held a state at its confirmed tokens (the fake checks it).
    assert worker.state_spills == sum(len(p.spills) for p in worker.plans)
    assert core.stats.preemptions["recompute"] > 0


def test_a_hybrid_worker_gets_no_prefix_hits():
    core = _hybrid_core(4, num_kv_blocks=64, block_size=BS, prefix_cache=True)
    worker = HybridWorker(BS, num_slots=4)
    prompt = list(range(300, 318))
    submit(core, "a", prompt=prompt, max_tokens=3)
    run_to_completion(core, worker)
    submit(core, "b", prompt=prompt, max_tokens=3)
    assert core.prefix_lookup_hashes(prompt) == []
    outcome = run_to_completion(core, worker)["b"]
    assert outcome.deltas[0].num_cached_tokens == 0
    assert any(r.seq_id == "b" and r.start_pos == 0 for p in worker.plans for r in p.rows)


def test_a_state_the_worker_lost_is_recomputed():
    core = _hybrid_core(4, num_kv_blocks=64, block_size=BS)
    worker = HybridWorker(BS, num_slots=4)
    _submit_all(core, n=3, max_tokens=8)
    outcomes: dict = {}
    for _ in range(3):
        collect(outcomes, tick(core, worker)[1])
    seq = core.sequence("r1")
    assert seq is not None and seq.state_slot is not None
    del worker.state[seq.state_slot]  # say a failed step left it unknown
    run_to_completion(core, worker, outcomes)
    assert worker.lost_states == 1
    _check(outcomes, n=3, max_tokens=8)
    assert core.sequence("r1") is None and not core.pool.slots.in_use


def test_slots_are_the_smallest_free_and_a_full_batch_is_one_run():
    slots = StateSlots(capacity=4)
    taken = [slots.take() for _ in range(4)]
    assert taken == [0, 1, 2, 3] and slots.take() is None
    slots.release(1)
    assert slots.take() == 1
    with pytest.raises(AssertionError):
        slots.check([0, 1, 2])  # slot 3 leaked


def test_a_prefix_hit_resumes_from_the_last_snapshot_before_it():
    core = _hybrid_core(4, num_snapshots=8, num_kv_blocks=64, block_size=BS)
    worker = HybridWorker(BS, num_slots=4, num_snapshots=8)
    shared = list(range(300, 313))  # 13 tokens: three full blocks, then one token
    submit(core, "a", prompt=[*shared, 7, 8, 9, 10, 11], max_tokens=3)
    run_to_completion(core, worker)
    submit(core, "b", prompt=[*shared, 50, 51], max_tokens=4)
    outcome = run_to_completion(core, worker)["b"]
    assert outcome.token_ids == expected_tokens("b", 4)
    assert outcome.deltas[0].num_cached_tokens == 12  # the last boundary with a snapshot
    assert worker.copies == 1 and worker.lost_states == 0
    first_b = next(r for p in worker.plans for r in p.rows if r.seq_id == "b")
    assert first_b.start_pos == 12


def test_a_hit_past_the_last_snapshot_is_cut_back_to_it():
    core = _hybrid_core(4, num_snapshots=1, num_kv_blocks=64, block_size=BS)
    worker = HybridWorker(BS, num_slots=4, num_snapshots=1)
    shared = list(range(300, 317))  # four full blocks
    submit(core, "a", prompt=shared, max_tokens=2)
    run_to_completion(core, worker)
    # One snapshot: a's one prefill row took it at its first boundary (4), the others
    # found it taken. b's KV hit (three blocks, 12 tokens) is cut back to 4.
    submit(core, "b", prompt=[*shared[:13], 60], max_tokens=2)
    outcome = run_to_completion(core, worker)["b"]
    assert outcome.token_ids == expected_tokens("b", 2)
    assert outcome.deltas[0].num_cached_tokens == 4 and worker.copies == 1
    assert core.stats.prefix_hit_tokens == 4


@pytest.mark.parametrize("mode", ["spill", "recompute", "auto"])
def test_snapshots_under_pressure_keep_every_output(mode):
    core = _hybrid_core(
        3, num_snapshots=4, num_kv_blocks=16, block_size=BS, spill_store=True,
        preemption_mode=mode,
    )  # fmt: skip
    worker = HybridWorker(BS, num_slots=3, num_snapshots=4)
    for i in range(6):  # a shared head, then each its own tail
        submit(core, f"r{i}", prompt=[*range(400, 409), *(500 + 13 * i + j for j in range(5))],
               max_tokens=12)  # fmt: skip
    outcomes = run_to_completion(core, worker)
    for i in range(6):
        assert outcomes[f"r{i}"].token_ids == expected_tokens(f"r{i}", 12)
    assert worker.lost_states == 0 and worker.copies > 0
    assert sum(core.stats.preemptions.values()) > 0


def test_the_shared_tier_serves_a_state_to_a_fresh_worker():
    prompt = list(range(300, 318))
    core = _hybrid_core(4, num_snapshots=8, num_kv_blocks=64, block_size=BS, spill_store=True)
    worker = HybridWorker(BS, num_slots=4, num_snapshots=8)
    submit(core, "a", prompt=prompt, max_tokens=3)
    run_to_completion(core, worker)
    stored = [b for p in worker.plans for b in p.prefix_stores]
    assert stored and all(b.snapshot is not None for b in stored[:4])
    # A restarted worker: nothing local; the tier (the same fake store) holds blocks and
    # states. The spill store would answer how many blocks, cut back to the last state.
    fresh_core = _hybrid_core(4, num_snapshots=8, num_kv_blocks=64, block_size=BS,
                              spill_store=True)  # fmt: skip
    fresh = HybridWorker(BS, num_slots=4, num_snapshots=8)
    fresh.tier, fresh.tier_states = dict(worker.tier), dict(worker.tier_states)
    hashes = fresh_core.prefix_lookup_hashes([*prompt[:14], 99, 98])
    assert len(hashes) == 3
    submit(fresh_core, "b", prompt=[*prompt[:14], 99, 98], max_tokens=3, tier_hashes=hashes)
    outcome = run_to_completion(fresh_core, fresh)["b"]
    assert outcome.token_ids == expected_tokens("b", 3)
    assert outcome.deltas[0].num_cached_tokens == 12
    assert fresh.lost_states == 0 and fresh_core.stats.prefix_hit_tokens == 12


def test_a_swapped_sequence_takes_its_state_to_another_worker():
    a = _hybrid_core(3, num_kv_blocks=14, block_size=BS, spill_store=True,
                     preemption_mode="spill", worker_id="wa")  # fmt: skip
    b = _hybrid_core(3, num_kv_blocks=14, block_size=BS, spill_store=True,
                     preemption_mode="spill", worker_id="wb")  # fmt: skip
    worker_a, worker_b = HybridWorker(BS, num_slots=3), HybridWorker(BS, num_slots=3)
    worker_b.spilled, worker_b.spilled_state = worker_a.spilled, worker_a.spilled_state
    _submit_all(core=a)
    outcomes: dict = {}
    while not any(s.spilled is not None and s.spilled.confirmed for s in a.places.swapped):
        collect(outcomes, tick(a, worker_a)[1])
    moved = a.evacuate()
    swapped = {s.request_id for s in moved if s.spilled is not None}
    assert swapped and all(s.state_slot is None for s in moved)
    b.adopt(moved, kv_layout="")
    b.check_integrity()
    run_to_completion(b, worker_b, outcomes)
    _check(outcomes)
    restored = {r.seq_id for p in worker_b.plans for r in p.restores if r.state_slot is not None}
    assert swapped <= restored and worker_b.lost_states == 0
