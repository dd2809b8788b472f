"""What the in-process tests of speculative decoding with a drafter share: their prompts
(repetitive ones, something to copy, and plain ones), the worker's model runner drafting
K tokens, and the scheduler's config that asks for them."""

from __future__ import annotations

from pathlib import Path

from spillway.services.scheduler.config import SchedulerConfig
from spillway.services.worker.loading import load_runner
from spillway.services.worker.runner import ModelRunner
from spillway.shared.config import load_settings
from tests.unit.worker.tiny_families import load_reference, reference_greedy

PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11, 12] * 3,
    [(7 * j) % 200 + 3 for j in range(13)],
    [40, 41, 42, 40, 41, 43],
    [(3 * j * j + 1) % 240 + 3 for j in range(19)],
]
# The hybrid models' tests: the same prompts, the third one repeating on for longer.
HYBRID_PROMPTS = [*PROMPTS[:2], [40, 41, 42, 40, 41, 43, 40, 41, 42, 40, 41], PROMPTS[3]]
K = 3


def spec_runner(model_dir: Path, speculative: str, kv_blocks: int, **settings) -> ModelRunner:
    """`model_dir`'s runner on the CPU in float32 with blocks of 4 tokens, drafting K tokens
    with `speculative`; `settings` add to those."""
    runner, _ = load_runner(
        load_settings(
            model=str(model_dir), kv_blocks=kv_blocks, device="cpu", dtype="float32",
            block_size=4, speculative=speculative, num_speculative_tokens=K, **settings,
        )
    )  # fmt: skip
    return runner


def spec_config(speculative: str, max_num_batched_tokens: int = 32) -> SchedulerConfig:
    """A batch of 4 drafting K tokens a row; the draft cost is fixed, not measured, so the
    drafts do not depend on this machine's load."""
    return SchedulerConfig(
        max_batch=4, max_num_batched_tokens=max_num_batched_tokens,
        speculative=speculative,  # type: ignore[arg-type]
        num_speculative_tokens=K, spec_draft_cost=0.1,
    )  # fmt: skip


def transformers_greedy(model_dir: Path, prompts: list[list[int]], n: int) -> dict[str, list[int]]:
    """Transformers' greedy `n` tokens after each prompt, by request id ("r<i>" for prompt
    i); every choice clear of a near tie, so that equality token for token is meaningful."""
    reference = load_reference(model_dir)
    out = {}
    for i, prompt in enumerate(prompts):
        tokens, gap = reference_greedy(reference, prompt, n)
        assert gap > 1e-3, "the tiny model's greedy choice is a near tie"
        out[f"r{i}"] = tokens
    return out
