"""/v1/responses through the official openai SDK (create, stream=True and the
`responses.stream` helper), against the scheduler double on a real NATS server."""

from __future__ import annotations

import openai
import pytest

from tests.integration.gateway.conftest import MODEL
from tests.integration.gateway.scheduler_double import REPLY_TEXT

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest.fixture
def client(system):
    return openai.AsyncOpenAI(base_url=f"{system.url}/v1", api_key="unused", max_retries=0)


async def test_create_with_text_input_and_instructions(client, system, served_tokenizer):
    r = await client.responses.create(
        model=MODEL, input="Say something.", instructions="Be brief.", metadata={"a": "b"}
    )
    assert r.object == "response" and r.status == "completed" and r.id.startswith("resp_")
    assert r.output_text == REPLY_TEXT
    assert [item.type for item in r.output] == ["message"]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Say something."},
    ]
    prompt = served_tokenizer.encode_chat(messages)
    assert system.scheduler.submits[-1].prompt_token_ids == prompt
    assert r.usage.input_tokens == len(prompt) and r.usage.output_tokens > 0


async def test_messages_input_and_max_output_tokens(client):
    r = await client.responses.create(
        model=MODEL,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
        max_output_tokens=3,
        reasoning={"effort": "low"},
    )
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3


async def test_streamed_events_have_openai_names_and_join_to_the_text(client):
    stream = await client.responses.create(model=MODEL, input="Say something.", stream=True)
    events = [event async for event in stream]
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == REPLY_TEXT
    assert events[-1].response.output_text == REPLY_TEXT


async def test_the_stream_helper_assembles_the_final_response(client):
    async with client.responses.stream(model=MODEL, input="Say something.") as stream:
        deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
        final = await stream.get_final_response()
    assert "".join(deltas) == final.output_text == REPLY_TEXT


@pytest.mark.parametrize(
    ("fields", "param"),
    [({"previous_response_id": "resp_1"}, "previous_response_id"),
     ({"background": True}, "background"),
     ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
     ({"max_output_tokens": 0}, "max_output_tokens"),
     ({"input": [{"type": "image", "x": 1}]}, "input[0].type"),
     ({"input": []}, "input")],
)  # fmt: skip
async def test_bad_fields_are_400s_naming_them(client, fields, param):
    body = {"model": MODEL, "input": "x", **fields}
    with pytest.raises(openai.BadRequestError) as caught:
        await client.responses.create(**body)
    assert caught.value.body["param"] == param
