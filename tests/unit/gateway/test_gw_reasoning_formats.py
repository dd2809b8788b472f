"""Every reasoning format (deepseek_r1, qwen3, granite) with the real chat templates: the
region the generation prompt leaves the output in (enable_thinking / thinking passed
through chat_template_kwargs), the split of reasoning from content however the text is
cut, and the reasoning tokens counted by region."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from spillway.services.gateway.choice_output import ChoiceOutput, OutputOptions
from spillway.services.gateway.reasoning import ReasoningText
from spillway.services.gateway.structured_output import GrammarBuilder
from spillway.services.gateway.tokenizer import ModelTokenizer
from spillway.services.gateway.tool_formats import tool_format
from spillway.services.gateway.validation import ModelInfo, RequestPreparer
from spillway.shared.output_formats import (
    GRANITE_RESPONSE,
    GRANITE_THINK,
    detect_reasoning,
    reasoning_syntax,
)
from spillway.shared.protocol import RequestDelta
from spillway.shared.regions import detect_markers

TEMPLATES = Path(__file__).parents[2] / "fixtures" / "chat_templates"
ASK = [{"role": "user", "content": "Why is the sky blue?"}]


def split(syntax, text: str, cuts: list[int], inside: bool = False) -> tuple[str, str]:
    reader = ReasoningText(syntax.starts, syntax.ends, inside=inside, anywhere=syntax.anywhere)
    reasoning = content = ""
    at = 0
    for cut in [*cuts, len(text)]:
        r, c = reader.feed(text[at:cut])
        reasoning, content, at = reasoning + r, content + c, cut
    r, c = reader.finish()
    return reasoning + r, content + c


SPLITS = [
    # (parser, output starts inside a block, text, reasoning, content)
    ("qwen3", False, "<think>\nShort.\n</think>\n\nBlue light scatters.", "\nShort.\n",
     "\n\nBlue light scatters."),
    ("qwen3", False, "No thinking today.", "", "No thinking today."),
    ("qwen3", True, "Rayleigh.</think>Scattering.", "Rayleigh.", "Scattering."),
    ("deepseek_r1", True, "<think>\nRayleigh.\n</think>\n\nScattering.", "\nRayleigh.\n",
     "\n\nScattering."),
    ("deepseek_r1", True, "Thinking that never ends", "Thinking that never ends", ""),
    ("granite", False, "Here is my thought process:\nshort waves\nHere is my response:\nBlue.",
     "\nshort waves\n", "\nBlue."),
    ("granite", False, "Here's my thought process: x Here's my response: y", " x ", " y"),
    # Granite's block opens only before any content.
    ("granite", False, "Well. Here is my thought process: x", "",
     "Well. Here is my thought process: x"),
    ("granite", False, "Here is", "", "Here is"),
]  # fmt: skip


@pytest.mark.parametrize(("parser", "inside", "text", "reasoning", "content"), SPLITS)
def test_reasoning_splits_the_same_in_any_pieces(parser, inside, text, reasoning, content):
    syntax = reasoning_syntax(parser)
    assert split(syntax, text, [], inside) == (reasoning, content)
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), k=rng.randint(1, len(text) - 1)))
        assert split(syntax, text, cuts, inside) == (reasoning, content)


@pytest.fixture(scope="module")
def grammars():
    return GrammarBuilder()


def preparer_for(tokenizer: ModelTokenizer, name: str, grammars, reasoning_parser=None):
    source = (TEMPLATES / name).read_text()
    tok = ModelTokenizer(tokenizer.tokenizer, tokenizer.special_tokens, source)
    token_id = tok.tokenizer.token_to_id
    info = ModelInfo(
        "m",
        8192,
        tok.vocab_size,
        markers=detect_markers(token_id, source, reasoning_parser=reasoning_parser),
        tool_format=tool_format(None, source),
        reasoning=detect_reasoning(token_id, source, reasoning_parser),
    )
    return tok, RequestPreparer(tok, info, lambda: 1, grammars=grammars)


REGIONS = [
    # (template, chat_template_kwargs, region the output starts in, prompt ends with)
    ("Qwen-Qwen3-0.6B.jinja", None, "plain", "<|im_start|>assistant\n"),
    ("Qwen-Qwen3-0.6B.jinja", {"enable_thinking": False}, "plain", "<think>\n\n</think>\n\n"),
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", None, "think", "<think>\n"),
    ("deepseek-ai-DeepSeek-V3.1.jinja", None, "plain", "<｜Assistant｜></think>"),
    ("deepseek-ai-DeepSeek-V3.1.jinja", {"thinking": True}, "think", "<｜Assistant｜><think>"),
]


@pytest.mark.parametrize(("name", "kwargs", "region", "ending"), REGIONS)
def test_the_generation_prompt_decides_where_the_output_starts(
    tokenizer, grammars, name, kwargs, region, ending
):
    tok, preparer = preparer_for(tokenizer, name, grammars)
    body = {"messages": ASK, **({"chat_template_kwargs": kwargs} if kwargs else {})}
    prepared = preparer.prepare("chat", body)
    assert prepared.split_reasoning
    assert prepared.sampling.initial_region == region
    assert tok.decode(prepared.prompts[0], skip_special_tokens=False).endswith(ending)


def test_deepseek_r1_reasons_from_the_start_unless_the_prompt_closed_the_block(tokenizer, grammars):
    # R1 does not write the opening tag: with --reasoning-parser deepseek_r1 the output
    # is reasoning up to `</think>`, even where the generation prompt opened no block.
    tok, preparer = preparer_for(tokenizer, "Qwen-Qwen3-0.6B.jinja", grammars, "deepseek_r1")
    prepared = preparer.prepare("chat", {"messages": ASK})
    assert prepared.sampling.initial_region == "think"
    ids = tok.encode("Rayleigh scattering.</think>It is blue.", add_special_tokens=False)
    output = run(tok, prepared.sampling.initial_region, preparer.model.markers, ids)
    assert (output.reasoning, output.text) == ("Rayleigh scattering.", "It is blue.")
    closed = {"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}}
    assert preparer.prepare("chat", closed).sampling.initial_region == "plain"


def run(tok, region, markers, ids, anywhere=True, per_delta=3) -> ChoiceOutput:
    options = OutputOptions(reasoning=markers, initial_region=region, reasoning_anywhere=anywhere)
    output = ChoiceOutput(0, tok, options)
    for i in range(0, len(ids), per_delta):
        last = i + per_delta >= len(ids)
        output.apply(
            RequestDelta(
                request_id="r",
                token_ids=ids[i : i + per_delta],
                finish_reason="stop" if last else None,
            )
        )
    return output


@pytest.mark.parametrize("per_delta", [1, 4, 100])
def test_granite_reasoning_spans_tokens_and_counts_them(tokenizer, per_delta):
    markers = detect_markers(tokenizer.tokenizer.token_to_id, None, reasoning_parser="granite")
    assert markers.think_start.texts == GRANITE_THINK
    assert markers.think_end.texts == GRANITE_RESPONSE
    text = "Here is my thought process: light scatters. Here's my response: Blue."
    ids = tokenizer.encode(text, add_special_tokens=False)
    output = run(tokenizer, "plain", markers, ids, anywhere=False, per_delta=per_delta)
    assert (output.reasoning, output.text) == (" light scatters. ", " Blue.")

    def completes(marker: str) -> int:
        return next(i for i in range(len(ids)) if marker in tokenizer.decode(ids[: i + 1], False))

    # From the token that completes the start marker to the one that completes the end.
    opened, closed = completes(GRANITE_THINK[0]), completes(GRANITE_RESPONSE[1])
    assert output.num_reasoning_tokens == closed - opened + 1
