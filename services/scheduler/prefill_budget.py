"""How many prompt tokens a step that carries decode rows may add.

A step's decode rows get their next token only when the whole step ends: a step that also
prefills 512 prompt tokens holds every running stream for the length of that prefill (on
a 2-core CPU, a few hundred milliseconds). With a step target (`itl_target_s`), a step
with decode rows takes only the prompt tokens that fit in what the target leaves beside
those rows, so that a burst of new prompts is spread over several steps instead of
stalling the streams; a step without decode rows still takes the whole token budget (no
stream waits on it, and fewer, larger steps finish the burst sooner).

The cost model is the steps' own, measured as they return: a step's forward takes about
`decode_s` for its decode rows (the latest all-decode steps, which read every weight once
whatever the batch) plus `per_token_s` for each prompt token. Until both are measured
nothing is capped. Where the decode rows alone take more than half the target (a busy
machine, a large batch), a step may still add as much prompt time as its decode rows
take: the streams' token time at most doubles, and prompts are not starved to a trickle
(measured under load: a 60 ms target against 300 ms decode steps gave 32-token chunks
and twice the TTFT). A chunk never drops below `min_chunk` tokens.
"""

from __future__ import annotations

# Weight of a new measurement in the running averages.
EWMA_WEIGHT = 0.25
# Steps with fewer prompt tokens say little about the per-token cost (the decode rows'
# share dominates them).
MIN_SAMPLE_TOKENS = 32
DEFAULT_MIN_CHUNK = 32


class PrefillBudget:
    def __init__(self, itl_target_s: float | None, min_chunk: int = DEFAULT_MIN_CHUNK) -> None:
        self.itl_target_s = itl_target_s
        self.min_chunk = min_chunk
        self.decode_s: float | None = None  # an all-decode step's forward
        self.per_token_s: float | None = None  # one prompt token's share of a forward

    def observe(self, prefill_tokens: int, decode_rows: int, forward_s: float) -> None:
        """A step's forward: `prefill_tokens` prompt tokens beside `decode_rows` rows."""
        if forward_s <= 0:
            return
        if prefill_tokens == 0:
            if decode_rows:
                self.decode_s = _mix(self.decode_s, forward_s)
            return
        if prefill_tokens < MIN_SAMPLE_TOKENS:
            return
        beside = (self.decode_s or 0.0) if decode_rows else 0.0
        per_token = max(forward_s - beside, 0.0) / prefill_tokens
        self.per_token_s = _mix(self.per_token_s, per_token)

    def tokens(self, decode_rows: int, budget: int) -> int:
        """The prompt tokens a step with `decode_rows` decode rows may take, out of the
        `budget` it has left."""
        target = self.itl_target_s
        if target is None or decode_rows == 0 or not self.per_token_s:
            return budget
        decode_s = self.decode_s or 0.0
        room = max(target - decode_s, decode_s)
        # (the small epsilon: 0.04 / 0.001 is 39.999... in floating point)
        fitting = int(room / self.per_token_s + 1e-6)
        return min(budget, max(fitting, self.min_chunk))


def _mix(old: float | None, new: float) -> float:
    return new if old is None else old + EWMA_WEIGHT * (new - old)
