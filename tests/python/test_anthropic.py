"""The official `anthropic` Python package against a real `mtpx serve` of the test model.

The test model is random, so replies are nonsense; the suite checks the protocol: what the SDK
sends is accepted, and what comes back parses into the SDK's types with the right values
(usage, stop reasons, streamed events that the SDK's accumulator turns into the same message,
tool_use blocks, structured output parsed into a pydantic model, errors as the SDK's exceptions).
The SDK has no `temperature` argument any more; `extra_body` sends it, as older SDKs did.
"""

from typing import Literal

import anthropic
import pydantic
import pytest

from conftest import BAN_SPECIALS, MODEL, READ_PARAMETERS, WINDOW

MESSAGES = [{"role": "user", "content": "Write a haiku about pages."}]
# Greedy, and the test model's special tokens banned so lengths are exact.
GREEDY = {"temperature": 0, "logit_bias": BAN_SPECIALS}
TOOLS = [{"name": "read", "description": "Read a file", "input_schema": READ_PARAMETERS}]


@pytest.fixture()
def client(server_url) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server_url, api_key="unused", max_retries=0)


def test_create_and_stream_give_the_same_message(client):
    args = dict(model=MODEL, max_tokens=12, system="You are terse.", messages=MESSAGES, extra_body=GREEDY)
    whole = client.messages.create(**args)
    assert whole.type == "message" and whole.role == "assistant" and whole.model == MODEL
    assert whole.stop_reason == "max_tokens"
    assert whole.usage.output_tokens == 12
    (block,) = whole.content
    assert block.type == "text" and block.text
    with client.messages.stream(**args) as stream:
        deltas = [event.delta.text for event in stream if event.type == "content_block_delta"]
        streamed = stream.get_final_message()
    assert "".join(deltas) == block.text
    assert [(b.type, b.text) for b in streamed.content] == [("text", block.text)]
    assert streamed.stop_reason == "max_tokens"
    assert streamed.usage.output_tokens == 12
    # The second request reused the first one's prompt from the cache.
    assert streamed.usage.cache_read_input_tokens > 0
    assert streamed.usage.input_tokens + streamed.usage.cache_read_input_tokens == (
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    )
    counted = client.messages.count_tokens(model=MODEL, system="You are terse.", messages=MESSAGES)
    assert counted.input_tokens == whole.usage.input_tokens + whole.usage.cache_read_input_tokens


def test_a_forced_tool_is_a_tool_use_block_and_its_result_goes_back(client):
    r = client.messages.create(
        model=MODEL, max_tokens=200, messages=MESSAGES, tools=TOOLS,
        tool_choice={"type": "tool", "name": "read"}, extra_body=GREEDY,
    )
    assert r.stop_reason == "tool_use"
    call = r.content[0]
    assert isinstance(call, anthropic.types.ToolUseBlock)
    assert call.name == "read" and isinstance(call.input["path"], str)
    follow = client.messages.create(
        model=MODEL, max_tokens=4, tools=TOOLS, extra_body=GREEDY,
        messages=MESSAGES + [
            {"role": "assistant", "content": r.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "42"}]},
        ],
    )
    assert follow.usage.input_tokens + follow.usage.cache_read_input_tokens > r.usage.input_tokens


class Pick(pydantic.BaseModel):
    ok: bool
    size: Literal["small", "large"]


def test_structured_output_parses_into_the_pydantic_model(client):
    r = client.messages.parse(model=MODEL, max_tokens=200, messages=MESSAGES, output_format=Pick, extra_body=GREEDY)
    assert isinstance(r.parsed_output, Pick)
    assert r.stop_reason == "end_turn"


def test_stop_sequences_and_errors(client):
    whole = client.messages.create(model=MODEL, max_tokens=12, messages=MESSAGES, extra_body=GREEDY)
    text = whole.content[0].text
    stop = text[len(text) // 2 :][:3]
    cut = client.messages.create(
        model=MODEL, max_tokens=12, messages=MESSAGES, stop_sequences=[stop], extra_body=GREEDY
    )
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert text.startswith(cut.content[0].text) and stop not in cut.content[0].text
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-sonnet-4-5", max_tokens=4, messages=MESSAGES)
    assert e.value.body["error"]["type"] == "not_found_error"
    # max_tokens is a ceiling (Claude Code asks for 32000); a prompt that cannot fit is refused.
    clamped = client.messages.create(
        model=MODEL, max_tokens=WINDOW, messages=MESSAGES, stop_sequences=[stop], extra_body=GREEDY
    )
    assert clamped.stop_reason == "stop_sequence" and clamped.content[0].text == cut.content[0].text
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "word " * WINDOW}]
        )
    assert "prompt is too long" in e.value.body["error"]["message"]
