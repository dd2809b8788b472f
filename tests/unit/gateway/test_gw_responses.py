"""Choice outputs from scheduler deltas, and the OpenAI bodies and chunks built from them."""

from __future__ import annotations

import json

from spillway.services.gateway.choice_output import ChoiceOutput, OutputOptions
from spillway.services.gateway.responses import (
    ChunkBuilder,
    ResponseMeta,
    Usage,
    completion_body,
    models_body,
    usage_of,
)
from spillway.shared.protocol import ErrorInfo, RequestDelta, SampledLogprobs, TokenLogprob


def deltas_for(ids: list[int], per_delta: int = 1, finish: str = "length") -> list[RequestDelta]:
    out = [
        RequestDelta(request_id="r", token_ids=ids[i : i + per_delta])
        for i in range(0, len(ids), per_delta)
    ]
    out[-1] = out[-1].model_copy(update={"finish_reason": finish})
    return out


def run_choice(tokenizer, ids, options=None, per_delta=1, finish="length"):
    output = ChoiceOutput(0, tokenizer, options or OutputOptions())
    steps = [output.apply(d) for d in deltas_for(ids, per_delta, finish)]
    return output, steps


def test_text_and_token_count_follow_the_deltas(tokenizer):
    ids = tokenizer.encode("Hello there, 世界 🎉!")
    output, steps = run_choice(tokenizer, ids, per_delta=2)
    assert output.text == "Hello there, 世界 🎉!" == "".join(s.text for s in steps)
    assert output.num_tokens == len(ids)
    assert output.finish_reason == "length"
    assert [s.finish_reason for s in steps[:-1]] == [None] * (len(steps) - 1)


def test_eos_token_counts_but_adds_no_text(tokenizer):
    ids = [*tokenizer.encode("Done."), 2]
    output, _ = run_choice(tokenizer, ids, finish="stop")
    assert (output.text, output.num_tokens, output.finish_reason) == ("Done.", len(ids), "stop")


def test_stop_string_across_tokens_ends_the_choice_and_asks_for_an_abort(tokenizer):
    ids = tokenizer.encode("one, two, three, four")
    options = OutputOptions(stop=["three"])
    output = ChoiceOutput(0, tokenizer, options)
    steps = []
    for d in deltas_for(ids, finish="length"):
        steps.append(output.apply(d))
        if steps[-1].finished:
            break
    assert output.text == "one, two, "
    assert steps[-1].finish_reason == "stop" and steps[-1].stop_matched
    # Tokens up to the one that completed the stop string are counted, none after.
    matched_at = next(i for i in range(len(ids)) if "three" in tokenizer.decode(ids[: i + 1]))
    assert output.num_tokens == matched_at + 1
    assert output.apply(RequestDelta(request_id="r", finish_reason="abort")).text == ""
    assert output.finish_reason == "stop"


def test_held_back_stop_prefix_is_released_at_the_end(tokenizer):
    ids = tokenizer.encode("the end is nea")
    output, steps = run_choice(tokenizer, ids, OutputOptions(stop=["near"]))
    assert output.text == "the end is nea"
    assert output.finish_reason == "length"
    assert not any(s.stop_matched for s in steps)


def test_end_releases_held_text_with_the_given_reason(tokenizer):
    output = ChoiceOutput(0, tokenizer, OutputOptions(stop=["xyz"]))
    output.apply(RequestDelta(request_id="r", token_ids=tokenizer.encode("abc x")))
    step = output.end("timeout")
    assert output.text == "abc x" and step.finish_reason == "timeout"
    assert output.end("abort").finish_reason is None  # already finished: no change


def test_error_delta_finishes_with_the_error(tokenizer):
    output = ChoiceOutput(0, tokenizer, OutputOptions())
    info = ErrorInfo(status=503, message="worker lost")
    step = output.apply(RequestDelta(request_id="r", finish_reason="error", error=info))
    assert step.error == info and step.finished and output.finished


def test_never_more_tokens_than_max_tokens_whatever_the_scheduler_sends(tokenizer):
    """Two schedulers running one request sent each token twice: the gateway keeps what
    was asked for, ends with "length", and asks for an abort."""
    ids = tokenizer.encode("one two three four")
    output = ChoiceOutput(0, tokenizer, OutputOptions(max_tokens=3))
    doubled = [t for t in ids for _ in range(2)]
    step = output.apply(RequestDelta(request_id="r", token_ids=doubled))
    assert output.num_tokens == 3 and step.finish_reason == "length" and step.stop_matched
    assert output.text == tokenizer.decode(doubled[:3])


def test_fail_ends_an_unfinished_choice_with_the_gateways_error(tokenizer):
    output = ChoiceOutput(0, tokenizer, OutputOptions())
    output.apply(RequestDelta(request_id="r", token_ids=tokenizer.encode("Hi")))
    info = ErrorInfo(status=503, message="scheduler lost", code="scheduler_lost")
    assert output.fail(info).error == info and output.finished
    assert output.fail(ErrorInfo(message="again")).error is None  # already ended


def logprob_deltas(tokenizer, text: str, k: int) -> tuple[list[int], list[RequestDelta]]:
    ids = tokenizer.encode(text)
    deltas = [
        RequestDelta(
            request_id="r",
            token_ids=[t],
            logprobs=[
                SampledLogprobs(
                    token_id=t,
                    logprob=-0.5 - i,
                    top=[
                        TokenLogprob(token_id=t, logprob=-0.5 - i),
                        *[TokenLogprob(token_id=100 + j, logprob=-3.0 - j) for j in range(k - 1)],
                    ],
                )
            ],
        )
        for i, t in enumerate(ids)
    ]
    return ids, deltas


def applied(tokenizer, deltas, options: OutputOptions, end: str | None = None) -> ChoiceOutput:
    """A choice with every delta applied, then ended for `end` where given."""
    output = ChoiceOutput(0, tokenizer, options)
    for d in deltas:
        output.apply(d)
    if end is not None:
        output.end(end)
    return output


def meta(kind, want_logprobs=False):
    return ResponseMeta(id="x-1", created=123, model="m", kind=kind, want_logprobs=want_logprobs)


def test_chat_logprobs_have_openai_shape(tokenizer):
    ids, deltas = logprob_deltas(tokenizer, "Hi 🎉", k=2)
    output = applied(tokenizer, deltas, OutputOptions(logprobs=2), "stop")
    body = completion_body(meta("chat", True), [output], Usage(3, len(ids)))
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == len(ids)
    assert b"".join(bytes(c["bytes"]) for c in content) == "Hi 🎉".encode()
    first = content[0]
    assert set(first) == {"token", "logprob", "bytes", "top_logprobs"}
    assert first["token"] == "Hi" and first["logprob"] == -0.5
    assert len(first["top_logprobs"]) == 2
    assert set(first["top_logprobs"][0]) == {"token", "logprob", "bytes"}
    json.dumps(body)  # plain JSON all the way down


def test_completion_logprobs_have_legacy_shape_and_text_offsets(tokenizer):
    _, deltas = logprob_deltas(tokenizer, "ab cd ef", k=1)
    output = applied(tokenizer, deltas, OutputOptions(logprobs=1), "length")
    lp = completion_body(meta("completion", True), [output], Usage(1, 3))["choices"][0]["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert "".join(lp["tokens"]) == "ab cd ef"
    offsets = [0]
    for token in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(token))
    assert lp["text_offset"] == offsets
    assert all(t in top for t, top in zip(lp["tokens"], lp["top_logprobs"], strict=True))


def test_tokens_as_ids_spelling(tokenizer):
    ids, deltas = logprob_deltas(tokenizer, "hello world", k=1)
    output = applied(tokenizer, deltas, OutputOptions(logprobs=0, tokens_as_ids=True))
    assert [i.token for i in output.logprobs] == [f"token_id:{t}" for t in ids]


def test_non_streamed_bodies_have_openai_shape(tokenizer):
    output, _ = run_choice(tokenizer, tokenizer.encode("Paris"), finish="stop")
    usage = usage_of([[1, 2, 3]], [output])
    chat = completion_body(meta("chat"), [output], usage)
    assert chat == {
        "id": "x-1",
        "object": "chat.completion",
        "created": 123,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Paris"},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": output.num_tokens,
                  "total_tokens": 3 + output.num_tokens,
                  "prompt_tokens_details": {"cached_tokens": 0}},
    }  # fmt: skip
    text = completion_body(meta("completion"), [output], usage)
    assert text["object"] == "text_completion"
    assert text["choices"][0] == {
        "index": 0, "text": "Paris", "logprobs": None, "finish_reason": "stop"
    }  # fmt: skip


def test_usage_counts_each_prompt_once_and_every_choice(tokenizer):
    a, _ = run_choice(tokenizer, [10, 11, 12])
    b, _ = run_choice(tokenizer, [13, 14])
    assert usage_of([[1, 2, 3, 4]], [a, b], n=2).body() == {
        "prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9,
        "prompt_tokens_details": {"cached_tokens": 0},
    }  # fmt: skip


def test_cached_tokens_come_from_the_first_delta_once_per_prompt(tokenizer):
    outputs = [ChoiceOutput(i, tokenizer, OutputOptions()) for i in range(4)]
    for i, output in enumerate(outputs):  # two prompts, two choices each
        output.apply(RequestDelta(request_id=f"c{i}", token_ids=[10], num_prompt_tokens=40,
                                  num_cached_tokens=16 * (i + 1)))  # fmt: skip
        output.apply(RequestDelta(request_id=f"c{i}", token_ids=[11], num_cached_tokens=0))
    usage = usage_of([[1] * 40, [2] * 40], outputs, n=2)
    assert usage.cached_tokens == 16 + 48
    assert usage.body()["prompt_tokens_details"] == {"cached_tokens": 64}


def test_chat_chunks_in_order(tokenizer):
    builder = ChunkBuilder(meta("chat"), include_usage=True)
    output, steps = run_choice(tokenizer, tokenizer.encode("Hi there"), finish="stop")
    chunks = builder.opening(1) + [c for s in steps for c in builder.step(s)]
    chunks.append(builder.usage(Usage(4, output.num_tokens)))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
    assert text == "Hi there"
    assert chunks[-2]["choices"][0] == {
        "index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"
    }  # fmt: skip
    assert [c["usage"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["total_tokens"] == 4 + output.num_tokens


def test_completion_chunks_without_usage_option(tokenizer):
    builder = ChunkBuilder(meta("completion"), include_usage=False)
    _, steps = run_choice(tokenizer, tokenizer.encode("abc"), finish="length")
    chunks = builder.opening(1) + [c for s in steps for c in builder.step(s)]
    assert all("usage" not in c for c in chunks)
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "abc"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_final_chunk_can_carry_usage():
    chunk = ChunkBuilder(meta("completion"), include_usage=False).finish(0, "stop", Usage(2, 3))
    assert chunk["choices"][0]["finish_reason"] == "stop"
    assert chunk["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5,
                              "prompt_tokens_details": {"cached_tokens": 0}}  # fmt: skip


def test_models_body():
    body = models_body(["SmolLM2-135M-Instruct"], 5, 8192)
    assert body["object"] == "list"
    assert body["data"][0]["id"] == "SmolLM2-135M-Instruct"
    assert body["data"][0]["object"] == "model"
    assert body["data"][0]["max_model_len"] == 8192


def test_models_body_lists_every_served_name():
    body = models_body(["a", "b"], 5, 100)
    assert [m["id"] for m in body["data"]] == ["a", "b"]
