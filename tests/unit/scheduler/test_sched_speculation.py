"""Speculative decoding's pure pieces in the scheduler: the n-gram lookup, how many
drafts pay, the pauses, and the core's accounting of a row that verifies drafts (tokens
appended up to a stop, computed tokens, blocks of rejected drafts released)."""

from __future__ import annotations

import pytest

from spillway.services.scheduler.config import SchedulerConfig
from spillway.services.scheduler.core import SchedulerCore
from spillway.services.scheduler.speculation import (
    BACKOFF_TOKENS,
    DRAFT_COST,
    MISS_BACKOFF_TOKENS,
    NgramIndex,
    SpecState,
    StepCosts,
    best_num_drafts,
    expected_accepted,
    merged,
)
from spillway.shared.clock import FakeClock
from spillway.shared.protocol import RowResult, SamplingParams, StepPlan, StepResult, SubmitRequest
from tests.unit.scheduler.harness import worker_info


def test_ngram_takes_the_longest_suffix_and_its_latest_occurrence():
    index = NgramIndex(3)
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # [5, 2, 3] never occurred; [2, 3] last occurred at 5, followed by 7 8 5 ...
    assert index.propose(tokens, 3) == [7, 8, 5]
    tokens += [7]  # [2, 3, 7] occurred at 5
    assert index.propose(tokens, 2) == [8, 5]


def test_ngram_falls_back_to_shorter_matches_and_never_to_the_suffix_itself():
    index = NgramIndex(4)
    assert index.propose([1, 2, 3, 4], 3) == []
    index = NgramIndex(4, n_min=1)
    assert index.propose([5, 1, 6, 7, 1], 3) == [6, 7, 1]  # unigram 1 at 1
    assert NgramIndex(4).propose([5, 1, 6, 7, 1], 3) == []  # two tokens at least by default
    index = NgramIndex(2)
    assert index.propose([3, 3, 3], 4) == [3]  # [3, 3] at 0 is followed by one token


def test_the_number_of_drafts_follows_the_acceptance():
    assert expected_accepted(0.5, 2) == 0.75
    assert best_num_drafts(0.9, 5) == 5
    assert 0 < best_num_drafts(0.5, 5) < 5
    assert best_num_drafts(0.05, 5) == 0
    assert best_num_drafts(0.9, 5, draft_cost=2.0) == 0  # drafts that cost more than a row


def test_a_sequence_whose_drafts_fail_pauses_longer_each_time():
    state = SpecState(NgramIndex(2))
    for _ in range(10):
        state.record(3, 0, num_output_tokens=20)
        if state.paused_until:
            break
    assert state.paused_until == 20 + BACKOFF_TOKENS
    for _ in range(10):
        state.record(2, 0, num_output_tokens=40)
        if state.paused_until > 40:
            break
    assert state.paused_until == 40 + 2 * BACKOFF_TOKENS
    state.record(3, 3, num_output_tokens=60)
    assert state.backoff == BACKOFF_TOKENS  # success resets the backoff


def test_acceptance_counts_only_the_drafts_that_were_tried():
    """Verifies that accept 2 of 7 drafts tried 3 (the third failed; the 4 after it were
    never in question): a draft stands 2 times in 3 once the ones before it did, not 2 in
    7; and one that accepts all its drafts comes to 1."""
    state = SpecState(NgramIndex(2))
    for _ in range(40):
        state.record(7, 2, num_output_tokens=10)
    assert state.acceptance == pytest.approx(2 / 3, abs=1e-3)
    assert best_num_drafts(state.acceptance, 7) >= 3
    for _ in range(40):
        state.record(7, 7, num_output_tokens=10)
    assert state.acceptance == pytest.approx(1.0, abs=1e-3)
    assert best_num_drafts(state.acceptance, 7, draft_cost=0.3) == 7


def test_lookups_that_find_nothing_wait_longer_each_time():
    state = SpecState(NgramIndex(2))
    state.missed(10)
    state.missed(12)
    state.missed(16)
    assert state.paused_until == 16 + 4 * MISS_BACKOFF_TOKENS
    state.record(3, 2, num_output_tokens=30)  # drafts found again
    state.missed(40)
    assert state.paused_until == 40 + MISS_BACKOFF_TOKENS


PROMPT = [10, 11, 12, 13, 10, 11, 12, 13, 10, 11]


def _core(**fields) -> SchedulerCore:
    config = SchedulerConfig(**{"speculative": "ngram", "num_speculative_tokens": 4, **fields})
    core = SchedulerCore(FakeClock(), config)
    core.attach_worker(worker_info(num_kv_blocks=16, block_size=4))
    return core


def _submit(core: SchedulerCore, **fields) -> None:
    req = SubmitRequest(
        request_id="r", gateway_id="g", prompt_token_ids=PROMPT,
        sampling=SamplingParams(temperature=0.0), **fields,
    )  # fmt: skip
    assert core.add_request(req) is None


def _step(core: SchedulerCore, plan: StepPlan, token: int, *extra: int) -> list[int]:
    result = StepResult(
        step_id=plan.step_id,
        rows=[RowResult(seq_id="r", token_id=token, extra_token_ids=list(extra))],
    )
    return [t for d in core.update_from_output(plan, result) for t in d.token_ids]


def _after_prefill(core: SchedulerCore, **fields) -> StepPlan:
    """The plan after r's prefill (submitted with `fields`; the worker sampled 12): the
    first whose row may carry drafts."""
    _submit(core, **fields)
    plan = core.schedule()
    assert plan is not None
    _step(core, plan, 12)
    plan = core.schedule()
    assert plan is not None
    return plan


def test_a_verified_row_appends_what_stood_and_releases_rejected_blocks():
    core = _core()
    _submit(core, max_tokens=50)
    plan = core.schedule()
    assert plan is not None and plan.rows[0].num_draft_tokens == 0  # the prefill
    assert _step(core, plan, 12) == [12]
    plan = core.schedule()
    assert plan is not None
    row = plan.rows[0]
    # [13, 10, 11, 12] occurred at 3, followed by 13 10 11 12; with the prior acceptance
    # three drafts give the most tokens per unit of cost.
    assert row.token_ids == [12, 13, 10, 11] and row.num_draft_tokens == 3
    seq = core.sequence("r")
    assert seq is not None and len(seq.block_ids) == 4  # positions 10..13
    core.check_integrity()
    # Two drafts stand (13, 10), then 99 where the third was 11.
    assert _step(core, plan, 13, 10, 99) == [13, 10, 99]
    assert seq.token_ids[len(PROMPT) :] == [12, 13, 10, 99]
    assert seq.num_computed_tokens == 13  # through the accepted 10; 99 is the next row's
    assert len(seq.block_ids) == 4  # 14 tokens: the last block holds 99's slot
    assert core.spec is not None
    assert core.spec.totals.draft_tokens == 3 and core.spec.totals.accepted_tokens == 2
    assert core.spec.totals.accepted_per_position == [1, 1, 0, 0]
    core.check_integrity()


def test_rejected_drafts_blocks_go_back_and_the_worker_cuts_its_table():
    core = _core()
    plan = _after_prefill(core, max_tokens=50)
    assert plan.rows[0].num_draft_tokens == 3
    seq = core.sequence("r")
    assert seq is not None
    held = list(seq.block_ids)
    _step(core, plan, 77)  # the first draft fails: 77 comes instead of 13
    assert seq.num_computed_tokens == 11 and seq.num_tokens == 12
    assert seq.block_ids == held[:3]  # 12 tokens in 3 blocks: the 4th went back
    plan = core.schedule()
    assert plan is not None
    (update,) = plan.updated_seqs
    assert update.num_kept_blocks == 3
    core.check_integrity()


def test_drafts_stop_at_max_tokens_and_a_stop_token_inside_them_ends_the_output():
    core = _core()
    plan = _after_prefill(core, max_tokens=3)
    assert plan.rows[0].num_draft_tokens == 1  # 1 + 1 + 1 = 3 tokens
    assert _step(core, plan, 13, 55) == [13, 55]
    seq = core.sequence("r")
    assert seq is not None and seq.finish_reason == "length"

    core = _core()
    plan = _after_prefill(core, max_tokens=50, stop_token_ids=[10])
    assert plan.rows[0].num_draft_tokens == 3
    # The worker emits 13 10 11 12 (three drafts stood) but 10 is a stop token.
    assert _step(core, plan, 13, 10, 11, 12) == [13, 10]
    seq = core.sequence("r")
    assert seq is not None and seq.finish_reason == "stop"
    assert seq.num_computed_tokens <= seq.num_tokens
    core.end_tick()
    core.check_integrity()
    assert core.kv_usage == 0.0


def test_a_speculating_sequence_runs_no_row_ahead_of_its_verify():
    core = _core(run_ahead=True)
    plan = _after_prefill(core, max_tokens=50)
    assert plan.rows[0].num_draft_tokens
    assert core.can_schedule() and core.schedule() is None  # waits for the verify


def test_several_cores_speculation_adds_up():
    a, b = _core(), _core(num_speculative_tokens=2)
    assert a.spec is not None and b.spec is not None
    a.spec.totals.add(4, 2)
    b.spec.totals.add(2, 2)
    a.spec.phases.observe("spec_draft", 0.001)
    b.spec.phases.observe("spec_draft", 0.003)
    totals, phases = merged([a.spec, b.spec])
    assert (totals.draft_tokens, totals.accepted_tokens) == (6, 4)
    assert totals.accepted_per_position == [2, 2, 0, 0]
    assert sum(phases["spec_draft"].counts) == 2
    assert phases["spec_draft"].sum == 0.004


def test_the_cost_of_a_draft_is_measured_from_the_steps():
    costs = StepCosts()
    assert costs.draft_cost == DRAFT_COST  # nothing measured yet
    for _ in range(3):
        costs.observe(rows=2, drafts=0, forward_s=0.020)  # 10 ms a row
        costs.observe(rows=1, drafts=3, forward_s=0.025)  # 5 ms a draft
    assert costs.draft_cost == pytest.approx(0.5)
    assert best_num_drafts(0.7, 4, costs.draft_cost) > 0
    # Drafts that cost as much as rows never pay, whatever the acceptance.
    for _ in range(20):
        costs.observe(rows=1, drafts=3, forward_s=0.040)
    assert costs.draft_cost == pytest.approx(1.0, abs=0.05)
    assert best_num_drafts(0.7, 4, costs.draft_cost) == 0


def test_a_verify_that_gives_up_run_ahead_counts_its_wait():
    """A verifying step's result comes a forward plus the turnaround after the previous
    one; where that wait is large against a row's time, no k pays: the sequence does not
    wait to speculate, it pauses and runs ahead."""
    costs = StepCosts()
    for _ in range(3):
        costs.observe(rows=1, drafts=0, forward_s=0.010)
        costs.observe(rows=1, drafts=3, forward_s=0.013)  # 1 ms a draft: cheap
        costs.observe_wait(period_s=0.014, forward_s=0.013)  # 1 ms of turnaround
    assert costs.verify_cost == pytest.approx(0.1, abs=0.01)
    assert best_num_drafts(0.7, 4, costs.draft_cost, costs.verify_cost) > 0
    for _ in range(20):
        costs.observe_wait(period_s=0.033, forward_s=0.013)  # a busy machine: 20 ms
    assert costs.verify_cost == pytest.approx(2.0, abs=0.05)
    assert best_num_drafts(0.7, 4, costs.draft_cost, costs.verify_cost) == 0
    core = _core()
    assert core.spec is not None
    core.spec.costs = costs
    _submit(core, max_tokens=50)
    plan = core.schedule()
    assert plan is not None
    _step(core, plan, 12)
    seq = core.sequence("r")
    assert seq is not None and not core.spec.wants(seq, 1)
    assert core.spec.state("r").paused_until == seq.num_output_tokens + BACKOFF_TOKENS
    for _ in range(60):  # plain steps only: the wait fades, and a verify measures it anew
        costs.observe(rows=1, drafts=0, forward_s=0.010)
    assert best_num_drafts(0.7, 4, costs.draft_cost, costs.verify_cost) > 0


def test_drafts_shrink_to_the_blocks_that_can_be_had():
    config = SchedulerConfig(speculative="ngram", num_speculative_tokens=4)
    core = SchedulerCore(FakeClock(), config)
    core.attach_worker(worker_info(num_kv_blocks=3, block_size=4))  # 12 slots in all
    plan = _after_prefill(core, max_tokens=50)
    # 11 tokens in 3 blocks, the row's token at position 10: room for one draft only.
    assert plan.rows[0].num_draft_tokens == 1
    assert sum(core.stats.preemptions.values()) == 0
    core.check_integrity()


def test_drafts_stop_at_the_positions_a_worker_verifies_exactly():
    """A worker that computes at most 3 positions of a row as one-token steps would (its
    native few-row path) gets rows of at most 2 drafts, whatever K allows."""
    config = SchedulerConfig(speculative="ngram", num_speculative_tokens=4, spec_draft_cost=0.0)
    core = SchedulerCore(FakeClock(), config)
    info = worker_info(num_kv_blocks=16, block_size=4).model_copy(update={"max_verify_tokens": 3})
    core.attach_worker(info)
    plan = _after_prefill(core, max_tokens=50)
    assert plan.rows[0].num_draft_tokens == 2


def test_mtp_drafts_come_from_the_step_result_and_only_while_fresh():
    core = _core(speculative="mtp", num_speculative_tokens=3)
    _submit(core, max_tokens=50)
    plan = core.schedule()
    assert plan is not None
    result = StepResult(
        step_id=plan.step_id, rows=[RowResult(seq_id="r", token_id=12, drafts=[7, 8, 9, 5])]
    )
    core.update_from_output(plan, result)
    plan = core.schedule()
    assert plan is not None
    row = plan.rows[0]
    # No lookup: the worker's drafts, at most K of them, after the token they follow.
    assert row.token_ids == [12, 7, 8, 9] and row.num_draft_tokens == 3
    # One draft stands; the result offers none: the next row carries none.
    result = StepResult(
        step_id=plan.step_id, rows=[RowResult(seq_id="r", token_id=7, extra_token_ids=[30])]
    )
    core.update_from_output(plan, result)
    plan = core.schedule()
    assert plan is not None and plan.rows[0].num_draft_tokens == 0
    assert plan.rows[0].token_ids == [30]
    assert core.spec is not None and core.spec.totals.accepted_tokens == 1
    core.check_integrity()
