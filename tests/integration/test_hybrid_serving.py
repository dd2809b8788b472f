"""Hybrid models (Granite 4.0-H, Qwen3-Next) served by the real scheduler core driving the
real model runner in one process: concurrent greedy requests of mixed lengths through
chunked prefill equal transformers token for token; under pressure on KV blocks and state
slots, spilled (with the recurrent state, to a real Redis), recomputed or either (auto),
every request keeps the tokens of the unpressured run and no slot or block leaks; a
prefix hit resumes from a state snapshot, skips the shared prefill and changes nothing."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace

import pytest
import torch

from spillway.kernels.cpu import ssm as cpu_ssm
from spillway.kernels.cpu.linear import Int8Linear
from spillway.services.scheduler.config import SchedulerConfig
from spillway.services.scheduler.core import SchedulerCore
from spillway.services.scheduler.prefix_hash import hash_hex
from spillway.services.spillstore.service import SpillStore
from spillway.services.worker.info import worker_info
from spillway.services.worker.kv_transfer import KVTransfer, connect_kv_store
from spillway.services.worker.loading import load_runner
from spillway.services.worker.runner import ModelRunner
from spillway.shared.clock import FakeClock
from spillway.shared.config import load_settings
from spillway.shared.protocol import RequestDelta, SamplingParams, SubmitRequest
from spillway.shared.spill_keys import SpillKeys
from tests.unit.worker.tiny_families import load_reference, reference_greedy, save_tiny_family

FAMILIES = ["granitemoehybrid", "qwen3_next"]
PROMPTS = [[(11 * i + 5 * j) % 250 + 3 for j in range(4 + 7 * i)] for i in range(4)]
NEW_TOKENS = 10
BS = 4


@pytest.fixture(scope="module", params=FAMILIES)
def family_dir(request, tmp_path_factory):
    return save_tiny_family(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def want(family_dir):
    reference = load_reference(family_dir)
    out = []
    for prompt in PROMPTS:
        tokens, gap = reference_greedy(reference, prompt, NEW_TOKENS)
        assert gap > 1e-3  # clear greedy choices: equality is meaningful
        out.append(tokens)
    return out


def _runner(folder, kv_blocks: int, state_slots: int, **extra: object) -> ModelRunner:
    settings = load_settings(
        model=str(folder), kv_blocks=kv_blocks, block_size=BS, state_slots=state_slots,
        device="cpu", dtype="float32", spill_store=False, **extra,
    )  # fmt: skip
    runner, _ = load_runner(settings)
    return runner


def _serve_all(
    folder,
    kv_blocks: int,
    state_slots: int,
    mode: str = "recompute",
    redis: str | None = None,
    prompts: list[list[int]] = PROMPTS,
    **extra: object,
) -> tuple[list[list[int]], SchedulerCore, ModelRunner]:
    runner = _runner(folder, kv_blocks, state_slots, **extra)
    config = SchedulerConfig(max_batch=8, max_num_batched_tokens=12)  # prompts go in chunks
    if redis is not None:
        config = replace(config, preemption_mode=mode, spill_store=True)  # type: ignore[arg-type]
        store = connect_kv_store(redis, 2.0)
        runner.kv_transfer = KVTransfer(store, SpillKeys(uuid.uuid4().hex[:8]), runner.kv_cache)
        runner.kv_transfer.state_pool = runner.state_pool
    core = SchedulerCore(FakeClock(), config)
    info = worker_info("w", "tiny", runner)
    assert info.num_state_slots == state_slots and info.state_slot_bytes > 0
    core.attach_worker(info)
    if redis is not None:
        core.spill_store_reported(True, 1 << 40)
    return _serve(core, runner, prompts)[0], core, runner


def _serve(
    core: SchedulerCore,
    runner: ModelRunner,
    prompts: list[list[int]],
    tag: str = "r",
    tier: list[list[int]] | None = None,
) -> tuple[list[list[int]], list[int]]:
    """Each prompt's greedy tokens, and its cached tokens (what its prefill skipped)."""
    for i, prompt in enumerate(prompts):
        error = core.add_request(
            SubmitRequest(
                request_id=f"{tag}{i}",
                gateway_id="g",
                prompt_token_ids=prompt,
                sampling=SamplingParams(temperature=0.0),
                max_tokens=NEW_TOKENS,
                ignore_eos=True,
            ),
            None if tier is None else tier[i],
        )
        assert error is None
    outputs: dict[str, list[int]] = {f"{tag}{i}": [] for i in range(len(prompts))}
    finished: dict[str, RequestDelta] = {}
    cached: dict[str, int] = {}
    for _ in range(2000):
        plan = core.schedule()
        deltas = [] if plan is None else core.update_from_output(plan, runner.execute(plan))
        for d in [*deltas, *core.end_tick()]:
            outputs[d.request_id] += d.token_ids
            if d.request_id not in cached:  # the first delta says it
                cached[d.request_id] = d.num_cached_tokens or 0
            if d.finish_reason is not None:
                finished[d.request_id] = d
        core.check_integrity()
        if len(finished) == len(prompts) and not core.has_work():
            break
    assert {d.finish_reason for d in finished.values()} == {"length"}
    assert core.kv_usage == 0.0 and core.num_swapped == 0
    ids = [f"{tag}{i}" for i in range(len(prompts))]
    return [outputs[i] for i in ids], [cached[i] for i in ids]


def test_concurrent_chunked_requests_equal_transformers(family_dir, want):
    cpu_ssm.PATHS.clear()
    got, core, _ = _serve_all(family_dir, kv_blocks=64, state_slots=8)
    assert got == want
    assert sum(core.stats.preemptions.values()) == 0
    # Decode steps of slots 0..R-1 take the batched path over the pool's rows.
    assert cpu_ssm.PATHS["view"] > 0


def test_a_bf16_kv_cache_serves_them_too(family_dir):
    # The float32 worker is the yardstick (it equals transformers: the test above).
    exact, _, _ = _serve_all(family_dir, kv_blocks=64, state_slots=8)
    got, _, runner = _serve_all(family_dir, kv_blocks=64, state_slots=8, kv_cache_dtype="bfloat16")
    assert runner.kv_cache.dtype == torch.bfloat16
    assert got == exact  # these models' greedy choices are clear enough to survive the rounding


def test_the_int8_mode_serves_them_on_int8_experts_made_at_start_up(family_dir, want):
    got, _, runner = _serve_all(family_dir, kv_blocks=64, state_slots=8, quantize="int8")
    experts = runner.model.ops.fused_experts
    linear = experts.linear
    assert experts.int8 and isinstance(linear, Int8Linear)
    made = experts.int8_forms()
    assert made["packed"] + made["streamed"] + made["one by one"] >= 2 * 3  # 3 MoE layers
    assert [len(tokens) for tokens in got] == [NEW_TOKENS] * len(PROMPTS)
    # int8 moves these tiny random models' later choices; each prompt's first token stays
    assert [tokens[0] for tokens in got] == [tokens[0] for tokens in want]
    # the warm-up alone made every int8 form the serving used: serving made none
    fresh_runner = _runner(family_dir, 64, 8, quantize="int8")  # kept: the forms die with it
    assert fresh_runner.model.ops.fused_experts.int8_forms() == made


def test_few_slots_queue_requests_and_recompute_under_block_pressure(family_dir, want):
    cpu_ssm.PATHS.clear()
    got, core, _ = _serve_all(family_dir, kv_blocks=10, state_slots=3)
    assert got == want
    assert core.stats.preemptions["recompute"] > 0
    # Rows stay sorted by slot through preemptions and resumes: steps whose slots are
    # one run take the batched path, the others (a gap left by a victim) the fallback.
    assert cpu_ssm.PATHS["view"] > 0


@pytest.mark.parametrize("mode", ["spill", "auto"])
def test_spilled_states_come_back_with_their_blocks(family_dir, want, redis_url, mode):
    got, core, _ = _serve_all(family_dir, kv_blocks=10, state_slots=3, mode=mode,
                                   redis=redis_url)  # fmt: skip
    assert got == want
    assert core.stats.spill_failures == 0
    if mode == "spill":
        assert (
            core.stats.preemptions["spill"] > 0
            and core.stats.swap_ins == core.stats.preemptions["spill"]
        )
    assert sum(core.stats.preemptions.values()) > 0


def test_a_prefix_hit_resumes_from_a_state_snapshot(family_dir, want):
    """PROMPTS[3] runs; then prompts sharing its first 14 tokens (three full blocks and
    two tokens) with other tails: each resumes from the snapshot at 12 tokens."""
    got, core, runner = _serve_all(family_dir, kv_blocks=64, state_slots=4, prompts=PROMPTS[3:])
    assert got == want[3:]
    head = PROMPTS[3][:14]
    tails = [[7, 9, 11], [200, 3]]
    followers, cached = _serve(core, runner, [[*head, *t] for t in tails], tag="f")
    assert cached == [12, 12]
    reference = load_reference(family_dir)
    for prompt, tokens in zip([[*head, *t] for t in tails], followers, strict=True):
        expected, gap = reference_greedy(reference, prompt, NEW_TOKENS)
        assert gap > 1e-3 and tokens == expected


def _tiered(folder, namespace: str, redis: str) -> tuple[SchedulerCore, ModelRunner]:
    runner = _runner(folder, kv_blocks=64, state_slots=4)
    runner.kv_transfer = KVTransfer(
        connect_kv_store(redis, 2.0), SpillKeys(namespace), runner.kv_cache
    )
    runner.kv_transfer.state_pool = runner.state_pool
    runner.kv_transfer.state_snapshots = runner.state_snapshots
    config = SchedulerConfig(
        max_batch=8, max_num_batched_tokens=12, spill_store=True, prefix_tier=True
    )
    core = SchedulerCore(FakeClock(), config)
    core.attach_worker(worker_info("w", "tiny", runner))
    return core, runner


def _tier_lookup(redis: str, namespace: str, hashes: list[int]) -> int:
    import redis.asyncio as aioredis

    async def ask() -> int:
        client = aioredis.from_url(redis)
        try:
            store = SpillStore(client, SpillKeys(namespace), 1 << 30)
            return await store.lookup([hash_hex(h) for h in hashes])
        finally:
            await client.aclose()

    return asyncio.run(ask())


def test_the_redis_tier_serves_a_snapshot_to_a_fresh_worker(family_dir, want, redis_url):
    namespace = uuid.uuid4().hex[:8]
    core, runner = _tiered(family_dir, namespace, redis_url)
    got, _ = _serve(core, runner, [PROMPTS[3]])  # its blocks and snapshots go to the tier
    assert got == want[3:]
    assert runner.kv_transfer is not None
    runner.kv_transfer.flush()
    fresh_core, fresh = _tiered(family_dir, namespace, redis_url)  # a restarted worker
    prompt = [*PROMPTS[3][:14], 8, 6]
    hashes = fresh_core.prefix_lookup_hashes(prompt)
    assert len(hashes) == 3  # nothing local; three full blocks to ask the tier about
    held = _tier_lookup(redis_url, namespace, hashes)
    assert held == 3
    tokens, cached = _serve(fresh_core, fresh, [prompt], tag="t", tier=[hashes[:held]])
    assert cached == [12] and fresh_core.stats.prefix_hit_tokens == 12
    expected, gap = reference_greedy(load_reference(family_dir), prompt, NEW_TOKENS)
    assert gap > 1e-3 and tokens == [expected]
