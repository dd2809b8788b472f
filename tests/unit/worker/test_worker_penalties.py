"""Penalties, logit_bias and min_tokens on the worker, against a reference computed here on
transformers' logits of the same model: the greedy token after each reference step must be
the runner's token."""

from __future__ import annotations

import pytest
import torch

from spillway.services.worker.runner import ModelRunner
from spillway.shared.protocol import NewSequence, SamplingParams, StepPlan, StepRow
from tests.unit.worker.tiny_llama import tiny_runner

PROMPT = [1, 17, 99, 3, 250, 41, 8, 8, 120, 77, 5, 19]
NEW_TOKENS = 14
EOS = 2


@pytest.fixture(scope="module")
def runner(tiny_llama_dir) -> ModelRunner:
    return tiny_runner(tiny_llama_dir, kv_blocks=16)


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()


def run(runner: ModelRunner, params: SamplingParams, steps: int = NEW_TOKENS) -> list[int]:
    """One sequence through the runner: the prompt in one row, then a decode row a step."""
    runner.execute(StepPlan(step_id=0, finished_seq_ids=list(runner.sequences)))
    new = NewSequence(seq_id="s", sampling=params, block_ids=[0, 1], prompt_token_ids=PROMPT)
    out: list[int] = []
    plan = StepPlan(
        step_id=1,
        new_seqs=[new],
        rows=[StepRow(seq_id="s", token_ids=PROMPT, start_pos=0, sample=True)],
    )
    for step in range(steps):
        result = runner.execute(plan)
        assert result.error is None, result.error
        out.append(result.rows[0].token_id)
        row = StepRow(
            seq_id="s",
            token_ids=[out[-1]],
            start_pos=len(PROMPT) + step,
            sample=True,
            output_index=len(out),
        )
        plan = StepPlan(step_id=step + 2, rows=[row])
    return out


def reference(hf_model, params: SamplingParams, eos_ids=(EOS,), steps: int = NEW_TOKENS):
    """Greedy decoding with the processing written out token by token (vLLM's order:
    logit_bias, repetition penalty over prompt + output, frequency and presence penalties
    over the output, the min_tokens ban)."""
    out: list[int] = []
    for _ in range(steps):
        with torch.inference_mode():
            logits = hf_model(torch.tensor([PROMPT + out])).logits[0, -1].tolist()
        for token, bias in params.logit_bias.items():
            logits[token] += bias
        for token in set(PROMPT) | set(out):
            if params.repetition_penalty != 1.0:
                x = logits[token]
                logits[token] = (
                    x / params.repetition_penalty if x > 0 else x * params.repetition_penalty
                )
        for token in set(out):
            logits[token] -= params.frequency_penalty * out.count(token)
            logits[token] -= params.presence_penalty
        if len(out) < params.min_tokens:
            for token in [*eos_ids, *params.stop_token_ids]:
                logits[token] = float("-inf")
        out.append(max(range(len(logits)), key=logits.__getitem__))
    return out


CASES = {
    "repetition": SamplingParams(temperature=0.0, repetition_penalty=1.8),
    "frequency+presence": SamplingParams(
        temperature=0.0, frequency_penalty=1.5, presence_penalty=0.8
    ),
    "logit_bias": SamplingParams(temperature=0.0, logit_bias={7: 9.0, 99: 4.0, 120: -100.0}),
    "all at once": SamplingParams(
        temperature=0.0,
        repetition_penalty=1.3,
        frequency_penalty=0.5,
        presence_penalty=-0.5,
        logit_bias={42: 3.0},
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_penalties_and_bias_match_the_reference_on_the_models_logits(runner, hf_model, name):
    params = CASES[name]
    got = run(runner, params)
    assert got == reference(hf_model, params)
    # The processing mattered: plain greedy decoding gives other tokens.
    assert got != run(runner, SamplingParams(temperature=0.0))


def test_min_tokens_bans_eos_and_stop_tokens_until_reached(runner, hf_model):
    # EOS and token 9 are made the favourites; min_tokens holds both off for 5 tokens.
    params = SamplingParams(
        temperature=0.0, logit_bias={EOS: 60.0, 9: 50.0}, min_tokens=5, stop_token_ids=[9]
    )
    got = run(runner, params, steps=6)
    assert EOS not in got[:5] and 9 not in got[:5]
    assert got[5] == EOS
    assert got == reference(hf_model, params, steps=6)


def test_penalties_apply_to_seeded_sampling_too(runner):
    base = SamplingParams(temperature=0.8, seed=11)
    penalized = base.model_copy(update={"frequency_penalty": 2.0, "presence_penalty": 2.0})
    assert run(runner, penalized) == run(runner, penalized)  # still deterministic
    free = run(runner, base)
    assert run(runner, penalized) != free
    pen = run(runner, penalized)
    assert max(pen.count(t) for t in pen) <= max(free.count(t) for t in free)
