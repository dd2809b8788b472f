"""One request as the scheduler sees it: its tokens, how many of them sit in the KV cache,
its blocks, and what the worker already knows about it.

Prefill and decode are not two modes. A sequence owns `num_tokens` tokens (prompt +
generated) of which `num_computed_tokens` are in the KV cache; each step computes some of
the rest. When a step's chunk reaches the end, the worker samples one more token:

    token_ids:  [ p0 p1 p2 p3 p4 | o0 o1 ]          num_prompt_tokens = 5, num_tokens = 7
    computed:   [ xx xx xx xx xx   xx ]  .          num_computed_tokens = 6
    next row:                          [o1]          start_pos 6, samples output index 2

A chunked prefill is several rows that stop short of the end (they do not sample); a
recomputed (preempted) sequence starts again at num_computed_tokens = 0 and re-prefills
prompt + generated tokens in one or more rows, the last of which samples the next token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from shared.protocol import ErrorInfo, FinishReason, SamplingParams, SubmitRequest


class SequenceStatus(Enum):
    WAITING = "waiting"  # never admitted yet
    RUNNING = "running"  # holds blocks; gets rows
    PREEMPTED = "preempted"  # blocks freed; re-prefills when blocks free
    FINISHED = "finished"  # has its finish reason; blocks go back at retirement


@dataclass(eq=False)
class Sequence:
    request_id: str
    gateway_id: str
    token_ids: list[int]  # prompt then generated
    num_prompt_tokens: int
    sampling: SamplingParams
    max_tokens: int | None
    stop_token_ids: frozenset[int]
    ignore_eos: bool
    priority: int
    arrival_s: float
    arrival_index: int  # breaks ties between equal arrival times
    deadline_s: float | None  # absolute, on the scheduler's clock
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: ErrorInfo | None = None
    # What the worker holds: False until its NewSequence went out, and again after it was
    # told to forget the sequence (preemption); block ids [:num_blocks_sent] it has.
    known_to_worker: bool = False
    num_blocks_sent: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from a prefix cache (none yet)
    sent_first_delta: bool = False
    num_preemptions: int = 0

    @classmethod
    def from_submit(cls, req: SubmitRequest, arrival_s: float, arrival_index: int) -> Sequence:
        deadline = None if req.deadline_ms is None else arrival_s + req.deadline_ms / 1000.0
        return cls(
            request_id=req.request_id,
            gateway_id=req.gateway_id,
            token_ids=list(req.prompt_token_ids),
            num_prompt_tokens=len(req.prompt_token_ids),
            sampling=req.sampling,
            max_tokens=req.max_tokens,
            stop_token_ids=frozenset(req.stop_token_ids),
            ignore_eos=req.ignore_eos,
            priority=req.priority,
            arrival_s=arrival_s,
            arrival_index=arrival_index,
            deadline_s=deadline,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_decoding(self) -> bool:
        """Its next row is one generated token (not a prompt chunk or a recompute)."""
        return self.num_output_tokens > 0 and self.num_uncomputed_tokens == 1

    @property
    def rank(self) -> tuple[int, float, int]:
        """Scheduling order: lower runs first; the highest rank is the preemption victim."""
        return (self.priority, self.arrival_s, self.arrival_index)

    @property
    def slot(self) -> int:
        """Where its state sits on the worker: rows are sorted by it. The first KV block
        stands in until sequences get SSM state slots."""
        return self.block_ids[0] if self.block_ids else -1
