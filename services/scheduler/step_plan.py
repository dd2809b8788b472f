"""Turning scheduling decisions into the worker's wire form: rows and block-table diffs."""

from __future__ import annotations

from spillway.services.scheduler.sequence import Sequence
from spillway.shared.protocol import NewSequence, SequenceUpdate, StepRow


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
