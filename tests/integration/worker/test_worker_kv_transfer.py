"""The worker's KV data plane against a real Redis: a spilled sequence restored into other
blocks continues exactly; shared-tier blocks load into a fresh runner; a store that is
gone loses the sequence (reported, not raised); run-ahead rows feed the last token; an
out-of-memory forward is reported as such and the runner goes on."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import redis
import torch

from spillway.services.cli.servers import start_redis
from spillway.services.worker.kv_transfer import KVTransfer, connect_kv_store
from spillway.services.worker.runner import ModelRunner
from spillway.shared.protocol import (
    KVRestore,
    KVSpill,
    NewSequence,
    PrefixBlock,
    PrefixLoad,
    SamplingParams,
    SpillOutcome,
    StepPlan,
    StepRow,
)
from spillway.shared.spill_keys import SpillKeys
from tests.unit.worker.conftest import tiny_llama_dir  # noqa: F401 (fixture)
from tests.unit.worker.tiny_llama import tiny_runner

GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, seed=11)
PROMPT = [1, 17, 99, 3, 250, 41, 8, 8, 120, 77, 5, 19, 23, 200, 150, 3, 9, 11, 4, 60]  # 20
BS = 16


@pytest.fixture(scope="module")
def runner(tiny_llama_dir, redis_url) -> ModelRunner:  # noqa: F811
    r = tiny_runner(tiny_llama_dir, kv_blocks=32)
    r.kv_transfer = KVTransfer(
        connect_kv_store(redis_url, 2.0), SpillKeys("kvt"), r.kv_cache, group_blocks=2
    )
    return r


class Driver:
    """Feeds one sequence through the runner step by step, as the scheduler would."""

    def __init__(self, runner: ModelRunner, seq_id: str, sampling=GREEDY) -> None:
        self.runner = runner
        self.seq_id = seq_id
        self.sampling = sampling
        self.tokens = list(PROMPT)
        self.computed = 0
        self.step_id = 100

    def plan(self, blocks: list[int], **fields) -> StepPlan:
        self.step_id += 1
        return StepPlan(step_id=self.step_id, **fields)

    def start(self, blocks: list[int]) -> None:
        self.blocks = blocks
        self.run(new_seqs=[NewSequence(seq_id=self.seq_id, sampling=self.sampling,
                                       block_ids=blocks)])  # fmt: skip

    def row(self) -> StepRow:
        return StepRow(
            seq_id=self.seq_id,
            token_ids=self.tokens[self.computed :],
            start_pos=self.computed,
            sample=True,
            output_index=len(self.tokens) - len(PROMPT),
        )

    def run(self, **fields) -> None:
        result = self.runner.execute(self.plan(self.blocks, rows=[self.row()], **fields))
        assert result.error is None, result.error
        assert self.seq_id not in result.lost_seq_ids
        self.computed = len(self.tokens)
        self.tokens.append(result.rows[0].token_id)

    def generate(self, n: int) -> list[int]:
        for _ in range(n):
            self.run()
        return self.tokens[len(PROMPT) :]


def _reset(runner: ModelRunner) -> None:
    runner.execute(StepPlan(step_id=0, finished_seq_ids=list(runner.sequences)))


@dataclass
class SpillRoundTrip:
    expected: list[int]  # an undisturbed sequence's tokens
    continued: list[int]  # the spilled one's, continued after its restore
    spill: SpillOutcome
    before: torch.Tensor  # its two blocks when spilled
    restored: torch.Tensor  # the blocks they were restored into


def _spill_round_trip(runner: ModelRunner) -> SpillRoundTrip:
    """A sequence spilled after 30 tokens (two blocks, the second partial), its blocks
    overwritten by another, restored into new blocks, then continued; and the same
    sequence undisturbed."""
    _reset(runner)
    reference = Driver(runner, "ref", SAMPLED)
    reference.start([0, 1, 2, 3])
    expected = reference.generate(24)
    _reset(runner)

    d = Driver(runner, "s", SAMPLED)
    d.start([4, 5, 6, 7])
    d.generate(9)  # 30 tokens computed: two blocks, the second partial
    before = runner.kv_cache.read_blocks([4, 5])
    spill = KVSpill(seq_id="s", spill_id=1, block_ids=[4, 5])
    result = runner.execute(d.plan(d.blocks, spills=[spill], finished_seq_ids=["s"]))
    # Another sequence overwrites the old blocks meanwhile.
    other = Driver(runner, "other")
    other.start([4, 5, 6, 7])
    other.generate(5)
    # Swap-in: new blocks, restore first, then the row continues where it stopped.
    d.blocks = [10, 11, 12, 13]
    restore = KVRestore(seq_id="s", spill_id=1, block_ids=[10, 11])
    d.run(
        new_seqs=[NewSequence(seq_id="s", sampling=SAMPLED, block_ids=d.blocks)],
        restores=[restore],
    )
    restored = runner.kv_cache.read_blocks([10, 11])
    return SpillRoundTrip(expected, d.generate(14), result.spills[0], before, restored)


def test_a_spilled_sequence_restored_into_other_blocks_continues_exactly(runner):
    trip = _spill_round_trip(runner)
    assert trip.spill.ok and trip.spill.num_keys == 1
    assert trip.spill.num_bytes == 2 * runner.kv_transfer.block_bytes
    assert trip.continued == trip.expected


def test_a_bf16_cache_spills_half_the_bytes_and_restores_exactly(tiny_llama_dir, redis_url):  # noqa: F811
    r = tiny_runner(tiny_llama_dir, kv_blocks=32, kv_cache_dtype="bfloat16")
    r.kv_transfer = KVTransfer(
        connect_kv_store(redis_url, 2.0), SpillKeys("kvt-bf16"), r.kv_cache, group_blocks=2
    )
    assert r.kv_transfer.block_bytes == 2 * 2 * BS * 2 * 16 * 2  # K and V, 2 layers, bf16
    trip = _spill_round_trip(r)
    assert trip.spill.ok and trip.spill.num_bytes == 2 * r.kv_transfer.block_bytes
    assert trip.restored.dtype == torch.bfloat16
    # the full block
    assert torch.equal(trip.restored[..., :1, :, :, :], trip.before[..., :1, :, :, :])
    assert trip.continued == trip.expected


def test_a_restore_past_blocks_still_cached_reads_only_the_rest(runner):
    """The scheduler's prefix cache still held the first block: the restore starts at
    block 1 of the spill (mid-group: groups hold two blocks here) and the sequence goes on
    exactly, its first block where it always was."""
    _reset(runner)
    reference = Driver(runner, "ref", SAMPLED)
    reference.start([0, 1, 2, 3])
    expected = reference.generate(30)

    d = Driver(runner, "s", SAMPLED)
    d.start([4, 5, 6, 7])
    d.generate(23)  # 42 tokens computed: three blocks, the third partial
    spill = KVSpill(seq_id="s", spill_id=1, block_ids=[4, 5, 6])
    result = runner.execute(d.plan(d.blocks, spills=[spill], finished_seq_ids=["s"]))
    assert result.spills[0].ok and result.spills[0].num_keys == 2
    other = Driver(runner, "other")
    other.start([5, 6, 8, 9])  # overwrites the spilled blocks 5 and 6, not 4
    other.generate(14)
    runner.execute(other.plan(other.blocks, finished_seq_ids=["other"]))
    d.blocks = [4, 10, 11, 12]
    restore = KVRestore(seq_id="s", spill_id=1, block_ids=[10, 11], first_block=1)
    d.run(
        new_seqs=[NewSequence(seq_id="s", sampling=SAMPLED, block_ids=d.blocks)],
        restores=[restore],
    )
    assert d.generate(6) == expected


def test_restoring_what_the_store_lost_reports_the_sequence_lost(runner):
    _reset(runner)
    d = Driver(runner, "gone")
    d.start([0, 1])
    result = runner.execute(
        d.plan(
            d.blocks,
            finished_seq_ids=["gone"],
            new_seqs=[NewSequence(seq_id="gone", sampling=GREEDY, block_ids=[2, 3])],
            restores=[KVRestore(seq_id="gone", spill_id=99, block_ids=[2, 3])],
            rows=[StepRow(seq_id="gone", token_ids=[5], start_pos=21, sample=True)],
        )
    )
    assert result.error is None and result.lost_seq_ids == ["gone"] and result.rows == []


def test_a_store_that_is_down_fails_spills_and_loses_restores_without_raising(tiny_llama_dir):  # noqa: F811
    server = start_redis()
    r = tiny_runner(tiny_llama_dir, kv_blocks=8)
    r.kv_transfer = KVTransfer(connect_kv_store(server.url, 1.0), SpillKeys("down"), r.kv_cache)
    d = Driver(r, "s")
    d.start([0, 1])
    d.generate(2)
    server.stop()
    result = r.execute(d.plan(d.blocks, spills=[KVSpill(seq_id="s", spill_id=1, block_ids=[0])]))
    assert result.error is None and not result.spills[0].ok
    result = r.execute(
        d.plan(d.blocks, restores=[KVRestore(seq_id="s", spill_id=1, block_ids=[3])])
    )
    assert result.error is None and result.lost_seq_ids == ["s"]
    d.generate(2)  # the runner goes on


def test_a_store_that_refuses_writes_fails_the_spill_in_words_not_bytes(tiny_llama_dir, caplog):  # noqa: F811
    server = start_redis()
    admin = redis.Redis.from_url(server.url)
    try:
        r = tiny_runner(tiny_llama_dir, kv_blocks=8)
        r.kv_transfer = KVTransfer(connect_kv_store(server.url, 1.0), SpillKeys("oom"), r.kv_cache)
        d = Driver(r, "s")
        d.start([0, 1])
        d.generate(2)
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", 1)  # above it: every write refused
        with caplog.at_level("DEBUG", logger="spillway.services.worker.kv_transfer"):
            spill = KVSpill(seq_id="s", spill_id=1, block_ids=[0, 1])
            result = r.execute(d.plan(d.blocks, spills=[spill]))
        outcome = result.spills[0]
        assert result.error is None and not outcome.ok
        assert outcome.error is not None and outcome.error.startswith("OutOfMemoryError: ")
        [line] = [rec.getMessage() for rec in caplog.records if "spilling s failed" in rec.message]
        assert "maxmemory" in line and "KB" in line
        for text in (outcome.error, line):
            assert text.isprintable() and "\\x" not in text and "\ufffd" not in text, text
    finally:
        admin.close()
        server.stop()


def test_shared_tier_blocks_load_into_a_fresh_runner(runner, tiny_llama_dir, redis_url):  # noqa: F811
    _reset(runner)
    d = Driver(runner, "a")
    d.start([0, 1, 2])
    expected = d.generate(16)  # 35 tokens computed: two full blocks
    stores = [PrefixBlock(block_id=0, block_hash="h0"), PrefixBlock(block_id=1, block_hash="h1")]
    runner.execute(d.plan(d.blocks, prefix_stores=stores))
    runner.kv_transfer.flush()
    assert redis.Redis.from_url(redis_url).zscore(SpillKeys("kvt").prefix_index(), "h1")

    fresh = tiny_runner(tiny_llama_dir, kv_blocks=16)
    fresh.kv_transfer = KVTransfer(
        connect_kv_store(redis_url, 2.0), SpillKeys("kvt"), fresh.kv_cache
    )
    b = Driver(fresh, "b")
    b.tokens = d.tokens[: 2 * BS + 1]
    b.computed = 2 * BS
    b.blocks = [7, 3, 9]
    load = PrefixLoad(seq_id="b", blocks=[PrefixBlock(block_id=7, block_hash="h0"),
                                           PrefixBlock(block_id=3, block_hash="h1")])  # fmt: skip
    b.run(new_seqs=[NewSequence(seq_id="b", sampling=GREEDY, block_ids=b.blocks)],
          prefix_loads=[load])  # fmt: skip
    # The original run's outputs from index 13 on, with only token 32 computed afresh.
    assert b.generate(2) == expected[:16]


def test_run_ahead_rows_feed_the_last_sampled_token(runner):
    _reset(runner)
    ref = Driver(runner, "ref")
    ref.start([0, 1])
    expected = ref.generate(5)  # with the token start() sampled: 6
    _reset(runner)
    runner.execute(StepPlan(step_id=1, new_seqs=[NewSequence(seq_id="x", sampling=GREEDY,
                                                              block_ids=[2, 3])]))  # fmt: skip
    tokens = []
    prefill = StepRow(seq_id="x", token_ids=PROMPT, start_pos=0, sample=True, output_index=0)
    first = runner.execute(StepPlan(step_id=2, rows=[prefill]))
    tokens.append(first.rows[0].token_id)
    for i in range(1, 6):
        row = StepRow(seq_id="x", token_ids=[], start_pos=len(PROMPT) + i - 1, sample=True,
                      output_index=i, feed_last=True)  # fmt: skip
        result = runner.execute(StepPlan(step_id=2 + i, rows=[row]))
        assert result.error is None, result.error
        tokens.append(result.rows[0].token_id)
    assert tokens == expected


def test_a_run_ahead_row_without_a_sampled_token_is_a_bad_plan(runner):
    _reset(runner)
    plan = StepPlan(
        step_id=3,
        new_seqs=[NewSequence(seq_id="y", sampling=GREEDY, block_ids=[0, 1])],
        rows=[StepRow(seq_id="y", token_ids=[], start_pos=0, sample=True, feed_last=True)],
    )
    result = runner.execute(plan)
    assert result.error is not None and result.error.code == "invalid_plan"
    assert "y" not in runner.sequences


def test_out_of_memory_is_reported_and_the_runner_goes_on(runner, monkeypatch):
    _reset(runner)
    d = Driver(runner, "m")
    d.start([0, 1])

    def boom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    with monkeypatch.context() as m:
        m.setattr(runner.model, "forward", boom)
        result = runner.execute(d.plan(d.blocks, rows=[d.row()]))
    assert result.error is not None and result.error.code == "out_of_memory"
    assert "m" not in runner.last_token
    d.generate(2)
