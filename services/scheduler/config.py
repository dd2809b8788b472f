"""The scheduler core's own limits (the KV geometry comes from the registered worker)."""

from __future__ import annotations

from dataclasses import dataclass

from shared.config import Settings


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch: int = 64  # sequences holding blocks at once
    max_num_batched_tokens: int = 512  # tokens one step may compute, all rows together
    max_waiting: int = 1024  # beyond this, submissions get 429

    @classmethod
    def from_settings(cls, settings: Settings) -> SchedulerConfig:
        return cls(
            max_batch=settings.max_batch,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            max_waiting=settings.max_waiting,
        )
