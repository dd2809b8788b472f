"""Regions, adaptive sampling and grammars on the worker, with the scripted think model
(tests/unit/worker/think_llama.py): its greedy answer is `<think>\\n Let me see</think>
Paris is lovely.`, with the think block opened by the generation prompt."""

from __future__ import annotations

import json

import pytest

from spillway.services.gateway.structured_output import GrammarBuilder
from spillway.services.gateway.tokenizer import load_tokenizer_folder
from spillway.services.worker.loading import load_runner
from spillway.services.worker.runner import ModelRunner
from spillway.shared.config import load_settings
from spillway.shared.protocol import NewSequence, RegionSampling, SamplingParams, StepPlan, StepRow
from tests.unit.worker.think_llama import script_ids

USER = [{"role": "user", "content": "Where shall we go?"}]


@pytest.fixture(scope="module")
def runner(think_llama_dir) -> ModelRunner:
    settings = load_settings(model=str(think_llama_dir), kv_blocks=64, device="cpu")
    runner, _ = load_runner(settings)
    assert runner.sampling.engine is not None
    runner.sampling.engine.wait_ready()
    return runner


@pytest.fixture(scope="module")
def tokenizer(think_llama_dir):
    return load_tokenizer_folder(think_llama_dir)


@pytest.fixture(scope="module")
def prompt(tokenizer) -> list[int]:
    return tokenizer.encode_chat(USER)


def start(runner: ModelRunner, seqs: dict[str, tuple[SamplingParams, list[int], list[int]]]):
    """Forgets everything, then prefills each (params, prompt, output so far) sequence: its
    first row recomputes prompt + output and samples the next token. Returns the tokens."""
    runner.execute(StepPlan(step_id=0, finished_seq_ids=list(runner.sequences)))
    news, rows = [], []
    for i, (seq_id, (params, prompt, output)) in enumerate(seqs.items()):
        blocks = list(range(8 * i, 8 * i + 8))
        news.append(
            NewSequence(seq_id=seq_id, sampling=params, block_ids=blocks, output_token_ids=output)
        )
        rows.append(StepRow(seq_id=seq_id, token_ids=prompt + output, start_pos=0, sample=True,
                            output_index=len(output)))  # fmt: skip
    result = runner.execute(StepPlan(step_id=1, new_seqs=news, rows=rows))
    assert result.error is None, result.error
    return {r.seq_id: r.token_id for r in result.rows}


def decode(runner: ModelRunner, seq_id: str, context: list[int], output: list[int], steps: int):
    """Appends `steps` tokens to `output` (context = prompt + output so far), one decode step
    each; returns the region after each."""
    regions = []
    for _ in range(steps):
        row = StepRow(seq_id=seq_id, token_ids=[output[-1]], start_pos=len(context) - 1,
                      sample=True, output_index=len(output))  # fmt: skip
        result = runner.execute(StepPlan(step_id=2, rows=[row]))
        assert result.error is None, result.error
        output.append(result.rows[0].token_id)
        context.append(output[-1])
        state = runner.sampling.get(seq_id)
        assert state is not None
        regions.append(state.region)
    return regions


def test_the_region_follows_each_generated_token(runner, prompt, tokenizer):
    greedy = SamplingParams(temperature=0.0, initial_region="think")
    first = start(runner, {"a": (greedy, prompt, [])})["a"]
    output = [first]
    regions = [runner.sampling.get("a").region]
    regions += decode(runner, "a", prompt + output, output, 8)
    script = script_ids(tokenizer)
    assert output == script[1:]
    #            " Let"   " me"    " see"   "</think>" " Paris" " is"    " lovely" "."  EOS
    assert regions == ["think"] * 3 + ["plain"] * 6


def test_a_sequence_that_comes_back_rebuilds_its_region_from_its_tokens(runner, tokenizer):
    script = script_ids(tokenizer)
    think = SamplingParams(temperature=0.0, initial_region="think")
    prompt = tokenizer.encode_chat(USER)
    # Back inside the think block (two reasoning tokens out) and past it.
    start(runner, {"in": (think, prompt, script[1:3]), "out": (think, prompt, script[1:6])})
    assert runner.sampling.get("in").region == "think"
    assert runner.sampling.get("out").region == "plain"
    assert runner.sampling.get("in").output == script[1:4]  # replayed, then the new token


def test_a_token_sampled_past_what_the_scheduler_kept_is_dropped(runner, prompt, tokenizer):
    script = script_ids(tokenizer)
    think = SamplingParams(temperature=0.0, initial_region="think")
    # The state has " Let me see </think>" (4 tokens) but the scheduler kept only 3 and asks
    # for output token 3 again (a run-ahead over-run it threw away): the region is think.
    start(runner, {"a": (think, prompt, script[1:4])})
    assert runner.sampling.get("a").output == script[1:5]
    assert runner.sampling.get("a").region == "plain"
    row = StepRow(seq_id="a", token_ids=[script[3]], start_pos=len(prompt) + 2, sample=True,
                  output_index=3)  # fmt: skip
    runner.execute(StepPlan(step_id=3, rows=[row]))
    state = runner.sampling.get("a")
    assert state.output == script[1:5] and state.region == "plain"
    assert len(state.output) == 4


def test_adaptive_sampling_changes_sampling_only_inside_the_configured_region(
    runner, prompt, tokenizer
):
    script = script_ids(tokenizer)
    free = SamplingParams(temperature=1.0, seed=3, initial_region="think")
    adaptive = free.model_copy(
        update={"region_sampling": {"think": RegionSampling(temperature=0.0)}}
    )
    # Inside the think block the adaptive sequence is greedy: it follows the script, which
    # sampling at temperature 1 leaves (the script holds a few percent of the mass).
    tokens = start(runner, {"free": (free, prompt, []), "adaptive": (adaptive, prompt, [])})
    assert tokens["adaptive"] == script[1]
    assert tokens["free"] != script[1]
    # Outside it (the block closed), both sample alike from the same context and seed.
    output = script[1:5]  # " Let me see</think>"
    tokens = start(runner, {"free": (free, prompt, output), "adaptive": (adaptive, prompt, output)})
    assert runner.sampling.get("adaptive").region == "plain"
    assert tokens["adaptive"] == tokens["free"]
    # Back inside (the block still open), the adaptive one is greedy again.
    output = script[1:3]
    tokens = start(runner, {"free": (free, prompt, output), "adaptive": (adaptive, prompt, output)})
    assert tokens["adaptive"] == script[3]


SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}


def think_then_json(seed: int) -> SamplingParams:
    """Greedy in the think block (the script closes it), then JSON of SCHEMA sampled under
    the grammar the gateway makes for response_format json_schema, strict."""
    return SamplingParams(
        temperature=1.0,
        seed=seed,
        initial_region="think",
        grammar=str(GrammarBuilder().json_schema(SCHEMA, True, "schema")),
        region_sampling={"think": RegionSampling(temperature=0.0)},
    )


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_grammar_starts_after_the_think_block_and_holds(runner, prompt, tokenizer, seed):
    jsonschema = pytest.importorskip("jsonschema")
    script = script_ids(tokenizer)
    params = think_then_json(seed)
    output = [start(runner, {"a": (params, prompt, [])})["a"]]
    context = prompt + output
    for _ in range(60):
        decode(runner, "a", context, output, 1)
        if output[-1] == 2:
            break
    assert output[:4] == script[1:5]  # the reasoning, untouched by the grammar
    assert output[-1] == 2  # the grammar ended the answer
    answer = tokenizer.decode(output[4:-1])
    jsonschema.validate(json.loads(answer), SCHEMA)
