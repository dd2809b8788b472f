"""The prefix cache: chained block hashes, shared blocks, the eviction queue, and the
core reusing cached prefixes at admission (fake worker that checks every block's
contents, so a wrong hit fails the test)."""

from __future__ import annotations

from spillway.services.scheduler.block_manager import BlockManager
from spillway.services.scheduler.prefix_hash import chain_hash, extend_hashes, layout_root
from tests.unit.scheduler.harness import (
    FakeWorker,
    Outcome,
    collect,
    expected_tokens,
    make_core,
    run_to_completion,
    submit,
    tick,
)


def test_chained_hashes_name_the_whole_prefix_not_just_the_block():
    root = layout_root("model/float32/B4")
    a = extend_hashes([], [1, 2, 3, 4, 5, 6, 7, 8], 4, root)
    b = extend_hashes([], [9, 9, 9, 9, 5, 6, 7, 8], 4, root)
    assert len(a) == 2 and a[1] != b[1]  # same second block, different prefix
    assert a == extend_hashes([], [1, 2, 3, 4, 5, 6, 7, 8, 0], 4, root)  # partial block: no hash
    assert chain_hash(root, [1, 2, 3, 4]) != chain_hash(layout_root("other"), [1, 2, 3, 4])


def test_lookup_finds_the_longest_cached_prefix_and_allocation_shares_it():
    blocks = BlockManager(num_blocks=8, block_size=4)
    first = blocks.allocate(10)
    assert first is not None and len(first) == 3
    blocks.commit(first[:2], [101, 102])
    assert blocks.lookup([101, 102, 103]) == first[:2]
    assert blocks.lookup([999, 102]) == []
    second = blocks.allocate(9, hits=first[:2])
    assert second is not None and second[:2] == first[:2] and second[2] not in first
    assert blocks.blocks[first[0]].ref_count == 2
    blocks.check_integrity([*first, *second])


def test_freed_hashed_blocks_stay_cached_until_reclaimed_least_recently_used_first():
    blocks = BlockManager(num_blocks=4, block_size=4)
    a = blocks.allocate(8)
    b = blocks.allocate(8)
    assert a is not None and b is not None
    blocks.commit(a, [1, 2])
    blocks.commit(b, [3, 4])
    blocks.free(a)
    blocks.free(b)
    assert blocks.num_free_blocks == 0 and blocks.num_cached_blocks == 4
    assert blocks.num_available_blocks == 4
    # Eviction order: a's tail (freed in reverse), a's head, b's tail, b's head.
    assert blocks.reclaim(1) == 1
    assert blocks.lookup([1, 2]) == [a[0]]
    fresh = blocks.allocate(8)  # the reclaimed block, then a's head is evicted
    assert fresh is not None and sorted(fresh) == sorted(a)
    assert blocks.lookup([1]) == [] and blocks.lookup([3, 4]) == b
    # A cache hit takes a block back out of the eviction queue.
    hit = blocks.allocate(4, hits=[b[0]])
    assert hit == [b[0]] and blocks.num_cached_blocks == 1
    blocks.check_integrity([*fresh, *hit])


def test_reclaim_passes_over_the_blocks_it_is_told_to_keep():
    blocks = BlockManager(num_blocks=4, block_size=4)
    a = blocks.allocate(16)
    assert a is not None
    blocks.commit(a, [1, 2, 3, 4])
    blocks.free(a)  # eviction order: a[3], a[2], a[1], a[0]
    assert blocks.reclaim(2, keep={a[3]}) == 2
    assert blocks.lookup([1, 2, 3, 4]) == [a[0]] and blocks.num_cached_blocks == 2
    assert blocks.reclaim(5, keep={a[0], a[3]}) == 0  # only kept ones are left
    assert blocks.reclaim(5) == 2 and blocks.num_free_blocks == 4
    blocks.check_integrity([])


def test_a_block_whose_hash_is_cached_elsewhere_stays_unregistered():
    blocks = BlockManager(num_blocks=4, block_size=4)
    a = blocks.allocate(4)
    b = blocks.allocate(4)
    assert a is not None and b is not None
    blocks.commit(a, [7])
    blocks.commit(b, [7])
    assert blocks.lookup([7]) == a
    blocks.free(b)
    assert blocks.num_free_blocks == 3 and blocks.num_cached_blocks == 0
    blocks.check_integrity(a)


def test_integrity_check_catches_a_leaked_block():
    blocks = BlockManager(num_blocks=4, block_size=4)
    a = blocks.allocate(8)
    assert a is not None
    try:
        blocks.check_integrity(a[:1])
    except AssertionError as e:
        assert "owners" in str(e)
    else:
        raise AssertionError("a block held by nobody passed the check")


def _shared_prompt(prefix_len: int, tail: int, tail_len: int = 3) -> list[int]:
    return [100 + i % 300 for i in range(prefix_len)] + [500 + tail + i for i in range(tail_len)]


def test_requests_sharing_a_prefix_skip_its_prefill_and_report_cached_tokens():
    core, _ = make_core(num_kv_blocks=64, block_size=4)
    worker = FakeWorker(block_size=4)
    submit(core, "first", prompt=_shared_prompt(20, 0), max_tokens=4)
    outcomes = run_to_completion(core, worker)
    submit(core, "second", prompt=_shared_prompt(20, 1), max_tokens=4)
    plan, deltas = tick(core, worker)
    collect(outcomes, deltas)
    run_to_completion(core, worker, outcomes)
    assert plan is not None
    row = next(r for r in plan.rows if r.seq_id == "second")
    assert row.start_pos == 20  # five cached blocks: only the 3 new tokens are computed
    assert len(row.token_ids) == 3
    assert outcomes["second"].deltas[0].num_cached_tokens == 20
    assert outcomes["first"].deltas[0].num_cached_tokens == 0
    assert outcomes["second"].token_ids == expected_tokens("second", 4)
    assert core.stats.prefix_query_tokens == 46 and core.stats.prefix_hit_tokens == 20


def test_a_fully_cached_prompt_still_computes_its_last_token():
    core, _ = make_core(num_kv_blocks=64, block_size=4)
    worker = FakeWorker(block_size=4)
    prompt = list(range(100, 116))  # exactly four blocks
    submit(core, "a", prompt=prompt, max_tokens=2)
    run_to_completion(core, worker)
    submit(core, "b", prompt=prompt, max_tokens=2)
    plan, _ = tick(core, worker)
    assert plan is not None and plan.rows[0].start_pos == 12 and plan.rows[0].sample
    outcome = run_to_completion(core, worker)
    assert outcome["b"].token_ids == expected_tokens("b", 2)[1:]  # the first came in tick


def test_prefix_cache_off_gives_the_same_tokens_and_no_hits():
    def run(prefix_cache: bool) -> tuple[dict[str, Outcome], int, int]:
        core, _ = make_core(num_kv_blocks=64, block_size=4, prefix_cache=prefix_cache)
        worker = FakeWorker(block_size=4)
        outcomes: dict[str, Outcome] = {}
        for i in range(4):
            submit(core, f"r{i}", prompt=_shared_prompt(13, i), max_tokens=6)
            run_to_completion(core, worker, outcomes)
        assert core.blocks is not None
        return outcomes, core.stats.prefix_hit_tokens, core.blocks.num_cached_blocks

    cached, hits, kept = run(True)
    uncached, no_hits, none_kept = run(False)
    assert hits == 3 * 12 and no_hits == 0
    # Off, finished blocks go straight back to the free queue: nothing is kept for reuse.
    assert kept > 0 and none_kept == 0
    for rid in cached:
        assert cached[rid].token_ids == uncached[rid].token_ids == expected_tokens(rid, 6)
