"""The gateway's Prometheus metrics (CONTRACT section 5).

Latencies (TTFT, inter-token, end-to-end) and token / finish counters are measured here,
per choice. The schedulers' gauges and counters (running, waiting, KV usage, preemptions,
prefix cache) come from every live scheduler's `SchedulerStats`, fetched at scrape time
and exposed by a custom collector with a `scheduler` label, so they are never stale
copies and sum() over the label is the deployment's figure.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from spillway.shared.protocol import PhaseHistogram, SchedulerLease, SchedulerStats, SpillStats

TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
PREEMPTION_MODES = ("spill", "recompute")
_Family = TypeVar("_Family", GaugeMetricFamily, CounterMetricFamily, HistogramMetricFamily)


class TokenTimer:
    """One choice's token timing: TTFT from arrival, then the gap between deltas spread
    evenly over the tokens a delta brought (a delta may carry several)."""

    def __init__(self, arrival: float) -> None:
        self.arrival = arrival
        self.last_token_at: float | None = None

    def on_tokens(self, count: int, now: float) -> tuple[float | None, list[float]]:
        """(time to first token if this is the first, inter-token latencies)."""
        if count <= 0:
            return None, []
        if self.last_token_at is None:
            self.last_token_at = now
            return now - self.arrival, []
        gap = (now - self.last_token_at) / count
        self.last_token_at = now
        return None, [gap] * count


class SchedulerStatsCollector(Collector):
    """Every live scheduler's series, each with a `scheduler` label (sum() over it is the
    deployment's figure). The spill store's series come once, unlabelled: the schedulers
    of one system relay the same store."""

    def __init__(self) -> None:
        self.stats: dict[str, SchedulerStats] = {}
        self.up: dict[str, bool] = {}

    def update(self, answers: Mapping[str, SchedulerStats | None]) -> None:
        """One scrape's answers by scheduler id, for exactly the live schedulers: one that
        did not answer (None) keeps its previous values, marked down; one no longer live
        drops out."""
        self.up = {sid: stats is not None for sid, stats in answers.items()}
        self.stats = {
            sid: stats if stats is not None else self.stats[sid]
            for sid, stats in answers.items()
            if stats is not None or sid in self.stats
        }

    def collect(self) -> Iterator[Metric]:
        up = _labelled(GaugeMetricFamily, "spillway_scheduler_up",
                       "1 when the scheduler answered the last scrape")  # fmt: skip
        for sid, answered in sorted(self.up.items()):
            up.add_metric([sid], 1.0 if answered else 0.0)
        yield up
        each = sorted(self.stats.items())
        yield from _per_scheduler(GaugeMetricFamily, each, (
            ("spillway_workers", "Workers registered with the scheduler", "num_workers"),
            ("spillway_requests_running", "Requests in the running batch", "num_running"),
            ("spillway_requests_waiting", "Requests waiting for admission", "num_waiting"),
            ("spillway_requests_swapped", "Requests whose KV waits in the spill store",
             "num_swapped"),
            ("spillway_kv_cache_usage_ratio", "Fraction of KV blocks in use", "kv_usage"),
            ("spillway_prefix_cache_blocks", "KV blocks kept by the prefix cache",
             "num_cached_blocks"),
        ))  # fmt: skip
        preemptions = _labelled(
            CounterMetricFamily,
            "spillway_preemptions",
            "Preemptions by what was done with the victim's KV (a spill that failed is a "
            "recompute)",
            "mode",
        )
        for sid, stats in each:
            for mode in sorted(set(PREEMPTION_MODES) | set(stats.preemptions)):
                preemptions.add_metric([mode, sid], stats.preemptions.get(mode, 0))
        yield preemptions
        yield from _per_scheduler(CounterMetricFamily, each, (
            ("spillway_spill_failures", "Spills the store did not take (each victim was "
             "recomputed instead)", "spill_failures"),
            ("spillway_swap_ins", "Spilled requests brought back to run", "swap_ins"),
            ("spillway_migrations", "Requests moved to another worker when theirs was lost "
             "or drained", "migrations"),
            ("spillway_prefix_cache_hits", "Prompt tokens found in the prefix cache",
             "prefix_cache_hit_tokens"),
            ("spillway_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
             "prefix_cache_query_tokens"),
        ))  # fmt: skip
        yield from _worker_metrics(each)
        yield from _phase_histograms(each)
        yield from _spec_decode_metrics(each)
        store = next((s.spill_store for _, s in each if s.spill_store is not None), None)
        yield from _spill_store_metrics(store)


def _per_scheduler(
    kind: type[_Family],
    each: Sequence[tuple[str, SchedulerStats]],
    rows: Sequence[tuple[str, str, str]],
) -> Iterator[Metric]:
    """A family of `kind` for each (name, doc, SchedulerStats field) row, with one series
    per scheduler: that field of its stats."""
    for name, doc, field in rows:
        family = _labelled(kind, name, doc)
        for sid, stats in each:
            family.add_metric([sid], getattr(stats, field))
        yield family


def _labelled(kind: type[_Family], name: str, doc: str, *more: str) -> _Family:
    return kind(name, doc, labels=[*more, "scheduler"])


def spill_health(leases: Sequence[SchedulerLease]) -> dict[str, object]:
    """What /health says of spilling, from the serving schedulers' leases (the worst)."""
    order = ("degraded", "unavailable", "ok", "off")
    statuses = [lease.spill_status for lease in leases if lease.spill_status]
    status = min(statuses, key=order.index) if statuses else "unavailable"
    body: dict[str, object] = {
        "status": status,
        "preemption_mode": ",".join(sorted({lease.preemption_mode for lease in leases})),
    }
    if status == "degraded":
        reasons = [lease.spill_reason for lease in leases if lease.spill_status == status]
        body["reason"] = next(
            (r for r in reasons if r), "redis is unavailable: victims are recomputed, not spilled"
        )
    return body


def _worker_metrics(each: Sequence[tuple[str, SchedulerStats]]) -> Iterator[Metric]:
    """Per worker a scheduler drives: where requests were placed and what hit there."""
    live = _labelled(GaugeMetricFamily, "spillway_worker_requests",
                     "Unfinished requests placed on each worker", "worker")  # fmt: skip
    usage = _labelled(GaugeMetricFamily, "spillway_worker_kv_cache_usage_ratio",
                      "Fraction of each worker's KV blocks in use", "worker")  # fmt: skip
    hits = _labelled(CounterMetricFamily, "spillway_worker_prefix_cache_hits",
                     "Prompt tokens found in each worker's prefix cache", "worker")  # fmt: skip
    steps = _labelled(CounterMetricFamily, "spillway_worker_steps", "Steps each worker ran",
                      "worker")  # fmt: skip
    for sid, stats in each:
        for w in stats.workers:
            live.add_metric([w.worker_id, sid], w.num_live)
            usage.add_metric([w.worker_id, sid], w.kv_usage)
            hits.add_metric([w.worker_id, sid], w.prefix_cache_hit_tokens)
            steps.add_metric([w.worker_id, sid], w.num_steps)
    yield from (live, usage, hits, steps)
    yield from _moe_metrics(each)


def _moe_metrics(each: Sequence[tuple[str, SchedulerStats]]) -> Iterator[Metric]:
    """Per MoE worker: its experts' load and, with expert parallel, the exchange."""
    tokens = _labelled(CounterMetricFamily, "spillway_moe_expert_tokens",
                       "Routed (token, expert) pairs per expert, summed over the MoE layers",
                       "worker", "expert")  # fmt: skip
    sent = _labelled(CounterMetricFamily, "spillway_ep_exchange_bytes",
                     "Bytes rank 0 of an expert-parallel worker sent to its other ranks",
                     "worker")  # fmt: skip
    seconds = _labelled(HistogramMetricFamily, "spillway_ep_exchange_seconds",
                        "Time per step in the experts' exchange between an expert-parallel "
                        "worker's ranks", "worker")  # fmt: skip
    for sid, stats in each:
        for w in stats.workers:
            for e, n in enumerate(w.expert_tokens):
                tokens.add_metric([w.worker_id, str(e), sid], n)
            if w.ep_exchange_seconds is not None:
                sent.add_metric([w.worker_id, sid], w.ep_exchange_bytes)
                seconds.add_metric([w.worker_id, sid], *_buckets(w.ep_exchange_seconds))
    yield from (tokens, sent, seconds)


def _buckets(h: PhaseHistogram) -> tuple[list[tuple[str, float]], float]:
    cumulative, buckets = 0, []
    for bound, count in zip([*h.bounds, float("inf")], h.counts, strict=True):
        cumulative += count
        buckets.append((_le(bound), cumulative))
    return buckets, h.sum


def _phase_histograms(each: Sequence[tuple[str, SchedulerStats]]) -> Iterator[Metric]:
    family = _labelled(
        HistogramMetricFamily,
        "spillway_scheduler_phase_seconds",
        "Time in each scheduler tick phase (schedule, update and the end-of-tick phases)",
        "phase",
    )
    for sid, stats in each:
        for phase, h in sorted(stats.phases.items()):
            cumulative, buckets = 0, []
            for bound, count in zip([*h.bounds, float("inf")], h.counts, strict=True):
                cumulative += count
                buckets.append((_le(bound), cumulative))
            family.add_metric([phase, sid], buckets, h.sum)
    yield family


def _spec_decode_metrics(each: Sequence[tuple[str, SchedulerStats]]) -> Iterator[Metric]:
    """Speculative decoding (CONTRACT section 7): drafts proposed and accepted, accepted
    by draft position, and the draft / verify / accept phases' times."""
    drafts = _labelled(CounterMetricFamily, "spillway_spec_decode_draft_tokens",
                       "Draft tokens proposed for verification")  # fmt: skip
    accepted = _labelled(CounterMetricFamily, "spillway_spec_decode_accepted_tokens",
                         "Draft tokens the target model accepted")  # fmt: skip
    per_position = _labelled(
        CounterMetricFamily,
        "spillway_spec_decode_accepted_tokens_per_position",
        "Draft tokens accepted at each position of a row's drafts (0: the first)",
        "position",
    )
    phases = _labelled(
        HistogramMetricFamily,
        "spillway_spec_decode_phase_seconds",
        "Time in each phase of speculative decoding: draft (proposing), verify (the "
        "forward of a step with drafts), accept (deciding which drafts stand)",
        "phase",
    )
    for sid, stats in each:
        drafts.add_metric([sid], stats.spec_draft_tokens)
        accepted.add_metric([sid], stats.spec_accepted_tokens)
        for position, n in enumerate(stats.spec_accepted_per_position):
            per_position.add_metric([str(position), sid], n)
        for phase, h in sorted(stats.spec_phases.items()):
            cumulative, buckets = 0, []
            for bound, count in zip([*h.bounds, float("inf")], h.counts, strict=True):
                cumulative += count
                buckets.append((_le(bound), cumulative))
            phases.add_metric([phase.removeprefix("spec_"), sid], buckets, h.sum)
    yield from (drafts, accepted, per_position, phases)


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))


def _spill_store_metrics(store: SpillStats | None) -> Iterator[Metric]:
    store = store or SpillStats(redis_ok=False)
    yield _gauge("spillway_spill_store_up", "1 when the spill store reaches Redis",
                 1.0 if store.redis_ok else 0.0)  # fmt: skip
    yield _gauge("spillway_spill_store_writable", "1 when Redis took the spill store's last "
                 "probe write", 1.0 if store.redis_ok and store.writable else 0.0)  # fmt: skip
    yield _gauge("spillway_spill_store_sequences", "Spilled sequences held", store.num_sequences)
    yield _gauge("spillway_spill_store_used_bytes", "Spilled KV bytes held", store.used_bytes)
    yield _gauge(
        "spillway_spill_store_capacity_bytes", "Spill store capacity", store.capacity_bytes
    )
    seqs = GaugeMetricFamily(
        "spillway_spill_store_sequence_bytes", "Spilled KV bytes per sequence", labels=["seq"]
    )
    for name, num_bytes in sorted(store.sequences.items()):
        seqs.add_metric([name], num_bytes)
    yield seqs
    for name, doc, value in (
        ("spillway_spill_store_spilled", "Spills recorded", store.spilled_total),
        ("spillway_spill_store_dropped", "Spills deleted after use", store.dropped_total),
        ("spillway_spill_store_expired", "Spills of dead workers deleted", store.expired_total),
        ("spillway_prefix_tier_evicted", "Shared-tier blocks evicted", store.prefix_evicted_total),
    ):
        yield CounterMetricFamily(name, doc, value=value)
    yield _gauge("spillway_prefix_tier_blocks", "Blocks in the shared prefix tier",
                 store.prefix_blocks)  # fmt: skip


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


# Our series that dashboards and autoscalers written for vLLM read under vLLM's names.
VLLM_ALIASES = {
    "spillway_requests_running": "vllm:num_requests_running",
    "spillway_requests_waiting": "vllm:num_requests_waiting",
    "spillway_kv_cache_usage_ratio": "vllm:kv_cache_usage_perc",
    "spillway_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "spillway_inter_token_latency_seconds": "vllm:inter_token_latency_seconds",
    "spillway_e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "spillway_prompt_tokens": "vllm:prompt_tokens",
    "spillway_generation_tokens": "vllm:generation_tokens",
}


class VllmAliases(Collector):
    """Each aliased series again under vLLM's name, with the same samples plus vLLM's
    `model_name` label: copied at scrape time, so the two never disagree."""

    def __init__(self, sources: Sequence[Collector], model_name: str) -> None:
        self.sources = sources
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        for source in self.sources:
            for metric in source.collect():
                alias = VLLM_ALIASES.get(metric.name)
                if alias is None:
                    continue
                copy = Metric(alias, metric.documentation, metric.type, metric.unit)
                for sample in metric.samples:
                    if sample.name.endswith("_created"):
                        continue  # the client library's own; vLLM has none
                    copy.add_sample(
                        alias + sample.name.removeprefix(metric.name),
                        {**sample.labels, "model_name": self.model_name},
                        sample.value,
                        sample.timestamp,
                        sample.exemplar,
                    )
                yield copy


class GatewayMetrics:
    """A registry of its own per gateway (several may live in one test process)."""

    def __init__(self, model_name: str = "") -> None:
        self.registry = CollectorRegistry()
        self.scheduler = SchedulerStatsCollector()
        self.registry.register(self.scheduler)
        self.ttft = self._latency(
            "spillway_time_to_first_token_seconds",
            "Time from arrival to the first generated token",
            TTFT_BUCKETS,
        )
        self.itl = self._latency(
            "spillway_inter_token_latency_seconds", "Time between generated tokens", ITL_BUCKETS
        )
        self.e2e = self._latency(
            "spillway_e2e_request_latency_seconds",
            "Time from arrival to the last token",
            E2E_BUCKETS,
        )
        self.prompt_tokens = Counter(
            "spillway_prompt_tokens", "Prompt tokens submitted", registry=self.registry
        )
        self.generation_tokens = Counter(
            "spillway_generation_tokens", "Tokens generated", registry=self.registry
        )
        self.finished = Counter(
            "spillway_requests_finished",
            "Sequences finished, by reason",
            ["finish_reason"],
            registry=self.registry,
        )
        aliased = [self.scheduler, self.ttft, self.itl, self.e2e]
        self.registry.register(
            VllmAliases([*aliased, self.prompt_tokens, self.generation_tokens], model_name)
        )

    def _latency(self, name: str, doc: str, buckets: Sequence[float]) -> Histogram:
        return Histogram(name, doc, buckets=buckets, registry=self.registry)

    def on_tokens(self, timer: TokenTimer, count: int, now: float) -> None:
        ttft, gaps = timer.on_tokens(count, now)
        if ttft is not None:
            self.ttft.observe(ttft)
        for gap in gaps:
            self.itl.observe(gap)
        self.generation_tokens.inc(count)

    def on_finished(self, timer: TokenTimer, finish_reason: str, now: float) -> None:
        self.e2e.observe(now - timer.arrival)
        self.finished.labels(finish_reason=finish_reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
