"""Latent attention's one-plane cache (DeepSeek-V3) through the spill store: a spilled
sequence restored into other blocks continues exactly, and a block's bytes hold the
plane once."""

from __future__ import annotations

import pytest

from spillway.services.worker.kv_transfer import KVTransfer, connect_kv_store
from spillway.services.worker.runner import ModelRunner
from spillway.shared.spill_keys import SpillKeys
from tests.integration.worker.test_worker_kv_transfer import _spill_round_trip
from tests.unit.worker.tiny_families import save_tiny_family
from tests.unit.worker.tiny_llama import tiny_runner


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
    trip = _spill_round_trip(runner)
    assert trip.spill.ok
    assert trip.spill.num_bytes == 2 * runner.kv_transfer.block_bytes
    assert trip.continued == trip.expected
