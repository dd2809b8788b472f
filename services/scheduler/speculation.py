"""Speculative decoding, the scheduler's part: n-gram drafts, how many a row gets, and
what was accepted.

A decoding sequence's row normally carries its last token and samples the next. With
drafts it carries the last token plus k guessed continuations; the worker samples at each
of the k + 1 positions (the same seeded draws it would make one step at a time) and keeps
drafts while its samples confirm them, so a row emits 1..k+1 tokens and the output is the
one plain decoding gives, token for token.

    token_ids:  [ ... p q r | s ]                  s: the last token (not computed yet)
    row:                    [ s d1 d2 d3 ]          drafts d1..d3 looked up, see below
    worker samples:            t1 t2 t3 t4          t_j drawn after s d1 .. d_{j-1}
    emits t1 = d1, t2 = d2, t3 != d3: [d1 d2 t3]   KV of s d1 d2 is kept, d3's is not

N-gram drafts (prompt lookup): the longest suffix of the sequence (up to ngram_max tokens,
then shorter, down to NGRAM_MIN) that occurred before, and the tokens that followed its
latest occurrence. A single repeated token predicts little in text with nothing to copy
(its drafts mostly fail there and cost the step their time), hence the floor of two.
An index of every n-gram's latest start, grown as tokens arrive, makes it O(ngram_max)
per lookup.

MTP drafts (`--speculative mtp`) and a draft model's (`--speculative draft`) come
from the worker instead: each sampled row's result
carries the drafts its model's multi-token-prediction layer proposes after the row's last
token (`offered`), and the sequence's next row takes them while the sequence still ends
with that token (stale ones are dropped: they are only guesses, never needed).

Speculation that does not pay stops. A sequence waits for each step's result before it
looks up drafts (no row runs ahead of a lookup), so one whose lookups find nothing runs
ahead for 2 tokens, then 4, ... before it looks again. Each keeps a running estimate of
the chance a draft stands once the drafts before it stood (`SpecState.acceptance`); the
number of drafts k is the one that maximises the expected tokens per unit of step cost
(`best_num_drafts`, a draft's cost measured by `StepCosts`), so a sequence copying long
runs drafts up to the cap and one whose drafts mostly fail drafts few; one whose drafts
keep failing (or for which no k pays) stops speculating for 8 tokens, then 16, ... With
many rows a step is compute-bound: above `spec_max_batch` running sequences nobody
speculates.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from spillway.services.scheduler.config import SchedulerConfig
from spillway.services.scheduler.kv_pool import KVPool
from spillway.services.scheduler.phase_stats import PhaseStats
from spillway.services.scheduler.sequence import Sequence
from spillway.shared.clock import Clock
from spillway.shared.protocol import PhaseHistogram, RowResult, SampledLogprobs, StepResult

# A draft token's cost relative to a plain decode row's, in a step's time, until measured:
# small while a step is bound by reading the weights (a small batch on a GPU), close to 1
# where it is bound by arithmetic (a busy CPU). Measured from the steps themselves (see
# StepCosts) once a few of each kind ran.
DRAFT_COST = 0.1
COST_WEIGHT = 0.2  # weight of the newest step in the running step costs
MIN_COST_SAMPLES = 3
# Each plain decode step shrinks the measured verify wait by this factor: where it stopped
# all speculation no verify measures it again, and the machine may have quietened; a
# wait of 2 rows decays below one in some 35 steps, and the next verify measures anew.
WAIT_DECAY = 0.98
# Prior per-draft acceptance of a sequence that has not verified anything yet.
PRIOR_ACCEPTANCE = 0.6
EWMA_WEIGHT = 0.3  # weight of the newest verify in the running acceptance
# Below this many accepted tokens expected per draft token, a sequence stops speculating.
MIN_ACCEPTANCE = 0.15
BACKOFF_TOKENS = 8  # first pause, in generated tokens; doubles up to MAX_BACKOFF_TOKENS
MAX_BACKOFF_TOKENS = 256
# After a lookup that found nothing, the sequence runs ahead for this many tokens before
# it looks again (it waits for a step's result to look): doubling while lookups miss.
MISS_BACKOFF_TOKENS = 2
MAX_MISS_BACKOFF_TOKENS = 64


NGRAM_MIN = 2


class NgramIndex:
    """Latest start of every n-gram (n <= n_max) of a token list that is followed by
    another token; grown incrementally as the list grows (it never shrinks)."""

    def __init__(self, n_max: int, n_min: int = NGRAM_MIN) -> None:
        self.n_max = n_max
        self.n_min = min(n_min, n_max)
        self._latest: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # tokens seen

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest
        matching suffix; [] when no suffix occurred before."""
        self._extend(token_ids)
        for n in range(min(self.n_max, len(token_ids) - 1), self.n_min - 1, -1):
            start = self._latest.get(tuple(token_ids[-n:]))
            if start is not None:
                return token_ids[start + n : start + n + k]
        return []

    def _extend(self, token_ids: list[int]) -> None:
        # Token j makes every n-gram ending just before it a followed one.
        for j in range(max(self._indexed, 1), len(token_ids)):
            for n in range(self.n_min, min(self.n_max, j) + 1):
                self._latest[tuple(token_ids[j - n : j])] = j - n
        self._indexed = len(token_ids)


def expected_accepted(alpha: float, k: int) -> float:
    """Drafts accepted on average out of k when each stands with probability alpha once
    the ones before it stood: alpha + alpha^2 + ... + alpha^k."""
    return sum(alpha**i for i in range(1, k + 1))


def best_num_drafts(
    alpha: float, k_max: int, draft_cost: float = DRAFT_COST, verify_cost: float = 0.0
) -> int:
    """The k in 0..k_max with the most tokens per unit of step cost: (1 + E[accepted]) /
    (1 + verify_cost + draft_cost * k), where verify_cost is what a verifying step costs
    beyond its rows (the run-ahead it gives up); 0 (a plain row) when no k beats it."""
    best, best_rate = 0, 1.0
    for k in range(1, k_max + 1):
        rate = (1.0 + expected_accepted(alpha, k)) / (1.0 + verify_cost + draft_cost * k)
        if rate > best_rate + 1e-9:
            best, best_rate = k, rate
    return best


@dataclass
class StepCosts:
    """What a draft costs, measured: the running mean of a plain decode step's forward
    time per row, and of a verifying step's extra time per draft beyond that; and what
    a verifying step costs beyond its forward: the wait between the previous result and
    its own that is not its forward (a speculating sequence runs no row ahead of its
    verify, so the step's turnaround through scheduler, bus and worker is not hidden
    behind another step's forward as a run-ahead row's is). On a quiet machine that
    wait is a few ms against a forward of 10 or more; on a busy one, whose scheduler and
    bus wait for a core, it was measured at a third of a step and more, and then
    speculation that would pay by its forward times does not."""

    per_row_s: float = 0.0
    per_draft_s: float = 0.0
    plain_steps: int = 0
    verify_steps: int = 0
    wait_s: float = 0.0
    waits: int = 0

    def observe(self, rows: int, drafts: int, forward_s: float) -> None:
        """A decode step of `rows` rows (none a prefill chunk) carrying `drafts` drafts."""
        if rows <= 0 or forward_s <= 0:
            return
        if not drafts:
            self.plain_steps += 1
            w = 1.0 if self.plain_steps == 1 else COST_WEIGHT
            self.per_row_s += w * (forward_s / rows - self.per_row_s)
            self.wait_s *= WAIT_DECAY
        elif self.plain_steps:
            extra = max(0.0, forward_s - self.per_row_s * rows) / drafts
            self.verify_steps += 1
            w = 1.0 if self.verify_steps == 1 else COST_WEIGHT
            self.per_draft_s += w * (extra - self.per_draft_s)

    def observe_wait(self, period_s: float, forward_s: float) -> None:
        """A verifying step whose result came period_s after the previous result."""
        self.waits += 1
        w = 1.0 if self.waits == 1 else COST_WEIGHT
        self.wait_s += w * (max(0.0, period_s - forward_s) - self.wait_s)

    @property
    def draft_cost(self) -> float:
        """A draft's cost relative to a row's (DRAFT_COST until both kinds were seen)."""
        if min(self.plain_steps, self.verify_steps) < MIN_COST_SAMPLES or self.per_row_s <= 0:
            return DRAFT_COST
        return self.per_draft_s / self.per_row_s

    @property
    def verify_cost(self) -> float:
        """A verifying step's wait relative to a row's time (0 until measured)."""
        if min(self.plain_steps, self.waits) < MIN_COST_SAMPLES or self.per_row_s <= 0:
            return 0.0
        return self.wait_s / self.per_row_s


@dataclass
class SpecState:
    """One sequence's speculation: its n-gram index and how its drafts fare.

    A verify of k drafts that accepts a < k of them saw a + 1 drafts tried in turn (the
    ones after the first failure were never in question), a of them standing; one that
    accepts all k saw k tried, all standing. The chance a draft stands once the ones
    before it did is estimated as the running sums' ratio, stood / tried: accepted /
    drafted would mistake the drafts after a failure for failures, and understate it the
    more, the larger k (at a true 0.9, k = 7 drafts show 0.60), shrinking k for the
    sequences that copy best."""

    index: NgramIndex
    acceptance: float = PRIOR_ACCEPTANCE  # stood / tried: see above
    stood: float = PRIOR_ACCEPTANCE  # running sums (weights EWMA_WEIGHT) of one verify's
    tried: float = 1.0  # drafts that stood and drafts that were tried
    paused_until: int = 0  # output tokens: no drafts before this many are out
    backoff: int = BACKOFF_TOKENS
    miss_backoff: int = MISS_BACKOFF_TOKENS
    # The worker's drafts (MTP), for the sequence once it holds offered_at tokens.
    offered: list[int] = field(default_factory=list)
    offered_at: int = -1

    def missed(self, num_output_tokens: int) -> None:
        """A lookup found nothing: no waiting to look again for a while."""
        self.paused_until = num_output_tokens + self.miss_backoff
        self.miss_backoff = min(2 * self.miss_backoff, MAX_MISS_BACKOFF_TOKENS)

    def record(
        self, num_drafts: int, num_accepted: int, num_output_tokens: int, pause: bool = False
    ) -> None:
        """A verifying row's outcome (num_drafts == 0: no k paid; with `pause`, the
        sequence stops speculating for its backoff at once)."""
        self.miss_backoff = MISS_BACKOFF_TOKENS
        if pause:
            self.paused_until = num_output_tokens + self.backoff
            self.backoff = min(2 * self.backoff, MAX_BACKOFF_TOKENS)
            return
        # no k paid: counted as one draft tried that failed
        tried = num_accepted + (1 if num_accepted < num_drafts or not num_drafts else 0)
        self.stood += EWMA_WEIGHT * (num_accepted - self.stood)
        self.tried += EWMA_WEIGHT * (tried - self.tried)
        self.acceptance = self.stood / self.tried
        if self.acceptance < MIN_ACCEPTANCE:
            self.paused_until = num_output_tokens + self.backoff
            self.backoff = min(2 * self.backoff, MAX_BACKOFF_TOKENS)
            # a fresh start after the pause
            self.acceptance, self.stood, self.tried = PRIOR_ACCEPTANCE, PRIOR_ACCEPTANCE, 1.0
        elif num_accepted:
            self.backoff = BACKOFF_TOKENS


@dataclass
class SpecTotals:
    """What every sequence's drafts came to (the CONTRACT's counters)."""

    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def add(self, num_drafts: int, num_accepted: int) -> None:
        self.draft_tokens += num_drafts
        self.accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_drafts:
            self.accepted_per_position.extend([0] * (num_drafts - len(self.accepted_per_position)))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1


class Speculation:
    """The core's speculation: n-gram drafts per sequence, the pauses, the totals, and
    the phases timed (draft: the lookups, here; verify and accept: the worker's)."""

    def __init__(self, config: SchedulerConfig, clock: Clock) -> None:
        self.num_tokens = config.num_speculative_tokens
        self.ngram_max = config.ngram_max
        # Drafts from the worker (its MTP layer or draft model, after each sampled row)
        # instead of lookups.
        self.from_worker = config.speculative in ("mtp", "draft")
        self.max_batch = config.spec_max_batch
        self.clock = clock
        self.totals = SpecTotals(accepted_per_position=[0] * self.num_tokens)
        self.phases = PhaseStats()  # spec_draft, spec_verify, spec_accept
        self.costs = StepCosts()
        self.fixed_cost = config.spec_draft_cost
        self._states: dict[str, SpecState] = {}
        self._last_result_at: float | None = None  # when the previous step's result came

    @classmethod
    def for_config(cls, config: SchedulerConfig, clock: Clock) -> Speculation | None:
        return cls(config, clock) if config.speculative != "none" else None

    def state(self, request_id: str) -> SpecState:
        state = self._states.get(request_id)
        if state is None:
            state = SpecState(NgramIndex(self.ngram_max))
            self._states[request_id] = state
        return state

    def wants(self, seq: Sequence, num_running: int) -> bool:
        """Whether the sequence would verify drafts now (then it runs no row ahead: its
        next row's start depends on how many drafts stand)."""
        if num_running > self.max_batch:
            return False
        state = self.state(seq.request_id)
        if seq.num_output_tokens < state.paused_until:
            return False
        if self._num_drafts(state) <= 0:  # no k pays: a pause, and run-ahead meanwhile
            state.record(0, 0, seq.num_output_tokens, pause=True)
            return False
        return True

    def _num_drafts(self, state: SpecState) -> int:
        if self.fixed_cost is not None:  # pinned: nothing measured counts
            return best_num_drafts(state.acceptance, self.num_tokens, self.fixed_cost)
        costs = self.costs
        return best_num_drafts(
            state.acceptance, self.num_tokens, costs.draft_cost, costs.verify_cost
        )

    def plan_drafts(self, seq: Sequence, budget: int, num_running: int, pool: KVPool) -> list[int]:
        """Drafts after a decoding sequence's row, when it speculates: no more than the
        step's token budget, max_tokens and the context leave, and no more than the
        blocks it holds or can get without preempting anyone (drafts never cost a
        sequence its place): the blocks it gets for them are added to its table."""
        info, blocks = pool.attached()
        if seq.num_inflight_samples or not seq.is_decoding:
            return []
        if not self.wants(seq, num_running):
            return []
        room = min(budget, info.max_model_len - seq.num_tokens - 1)
        if info.max_verify_tokens:  # more would not verify at one row's rounding
            room = min(room, info.max_verify_tokens - 1)
        if seq.max_tokens is not None:
            room = min(room, seq.max_tokens - seq.num_output_tokens - 1)
        drafts = self.propose(seq, room)
        if not drafts:
            return []
        end = seq.num_scheduled_tokens + 1  # the row's last token, drafts after it
        held = len(seq.block_ids) * blocks.block_size
        if end + len(drafts) > held:
            more = blocks.append_slots(seq.block_ids, end + len(drafts))
            if more is None:
                drafts = drafts[: held - end]
            else:
                seq.block_ids.extend(more)
        return drafts

    def propose(self, seq: Sequence, room: int) -> list[int]:
        """Drafts for a decoding sequence whose last token is known: at most `room` (what
        max_tokens, the context and the step's budget leave). A lookup that finds nothing
        pauses the sequence's lookups (2 tokens, doubling while they miss): one with
        nothing to copy rarely gives up running ahead."""
        if room <= 0:
            return []
        start = self.clock.now()
        state = self.state(seq.request_id)
        k = min(self._num_drafts(state), room)
        if k <= 0:
            state.record(0, 0, seq.num_output_tokens)
            drafts = []
        elif self.from_worker:
            # Offered for the sequence as it stands, or stale (a row ran since): none.
            ok = state.offered_at == len(seq.token_ids)
            drafts = state.offered[:k] if ok else []
        else:
            drafts = state.index.propose(seq.token_ids, k)
            if not drafts:
                state.missed(seq.num_output_tokens)
        self.phases.observe("spec_draft", self.clock.now() - start)
        return drafts

    def offered(self, seq: Sequence, drafts: list[int]) -> None:
        """The worker's drafts to follow the sequence's tokens as they now stand."""
        state = self.state(seq.request_id)
        state.offered, state.offered_at = list(drafts), len(seq.token_ids)

    def verified(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        self.totals.add(num_drafts, num_accepted)
        self.state(seq.request_id).record(num_drafts, num_accepted, seq.num_output_tokens)

    def step_timed(self, rows: int, drafts: int, decode_only: bool, result: StepResult) -> None:
        """A step's forward time (for the costs when it decoded only); with drafts, its
        verify and acceptance times."""
        now = self.clock.now()
        period = None if self._last_result_at is None else now - self._last_result_at
        self._last_result_at = now
        if decode_only:
            self.costs.observe(rows, drafts, result.forward_s)
        if not drafts:
            return
        if decode_only and period is not None:
            self.costs.observe_wait(period, result.forward_s)
        accept_s = result.accept_s or 0.0
        self.phases.observe("spec_verify", max(0.0, result.forward_s - accept_s))
        if result.accept_s is not None:
            self.phases.observe("spec_accept", accept_s)

    def forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)


def verified_tokens(out: RowResult, drafts: list[int]) -> list[RowResult] | None:
    """The tokens a verifying row emits, one result each, in order: the drafts it
    accepted, then the token sampled after the last of them; None when it accepted
    drafts it was not given."""
    emitted = [out.token_id, *out.extra_token_ids]
    extra: list[SampledLogprobs | None] = [None] * len(out.extra_token_ids)
    if out.extra_logprobs is not None:
        extra = list(out.extra_logprobs)
    num_accepted = len(emitted) - 1
    if emitted[:num_accepted] != drafts[:num_accepted] or num_accepted > len(drafts):
        return None
    return [
        RowResult(seq_id=out.seq_id, token_id=token_id, logprobs=logprobs)
        for token_id, logprobs in zip(emitted, [out.logprobs, *extra], strict=True)
    ]


def merged(specs: list[Speculation]) -> tuple[SpecTotals, dict[str, PhaseHistogram]]:
    """Several cores' speculation as one scheduler's: totals summed, histograms merged."""
    totals = SpecTotals()
    phases: dict[str, PhaseHistogram] = {}
    for spec in specs:
        totals.draft_tokens += spec.totals.draft_tokens
        totals.accepted_tokens += spec.totals.accepted_tokens
        per_position = spec.totals.accepted_per_position
        if len(totals.accepted_per_position) < len(per_position):
            totals.accepted_per_position.extend(
                [0] * (len(per_position) - len(totals.accepted_per_position))
            )
        for i, n in enumerate(per_position):
            totals.accepted_per_position[i] += n
        for name, h in spec.phases.snapshot().items():
            into = phases.get(name)
            if into is None:
                phases[name] = h
            else:
                into.counts = [a + b for a, b in zip(into.counts, h.counts, strict=True)]
                into.sum += h.sum
    return totals, phases
