"""Every message between services: typed pydantic models and their one codec.

Subjects live in `shared.subjects`; trace context rides in NATS headers, never in bodies.
Running sequences travel to the worker as diffs (`SequenceUpdate`), not as full state.
"""

from __future__ import annotations

from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

FinishReason = Literal["stop", "length", "timeout", "abort", "error"]
# Where a sequence is in its output (shared.regions tracks it token by token).
RegionName = Literal["plain", "think", "code", "tool_call"]


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")


M = TypeVar("M", bound=BaseModel)


def encode(msg: BaseModel) -> bytes:
    return msg.model_dump_json(exclude_none=True).encode()


def decode(model: type[M], data: bytes) -> M:
    """Raises pydantic.ValidationError on a malformed body."""
    return model.model_validate_json(data)


class ErrorInfo(Message):
    """An error that travels between services; the gateway turns it into an OpenAI body."""

    status: int = 500
    message: str
    type: str = "server_error"
    param: str | None = None
    code: str | None = None


class ErrorReply(Message):
    """The reply to a request/reply message that could not be served."""

    error: ErrorInfo


# --- sampling -------------------------------------------------------------------------


class RegionSampling(Message):
    """Adaptive sampling: settings that replace the request's own inside one region."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None


class SamplingParams(Message):
    """Carried to the worker once per sequence. temperature == 0 means greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    # Always set by the gateway (a random one when the user gave none) so a preempted and
    # recomputed sequence samples the same tokens again.
    seed: int = 0
    # None: no logprobs; k >= 0: the chosen token's logprob plus the top k.
    logprobs: int | None = None
    # Penalties as vLLM applies them: repetition over prompt + output tokens, frequency
    # and presence over output tokens; logit_bias adds to a token's raw logit.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = Field(default_factory=dict)
    # Until min_tokens tokens are out, the worker masks EOS and these ids (the request's
    # stop token ids; the scheduler stops on SubmitRequest's copy).
    min_tokens: int = 0
    stop_token_ids: list[int] = Field(default_factory=list)
    # Adaptive sampling: inside a region named here, its settings replace the ones above.
    region_sampling: dict[RegionName, RegionSampling] = Field(default_factory=dict)
    # The region the output starts in (a generation prompt may open a think block).
    initial_region: RegionName = "plain"
    # A grammar (xgrammar EBNF) the output must follow, from its first token, or from the
    # end of the think block when the output starts inside one.
    grammar: str | None = None


class TokenLogprob(Message):
    token_id: int
    logprob: float


class SampledLogprobs(Message):
    """The chosen token's logprob and the top alternatives, from the unprocessed logits."""

    token_id: int
    logprob: float
    top: list[TokenLogprob] = Field(default_factory=list)


# --- gateway <-> scheduler -------------------------------------------------------------


class SubmitRequest(Message):
    """sched.submit (request/reply -> SubmitReply)."""

    request_id: str
    gateway_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    max_tokens: int | None = None  # None: up to the context length
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    priority: int = 0
    # Budget left when the gateway sent it; the scheduler anchors it to its own clock.
    deadline_ms: float | None = None


class SubmitReply(Message):
    ok: bool = True
    error: ErrorInfo | None = None


class AbortRequest(Message):
    """sched.abort (publish), and the body of the public llm.abort (one id)."""

    request_ids: list[str]


class RequestDelta(Message):
    """One request's news from one tick."""

    request_id: str
    token_ids: list[int] = Field(default_factory=list)
    logprobs: list[SampledLogprobs] | None = None
    finish_reason: FinishReason | None = None
    error: ErrorInfo | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0


class DeltaBatch(Message):
    """gateway.<id>.deltas: every request of that gateway that changed this tick."""

    deltas: list[RequestDelta]


class StatsRequest(Message):
    pass


class SchedulerStats(Message):
    """sched.stats reply: health and the gauges / counters the gateway exports."""

    num_workers: int
    num_running: int
    num_waiting: int
    num_swapped: int = 0
    num_preempted: int = 0
    kv_usage: float = 0.0
    num_kv_blocks: int = 0
    max_model_len: int = 0
    preemptions: dict[str, int] = Field(default_factory=dict)
    prefix_cache_hit_tokens: int = 0
    prefix_cache_query_tokens: int = 0
    num_steps: int = 0
    # Rolling medians over recent steps, in seconds (absent before the first step): the
    # scheduler's bookkeeping per step (schedule + update + end of tick), the bus round
    # trip less the worker's forward time, and the worker's forward time.
    step_bookkeeping_s: float | None = None
    step_bus_s: float | None = None
    step_forward_s: float | None = None


# --- scheduler <-> worker --------------------------------------------------------------


class WorkerInfo(Message):
    """worker.register (request/reply -> RegisterReply), repeated in every heartbeat."""

    worker_id: str
    model_id: str
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    device: str
    dtype: str


class RegisterReply(Message):
    ok: bool = True


class Heartbeat(Message):
    info: WorkerInfo
    num_steps: int = 0


class NewSequence(Message):
    """A sequence the worker has not seen (or must forget and take afresh)."""

    seq_id: str
    sampling: SamplingParams
    block_ids: list[int]
    # The prompt, sent only when sampling needs it (repetition_penalty counts its tokens).
    prompt_token_ids: list[int] | None = None
    # Tokens the sequence generated so far (non-empty when it comes back after a
    # preemption or spill): per-sequence sampling state is rebuilt from them.
    output_token_ids: list[int] = Field(default_factory=list)


class SequenceUpdate(Message):
    """Blocks appended to a running sequence's block table since the last step."""

    seq_id: str
    new_block_ids: list[int]


class StepRow(Message):
    """One row of a step: tokens to run through the model for one sequence.

    token_ids[0] sits at position start_pos (== the sequence's computed tokens so far).
    A row samples when its chunk reaches the end of the sequence; output_index is then
    the index of the token it will produce among the generated ones (seeds the sampler).
    """

    seq_id: str
    token_ids: list[int]
    start_pos: int
    sample: bool
    output_index: int = 0
    # W3C traceparent of the scheduler's span for this row, when traces are exported:
    # the worker's span for the row becomes its child.
    traceparent: str | None = None


class StepPlan(Message):
    """worker.<id>.step (request/reply -> StepResult). Applied in field order."""

    step_id: int
    finished_seq_ids: list[str] = Field(default_factory=list)
    new_seqs: list[NewSequence] = Field(default_factory=list)
    updated_seqs: list[SequenceUpdate] = Field(default_factory=list)
    rows: list[StepRow] = Field(default_factory=list)


class RowResult(Message):
    seq_id: str
    token_id: int
    logprobs: SampledLogprobs | None = None


class StepResult(Message):
    step_id: int
    rows: list[RowResult] = Field(default_factory=list)  # one per sampling row, plan order
    forward_s: float = 0.0  # time in the model's forward and sampling
    error: ErrorInfo | None = None


# --- spill store ----------------------------------------------------------------------


class SpillStats(Message):
    """spill.stats reply."""

    redis_ok: bool
    num_keys: int = 0
    used_bytes: int = 0
    capacity_bytes: int = 0
