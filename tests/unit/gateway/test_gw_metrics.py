"""Latency math and the exported metric names (CONTRACT section 5)."""

from __future__ import annotations

import pytest

from spillway.services.gateway.metrics import GatewayMetrics, TokenTimer, spill_health
from spillway.services.scheduler.phase_stats import PhaseStats
from spillway.services.scheduler.preemption import spill_status
from spillway.shared.protocol import SchedulerLease, SchedulerStats, SpillStats, WorkerLoad
from tests.metric_names import CONTRACT_NAMES


def test_first_token_then_gaps_spread_over_a_delta():
    timer = TokenTimer(arrival=10.0)
    assert timer.on_tokens(1, 10.25) == (0.25, [])
    assert timer.on_tokens(1, 10.35) == (None, [pytest.approx(0.1)])
    ttft, gaps = timer.on_tokens(2, 10.55)
    assert ttft is None and gaps == [pytest.approx(0.1), pytest.approx(0.1)]
    assert timer.on_tokens(0, 11.0) == (None, [])


def test_first_delta_with_several_tokens_counts_as_first_token():
    timer = TokenTimer(arrival=0.0)
    assert timer.on_tokens(3, 0.5) == (0.5, [])


def metric_value(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} missing")


def assert_values(text: str, expected: dict[str, object]) -> None:
    """Each named series of the exposition `text` has its expected value."""
    assert {name: metric_value(text, name) for name in expected} == expected


def render_with_s1(metrics: GatewayMetrics, **stats) -> str:
    """The exposition once scheduler s1 has reported these SchedulerStats fields."""
    fields = {"num_workers": 1, "num_waiting": 0, **stats}
    metrics.scheduler.update({"s1": SchedulerStats(**fields)})
    return metrics.render().decode()


def test_exported_names_and_scheduler_values():
    metrics = GatewayMetrics()
    timer = TokenTimer(0.0)
    metrics.prompt_tokens.inc(7)
    metrics.on_tokens(timer, 1, 0.2)
    metrics.on_tokens(timer, 2, 0.4)
    metrics.on_finished(timer, "length", 0.5)
    text = render_with_s1(
        metrics, num_workers=2, num_running=3, num_waiting=4, kv_usage=0.25,
        preemptions={"spill": 5}, spill_failures=2, swap_ins=4, prefix_cache_hit_tokens=16,
        prefix_cache_query_tokens=64,
    )  # fmt: skip
    for name in CONTRACT_NAMES:
        name = name.replace("}", ',scheduler="s1"}') if "{" in name else name
        assert name in text, name
    on = '{scheduler="s1"}'
    assert_values(text, {
        f"spillway_requests_running{on}": 3,
        f"spillway_requests_waiting{on}": 4,
        f"spillway_kv_cache_usage_ratio{on}": 0.25,
        'spillway_preemptions_total{mode="spill",scheduler="s1"}': 5,
        'spillway_preemptions_total{mode="recompute",scheduler="s1"}': 0,
        f"spillway_spill_failures_total{on}": 2,
        f"spillway_swap_ins_total{on}": 4,
        f"spillway_prefix_cache_hits_total{on}": 16,
        "spillway_prompt_tokens_total": 7,
        "spillway_generation_tokens_total": 3,
        'spillway_requests_finished_total{finish_reason="length"}': 1,
        "spillway_time_to_first_token_seconds_count": 1,
        "spillway_inter_token_latency_seconds_count": 2,
        "spillway_e2e_request_latency_seconds_sum": 0.5,
    })  # fmt: skip


def test_scheduler_down_keeps_last_values_and_says_so():
    metrics = GatewayMetrics()
    metrics.scheduler.update(
        {"s1": SchedulerStats(num_workers=1, num_running=2, num_waiting=0), "s2": None}
    )
    metrics.scheduler.update({"s1": None, "s2": None})
    text = metrics.render().decode()
    assert metric_value(text, 'spillway_scheduler_up{scheduler="s1"}') == 0
    assert metric_value(text, 'spillway_scheduler_up{scheduler="s2"}') == 0
    assert metric_value(text, 'spillway_requests_running{scheduler="s1"}') == 2
    assert 'spillway_requests_running{scheduler="s2"}' not in text  # never answered


def test_every_live_scheduler_has_its_series_and_a_dead_one_drops_out():
    metrics = GatewayMetrics()

    def stats(running: int, spilled: int, worker: str) -> SchedulerStats:
        return SchedulerStats(
            num_workers=1,
            num_running=running,
            num_waiting=0,
            preemptions={"spill": spilled, "recompute": 1},
            workers=[WorkerLoad(worker_id=worker, num_live=running)],
        )

    metrics.scheduler.update({"a": stats(2, 3, "wa"), "b": stats(5, 7, "wb")})
    text = metrics.render().decode()
    assert metric_value(text, 'spillway_requests_running{scheduler="a"}') == 2
    assert metric_value(text, 'spillway_requests_running{scheduler="b"}') == 5
    assert metric_value(text, 'spillway_preemptions_total{mode="spill",scheduler="b"}') == 7
    assert metric_value(text, 'spillway_worker_requests{scheduler="a",worker="wa"}') == 2
    metrics.scheduler.update({"b": stats(1, 8, "wb")})  # a's lease lapsed
    text = metrics.render().decode()
    assert 'scheduler="a"' not in text
    assert metric_value(text, 'spillway_requests_running{scheduler="b"}') == 1


def test_phase_histograms_and_the_spill_store_are_exported_without_a_tracing_backend():
    phases = PhaseStats()
    for seconds in (0.0002, 0.0004, 0.02):
        phases.observe("swap_in", seconds)
    phases.observe("drain", 0.3)
    store = SpillStats(
        redis_ok=True, num_sequences=2, used_bytes=3000, capacity_bytes=10_000,
        sequences={"a:1": 2000, "b:1": 1000}, expired_total=1, prefix_blocks=7,
    )  # fmt: skip
    text = render_with_s1(
        GatewayMetrics(), num_running=0, num_swapped=2, phases=phases.snapshot(), spill_store=store
    )
    name = "spillway_scheduler_phase_seconds"
    s1 = 'scheduler="s1"'
    assert_values(text, {
        f'{name}_count{{phase="swap_in",{s1}}}': 3,
        f'{name}_bucket{{le="0.0005",phase="swap_in",{s1}}}': 2,
        f'{name}_bucket{{le="+Inf",phase="swap_in",{s1}}}': 3,
        f'{name}_sum{{phase="drain",{s1}}}': pytest.approx(0.3),
        f"spillway_requests_swapped{{{s1}}}": 2,
        "spillway_spill_store_up": 1,
        "spillway_spill_store_used_bytes": 3000,
        'spillway_spill_store_sequence_bytes{seq="a:1"}': 2000,
        "spillway_spill_store_expired_total": 1,
        "spillway_prefix_tier_blocks": 7,
    })  # fmt: skip


def test_health_says_spill_is_degraded_while_redis_is_down():
    def lease(status: str) -> SchedulerLease:
        return SchedulerLease(scheduler_id=status, interval_s=0.5, spill_status=status,
                              preemption_mode="auto")  # fmt: skip

    body = spill_health([lease("ok"), lease("degraded")])
    assert body["status"] == "degraded" and "recomputed" in str(body["reason"])
    assert spill_health([lease("ok")]) == {"status": "ok", "preemption_mode": "auto"}
    assert spill_health([])["status"] == "unavailable"
    assert spill_status("auto", SpillStats(redis_ok=False)) == "degraded"
    # The scheduler's words for why, when it gives them.
    told = lease("degraded").model_copy(update={"spill_reason": "redis refuses writes (OOM)"})
    assert spill_health([lease("ok"), told])["reason"] == "redis refuses writes (OOM)"
    assert spill_status("recompute", None) == "off"
    assert spill_status("spill", None) == "unavailable"


def test_speculative_decoding_counters_and_phases_per_scheduler():
    """CONTRACT section 7's names, by scheduler and draft position."""
    phases = PhaseStats()
    phases.observe("spec_verify", 0.004)
    phases.observe("spec_draft", 0.00002)
    text = render_with_s1(
        GatewayMetrics(), num_running=1, spec_draft_tokens=30, spec_accepted_tokens=17,
        spec_accepted_per_position=[9, 6, 2], spec_phases=phases.snapshot(),
    )  # fmt: skip
    s1 = 'scheduler="s1"'
    per_position = "spillway_spec_decode_accepted_tokens_per_position_total"
    phase = "spillway_spec_decode_phase_seconds"
    assert_values(text, {
        f"spillway_spec_decode_draft_tokens_total{{{s1}}}": 30,
        f"spillway_spec_decode_accepted_tokens_total{{{s1}}}": 17,
        **{f'{per_position}{{position="{p}",{s1}}}': n for p, n in enumerate([9, 6, 2])},
        f'{phase}_count{{phase="verify",{s1}}}': 1,
        f'{phase}_sum{{phase="draft",{s1}}}': pytest.approx(2e-5),
    })  # fmt: skip
