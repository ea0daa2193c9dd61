"""The official `openai` SDK's Responses API against a real `mtpx serve` of the test model.

The test model is random, so output text is nonsense; the suite checks the protocol: what
the SDK sends is accepted, and what comes back parses into the SDK's types, streamed and not,
and `previous_response_id` continues the stored conversation (its KV reused).
"""

import json
import time

import openai
import pytest
from openai import OpenAI

from conftest import BAN_SPECIALS, MODEL, READ_PARAMETERS

PAGE = 16
TOOLS = [{"type": "function", "name": "read", "description": "Read a file", "parameters": READ_PARAMETERS}]


def create(client: OpenAI, **kw):
    args = dict(
        model=MODEL,
        instructions="You are terse.",
        input="Write a haiku about pages.",
        temperature=0,
        max_output_tokens=10,
        extra_body={"logit_bias": BAN_SPECIALS},
    )
    args.update(kw)
    return client.responses.create(**args)


def test_plain_response(client):
    r = create(client)
    assert r.object == "response"
    assert r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].type == "message"
    assert r.output[0].role == "assistant"
    assert r.output[0].status == "incomplete", "the item was cut as the response was"
    assert isinstance(r.output_text, str) and r.output_text
    assert r.usage.output_tokens == 10
    assert r.usage.total_tokens == r.usage.input_tokens + 10
    assert r.usage.input_tokens_details.cached_tokens >= 0
    assert client.responses.retrieve(r.id).id == r.id


def test_streaming_equals_non_streaming(client):
    plain = create(client)
    events = list(create(client, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == plain.output_text
    assert events[-1].response.output_text == plain.output_text
    assert events[-1].response.usage.output_tokens == 10
    done = [e for e in events if e.type == "response.output_item.done"]
    assert [e.item.status for e in done] == ["incomplete"]


def test_the_conversations_api_is_refused_not_ignored(client):
    with pytest.raises(openai.BadRequestError) as e:
        create(client, conversation="conv_123")
    assert e.value.body["param"] == "conversation"
    assert "previous_response_id" in e.value.body["message"]


def test_previous_response_id_continues_with_tool_rounds(client):
    first = create(client, tools=TOOLS)
    prev = first
    for turn in range(1, 4):
        call_id = f"call_{turn}"
        r = create(
            client,
            tools=TOOLS,
            previous_response_id=prev.id,
            input=[
                {"type": "function_call", "call_id": call_id, "name": "read",
                 "arguments": json.dumps({"path": f"f{turn}.py"})},
                {"type": "function_call_output", "call_id": call_id, "output": f"print({turn})"},
            ],
        )
        assert r.previous_response_id == prev.id
        prev_input = prev.usage.input_tokens
        cached = r.usage.input_tokens_details.cached_tokens
        assert cached >= prev_input - prev_input % PAGE, (cached, prev_input)
        prev = r
    # An output answers a call made anywhere earlier in the chain, and only such a call.
    late = create(client, tools=TOOLS, previous_response_id=prev.id,
                  input=[{"type": "function_call_output", "call_id": "call_1", "output": "again"}])
    assert late.previous_response_id == prev.id
    with pytest.raises(openai.BadRequestError, match="call_9") as e:
        create(client, tools=TOOLS, previous_response_id=prev.id,
               input=[{"type": "function_call_output", "call_id": "call_9", "output": "x"}])
    assert e.value.param == "input[0].call_id"


def test_errors_are_openai_errors(client):
    with pytest.raises(openai.BadRequestError) as e:
        create(client, previous_response_id="resp_does_not_exist")
    assert e.value.code == "previous_response_not_found"
    # A hosted tool is left out of the prompt (the Codex CLI declares some); forcing one, which
    # this server cannot run, is refused.
    hosted = [{"type": "web_search_preview"}]
    assert create(client, tools=hosted).output_text == create(client).output_text
    with pytest.raises(openai.BadRequestError) as e:
        create(client, tools=hosted, tool_choice={"type": "web_search_preview"})
    assert e.value.code == "unsupported_tool"


def test_tool_choice_none_keeps_the_tools_in_the_prompt_and_calls_nothing(client):
    auto = create(client, input="Read a.txt", tools=TOOLS)
    none = create(client, input="Read a.txt", tools=TOOLS, tool_choice="none")
    # The same prompt (the tools rendered), so a conversation's cached prefix holds.
    assert none.usage.input_tokens == auto.usage.input_tokens
    assert all(item.type != "function_call" for item in none.output)


def test_input_items_list_a_chain_through_the_sdk(client):
    first = create(client, input="Fix main.rs.", tools=TOOLS)
    second = create(
        client,
        tools=TOOLS,
        previous_response_id=first.id,
        input=[
            {"type": "function_call", "call_id": "call_1", "name": "read",
             "arguments": json.dumps({"path": "main.rs"})},
            {"type": "function_call_output", "call_id": "call_1", "output": "fn main() {}"},
        ],
    )
    # The SDK pages through the cursors by itself (limit=2 forces several pages).
    items = list(client.responses.input_items.list(second.id, limit=2, order="asc"))
    kinds = [item.type for item in items]
    assert kinds[0] == "message" and items[0].role == "user"
    assert items[0].content[0].text == "Fix main.rs."
    assert [item.id for item in items[1:-2]] == [item.id for item in first.output]
    assert kinds[-2:] == ["function_call", "function_call_output"]
    assert items[-1].output == "fn main() {}"
    newest_first = list(client.responses.input_items.list(second.id))
    assert [item.id for item in newest_first] == [item.id for item in reversed(items)]
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_does_not_exist").data


def test_background_responses_are_polled_and_cancelled_through_the_sdk(client):
    created = create(client, background=True)
    assert created.background and created.status == "in_progress"
    # Polled as the SDK's users do, until it has ended (bounded).
    for _ in range(6000):
        done = client.responses.retrieve(created.id)
        if done.status != "in_progress":
            break
        time.sleep(0.01)
    assert done.status in ("completed", "incomplete")
    assert done.output_text == create(client).output_text

    long = create(client, background=True, max_output_tokens=3000, input="Write a long essay.")
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(long.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.cancel(create(client).id)
    with pytest.raises(openai.BadRequestError, match="store"):
        create(client, background=True, store=False)


def test_a_background_stream_resumes_through_the_sdk(client):
    # The SDK's own example: stream a background response, stop reading, pick it up later.
    args = dict(
        model=MODEL,
        input="Write a haiku about pages.",
        temperature=0,
        max_output_tokens=30,
        extra_body={"logit_bias": BAN_SPECIALS},
    )
    with client.responses.stream(background=True, **args) as stream:
        for event in stream:
            if event.type == "response.created":
                rid = event.response.id
                assert event.response.background
            if event.sequence_number == 4:
                break
    with client.responses.stream(response_id=rid, starting_after=4) as stream:
        events = list(stream)
    numbers = [event.sequence_number for event in events]
    assert numbers == list(range(5, 5 + len(numbers)))
    stored = client.responses.retrieve(rid)
    # (The test model runs to `max_output_tokens`: the stream ends `response.incomplete`, which
    # the SDK's `get_final_response` does not take.)
    assert stored.status == "incomplete"
    final = events[-1]
    assert final.type == "response.incomplete"
    assert final.response.id == rid and final.response.output_text == stored.output_text
    assert stored.output_text == client.responses.create(**args).output_text
    # The raw retrieval with `starting_after` sends only what follows it.
    raw = list(client.responses.retrieve(rid, stream=True, starting_after=2))
    assert [e.sequence_number for e in raw] == list(range(3, 5 + len(numbers)))
    assert raw[-1].response.output_text == stored.output_text
    with pytest.raises(openai.BadRequestError, match="starting_after"):
        list(client.responses.retrieve(rid, stream=True, starting_after=10_000))
    with pytest.raises(openai.BadRequestError, match="stream"):
        list(client.responses.retrieve(create(client).id, stream=True))
