"""The worker's side of speculative decoding: which drafts stand, and rows that verify
drafts emitting exactly what one-token steps emit, with a grammar (drafts it refuses are
cut before the forward, the draft positions masked from the state the drafts before them
lead to), a think block that ends inside the drafts, and seeded sampling."""

from __future__ import annotations

import pytest

from spillway.services.worker.runner import ModelRunner
from spillway.services.worker.speculative import accepted_length, extra_logprobs, verify_drafts
from spillway.shared.protocol import (
    SampledLogprobs,
    SamplingParams,
    StepPlan,
    StepRow,
)
from tests.unit.worker.test_worker_regions import (  # noqa: F401 (fixtures)
    prompt,
    runner,
    start,
    think_then_json,
    tokenizer,
)


def test_drafts_stand_while_the_samples_confirm_them():
    assert accepted_length([5, 6, 7], [5, 6, 9, 1]) == 2
    assert accepted_length([5, 6, 7], [5, 6, 7, 1]) == 3
    assert accepted_length([5], [4, 5]) == 0
    assert accepted_length([], [4]) == 0
    lp = [SampledLogprobs(token_id=t, logprob=-float(t)) for t in (1, 2, 3, 4, 5, 6)]
    # Two rows: one with 3 drafts (1 stands), one plain.
    out = verify_drafts([[1, 7, 8], []], [1, 2, 3, 4, 5], lp[:5])
    assert [tokens for tokens, _ in out] == [[1, 2], [5]]
    assert [t.token_id for t in out[0][1] if t is not None] == [1, 2]
    assert extra_logprobs(out[0][1]) == [lp[1]]
    assert extra_logprobs(out[1][1]) is None


def _run(
    runner: ModelRunner,  # noqa: F811
    params: SamplingParams,
    prompt_ids,
    drafts_for,
) -> list[int]:
    """Generates to EOS (or 60 tokens); each step's row carries drafts_for(output)."""
    output = [start(runner, {"a": (params, prompt_ids, [])})["a"]]
    context = prompt_ids + output
    for step in range(60):
        if output[-1] == 2:
            break
        drafts = drafts_for(output)
        row = StepRow(
            seq_id="a",
            token_ids=[output[-1], *drafts],
            start_pos=len(context) - 1,
            sample=True,
            output_index=len(output),
            num_draft_tokens=len(drafts),
        )
        result = runner.execute(StepPlan(step_id=10 + step, rows=[row]))
        assert result.error is None, result.error
        (out,) = result.rows
        emitted = [out.token_id, *out.extra_token_ids]
        assert len(emitted) <= len(drafts) + 1
        assert emitted[:-1] == drafts[: len(emitted) - 1]
        if 2 in emitted:  # EOS ends it (the scheduler drops what follows)
            emitted = emitted[: emitted.index(2) + 1]
        output += emitted
        context += emitted
    return output


@pytest.mark.parametrize("seed", [1, 2])
def test_rows_with_drafts_emit_what_one_token_steps_emit_under_a_grammar(
    runner,  # noqa: F811
    prompt,  # noqa: F811
    seed,
):
    params = think_then_json(seed)
    want = _run(runner, params, prompt, lambda output: [])
    assert want[-1] == 2

    def oracle(output: list[int]) -> list[int]:
        """The right next tokens, but every other step a wrong one (the grammar, or the
        sample, refuses it) after the first."""
        nxt = want[len(output) : len(output) + 3]
        if len(output) % 2 and len(nxt) == 3:
            nxt[1] = 5
        return nxt

    got = _run(runner, params, prompt, oracle)
    assert got == want
