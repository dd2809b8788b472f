"""What every process checks of an expert-parallel group before it starts: the split of
each MoE layer's experts over the ranks (the worker's layers and `spillway up`'s refusal
use the same arithmetic)."""

from __future__ import annotations

from spillway.shared.config import Settings
from spillway.shared.model_config import ModelConfig


def expert_range(num_experts: int, rank: int, size: int) -> tuple[int, int]:
    """[lo, hi): the experts rank `rank` of `size` holds."""
    if num_experts % size:
        raise ValueError(
            f"--expert-parallel {size} does not divide the model's {num_experts} experts"
        )
    per = num_experts // size
    return rank * per, (rank + 1) * per


def check_expert_parallel(settings: Settings, config: ModelConfig, model_id: str) -> None:
    """Refuses a group the model cannot be split over, before any rank waits for others."""
    n = settings.expert_parallel
    if n == 1:
        return
    if config.moe is None:
        raise ValueError(
            f"--expert-parallel {n}: {model_id} is a dense model (no mixture-of-experts "
            "layers to split); serve it with --expert-parallel 1"
        )
    expert_range(config.moe.num_experts, 0, n)  # raises when n does not divide E
    if not 0 <= settings.rank < n:
        raise ValueError(f"--rank {settings.rank} is outside 0..{n - 1}")
    if not settings.dist_url:
        raise ValueError(f"--expert-parallel {n} needs --dist-url tcp://HOST:PORT")
