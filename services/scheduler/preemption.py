"""How a preemption victim gives its blocks back: spilled to the store, or recomputed.

    spill      the worker copies the victim's blocks to the spill store; the victim is
               `swapped` and later read back (swap-in) exactly as it was
    recompute  the blocks are simply freed; the victim re-prefills prompt + generated
               tokens when blocks free up
    auto       spill when the store is healthy, has room, and reading the sequence back
               is expected to beat recomputing it; recompute otherwise

The auto rule compares two estimates (docs/architecture.md, the scheduler tick):

    spill cost     = 2 * bytes / kv_bandwidth + 2 * kv_latency   (write now, read later)
    recompute cost = computed_tokens / prefill_rate

Both rates start from figures measured on the development machine and follow what the
system observes (the worker reports its KV transfer times; prefill-heavy steps give the
prefill rate), so the crossover adapts to the machine it runs on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from spillway.shared.log_safety import safe_text
from spillway.shared.protocol import SpillStats

Mode = Literal["spill", "recompute"]
ConfiguredMode = Literal["auto", "spill", "recompute"]

# Measured on a 2-core AMD EPYC by bench/spill.py (docs/measurements/, 2026-12-01): a
# localhost Redis moved ~0.3 GB/s of KV (written and read back) with ~1 ms per pipelined
# round trip; a float32 SmolLM2-135M prefills ~870 tokens/s. The EWMAs below replace
# them as soon as the system observes its own figures.
DEFAULT_KV_BANDWIDTH_BPS = 0.3e9
DEFAULT_KV_LATENCY_S = 1e-3
DEFAULT_PREFILL_TOKENS_PER_S = 850.0
EWMA_WEIGHT = 0.2
# Steps with fewer tokens say little about prefill throughput (decode dominates them).
MIN_PREFILL_SAMPLE_TOKENS = 64
MIN_KV_SAMPLE_BYTES = 1 << 20
# After a spill failed, spill no more for this long (the store's health report catches
# up meanwhile): new victims are recomputed.
SPILL_BACKOFF_S = 2.0
# How long a refused spill keeps spilling "degraded" in /health: longer than the backoff,
# so that a store that refuses every retry reads as degraded throughout.
SPILL_FAILURE_MEMORY_S = 10.0


@dataclass
class SpillHealth:
    """What the spill store last said, and when (the scheduler's clock)."""

    ok: bool = False
    free_bytes: int = 0
    at_s: float = float("-inf")


class PreemptionPolicy:
    def __init__(
        self,
        mode: ConfiguredMode,
        spill_available: bool,
        stale_after_s: float = 5.0,
    ) -> None:
        self.mode = mode
        self.spill_available = spill_available
        self.stale_after_s = stale_after_s
        self.health = SpillHealth()
        self.kv_bandwidth_bps = DEFAULT_KV_BANDWIDTH_BPS
        self.kv_latency_s = DEFAULT_KV_LATENCY_S
        self.prefill_tokens_per_s = DEFAULT_PREFILL_TOKENS_PER_S
        self._blocked_until_s = float("-inf")
        self._pending_bytes = 0  # spilled since the store's last report

    # --- what the system observes -------------------------------------------------------

    def store_reported(self, ok: bool, free_bytes: int, now_s: float) -> None:
        self.health = SpillHealth(ok, free_bytes, now_s)
        self._pending_bytes = 0

    def spill_failed(self, now_s: float) -> None:
        self._blocked_until_s = now_s + SPILL_BACKOFF_S

    def observe_kv_io(self, num_bytes: int, seconds: float) -> None:
        if num_bytes >= MIN_KV_SAMPLE_BYTES and seconds > 0:
            bps = num_bytes / seconds
            self.kv_bandwidth_bps += EWMA_WEIGHT * (bps - self.kv_bandwidth_bps)

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        if num_tokens >= MIN_PREFILL_SAMPLE_TOKENS and seconds > 0:
            rate = num_tokens / seconds
            self.prefill_tokens_per_s += EWMA_WEIGHT * (rate - self.prefill_tokens_per_s)

    # --- the decision -------------------------------------------------------------------

    def can_spill(self, num_bytes: int, now_s: float) -> bool:
        """The store is configured, healthy (recently), not backing off, and has room."""
        h = self.health
        return (
            self.spill_available
            and h.ok
            and now_s - h.at_s <= self.stale_after_s
            and now_s >= self._blocked_until_s
            and num_bytes <= h.free_bytes - self._pending_bytes
        )

    def spill_cost_s(self, num_bytes: int) -> float:
        return 2 * num_bytes / self.kv_bandwidth_bps + 2 * self.kv_latency_s

    def recompute_cost_s(self, num_tokens: int) -> float:
        return num_tokens / self.prefill_tokens_per_s

    def crossover_tokens(self, bytes_per_token: float) -> float:
        """The sequence length above which auto spills (costs equal there)."""
        per_token = 1 / self.prefill_tokens_per_s - 2 * bytes_per_token / self.kv_bandwidth_bps
        if per_token <= 0:
            return float("inf")
        return 2 * self.kv_latency_s / per_token

    def choose(self, num_tokens: int, num_bytes: int, now_s: float) -> Mode:
        """The mode for a victim holding `num_tokens` computed tokens in `num_bytes`."""
        if self.mode == "recompute" or num_tokens == 0:
            return "recompute"
        if not self.can_spill(num_bytes, now_s):
            return "recompute"
        if self.mode == "auto" and self.spill_cost_s(num_bytes) >= self.recompute_cost_s(
            num_tokens
        ):
            return "recompute"
        self._pending_bytes += num_bytes
        return "spill"


def spill_status(preemption_mode: str, store: SpillStats | None, failing: str = "") -> str:
    """Spilling in one word, for the lease and /health: "off" (recompute only), "ok",
    "degraded" (Redis is down, takes no writes, or refused a spill lately (`failing`):
    victims are recomputed, the system still serves) or "unavailable" (no spill store
    answers)."""
    if preemption_mode == "recompute":
        return "off"
    if store is None:
        return "unavailable"
    return "ok" if store.redis_ok and store.writable and not failing else "degraded"


def spill_reason(preemption_mode: str, store: SpillStats | None, failing: str = "") -> str:
    """Why spilling is not "ok" (see spill_status), in words for /health; "" when it is."""
    status = spill_status(preemption_mode, store, failing)
    if status == "unavailable":
        return "no spill store answers: victims are recomputed, not spilled"
    if status != "degraded":
        return ""
    assert store is not None
    if not store.redis_ok:
        why = f"redis is unavailable ({store.redis_error})"
    elif not store.writable:
        why = f"redis refuses writes ({store.redis_error})"
    else:
        why = f"spills failed lately ({failing})"
    return f"{why}: victims are recomputed, not spilled"


class RecentSpillFailures:
    """The last spill the store refused, remembered for `memory_s`: spilling reads as
    degraded meanwhile (a store that refuses writes may still answer its probe)."""

    def __init__(self, memory_s: float = SPILL_FAILURE_MEMORY_S) -> None:
        self.memory_s = memory_s
        self._seen = 0
        self._at_s = float("-inf")
        self._error = ""

    def observe(self, total_failures: int, error: str, now_s: float) -> None:
        """The failures counted so far (a running total) and the last one's error."""
        if total_failures > self._seen:
            self._at_s = now_s
            self._error = safe_text(error) or "the store did not take the KV"
        self._seen = total_failures

    def failing(self, now_s: float) -> str:
        """The last failure's error while it is recent, else ""."""
        return self._error if now_s - self._at_s <= self.memory_s else ""
