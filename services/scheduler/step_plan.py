"""Turning scheduling decisions into the worker's wire form: the step plan (`build_plan`),
its rows (`make_row`) and block-table diffs (`worker_diff`); and the seed's line on a
step's batch (`batch_line`)."""

from __future__ import annotations

from collections.abc import Iterable

from spillway.services.scheduler.inflight import InflightStep, PlannedLoad, PlannedRow
from spillway.services.scheduler.kv_orders import KVOrders
from spillway.services.scheduler.kv_pool import KVPool
from spillway.services.scheduler.observer import RowKind, SchedulerObserver
from spillway.services.scheduler.sequence import Sequence, SequenceStatus
from spillway.shared.protocol import KVRestore, NewSequence, SequenceUpdate, StepPlan, StepRow

# A row planned: the sequence, its tokens this step, the drafts after its last token.
Planned = tuple[Sequence, int, list[int]]


def build_plan(
    step_id: int,
    planned: list[Planned],
    orders: KVOrders,
    pool: KVPool,
    observer: SchedulerObserver,
) -> tuple[StepPlan, InflightStep]:
    """The plan of a step, in StepPlan's order (the worker forgets and writes, learns
    its sequences, reads KV in, then runs the rows), and what the core remembers of it
    until its result. Rows go in state-slot order; each records its sequence's epoch
    and counts in its in-flight tokens, samples, rows and drafts."""
    plan = StepPlan(step_id=step_id)
    step = InflightStep(step_id)
    orders.into_plan(plan, step)
    for seq, num_tokens, drafts in sorted(planned, key=lambda p: p[0].sort_slot):
        kind: RowKind = "decode" if seq.is_decoding else "prefill"
        row = make_row(seq, num_tokens)
        pool.snapshots_for(seq, row, step)
        if drafts:
            row.token_ids = [*row.token_ids, *drafts]
            row.num_draft_tokens = len(drafts)
            seq.num_inflight_drafts += len(drafts)
        row.traceparent = observer.row_planned(seq, row, kind)
        plan.rows.append(row)
        step.rows.append(PlannedRow(seq, seq.epoch, num_tokens, row.sample, drafts))
        seq.num_inflight_tokens += num_tokens
        seq.num_inflight_samples += int(row.sample)
        seq.num_inflight_rows += 1
        diff = worker_diff(seq)
        if isinstance(diff, NewSequence):
            plan.new_seqs.append(diff)
        elif diff is not None:
            plan.updated_seqs.append(diff)
    for seq, order, tier_tokens in orders.take_loads():
        if seq.status is not SequenceStatus.RUNNING:
            continue
        if isinstance(order, KVRestore):
            plan.restores.append(order)
        else:
            plan.prefix_loads.append(order)
        step.loads.append(PlannedLoad(seq, seq.epoch, tier_tokens))
        _known_without_row(seq, plan)
    for seq, epoch, copy in orders.take_state_copies():
        if seq.status is not SequenceStatus.RUNNING or seq.epoch != epoch:
            continue
        plan.state_copies.append(copy)
        _known_without_row(seq, plan)
    return plan, step


def _known_without_row(seq: Sequence, plan: StepPlan) -> None:
    """A sequence with no row this step whose KV or state comes in: the worker needs it
    (its blocks, its slot)."""
    if not seq.known_to_worker:
        plan.new_seqs.append(worker_diff(seq))  # type: ignore[arg-type]


def make_row(seq: Sequence, num_tokens: int) -> StepRow:
    """The next `num_tokens` unscheduled tokens of `seq`. Only a chunk that reaches the end
    of the sequence samples, and then it produces the next output token.

        token_ids: [ ...scheduled... | chunk (num_tokens) | rest ]
                                     ^ start_pos            ^ num_planned_tokens

    When the chunk is the token a step in flight is sampling, the worker feeds it itself
    (`feed_last`): the scheduler does not know it yet.
    """
    start = seq.num_scheduled_tokens
    end = start + num_tokens
    sample = end == seq.num_planned_tokens
    feed_last = start >= seq.num_tokens
    assert not feed_last or num_tokens == 1, "only one unknown token can be fed"
    return StepRow(
        seq_id=seq.request_id,
        token_ids=[] if feed_last else seq.token_ids[start:end],
        start_pos=start,
        sample=sample,
        output_index=end - seq.num_prompt_tokens if sample else 0,
        feed_last=feed_last,
    )


def worker_diff(seq: Sequence) -> NewSequence | SequenceUpdate | None:
    """What the worker must learn about `seq` before this step, and records it as sent:
    the whole sequence on its first appearance, later only the appended block ids."""
    if not seq.known_to_worker:
        seq.known_to_worker = True
        seq.num_blocks_sent = len(seq.block_ids)
        return NewSequence(
            seq_id=seq.request_id,
            sampling=seq.sampling,
            block_ids=list(seq.block_ids),
            prompt_token_ids=seq.token_ids[: seq.num_prompt_tokens]
            if seq.sampling.repetition_penalty != 1.0
            else None,
            output_token_ids=seq.output_token_ids,
            state_slot=seq.state_slot,
        )
    if len(seq.block_ids) > seq.num_blocks_sent or seq.blocks_cut:
        new_block_ids = seq.block_ids[seq.num_blocks_sent :]
        kept = seq.num_blocks_sent if seq.blocks_cut else None
        seq.num_blocks_sent = len(seq.block_ids)
        seq.blocks_cut = False
        return SequenceUpdate(
            seq_id=seq.request_id, new_block_ids=new_block_ids, num_kept_blocks=kept
        )
    return None


def batch_line(running: Iterable[Sequence]) -> str:
    """The seed's per-step line: one entry per running sequence in slot order."""
    rows = sorted(running, key=lambda s: s.sort_slot)
    parts = [
        f"[{i}: slot={s.state_slot} seq_len={s.num_tokens} "
        f"bt={s.block_ids[0] if s.block_ids else -1}/{len(s.block_ids)} "
        f"last={s.token_ids[-1] if s.token_ids else -1} out_n={s.num_output_tokens}]"
        for i, s in enumerate(rows)
    ]
    return f"n={len(rows)}: {' '.join(parts)}"
