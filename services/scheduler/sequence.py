"""One request as the scheduler sees it: its tokens, how many of them sit in the KV cache,
its blocks, and what the worker already knows about it.

Prefill and decode are not two modes. A sequence owns `num_tokens` tokens (prompt +
generated) of which `num_computed_tokens` are in the KV cache; each step computes some of
the rest. When a step's chunk reaches the end, the worker samples one more token:

    token_ids:  [ p0 p1 p2 p3 p4 | o0 o1 ]          num_prompt_tokens = 5, num_tokens = 7
    computed:   [ xx xx xx xx xx   xx ]  .          num_computed_tokens = 6
    next row:                          [o1]          start_pos 6, samples output index 2

A chunked prefill is several rows that stop short of the end (they do not sample); a
recomputed (preempted) sequence starts again at num_computed_tokens = 0 (or at its first
uncached block) and re-prefills prompt + generated tokens; a swapped-in one continues at
the tokens its spilled blocks held. A prefix-cache hit starts a new sequence past the
cached blocks.

Steps that run ahead: while a step is in flight, the sequence's tokens in it are
`num_inflight_tokens` (computed once its result is applied), and a sampling row in it
means one more token is coming (`num_inflight_samples`). The next row then starts at
`num_scheduled_tokens` and, when it is that coming token, the worker feeds the sequence's
own last sampled token (`StepRow.feed_last`):

    token_ids:  [ p0 p1 p2 | o0 ]  ?                 o1 is being sampled by step N
    computed:   [ xx xx xx ]                         step N computes o0 (in flight)
    step N+1:                     [o1]               start_pos 4, feed_last
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from spillway.shared.protocol import ErrorInfo, FinishReason, SamplingParams, SubmitRequest


class SequenceStatus(Enum):
    WAITING = "waiting"  # never admitted yet
    RUNNING = "running"  # holds blocks; gets rows
    PREEMPTED = "preempted"  # blocks freed; re-prefills when blocks free
    SWAPPED = "swapped"  # blocks copied to the spill store and freed; swapped in later
    FINISHED = "finished"  # has its finish reason; blocks go back at retirement


@dataclass
class SpilledKV:
    """Where a swapped sequence's KV lies: `num_blocks` blocks holding its first
    `num_tokens` tokens under spill id `spill_id`; `confirmed` once the worker reported
    the write (only then may it be swapped in)."""

    spill_id: int
    num_blocks: int
    num_tokens: int
    confirmed: bool = False


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
    # Prompt tokens served from the prefix cache or the shared tier at first admission.
    num_cached_tokens: int = 0
    sent_first_delta: bool = False
    num_preemptions: int = 0
    preemptions_by_mode: dict[str, int] = field(default_factory=dict)
    # Chained hashes of its full blocks (`prefix_hash.extend_hashes`), grown lazily.
    block_hashes: list[int] = field(default_factory=list)
    num_committed_blocks: int = 0  # its leading blocks registered in the prefix cache
    # Hashes the shared prefix tier held, past the local cache, when the request arrived.
    tier_hashes: list[int] = field(default_factory=list)
    # The state slot: a small integer held while the sequence holds blocks (a hybrid
    # worker keeps its recurrent state there; `state_slots`). Rows are sorted by it.
    state_slot: int | None = None
    # Bumped whenever rows already sent stop counting (preempted, spilled, finished,
    # resynced): a row planned under another epoch is void when its result comes.
    epoch: int = 0
    num_inflight_tokens: int = 0
    num_inflight_samples: int = 0
    num_inflight_rows: int = 0
    # Drafts in a row in flight (speculative decoding): its next row waits for the result.
    num_inflight_drafts: int = 0
    # Blocks that held only rejected drafts were freed: the worker's table is cut to
    # num_blocks_sent blocks with the next update.
    blocks_cut: bool = False
    spilled: SpilledKV | None = None
    # A restore or prefix load is ordered for its blocks and not yet known to have worked.
    kv_pending: bool = False
    num_spills: int = 0  # spill ids are (request id, this counter)

    @classmethod
    def from_submit(cls, req: SubmitRequest, arrival_s: float, arrival_index: int) -> Sequence:
        deadline = None if req.deadline_ms is None else arrival_s + req.deadline_ms / 1000.0
        return cls(
            request_id=req.request_id,
            gateway_id=req.gateway_id,
            token_ids=[*req.prompt_token_ids, *req.output_token_ids],
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
    def num_scheduled_tokens(self) -> int:
        """Tokens computed or on their way to be (in a step in flight)."""
        return self.num_computed_tokens + self.num_inflight_tokens

    @property
    def num_planned_tokens(self) -> int:
        """Tokens known, or coming from a sampling row in flight."""
        return len(self.token_ids) + self.num_inflight_samples

    @property
    def num_unscheduled_tokens(self) -> int:
        return self.num_planned_tokens - self.num_scheduled_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_decoding(self) -> bool:
        """Its next row is one generated token (not a prompt chunk or a recompute)."""
        return self.num_output_tokens > 0 and self.num_unscheduled_tokens == 1

    @property
    def rank(self) -> tuple[int, float, int]:
        """Scheduling order: lower runs first; the highest rank is the preemption victim."""
        return (self.priority, self.arrival_s, self.arrival_index)

    @property
    def sort_slot(self) -> int:
        """Rows are sorted by it (the seed's key), so state in contiguous slots runs
        together."""
        return self.state_slot if self.state_slot is not None else -1

    def bump_epoch(self) -> None:
        """Rows already sent stop counting: none of them is in flight for it any more."""
        self.epoch += 1
        self.num_inflight_tokens = 0
        self.num_inflight_samples = 0
        self.num_inflight_rows = 0
        self.num_inflight_drafts = 0

    def count_preemption(self, mode: str) -> None:
        self.num_preemptions += 1
        self.preemptions_by_mode[mode] = self.preemptions_by_mode.get(mode, 0) + 1
