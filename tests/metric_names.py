"""The metric names the gateway's /metrics must export (CONTRACT section 5), as the unit,
integration and end-to-end tests check them. A name with labels gives labels its series
must carry; `bare` drops them (what a test that cannot know every label looks for)."""

from __future__ import annotations

CONTRACT_NAMES = [
    "spillway_time_to_first_token_seconds_bucket",
    "spillway_inter_token_latency_seconds_bucket",
    "spillway_e2e_request_latency_seconds_bucket",
    "spillway_requests_running",
    "spillway_requests_waiting",
    "spillway_kv_cache_usage_ratio",
    'spillway_preemptions_total{mode="spill"}',
    'spillway_preemptions_total{mode="recompute"}',
    "spillway_prefix_cache_hits_total",
    "spillway_prefix_cache_queries_total",
    "spillway_prompt_tokens_total",
    "spillway_generation_tokens_total",
    "spillway_requests_finished_total",
]


def bare(name: str) -> str:
    """The name without its labels."""
    return name.split("{")[0]
