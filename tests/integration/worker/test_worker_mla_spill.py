"""Latent attention's one-plane cache (DeepSeek-V3) through the spill store: a spilled
sequence restored into other blocks continues exactly, and a block's bytes hold the
plane once."""

from __future__ import annotations

import pytest

from spillway.services.worker.kv_transfer import KVTransfer, connect_kv_store
from spillway.services.worker.runner import ModelRunner
from spillway.shared.protocol import KVRestore, KVSpill, NewSequence, SamplingParams
from spillway.shared.spill_keys import SpillKeys
from tests.integration.worker.test_worker_kv_transfer import Driver, _reset
from tests.unit.worker.tiny_families import save_tiny_family
from tests.unit.worker.tiny_llama import tiny_runner

SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, seed=11)


@pytest.fixture(scope="module")
def runner(tmp_path_factory, redis_url) -> ModelRunner:
    folder = save_tiny_family(tmp_path_factory.mktemp("deepseek"), "deepseek_v3")
    r = tiny_runner(folder, kv_blocks=32)
    r.kv_transfer = KVTransfer(
        connect_kv_store(redis_url, 2.0), SpillKeys("mla"), r.kv_cache, group_blocks=2
    )
    return r


def test_the_cache_is_one_latent_plane(runner):
    cache = runner.kv_cache
    assert cache.planes == 1 and cache.v is cache.k
    assert cache.block_shape == (runner.block_size, 1, 32 + 8)  # kv_lora_rank + rope dim
    assert runner.kv_transfer.block_bytes == 2 * runner.block_size * 40 * 4  # 2 layers, f32


def test_a_spilled_latent_sequence_restored_into_other_blocks_continues_exactly(runner):
    _reset(runner)
    reference = Driver(runner, "ref", SAMPLED)
    reference.start([0, 1, 2, 3])
    expected = reference.generate(24)
    _reset(runner)

    d = Driver(runner, "s", SAMPLED)
    d.start([4, 5, 6, 7])
    d.generate(9)  # 30 tokens computed: two blocks, the second partial
    spill = KVSpill(seq_id="s", spill_id=1, block_ids=[4, 5])
    result = runner.execute(d.plan(d.blocks, spills=[spill], finished_seq_ids=["s"]))
    assert result.spills[0].ok
    assert result.spills[0].num_bytes == 2 * runner.kv_transfer.block_bytes
    other = Driver(runner, "other")
    other.start([4, 5, 6, 7])  # overwrites the spilled blocks
    other.generate(5)
    d.blocks = [10, 11, 12, 13]
    restore = KVRestore(seq_id="s", spill_id=1, block_ids=[10, 11])
    d.run(
        new_seqs=[NewSequence(seq_id="s", sampling=SAMPLED, block_ids=d.blocks)],
        restores=[restore],
    )
    assert d.generate(14) == expected
