//! Anthropic's Messages API over a real pulled model (Qwen2.5-Coder-0.5B-Instruct):
//! `/v1/messages` gives the reply `/v1/chat/completions` gives for the same request, streamed
//! as Anthropic's events that add up to the same message; tools come back as `tool_use`
//! blocks and their `tool_result`s are answered from; a final assistant message is continued;
//! `stop_sequences`, `max_tokens`, `output_config.format`, `count_tokens` and errors in
//! Anthropic's shape. Needs `mtpx pull qwen2.5-coder-0.5b`. (The `anthropic` Python package is
//! run against the test model in `tests/python/test_anthropic.py`.)

#[path = "fixtures/api/client.rs"]
mod client;
mod common;

use client::*;
use common::small_qwen_server;
use mtpx::api::testing::TestServer;
use serde_json::{json, Value};

fn server() -> TestServer {
    small_qwen_server()
}

fn weather_tool() -> Value {
    json!([{"name": "get_weather", "description": "Get the current weather for a city",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                             "required": ["city"]}}])
}

/// `(event name, data)` of each frame of an Anthropic SSE body.
fn named_events(reply: &Reply) -> Vec<(String, Value)> {
    assert_eq!(reply.status, 200, "{}", reply.text());
    reply
        .text()
        .split("\n\n")
        .filter(|f| !f.trim().is_empty() && !f.starts_with(':'))
        .map(|frame| {
            let (event, data) = frame.split_once('\n').unwrap_or_else(|| panic!("{frame}"));
            let name = event
                .strip_prefix("event: ")
                .unwrap_or_else(|| panic!("{frame}"));
            let data = data
                .strip_prefix("data: ")
                .unwrap_or_else(|| panic!("{frame}"));
            (name.to_string(), serde_json::from_str(data).unwrap())
        })
        .collect()
}

/// The message a stream adds up to, checking the order of its events.
fn assemble(events: &[(String, Value)]) -> Value {
    let (first, data) = &events[0];
    assert_eq!(first, "message_start", "{events:?}");
    let mut message = data["message"].clone();
    let mut content: Vec<Value> = Vec::new();
    let mut partial = String::new();
    let mut open: Option<usize> = None;
    for (name, data) in &events[1..] {
        assert_eq!(data["type"], name.as_str());
        match name.as_str() {
            "content_block_start" => {
                assert_eq!(open, None, "a block opens while another is open");
                assert_eq!(data["index"], content.len());
                content.push(data["content_block"].clone());
                open = Some(content.len() - 1);
            }
            "content_block_delta" => {
                let i = open.expect("a delta outside a block");
                assert_eq!(data["index"], i);
                let d = &data["delta"];
                let block = &mut content[i];
                match d["type"].as_str().unwrap() {
                    "text_delta" => {
                        let t = format!(
                            "{}{}",
                            block["text"].as_str().unwrap(),
                            d["text"].as_str().unwrap()
                        );
                        block["text"] = json!(t);
                    }
                    "input_json_delta" => partial.push_str(d["partial_json"].as_str().unwrap()),
                    other => panic!("unexpected delta {other}"),
                }
            }
            "content_block_stop" => {
                let i = open.take().expect("a stop outside a block");
                if content[i]["type"] == "tool_use" {
                    content[i]["input"] =
                        serde_json::from_str(&std::mem::take(&mut partial)).unwrap();
                }
            }
            "message_delta" => {
                message["stop_reason"] = data["delta"]["stop_reason"].clone();
                message["stop_sequence"] = data["delta"]["stop_sequence"].clone();
                message["usage"] = data["usage"].clone();
            }
            "message_stop" => {}
            other => panic!("unexpected event {other}"),
        }
    }
    assert_eq!(events.last().unwrap().0, "message_stop");
    message["content"] = Value::Array(content);
    message
}

#[actix_rt::test]
async fn messages_match_chat_completions_and_stream_the_same_message() {
    let s = server();
    let messages = json!([{"role": "user", "content": "Write a haiku about Rust."}]);
    let openai = post(
        &s.at("/v1/chat/completions"),
        &json!({"messages": [{"role": "system", "content": "You are a poet."},
                             {"role": "user", "content": "Write a haiku about Rust."}],
                "temperature": 0, "max_tokens": 48}),
    )
    .await
    .json();
    let body = json!({"model": "test-model", "max_tokens": 48, "temperature": 0,
                      "system": [{"type": "text", "text": "You are a poet."}],
                      "messages": messages});
    let whole = post(&s.at("/v1/messages"), &body).await.json();
    assert_eq!(whole["type"], "message");
    assert!(whole["id"].as_str().unwrap().starts_with("msg_"), "{whole}");
    assert_eq!(whole["content"][0]["type"], "text");
    assert_eq!(
        whole["content"][0]["text"], openai["choices"][0]["message"]["content"],
        "{whole}"
    );
    let u = &whole["usage"];
    assert_eq!(
        u["input_tokens"].as_u64().unwrap() + u["cache_read_input_tokens"].as_u64().unwrap(),
        openai["usage"]["prompt_tokens"].as_u64().unwrap(),
        "{whole}"
    );
    assert_eq!(u["output_tokens"], openai["usage"]["completion_tokens"]);
    let expected_stop = match openai["choices"][0]["finish_reason"].as_str() {
        Some("length") => "max_tokens",
        _ => "end_turn",
    };
    assert_eq!(whole["stop_reason"], expected_stop);

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let reply = post(&s.at("/v1/messages"), &streamed).await;
    assert_eq!(
        reply.header("content-type").as_deref(),
        Some("text/event-stream; charset=utf-8")
    );
    let message = assemble(&named_events(&reply));
    assert_eq!(message["content"], whole["content"]);
    assert_eq!(message["stop_reason"], whole["stop_reason"]);
    assert_eq!(
        message["usage"]["output_tokens"],
        whole["usage"]["output_tokens"]
    );

    // count_tokens counts the prompt the reply was given.
    let count = post(&s.at("/v1/messages/count_tokens"), &body).await.json();
    assert_eq!(
        count["input_tokens"], openai["usage"]["prompt_tokens"],
        "{count}"
    );

    // A stop sequence ends the reply and is named; `max_tokens` cuts it.
    let text = whole["content"][0]["text"].as_str().unwrap();
    let word: String = text.split_whitespace().nth(2).unwrap().to_string();
    let mut stopped = body.clone();
    stopped["stop_sequences"] = json!([word]);
    let r = post(&s.at("/v1/messages"), &stopped).await.json();
    assert_eq!(r["stop_reason"], "stop_sequence", "{r}");
    assert_eq!(r["stop_sequence"], json!(word));
    assert!(
        text.starts_with(r["content"][0]["text"].as_str().unwrap()),
        "{r}"
    );
    let mut cut = body.clone();
    cut["max_tokens"] = json!(3);
    let r = post(&s.at("/v1/messages"), &cut).await.json();
    assert_eq!(
        (
            r["stop_reason"].clone(),
            r["usage"]["output_tokens"].clone()
        ),
        (json!("max_tokens"), json!(3))
    );
}

#[actix_rt::test]
async fn tools_come_back_as_tool_use_and_results_are_answered_from() {
    let s = server();
    let body = json!({
        "max_tokens": 64, "temperature": 0, "tools": weather_tool(),
        "messages": [{"role": "user", "content": "What is the weather in Paris? Use the tool."}],
    });
    let whole = post(&s.at("/v1/messages"), &body).await.json();
    assert_eq!(whole["stop_reason"], "tool_use", "{whole}");
    let call = whole["content"].as_array().unwrap().last().unwrap().clone();
    assert_eq!(call["type"], "tool_use");
    assert_eq!(call["name"], "get_weather");
    assert_eq!(call["input"], json!({"city": "Paris"}));

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let message = assemble(&named_events(&post(&s.at("/v1/messages"), &streamed).await));
    assert_eq!(message["stop_reason"], "tool_use");
    let streamed_call = message["content"]
        .as_array()
        .unwrap()
        .last()
        .unwrap()
        .clone();
    assert_eq!(
        (&streamed_call["name"], &streamed_call["input"]),
        (&call["name"], &call["input"])
    );

    // The result goes back as a `tool_result` block, with the user's next words beside it as
    // Claude Code sends them; the model's text uses it. (Alone, the result draws the same call
    // again from the 0.5B model at temperature 0; without the tool grammar it used to write a
    // made-up result after that call, which is where the "31" once came from.)
    let mut messages = body["messages"].as_array().unwrap().clone();
    messages.push(json!({"role": "assistant", "content": whole["content"]}));
    messages.push(json!({"role": "user", "content": [{"type": "tool_result",
        "tool_use_id": call["id"], "content": "{\"temperature_c\": 31, \"sky\": \"clear\"}"},
        {"type": "text", "text": "Answer in one sentence from the result."}]}));
    let mut next = body.clone();
    next["messages"] = Value::Array(messages);
    let answer = post(&s.at("/v1/messages"), &next).await.json();
    let text: String = answer["content"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|b| b["text"].as_str())
        .collect();
    assert_eq!(answer["stop_reason"], "end_turn", "{answer}");
    assert!(text.contains("31"), "{answer}");

    // `tool_choice` `tool` forces that call even when the question needs none.
    let mut forced = body.clone();
    forced["messages"] = json!([{"role": "user", "content": "Say hi."}]);
    forced["tool_choice"] = json!({"type": "tool", "name": "get_weather"});
    let r = post(&s.at("/v1/messages"), &forced).await.json();
    assert_eq!(r["stop_reason"], "tool_use", "{r}");
    assert_eq!(r["content"][0]["name"], "get_weather");
    assert!(r["content"][0]["input"]["city"].is_string(), "{r}");
}

#[actix_rt::test]
async fn prefill_structured_output_and_errors() {
    let s = server();
    // A final assistant message is continued, and not repeated in the reply.
    let r = post(
        &s.at("/v1/messages"),
        &json!({"max_tokens": 24, "temperature": 0, "messages": [
            {"role": "user", "content": "Give the capital of France as JSON with the key capital."},
            {"role": "assistant", "content": "{\"capital\":"}]}),
    )
    .await
    .json();
    let rest = r["content"][0]["text"].as_str().unwrap();
    let doc: Value = serde_json::from_str(&format!("{{\"capital\":{rest}"))
        .unwrap_or_else(|e| panic!("{e}: {r}"));
    assert_eq!(doc["capital"], "Paris", "{r}");

    // `output_config.format`: JSON of the schema where the same request gives prose.
    let schema = json!({"type": "object", "properties": {"city": {"type": "string"},
        "country": {"type": "string"}}, "required": ["city", "country"]});
    let r = post(
        &s.at("/v1/messages"),
        &json!({"max_tokens": 60, "temperature": 0,
                "output_config": {"format": {"type": "json_schema", "schema": schema}},
                "messages": [{"role": "user", "content": "Tell me about Paris."}]}),
    )
    .await
    .json();
    let doc: Value = serde_json::from_str(r["content"][0]["text"].as_str().unwrap()).unwrap();
    assert_eq!(doc.as_object().unwrap().len(), 2, "{r}");
    assert!(doc["city"].is_string() && doc["country"].is_string(), "{r}");

    // Errors: Anthropic's shape, its type following the status; the server keeps serving.
    let error = |r: &Reply| -> (u16, String, String) {
        let b = r.json();
        assert_eq!(b["type"], "error", "{b}");
        (
            r.status,
            b["error"]["type"].as_str().unwrap().to_string(),
            b["error"]["message"].as_str().unwrap().to_string(),
        )
    };
    let msgs = json!([{"role": "user", "content": "x"}]);
    let cases = [
        (
            json!({"messages": msgs}),
            400,
            "invalid_request_error",
            "max_tokens",
        ),
        (
            json!({"max_tokens": 4, "model": "claude-sonnet-4-5", "messages": msgs}),
            404,
            "not_found_error",
            "claude-sonnet-4-5",
        ),
        (
            json!({"max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}]}]}),
            400,
            "invalid_request_error",
            "text only",
        ),
        (
            // `max_tokens` past the window is a ceiling (served, cut to fit); a prompt that
            // cannot fit at all is refused before inference.
            json!({"max_tokens": 4, "messages": [{"role": "user", "content": "word ".repeat(2100)}]}),
            400,
            "invalid_request_error",
            "prompt is too long",
        ),
        (
            json!({"max_tokens": 4, "messages": msgs, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}),
            400,
            "invalid_request_error",
            "web_search_20250305",
        ),
        (
            json!({"max_tokens": 4, "messages": [{"role": "assistant", "content": "Hi"}]}),
            400,
            "invalid_request_error",
            "needs a `user` message",
        ),
        (
            json!({"max_tokens": 4, "messages": [{"role": "user", "content": ""}]}),
            400,
            "invalid_request_error",
            "non-empty content",
        ),
        (
            json!({"max_tokens": 4, "messages": []}),
            400,
            "invalid_request_error",
            "must not be empty",
        ),
    ];
    for (body, status, kind, needle) in cases {
        let (got_status, got_kind, message) = error(&post(&s.at("/v1/messages"), &body).await);
        assert_eq!(
            (got_status, got_kind.as_str()),
            (status, kind),
            "{body}: {message}"
        );
        assert!(message.contains(needle), "{body}: {message}");
    }
    // Routes Anthropic has and mtpx does not, and a wrong method, answer in Anthropic's shape.
    let (status, kind, _) = error(&post(&s.at("/v1/messages/batches"), &json!({})).await);
    assert_eq!((status, kind.as_str()), (404, "not_found_error"));
    let (status, kind, _) = error(&get(&s.at("/v1/messages")).await);
    assert_eq!((status, kind.as_str()), (405, "invalid_request_error"));
    let r = post(
        &s.at("/v1/messages"),
        &json!({"max_tokens": 4, "messages": msgs}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
}
