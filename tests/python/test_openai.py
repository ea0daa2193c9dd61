"""The official `openai` SDK against a real `mtpx serve` of the test model.

The test model is random, so replies are nonsense; the suite checks the protocol: what the SDK
sends is accepted, and what comes back parses into the SDK's types with the right values.
Its last 9 token ids are special (end-of-turn and tags); banning them keeps lengths exact.
"""

import json
from typing import Literal

import openai
import pydantic
import pytest
from openai import OpenAI

from conftest import BAN_SPECIALS, MODEL, READ_PARAMETERS, WINDOW

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Write a haiku about pages."},
]
TOOLS = [
    {
        "type": "function",
        "function": {"name": "read", "description": "Read a file", "parameters": READ_PARAMETERS},
    }
]


def greedy(client: OpenAI, **kw):
    args = dict(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=12, logit_bias=BAN_SPECIALS)
    args.update(kw)
    return client.chat.completions.create(**args)


def test_models_advertise_the_enforced_window(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].context_window == WINDOW
    assert client.models.retrieve(MODEL).max_model_len == WINDOW
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_plain_chat(client):
    r = greedy(client)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert isinstance(r.choices[0].message.content, str)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_streaming_chat_with_usage_equals_non_streaming(client):
    plain = greedy(client)
    stream = greedy(client, stream=True, stream_options={"include_usage": True})
    text, finish, usage, roles = "", None, None, []
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.role:
                roles.append(c.delta.role)
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert roles == ["assistant"]
    assert text == plain.choices[0].message.content
    assert finish == "length"
    assert usage is not None and usage.completion_tokens == 12
    assert usage.prompt_tokens == plain.usage.prompt_tokens


def test_seed_reproducibility(client):
    a = greedy(client, temperature=1.0, seed=42, max_tokens=16)
    b = greedy(client, temperature=1.0, seed=42, max_tokens=16)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_n_two_gives_two_choices(client):
    r = greedy(client, temperature=1.0, seed=3, n=2, max_tokens=8)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == 16


def test_stop_sequences(client):
    text = greedy(client, max_tokens=40).choices[0].message.content
    assert len(text) > 6
    stop = text[3:5]
    r = greedy(client, max_tokens=40, stop=[stop])
    assert r.choices[0].message.content == text[: text.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_max_tokens_past_the_window_is_served_up_to_it(client):
    r = greedy(client, max_tokens=WINDOW)
    assert r.choices[0].finish_reason == "length"
    served = WINDOW - r.usage.prompt_tokens
    assert r.usage.completion_tokens == served
    assert r.usage.max_tokens_clamped == {"requested": WINDOW, "served": served}


def test_context_length_error_is_a_bad_request(strict_server_url):
    client = OpenAI(base_url=f"{strict_server_url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        greedy(client, max_tokens=WINDOW)
    err = info.value
    assert err.code == "context_length_exceeded"
    assert err.body["context_window"] == WINDOW
    assert err.body["max_tokens"] == WINDOW
    assert err.body["prompt_tokens"] > 0


def test_bad_values_name_their_field(client):
    with pytest.raises(openai.BadRequestError) as info:
        greedy(client, temperature=5)
    assert info.value.param == "temperature"


def test_tool_result_round_trip(client):
    messages = [
        {"role": "user", "content": "Read a.txt"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "read", "arguments": json.dumps({"path": "a.txt"})}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "hello"},
    ]
    for stream in (False, True):
        r = greedy(client, messages=messages, tools=TOOLS, tool_choice="auto", stream=stream)
        if stream:
            chunks = list(r)
            assert chunks[-1].choices[0].finish_reason == "length"
        else:
            assert r.choices[0].finish_reason == "length"


def test_malformed_tool_blocks_fall_back_to_content(client, server_url):
    # Forcing the `<tool_call>` tag over and over never makes a valid call: the text is content.
    import urllib.request

    req = urllib.request.Request(
        f"{server_url}/tokenize",
        data=json.dumps({"prompt": "<tool_call>"}).encode(),
        headers={"content-type": "application/json"},
    )
    tag = json.load(urllib.request.urlopen(req))["tokens"][0]
    bias = dict(BAN_SPECIALS, **{str(tag): 100})
    r = greedy(client, tools=TOOLS, logit_bias=bias, max_tokens=3)
    assert r.choices[0].message.content.startswith("<tool_call>")
    assert not r.choices[0].message.tool_calls


def test_text_completions(client):
    r = client.completions.create(model=MODEL, prompt="function update(v) {", max_tokens=6, temperature=0, logit_bias=BAN_SPECIALS)
    assert r.choices[0].finish_reason == "length"
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL, prompt="function update(v) {", max_tokens=6, temperature=0, logit_bias=BAN_SPECIALS, stream=True
        )
        if c.choices
    )
    assert streamed == r.choices[0].text


def test_echo_with_logprobs_scores_the_prompt(client):
    # What lm-eval's `local-completions` sends for a log-likelihood.
    r = client.completions.create(
        model=MODEL, prompt="function update(v) {", echo=True, logprobs=1, max_tokens=1,
        temperature=0, logit_bias=BAN_SPECIALS,
    )
    choice = r.choices[0]
    assert choice.text.startswith("function update(v) {")
    lp = choice.logprobs
    assert len(lp.tokens) == r.usage.prompt_tokens + 1
    assert lp.token_logprobs[0] is None
    assert all(x < 0 for x in lp.token_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset)


def test_an_api_key_is_required_when_configured(keyed_server_url):
    anonymous = OpenAI(base_url=f"{keyed_server_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        anonymous.models.list()
    keyed = OpenAI(base_url=f"{keyed_server_url}/v1", api_key="sekret", max_retries=0)
    assert keyed.models.list().data[0].id == MODEL


class Pick(pydantic.BaseModel):
    ok: bool
    size: Literal["small", "large"]
    count: int = pydantic.Field(ge=0, le=9)


def test_structured_output_parses_into_the_pydantic_model(client):
    # The SDK sends a strict `json_schema` and parses the reply into the model: a random model
    # can only write such a reply under the grammar. The stop tokens are banned, yet a complete
    # document still ends the reply.
    r = client.chat.completions.parse(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=400,
        logit_bias=BAN_SPECIALS, response_format=Pick,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, Pick)
    assert Pick.model_validate_json(choice.message.content) == choice.message.parsed
    # json_object: the reply starts an object.
    r = greedy(client, response_format={"type": "json_object"}, max_tokens=8)
    assert r.choices[0].message.content.lstrip().startswith("{")


def test_grammars_and_ignore_eos_through_extra_body(client):
    # What vLLM's and llama.cpp's users send through the SDK's `extra_body`: a GBNF grammar
    # (`guided_grammar`, or llama.cpp's `grammar`), a Lark one, and `ignore_eos`. The random
    # model can only write text of the grammar under it, and the grammar ends the reply.
    gbnf = 'root ::= ("yes" | "no") ", " [0-9]{2} " " word\nword ::= [a-z]{1,8}'
    lark = 'start: ("yes" | "no") ", " /[0-9]{2}/ " " /[a-z]{1,8}/'
    texts = []
    for extra in ({"guided_grammar": gbnf}, {"grammar": gbnf}, {"guided_grammar": lark}):
        r = greedy(client, max_tokens=40, extra_body=extra)
        choice = r.choices[0]
        head, _, tail = choice.message.content.partition(", ")
        number, _, word = tail.partition(" ")
        assert head in ("yes", "no"), choice.message.content
        assert len(number) == 2 and number.isdigit(), choice.message.content
        assert 1 <= len(word) <= 8 and word.isalpha() and word.islower(), choice.message.content
        assert choice.finish_reason == "stop"
        texts.append(choice.message.content)
    assert texts[0] == texts[1] == texts[2]
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=20, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 20
    with pytest.raises(openai.BadRequestError) as e:
        greedy(client, extra_body={"guided_grammar": "root ::= [a-"})
    assert e.value.body["param"] == "guided_grammar"
    assert "character class" in e.value.body["message"]


def test_embeddings_in_the_sdks_default_base64_equal_floats(client):
    texts = ["def add(a, b): return a + b", "the cat sat on the mat"]
    # Without encoding_format the SDK asks for base64 and decodes the float32 bytes itself.
    default = client.embeddings.create(model=MODEL, input=texts)
    floats = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    assert [d.index for d in default.data] == [0, 1]
    for a, b in zip(default.data, floats.data):
        assert len(a.embedding) == len(b.embedding) > 0
        assert max(abs(x - y) for x, y in zip(a.embedding, b.embedding)) < 1e-6
        assert abs(sum(x * x for x in a.embedding) - 1) < 1e-4
    assert default.data[0].embedding != default.data[1].embedding
    assert default.usage.prompt_tokens == default.usage.total_tokens > 0
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model=MODEL, input=["ok", "word " * WINDOW])
    assert info.value.code == "context_length_exceeded"
    assert info.value.param == "input"
    assert "`input[1]`" in info.value.message
