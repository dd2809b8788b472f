"""KV pressure in the pure core: victims spilled or recomputed, swap-in, failures of the
store at every point, the worker running out of memory, the shared prefix tier. The fake
worker checks every block's contents, so a bad restore or a wrong reuse fails at once."""

from __future__ import annotations

import pytest

from spillway.services.scheduler.preemption import PreemptionPolicy
from tests.unit.scheduler.harness import (
    EOS,
    FakeWorker,
    Outcome,
    RecordingObserver,
    collect,
    expected_tokens,
    make_core,
    run_to_completion,
    submit,
    tick,
)

BS = 4


def _pressure(core, worker, n=6, prompt_len=7, max_tokens=20, **kwargs):
    for i in range(n):
        submit(core, f"r{i}", prompt=[200 + 17 * i + j for j in range(prompt_len)],
               max_tokens=max_tokens, **kwargs)  # fmt: skip
    return run_to_completion(core, worker)


def _spilled_ids(worker: FakeWorker) -> set[tuple[str, int]]:
    return {(s.seq_id, s.spill_id) for p in worker.plans for s in p.spills}


def _roomy() -> dict[str, Outcome]:
    core, _ = make_core(num_kv_blocks=256, block_size=BS)
    return _pressure(core, FakeWorker(BS))


@pytest.mark.parametrize("mode", ["spill", "auto", "recompute"])
def test_every_mode_completes_with_the_tokens_of_an_unpressured_run(mode):
    roomy = _roomy()
    core, _ = make_core(
        num_kv_blocks=14, block_size=BS, spill_store=True, preemption_mode=mode, max_batch=6
    )
    worker = FakeWorker(BS)
    # auto spills when reading back beats recomputing: make recompute look slow.
    core.policy.prefill_tokens_per_s = 1.0
    outcomes = _pressure(core, worker)
    for rid, outcome in roomy.items():
        assert outcomes[rid].finish_reason == "length"
        assert outcomes[rid].token_ids == outcome.token_ids == expected_tokens(rid, 20)
    forced = "recompute" if mode == "recompute" else "spill"
    other = "spill" if forced == "recompute" else "recompute"
    assert core.stats.preemptions[forced] > 0 and core.stats.preemptions[other] == 0
    assert core.blocks is not None and core.blocks.num_available_blocks == 14
    # Every spill was read back by a swap-in and then dropped from the store.
    spilled = _spilled_ids(worker)
    assert len(spilled) == core.stats.preemptions["spill"]
    restored = {(r.seq_id, r.spill_id) for p in worker.plans for r in p.restores}
    assert restored <= spilled  # a swap-in that found every block cached reads nothing
    assert {(d.seq_id, d.spill_id) for d in core.take_spill_drops()} == spilled
    assert core.num_swapped == 0


def test_a_spilled_sequence_moves_to_swapped_and_comes_back_where_it_was():
    observer = RecordingObserver()
    core, _ = make_core(
        num_kv_blocks=10, block_size=BS, spill_store=True, preemption_mode="spill",
        observer=observer,
    )  # fmt: skip
    worker = FakeWorker(BS)
    outcomes = _pressure(core, worker, n=3, prompt_len=6, max_tokens=16)
    victims = [rid for rid in outcomes if "preempted:spill" in observer.of(rid)]
    assert victims
    for rid in victims:
        assert observer.of(rid)[observer.of(rid).index("preempted:spill") + 1] == "resumed"
    # The swap-in row continues from the restored tokens: no prompt is recomputed.
    first_restore = next(p for p in worker.plans if p.restores)
    restore = first_restore.restores[0]
    row = next(r for r in first_restore.rows if r.seq_id == restore.seq_id)
    restored_blocks = restore.first_block + len(restore.block_ids)
    assert row.start_pos > 0 and row.start_pos >= (restored_blocks - 1) * BS


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_a_swap_in_reads_back_only_what_the_prefix_cache_lost(prefix_cache):
    """A victim's full blocks stay cached after its spill; its swap-in reuses those still
    there and reads only the rest from the store (the fake worker checks every block)."""
    roomy = _roomy()
    core, _ = make_core(
        num_kv_blocks=14, block_size=BS, spill_store=True, preemption_mode="spill",
        max_batch=6, prefix_cache=prefix_cache,
    )  # fmt: skip
    worker = FakeWorker(BS)
    outcomes = _pressure(core, worker)
    for rid in roomy:
        assert outcomes[rid].token_ids == roomy[rid].token_ids
    assert core.stats.swap_ins == core.stats.preemptions["spill"] > 0
    restores = [r for p in worker.plans for r in p.restores]
    if prefix_cache:
        assert core.stats.swap_in_cached_blocks > 0
        assert len(restores) < core.stats.swap_ins or any(r.first_block > 0 for r in restores)
    else:
        assert core.stats.swap_in_cached_blocks == 0
        assert len(restores) == core.stats.swap_ins and all(r.first_block == 0 for r in restores)
    assert {(d.seq_id, d.spill_id) for d in core.take_spill_drops()} == _spilled_ids(worker)


def test_a_failed_spill_falls_back_to_recompute_and_new_victims_are_recomputed():
    roomy = _roomy()
    core, _ = make_core(
        num_kv_blocks=14, block_size=BS, spill_store=True, preemption_mode="spill", max_batch=6
    )
    worker = FakeWorker(BS)
    worker.store_down = True
    outcomes = _pressure(core, worker)
    for rid in roomy:
        assert outcomes[rid].token_ids == roomy[rid].token_ids
    assert core.stats.spill_failures >= 1
    # A failed spill counts as what was done (a recompute); after the first failure the
    # policy stops spilling: the rest are recomputed too.
    assert core.stats.preemptions["spill"] == 0
    assert core.stats.preemptions["recompute"] > core.stats.spill_failures
    assert core.num_swapped == 0 and not any(p.restores for p in worker.plans)


def test_spilling_resumes_once_the_store_reports_healthy_again():
    core, clock = make_core(
        num_kv_blocks=14, block_size=BS, spill_store=True, preemption_mode="spill"
    )
    core.policy.spill_failed(clock.now())
    assert core.policy.choose(10, 100, clock.now()) == "recompute"
    clock.advance(5.0)
    core.spill_store_reported(True, 1 << 30)
    assert core.policy.choose(10, 100, clock.now()) == "spill"
    core.spill_store_reported(False, 1 << 30)
    assert core.policy.choose(10, 100, clock.now()) == "recompute"
    core.spill_store_reported(True, 50)  # no room for 100 bytes
    assert core.policy.choose(10, 100, clock.now()) == "recompute"


def test_a_restore_that_finds_nothing_recomputes_and_loses_no_token():
    roomy = _roomy()
    observer = RecordingObserver()
    core, _ = make_core(
        num_kv_blocks=14, block_size=BS, spill_store=True, preemption_mode="spill", max_batch=6,
        observer=observer,
    )  # fmt: skip
    worker = FakeWorker(BS)
    outcomes: dict[str, Outcome] = {}
    for i in range(6):
        submit(core, f"r{i}", prompt=[200 + 17 * i + j for j in range(7)], max_tokens=20)
    while not any(p.spills for p in worker.plans):
        collect(outcomes, tick(core, worker)[1])
    worker.spilled.clear()  # the store lost everything (a Redis restart)
    run_to_completion(core, worker, outcomes)
    for rid in roomy:
        assert outcomes[rid].token_ids == roomy[rid].token_ids
    assert any(event == "kv_lost" for event, _ in observer.events)
    assert core.num_swapped == 0 and core.blocks is not None
    assert core.blocks.num_available_blocks == 14


def test_auto_spills_long_sequences_and_recomputes_short_ones():
    policy = PreemptionPolicy("auto", spill_available=True)
    policy.store_reported(True, 1 << 40, 0.0)
    bytes_per_token = 737_280 / 16  # SmolLM2-135M, float32, per token
    crossover = policy.crossover_tokens(bytes_per_token)
    assert 0 < crossover < 2000
    short, long_ = int(crossover / 2), int(crossover * 2) + 16
    assert policy.choose(short, int(short * bytes_per_token), 0.0) == "recompute"
    assert policy.choose(long_, int(long_ * bytes_per_token), 0.0) == "spill"
    # A slower store moves the crossover up.
    policy.observe_kv_io(100 << 20, 100.0)
    assert policy.crossover_tokens(bytes_per_token) > crossover


def test_out_of_memory_sheds_one_victim_per_retry_and_the_rest_go_on():
    roomy = _roomy()
    observer = RecordingObserver()
    core, _ = make_core(num_kv_blocks=256, block_size=BS, max_batch=6, observer=observer)
    worker = FakeWorker(BS)
    worker.oom_rows_above = 3
    outcomes = _pressure(core, worker)
    for rid in roomy:
        assert outcomes[rid].token_ids == roomy[rid].token_ids
    assert core.stats.preemptions["recompute"] >= 3
    # Victims went one at a time, latest arrival first.
    order = [rid for event, rid in observer.events if event.startswith("preempted")]
    assert order[:3] == ["r5", "r4", "r3"]


def test_out_of_memory_with_a_single_row_ends_that_request_with_an_error():
    core, _ = make_core(num_kv_blocks=64, block_size=BS)
    worker = FakeWorker(BS)
    worker.oom_rows_above = 0
    submit(core, "alone", max_tokens=4)
    outcome = run_to_completion(core, worker)["alone"]
    assert outcome.finish_reason == "error"
    assert outcome.deltas[-1].error is not None
    assert outcome.deltas[-1].error.code == "out_of_memory"


def test_swap_in_reclaims_cached_prefix_blocks_when_nothing_else_fits(caplog):
    core, _ = make_core(
        num_kv_blocks=12, block_size=BS, spill_store=True, preemption_mode="spill", max_batch=4
    )
    worker = FakeWorker(BS)
    caplog.set_level("INFO")
    outcomes = _pressure(core, worker, n=4, prompt_len=9, max_tokens=14)
    assert all(o.finish_reason == "length" for o in outcomes.values())
    assert core.stats.preemptions["spill"] > 0
    assert any("reclaimed" in r.message for r in caplog.records)


def test_finished_blocks_go_to_the_shared_tier_and_a_fresh_worker_loads_them():
    prompt = [300 + i for i in range(18)]
    core, _ = make_core(num_kv_blocks=64, block_size=BS, spill_store=True)
    worker = FakeWorker(BS)
    submit(core, "a", prompt=prompt, max_tokens=3)
    run_to_completion(core, worker)
    stored = [b.block_hash for p in worker.plans for b in p.prefix_stores]
    assert len(stored) == (18 + 2) // BS  # every full computed block
    # A new scheduler state (a restarted worker): the local cache is empty; the tier
    # (the same fake store) holds the blocks.
    fresh_core, _ = make_core(num_kv_blocks=64, block_size=BS, spill_store=True)
    fresh = FakeWorker(BS)
    fresh.tier = dict(worker.tier)
    hashes = fresh_core.prefix_lookup_hashes(prompt)
    assert len(hashes) == 4
    submit(fresh_core, "b", prompt=prompt, max_tokens=3, tier_hashes=hashes)
    outcome = run_to_completion(fresh_core, fresh)["b"]
    loads = [load for p in fresh.plans for load in p.prefix_loads]
    assert len(loads) == 1 and len(loads[0].blocks) == 4
    first_row = next(r for p in fresh.plans for r in p.rows if r.seq_id == "b")
    assert first_row.start_pos == 16
    assert outcome.deltas[0].num_cached_tokens == 16
    assert outcome.token_ids == expected_tokens("b", 3)
    assert fresh_core.stats.prefix_hit_tokens == 16


def test_a_tier_load_that_fails_recomputes_the_prompt():
    prompt = [300 + i for i in range(18)]
    core, _ = make_core(num_kv_blocks=64, block_size=BS, spill_store=True)
    worker = FakeWorker(BS)
    root_hashes = core.prefix_lookup_hashes(prompt)
    submit(core, "b", prompt=prompt, max_tokens=3, tier_hashes=root_hashes)
    outcome = run_to_completion(core, worker)["b"]  # the tier is empty: the load is lost
    assert outcome.token_ids == expected_tokens("b", 3)
    assert outcome.deltas[0].num_cached_tokens == 0
    assert core.stats.prefix_hit_tokens == 0


def test_eos_mid_run_still_ends_every_request_once():
    def token_fn(seq_id: str, i: int) -> int:
        return EOS if (seq_id == "r1" and i == 5) else 100 + (i * 7 + len(seq_id)) % 800

    core, _ = make_core(
        num_kv_blocks=14, block_size=BS, spill_store=True, preemption_mode="spill", max_batch=6
    )
    worker = FakeWorker(BS, token_fn=token_fn)
    outcomes = _pressure(core, worker)
    assert outcomes["r1"].finish_reason == "stop" and len(outcomes["r1"].token_ids) == 6
    assert all(outcomes[f"r{i}"].finish_reason == "length" for i in (0, 2, 3, 4, 5))
