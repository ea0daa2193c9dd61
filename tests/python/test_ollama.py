"""The official `ollama` Python package against a real `mtpx serve` of the test model.

The test model is random, so replies are nonsense; the suite checks the protocol: what the
client sends is accepted, and what comes back parses into the client's types with the right
values (the counts, the done line, errors as `ResponseError` with the right status).
"""

from typing import Literal

import ollama
import pydantic
import pytest

from conftest import MODEL, READ_PARAMETERS, WINDOW

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Write a haiku about pages."},
]
GREEDY = {"temperature": 0, "num_predict": 12}


@pytest.fixture()
def client(server_url) -> ollama.Client:
    return ollama.Client(host=server_url)


def test_the_served_model_is_listed_shown_and_running(client):
    (listed,) = client.list().models
    assert listed.model == f"{MODEL}:latest"
    assert listed.details.format == "gguf"
    assert listed.details.family == "qwen3"
    assert listed.size > 0
    shown = client.show(listed.model)
    # Clients size their prompts by this: the window the server enforces.
    assert shown.modelinfo["qwen3.context_length"] == WINDOW
    assert "completion" in shown.capabilities
    (running,) = client.ps().models
    assert running.context_length == WINDOW
    assert client._request_raw("GET", "/api/version").json()["version"]


def test_streamed_chat_equals_the_whole_reply(client):
    whole = client.chat(model=MODEL, messages=MESSAGES, options=GREEDY)
    assert whole.done and whole.done_reason in ("stop", "length")
    assert whole.message.role == "assistant"
    assert whole.prompt_eval_count > 10
    assert 1 <= whole.eval_count <= 12
    assert whole.total_duration >= whole.eval_duration > 0
    lines = list(client.chat(model=MODEL, messages=MESSAGES, options=GREEDY, stream=True))
    assert all(not line.done for line in lines[:-1]) and lines[-1].done
    assert "".join(line.message.content for line in lines) == whole.message.content
    assert lines[-1].eval_count == whole.eval_count
    assert lines[-1].done_reason == whole.done_reason


def test_num_predict_and_seed(client):
    r = client.chat(model=MODEL, messages=MESSAGES, options={"temperature": 0, "num_predict": 3})
    assert r.eval_count <= 3
    assert (r.done_reason == "length") == (r.eval_count == 3)
    sampled = {"temperature": 1.0, "seed": 7, "num_predict": 10}
    first = client.chat(model=MODEL, messages=MESSAGES, options=sampled)
    again = client.chat(model=MODEL, messages=MESSAGES, options=sampled)
    assert first.message.content == again.message.content


class Pick(pydantic.BaseModel):
    ok: bool
    size: Literal["small", "large"]
    count: int = pydantic.Field(ge=0, le=9)


def test_format_schema_parses_into_the_pydantic_model(client):
    # What the ollama README shows: `format=Model.model_json_schema()`. pydantic's schema does
    # not close the object; a random model would add keys until num_predict unless the
    # grammar admits only the declared ones (as Ollama's does).
    r = client.chat(
        model=MODEL, messages=MESSAGES, format=Pick.model_json_schema(),
        options={"temperature": 0, "num_predict": 400},
    )
    assert r.done_reason == "stop", r.message.content
    Pick.model_validate_json(r.message.content)
    r = client.generate(model=MODEL, prompt="Reply in JSON.", format="json", options=GREEDY)
    assert r.response.lstrip().startswith("{")


def test_tool_round_trip_messages_are_accepted(client):
    tools = [{"type": "function", "function": {
        "name": "read", "description": "Read a file", "parameters": READ_PARAMETERS}}]
    messages = [
        {"role": "user", "content": "Read a.txt"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"function": {"name": "read", "arguments": {"path": "a.txt"}}}]},
        {"role": "tool", "content": "hello", "tool_name": "read"},
    ]
    r = client.chat(model=MODEL, messages=messages, tools=tools, options=GREEDY)
    assert r.done


def test_generate_with_system_and_raw(client):
    templated = client.generate(model=MODEL, prompt="pages", system="Be terse.", options=GREEDY)
    raw = client.generate(model=MODEL, prompt="pages", raw=True, options=GREEDY)
    assert templated.done and raw.done
    # The template wraps the prompt: many more prompt tokens than the raw text.
    assert templated.prompt_eval_count > raw.prompt_eval_count
    # Nothing to generate: Ollama's "load" answer.
    assert client.generate(model=MODEL).done_reason == "load"


def test_errors_are_response_errors_with_the_right_status(client):
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="llama3", messages=MESSAGES)
    assert e.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=MODEL, messages=MESSAGES, options={"temperature": 7})
    assert e.value.status_code == 400 and "temperature" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        long = [{"role": "user", "content": "page " * (WINDOW + 100)}]
        # Refused before the stream starts (the generator sends the request when iterated).
        list(client.chat(model=MODEL, messages=long, stream=True))
        pytest.fail("a prompt over the window must be refused")
    assert e.value.status_code == 400
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model=MODEL, prompt="x", suffix="y")
    assert e.value.status_code == 400 and "suffix" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.delete(model=MODEL)
    assert e.value.status_code == 501 and "not implemented" in e.value.error
    # The server is still serving.
    assert client.chat(model=MODEL, messages=MESSAGES, options=GREEDY).done


def test_embed_gives_unit_vectors_and_truncates_by_default(client):
    reply = client.embed(model=MODEL, input=["def add(a, b): return a + b", "the cat sat"])
    assert len(reply.embeddings) == 2
    for v in reply.embeddings:
        assert abs(sum(x * x for x in v) - 1) < 1e-4
    assert reply.prompt_eval_count > 0
    long = "word " * WINDOW
    assert client.embed(model=MODEL, input=long).prompt_eval_count == WINDOW
    with pytest.raises(ollama.ResponseError) as info:
        client.embed(model=MODEL, input=long, truncate=False)
    assert info.value.status_code == 400
    # The older call: the same direction, not normalised.
    old = client.embeddings(model=MODEL, prompt="the cat sat").embedding
    norm = sum(x * x for x in old) ** 0.5
    assert max(abs(x / norm - y) for x, y in zip(old, reply.embeddings[1])) < 1e-5
