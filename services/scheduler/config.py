"""The scheduler core's own limits (the KV geometry comes from the registered worker)."""

from __future__ import annotations

from dataclasses import dataclass

from spillway.shared.config import PreemptionMode, Settings, SpeculativeMethod, settings_part


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch: int = 64  # sequences holding blocks at once
    max_num_batched_tokens: int = 512  # tokens one step may compute, all rows together
    max_waiting: int = 1024  # beyond this, submissions get 429
    preemption_mode: PreemptionMode = "recompute"
    prefix_cache: bool = True
    # A spill store serves this system: spilling, swap-in and the shared prefix tier
    # are possible (whether it is healthy right now is the policy's business).
    spill_store: bool = False
    prefix_tier: bool = False  # finished sequences' full blocks go to the shared tier
    prefix_tier_blocks: int = 4096  # hashes remembered as already stored there
    run_ahead: bool = False  # plan step N+1 before step N's result is applied
    # A step with decode rows takes only the prompt tokens that keep it within this many
    # seconds (prefill_budget.py); None: the whole token budget.
    itl_target_s: float | None = None
    # Speculative decoding: "ngram" drafts are looked up here (the other methods' drafts
    # come from the worker); K drafts at most per row; the longest n-gram looked up; no
    # drafts while more than spec_max_batch sequences run (steps are compute-bound).
    speculative: SpeculativeMethod = "none"
    num_speculative_tokens: int = 3
    ngram_max: int = 4
    spec_max_batch: int = 16
    # A draft's cost relative to a decode row's; None: measured from the steps.
    spec_draft_cost: float | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> SchedulerConfig:
        return settings_part(
            cls,
            settings,
            prefix_tier=settings.spill_store and settings.prefix_tier_blocks > 0,
            itl_target_s=None if settings.itl_target_ms is None else settings.itl_target_ms / 1e3,
        )
