"""Every message between services: typed pydantic models and their one codec.

Subjects live in `shared.subjects`; trace context rides in NATS headers. A message that
serves many requests (a step plan) carries its own context there, and the parts that act
for one request carry that request's in the body (`traceparent` of rows, spills and
restores).
Running sequences travel to the worker as diffs (`SequenceUpdate`), not as full state.
"""

from __future__ import annotations

from typing import Literal, TypeVar, get_args

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


# A request a draining scheduler gives back before it produced anything (an error delta
# with this code): the gateway submits it again to another scheduler.
HANDED_BACK_CODE = "handed_back"
# A step the worker could not run for lack of device memory (an error StepResult): the
# scheduler sheds one victim and retries the rest.
OUT_OF_MEMORY_CODE = "out_of_memory"


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
    # A resumed request (its first scheduler died, or the bus lost its news): the tokens
    # it already generated and the client already has. They follow the prompt in the KV
    # but count as output, as after a preemption: max_tokens, min_tokens and penalties
    # count them, the seeded sampler draws the next token at output index
    # len(output_token_ids), and only tokens after them are sent as deltas.
    output_token_ids: list[int] = Field(default_factory=list)


class SubmitReply(Message):
    ok: bool = True
    error: ErrorInfo | None = None
    # The scheduler that took the request: the gateway watches its lease and expects the
    # request's deltas from it alone.
    scheduler_id: str = ""


class AbortRequest(Message):
    """sched.abort (publish), and the body of the public llm.abort (one id)."""

    request_ids: list[str]


class RequestDelta(Message):
    """One request's news from one tick."""

    request_id: str
    token_ids: list[int] = Field(default_factory=list)
    # Output tokens the request had before this delta's first one (resumed tokens
    # included): news lost on the bus shows at the gateway as a gap, a repeat as an
    # overlap. None from a sender that does not count.
    first_token: int | None = None
    logprobs: list[SampledLogprobs] | None = None
    finish_reason: FinishReason | None = None
    error: ErrorInfo | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # The request's scheduler span (W3C traceparent) when tracing: a batch of several
    # requests' news has no one context for its headers, so each delta carries its own.
    traceparent: str | None = None


class DeltaBatch(Message):
    """gateway.<id>.deltas: every request of that gateway that changed this tick."""

    deltas: list[RequestDelta]


class StatsRequest(Message):
    pass


class PhaseHistogram(Message):
    """One tick phase's durations: counts per bucket (upper bounds in seconds, the last
    is +Inf), their sum and count, as Prometheus histograms hold them."""

    bounds: list[float]
    counts: list[int]  # not cumulative; len(bounds) + 1 (the last counts > bounds[-1])
    sum: float = 0.0


class WorkerLoad(Message):
    """One worker a scheduler drives, in its stats: where its sequences and hits are."""

    worker_id: str
    num_running: int = 0
    num_waiting: int = 0
    num_live: int = 0  # sequences placed there and not finished, in any state
    kv_usage: float = 0.0
    num_kv_blocks: int = 0
    prefix_cache_hit_tokens: int = 0
    migrations: int = 0  # requests moved onto it from a lost worker
    num_steps: int = 0
    draining: bool = False
    # A MoE worker: routed (token, expert) pairs per expert so far; with expert parallel,
    # the bytes its rank 0 sent in the experts' exchange and the exchange's time per step.
    expert_tokens: list[int] = Field(default_factory=list)
    ep_exchange_bytes: int = 0
    ep_exchange_seconds: PhaseHistogram | None = None


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
    # Preemptions by what was done: "spill" (the store took the KV) or "recompute" (a
    # spill the store refused counts here, and in spill_failures too).
    preemptions: dict[str, int] = Field(default_factory=dict)
    spill_failures: int = 0
    swap_ins: int = 0  # spilled requests brought back to run
    # Requests carried over (recomputed or swapped in) to a worker that replaced a lost one.
    migrations: int = 0
    prefix_cache_hit_tokens: int = 0
    prefix_cache_query_tokens: int = 0
    num_steps: int = 0
    # Rolling medians over recent steps, in seconds (absent before the first step): the
    # scheduler's bookkeeping per step (schedule + update + end of tick), the bus round
    # trip less the worker's forward time, and the worker's forward time.
    step_bookkeeping_s: float | None = None
    step_bus_s: float | None = None
    step_forward_s: float | None = None
    # Median time between back-to-back step results that the worker spent not computing.
    step_overhead_s: float | None = None
    # Medians of the worker's own phases: building the step's index tensors (before the
    # forward, part of step_overhead_s) and sampling (the end of step_forward_s).
    step_prepare_s: float | None = None
    step_sample_s: float | None = None
    # Of all steps' time so far, the share the workers spent on spill-store I/O.
    step_kv_io_share: float | None = None
    num_cached_blocks: int = 0  # blocks kept by the prefix cache, evictable
    preemption_mode: str = "auto"
    run_ahead: bool = False
    # The end-of-tick phases (and schedule / update), timed in the scheduler process.
    phases: dict[str, PhaseHistogram] = Field(default_factory=dict)
    # Speculative decoding: drafts proposed and accepted, and accepted per draft position.
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = Field(default_factory=list)
    # Its phases timed: spec_draft (lookups, here), spec_verify and spec_accept (worker).
    spec_phases: dict[str, PhaseHistogram] = Field(default_factory=dict)
    # The spill store's last answer (None: none yet, or it does not answer).
    spill_store: SpillStats | None = None
    scheduler_id: str = ""
    worker_id: str | None = None  # the first worker it drives (num_workers counts registrations)
    workers: list[WorkerLoad] = Field(default_factory=list)  # every worker it drives


class SchedulerLease(Message):
    """sched.heartbeat, every lease interval: a scheduler is alive, what it drives and how
    busy it is. Gateways route by it and end the requests of a scheduler whose lease
    lapsed; workers pick the scheduler they register with by it."""

    scheduler_id: str
    interval_s: float
    # Random per scheduler process: a new boot id under a known scheduler id (one given a
    # fixed id, restarted) is a scheduler that knows none of the old one's requests.
    boot_id: str = ""
    worker_id: str | None = None  # the worker it drives
    worker_ids: list[str] = Field(default_factory=list)  # every worker registered with it
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    draining: bool = False  # stopping: it takes no new requests
    # Spilling, in one word (services/scheduler/preemption.spill_status), why when it is
    # not "ok" (words, never payload), and the mode.
    spill_status: str = ""
    spill_reason: str = ""
    preemption_mode: str = ""
    # The spills its sequences hold (shared/spill_keys.spill_name), so that the spill store
    # forgets one whose drop never came (lost in a NATS restart); None: not listed (too
    # many to list).
    spills: list[str] | None = None


# --- tick reports (sched.<id>.tick) ----------------------------------------------------

TickPhaseName = Literal[
    "deadline_sweep", "drain", "store_finished", "retire", "swap_in", "resume", "admit", "step"
]
# A tick's phases in the order every report lists them: the end-of-tick phases of the
# seeds' loop, then admission (the next step's planning) and the step itself.
TICK_PHASES: tuple[TickPhaseName, ...] = get_args(TickPhaseName)


class RetiredRequest(Message):
    request_id: str
    finish_reason: FinishReason


class PreemptedRequest(Message):
    request_id: str
    mode: Literal["recompute", "spill"]
    # KV bytes it held: written to the spill store (spill) or dropped to be recomputed.
    bytes: int = 0


class SwappedInRequest(Message):
    request_id: str
    bytes: int = 0  # read back from the spill store (blocks still cached are not read)


class AdmittedRequest(Message):
    request_id: str
    cached_tokens: int = 0  # prompt tokens found in the prefix cache or the shared tier


class TickPhase(Message):
    """What one phase of one tick did, and how long it took. Lists name requests by id
    only: no prompt or output text ever leaves in a report."""

    name: TickPhaseName
    seconds: float = 0.0
    swept: list[str] = Field(default_factory=list)  # deadline_sweep: timed out
    retired: list[RetiredRequest] = Field(default_factory=list)  # retire
    swapped_in: list[SwappedInRequest] = Field(default_factory=list)  # swap_in
    resumed: list[str] = Field(default_factory=list)  # resume: recomputed from tokens
    admitted: list[AdmittedRequest] = Field(default_factory=list)  # admit
    # admit (to make room for the step's rows), step (a worker out of memory)
    preempted: list[PreemptedRequest] = Field(default_factory=list)
    rows: int = 0  # step: rows applied
    tokens: int = 0  # step: tokens computed (prefill and decode)
    sampled: int = 0  # step: tokens generated


class TickReport(Message):
    """sched.<scheduler-id>.tick: one per tick of one worker's lane (`spillway top`)."""

    scheduler: str
    worker: str
    tick: int  # counts this lane's ticks from 1
    time: float  # Unix time the tick ended
    phases: list[TickPhase]  # every phase of TICK_PHASES, in that order
    running: int = 0
    waiting: int = 0  # waiting for admission, and preempted ones waiting to recompute
    swapped: int = 0
    kv_cache_usage: float = 0.0  # fraction of the worker's KV blocks in use


class GatewayBeat(Message):
    """gateway.heartbeat, every GATEWAY_BEAT_INTERVAL_S: a gateway is alive. A scheduler
    suspects a gateway it has heard and then not for GATEWAY_TIMEOUT_S, and aborts its
    requests once it stays silent past the grace (SPILLWAY_GATEWAY_GRACE_S: its process
    died, nobody is left to read their output)."""

    gateway_id: str
    interval_s: float


GATEWAY_BEAT_INTERVAL_S = 0.25
GATEWAY_TIMEOUT_S = 1.0


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
    # What one block's bytes mean (model, dtype, geometry): spilled or shared blocks are
    # only ever read back by a worker with the same layout.
    kv_layout: str = ""
    block_bytes: int = 0  # one block across all layers, K and V (and a drafter's, spilled with it)
    # Whether the worker reached the spill store's Redis at start (it retries later).
    kv_store: bool = False
    # Random per worker process: a registration with a new boot id is a restarted worker
    # (empty KV cache) even when its worker id is the same.
    boot_id: str = ""
    # A hybrid model's state pool: slots (one per running sequence) and the float32 bytes
    # of one slot across the recurrent layers; 0 for a model without recurrent layers.
    num_state_slots: int = Field(default=0, ge=0)
    state_slot_bytes: int = Field(default=0, ge=0)
    # Snapshots of states at block boundaries (a hybrid model's prefix caching); 0: none.
    num_state_snapshots: int = Field(default=0, ge=0)
    # Positions (a token and its drafts) one verifying row may compute exactly as one-token
    # steps would, the weights read once; 0: no bound. The scheduler drafts no more.
    max_verify_tokens: int = Field(default=0, ge=0)


class RegisterReply(Message):
    ok: bool = True
    scheduler_id: str = ""  # the scheduler the worker now belongs to


class Heartbeat(Message):
    info: WorkerInfo
    num_steps: int = 0
    scheduler_id: str = ""  # the scheduler the worker belongs to ("" while it has none)
    # SIGTERM: the worker stops once its sequences are done (or after drain_timeout_s).
    draining: bool = False


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
    # A hybrid model's state slot for it (held while it holds blocks).
    state_slot: int | None = None


class SequenceUpdate(Message):
    """Blocks appended to a running sequence's block table since the last step."""

    seq_id: str
    new_block_ids: list[int]
    # Speculative decoding: the table is first cut to its first this many blocks (the
    # scheduler freed the blocks that held only rejected drafts), then extended.
    num_kept_blocks: int | None = Field(default=None, ge=0)


class StateSnapshot(Message):
    """Copy the row's sequence's state, once its first `num_tokens` tokens of this row
    ran, into snapshot `snapshot` (a hybrid model's prefix caching)."""

    num_tokens: int = Field(ge=1)
    snapshot: int = Field(ge=0)


class StateCopy(Message):
    """Before the rows: snapshot `snapshot` into the sequence's state slot; its state
    then stands at `num_tokens` tokens (a prefix hit of a hybrid model)."""

    seq_id: str
    snapshot: int = Field(ge=0)
    num_tokens: int = Field(ge=1)


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
    # Run-ahead: the row's one token is the one the worker sampled last for this sequence
    # (in the step before, whose result the scheduler has not seen); token_ids is empty.
    feed_last: bool = False
    # Hybrid models: snapshots of the state taken at block boundaries inside this row.
    state_snapshots: list[StateSnapshot] = Field(default_factory=list)
    # Speculative decoding: the last num_draft_tokens of token_ids are drafts. The row
    # samples at each of its last num_draft_tokens + 1 positions (output indices
    # output_index, output_index + 1, ...) and keeps drafts while the samples confirm them.
    num_draft_tokens: int = Field(default=0, ge=0)
    # W3C traceparent of the scheduler's span for this row, when traces are exported:
    # the worker's span for the row becomes its child.
    traceparent: str | None = None


class KVSpill(Message):
    """Copy a victim's blocks to the spill store (keys `spill:seq:<seq_id>:<spill_id>:*`)
    before anything else in the step may overwrite them."""

    seq_id: str
    spill_id: int
    block_ids: list[int]
    # A hybrid model: the recurrent state in this slot goes too, and must stand at
    # `state_tokens` tokens (the spill fails otherwise: it would not match the blocks).
    state_slot: int | None = None
    state_tokens: int = 0

    # W3C traceparent of the scheduler's span for this order, when traces are exported:
    # the worker's span for its I/O becomes its child (a step serves many requests).
    traceparent: str | None = None


class KVRestore(Message):
    """Read a spilled sequence's blocks back, in order, into `block_ids`, starting at
    block `first_block` of the spill (the leading blocks the scheduler's prefix cache
    still held are not read back)."""

    seq_id: str
    spill_id: int
    block_ids: list[int]
    first_block: int = Field(default=0, ge=0)
    # A hybrid model: the spilled recurrent state goes into this slot; it then stands at
    # `state_tokens` tokens.
    state_slot: int | None = None
    state_tokens: int = 0

    # W3C traceparent of the scheduler's span for this order, when traces are exported:
    # the worker's span for its I/O becomes its child (a step serves many requests).
    traceparent: str | None = None


class PrefixBlock(Message):
    """A full block and its chained hash (hex): the shared prefix tier's key."""

    block_id: int
    block_hash: str
    # A hybrid model: the state snapshot after this block, stored beside it.
    snapshot: int | None = None


class PrefixLoad(Message):
    """Fill a new sequence's leading blocks from the shared prefix tier."""

    seq_id: str
    blocks: list[PrefixBlock]
    # A hybrid model: the state stored after the last block goes into this slot; it then
    # stands at `state_tokens` tokens.
    state_slot: int | None = None
    state_tokens: int = 0


class StepPlan(Message):
    """worker.<id>.step (request/reply -> StepResult). Applied in field order: KV leaves
    first (spills, prefix stores: their blocks may be reused by this very step), then the
    sequence table, then KV comes in (restores, prefix loads), then the rows run."""

    step_id: int
    spills: list[KVSpill] = Field(default_factory=list)
    prefix_stores: list[PrefixBlock] = Field(default_factory=list)
    finished_seq_ids: list[str] = Field(default_factory=list)
    new_seqs: list[NewSequence] = Field(default_factory=list)
    updated_seqs: list[SequenceUpdate] = Field(default_factory=list)
    restores: list[KVRestore] = Field(default_factory=list)
    prefix_loads: list[PrefixLoad] = Field(default_factory=list)
    state_copies: list[StateCopy] = Field(default_factory=list)
    rows: list[StepRow] = Field(default_factory=list)


class RowResult(Message):
    seq_id: str
    token_id: int
    logprobs: SampledLogprobs | None = None
    # A row with drafts: the tokens it emits after token_id (the drafts confirmed after
    # the first, then the one sampled where the drafts stop), with their logprobs. The
    # first len(extra_token_ids) drafts were accepted.
    extra_token_ids: list[int] = Field(default_factory=list)
    extra_logprobs: list[SampledLogprobs] | None = None
    # Drafts the worker's own drafter (an MTP layer) proposes after the row's last emitted
    # token: the scheduler may put them after that token in the sequence's next row.
    drafts: list[int] = Field(default_factory=list)


class SpillOutcome(Message):
    seq_id: str
    spill_id: int
    ok: bool
    num_bytes: int = 0
    num_keys: int = 0
    error: str | None = None


class StepResult(Message):
    step_id: int
    rows: list[RowResult] = Field(default_factory=list)  # one per sampling row, plan order
    forward_s: float = 0.0  # time in the model's forward and sampling
    # The worker's phases, when it reports them: building the step's index tensors, and
    # the sampling part of forward_s (on CUDA the forward's tail, which sampling waits
    # for, counts as sampling).
    prepare_s: float | None = None
    sample_s: float | None = None
    # A step with drafts: the time spent deciding which drafts stand (part of sample_s).
    accept_s: float | None = None
    error: ErrorInfo | None = None
    spills: list[SpillOutcome] = Field(default_factory=list)
    # Sequences whose restore or prefix load failed (data gone, store down): their rows
    # did not run, and their blocks hold nothing usable.
    lost_seq_ids: list[str] = Field(default_factory=list)
    # Time and bytes of the step's KV traffic with the spill store (both directions).
    kv_io_s: float = 0.0
    kv_io_bytes: int = 0
    restored_bytes: int = 0
    restore_s: float = 0.0
    # A MoE model's step: routed (token, expert) pairs per expert, summed over the MoE
    # layers (empty for a dense model); with expert parallel, the bytes rank 0 sent to the
    # other ranks in the experts' exchange and the time it spent in it.
    expert_tokens: list[int] = Field(default_factory=list)
    ep_exchange_bytes: int = 0
    ep_exchange_s: float = 0.0


# --- spill store ----------------------------------------------------------------------


class SpillStats(Message):
    """spill.stats reply: the spill store's accounting."""

    redis_ok: bool  # Redis answers
    # It took the spill store's last probe write (a Redis at its maxmemory answers, and
    # refuses every write); when not, redis_error says why (kind and text, no payload).
    writable: bool = True
    redis_error: str = ""
    num_sequences: int = 0  # spilled sequences held
    num_keys: int = 0
    used_bytes: int = 0  # spilled KV held
    capacity_bytes: int = 0
    # Per spilled sequence: "<seq_id>:<spill_id>" -> bytes.
    sequences: dict[str, int] = Field(default_factory=dict)
    spilled_total: int = 0  # sequences recorded since start
    dropped_total: int = 0  # deleted on resume, finish or abort
    expired_total: int = 0  # deleted because the worker that wrote them died
    prefix_blocks: int = 0  # blocks in the shared prefix tier
    prefix_bytes: int = 0
    prefix_capacity_blocks: int = 0
    prefix_evicted_total: int = 0


class SpillRecord(Message):
    """spill.recorded (publish, worker -> spill store): a spill's keys are written."""

    seq_id: str
    spill_id: int
    worker_id: str
    num_bytes: int
    num_keys: int
    # The scheduler that ordered the spill and its process: the store expires the spills
    # of a scheduler that died (its requests resume elsewhere and never read them).
    scheduler_id: str = ""
    boot_id: str = ""


class SpillRef(Message):
    seq_id: str
    spill_id: int


class SpillDrop(Message):
    """spill.drop (publish, scheduler -> spill store): these spills are not needed any
    more (resumed, finished, aborted, or their sequence is recomputed)."""

    spills: list[SpillRef]


class PrefixLookup(Message):
    """spill.prefix_lookup (request/reply -> PrefixLookupReply): how many of these
    chained block hashes (hex, in order) the shared prefix tier holds, from the first."""

    block_hashes: list[str]
    request_id: str | None = None  # the request it is asked for (its trace's spans say so)


class PrefixLookupReply(Message):
    num_hits: int
