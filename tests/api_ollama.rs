//! Ollama's API over a real pulled model (Qwen2.5-Coder-0.5B-Instruct): `/api/chat` gives the
//! reply `/v1/chat/completions` gives for the same request, streamed as NDJSON lines that add
//! up to it; tool calls come back whole with the arguments as an object; `format` takes a JSON
//! Schema; `/api/generate` fills in the middle with `suffix`. Needs `mtpx pull
//! qwen2.5-coder-0.5b`. (The `ollama` Python package is run against the test model in
//! `tests/python/test_ollama.py`.)

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

/// The NDJSON lines of a streamed reply.
fn lines(reply: &Reply) -> Vec<Value> {
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(
        reply.header("content-type").as_deref(),
        Some("application/x-ndjson")
    );
    reply
        .text()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

fn weather_tool() -> Value {
    json!([{"type": "function", "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]},
    }}])
}

#[actix_rt::test]
async fn chat_matches_the_openai_endpoint_and_streams_the_same_reply() {
    let s = server();
    let tags = get(&s.at("/api/tags")).await.json();
    let name = tags["models"][0]["name"].as_str().unwrap().to_string();
    assert!(name.ends_with(":latest"), "{tags}");
    let messages = json!([{"role": "user", "content": "Write a haiku about Rust."}]);
    let openai = post(
        &s.at("/v1/chat/completions"),
        &json!({"messages": messages, "temperature": 0, "max_tokens": 12}),
    )
    .await
    .json();
    let expected = openai["choices"][0]["message"]["content"].as_str().unwrap();
    let body = json!({"model": name, "messages": messages,
                      "stream": false, "options": {"temperature": 0, "num_predict": 12}});
    let reply = post(&s.at("/api/chat"), &body).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let whole = reply.json();
    assert_eq!(whole["message"]["content"], expected);
    assert_eq!(whole["model"], name.as_str());
    assert_eq!(whole["done"], true);
    assert_eq!(whole["done_reason"], "length");
    assert_eq!(whole["eval_count"], 12);
    assert_eq!(whole["prompt_eval_count"], openai["usage"]["prompt_tokens"]);

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let lines = lines(&post(&s.at("/api/chat"), &streamed).await);
    let (last, text) = lines.split_last().unwrap();
    assert!(text.len() > 1, "{lines:?}");
    assert!(text.iter().all(|l| l["done"] == false));
    let joined: String = text
        .iter()
        .map(|l| l["message"]["content"].as_str().unwrap())
        .collect();
    assert_eq!(joined, expected);
    assert_eq!(last["done"], true);
    assert_eq!(last["eval_count"], 12);
    assert!(last["eval_duration"].as_u64().unwrap() > 0);
    assert!(last["total_duration"].as_u64() >= last["eval_duration"].as_u64());
}

#[actix_rt::test]
async fn tool_calls_come_back_whole_with_object_arguments() {
    let s = server();
    let body = json!({
        "messages": [{"role": "user", "content": "What is the weather in Paris? Use the tool."}],
        "tools": weather_tool(), "stream": false, "options": {"temperature": 0},
    });
    let whole = post(&s.at("/api/chat"), &body).await.json();
    let call = &whole["message"]["tool_calls"][0]["function"];
    assert_eq!(call["name"], "get_weather", "{whole}");
    assert_eq!(call["arguments"], json!({"city": "Paris"}), "{whole}");
    assert_eq!(whole["done_reason"], "stop");

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let lines = lines(&post(&s.at("/api/chat"), &streamed).await);
    let calls: Vec<&Value> = lines
        .iter()
        .filter_map(|l| l["message"]["tool_calls"].as_array())
        .flatten()
        .collect();
    assert_eq!(calls, [&whole["message"]["tool_calls"][0]], "{lines:?}");

    // The result goes back as a `tool` message naming the tool; the model answers from it.
    let mut messages = body["messages"].as_array().unwrap().clone();
    messages.push(whole["message"].clone());
    messages.push(json!({"role": "tool", "tool_name": "get_weather",
                         "content": "{\"temperature_c\": 31, \"sky\": \"clear\"}"}));
    let next = post(
        &s.at("/api/chat"),
        &json!({"messages": messages, "tools": weather_tool(), "stream": false,
                "options": {"temperature": 0, "num_predict": 40}}),
    )
    .await
    .json();
    let answer = next["message"]["content"].as_str().unwrap();
    assert!(answer.contains("31"), "{next}");
}

#[actix_rt::test]
async fn format_schema_and_fill_in_the_middle() {
    let s = server();
    // A schema as pydantic writes it (no `additionalProperties`): only its keys come back.
    let schema = json!({"type": "object", "title": "Country",
        "properties": {"name": {"type": "string"}, "capital": {"type": "string"}},
        "required": ["name", "capital"]});
    let whole = post(
        &s.at("/api/chat"),
        &json!({"messages": [{"role": "user", "content": "Tell me about France as JSON."}],
                "format": schema, "stream": false,
                "options": {"temperature": 0, "num_predict": 200}}),
    )
    .await
    .json();
    assert_eq!(whole["done_reason"], "stop", "{whole}");
    let country: Value = serde_json::from_str(whole["message"]["content"].as_str().unwrap())
        .unwrap_or_else(|e| panic!("{e}: {whole}"));
    let mut keys: Vec<&String> = country.as_object().unwrap().keys().collect();
    keys.sort();
    assert_eq!(keys, ["capital", "name"], "{country}");
    assert_eq!(country["capital"], "Paris");

    let fim = post(
        &s.at("/api/generate"),
        &json!({"prompt": "def fib(n):\n", "suffix": "\n\nprint(fib(10))\n", "stream": false,
                "options": {"temperature": 0, "num_predict": 48}}),
    )
    .await
    .json();
    let middle = fim["response"].as_str().unwrap();
    assert!(
        middle.contains("fib(n - 1)") || middle.contains("fib(n-1)"),
        "{fim}"
    );
    assert_eq!(fim["done_reason"], "stop", "{fim}");
}

#[actix_rt::test]
async fn errors_are_ollama_shaped() {
    let s = server();
    let bad = post(
        &s.at("/api/chat"),
        &json!({"messages": [{"role": "user", "content": "x"}], "options": {"top_p": "high"}}),
    )
    .await;
    assert_eq!(bad.status, 400);
    let message = bad.json()["error"].as_str().unwrap().to_string();
    assert!(message.contains("options.top_p"), "{message}");
    let missing = post(
        &s.at("/api/chat"),
        &json!({"model": "llama3", "messages": []}),
    )
    .await;
    assert_eq!(missing.status, 404);
    assert!(missing.json()["error"].is_string());
    let long = "word ".repeat(3000);
    let over = post(
        &s.at("/api/generate"),
        &json!({"prompt": long, "options": {"num_predict": 10}}),
    )
    .await;
    assert_eq!(over.status, 400, "{}", over.text());
    assert!(over.json()["error"].as_str().unwrap().contains("2048"));
    let pull = post(&s.at("/api/pull"), &json!({"model": "llama3"})).await;
    assert_eq!(pull.status, 501);
    // A wrong method under /api/ is answered in Ollama's shape too.
    let wrong = get(&s.at("/api/chat")).await;
    assert_eq!(wrong.status, 405, "{}", wrong.text());
    assert!(wrong.json()["error"].is_string(), "{}", wrong.text());
    // Qwen2.5-Coder does not think: `think: true` is refused, as Ollama refuses it.
    let think = post(
        &s.at("/api/chat"),
        &json!({"messages": [{"role": "user", "content": "x"}], "think": true}),
    )
    .await;
    assert_eq!(think.status, 400);
    let message = think.json()["error"].as_str().unwrap().to_string();
    assert!(message.contains("does not support thinking"), "{message}");
}

/// A final assistant message is continued, as Ollama's templates leave it open: the reply is
/// what follows it, the same as Anthropic's prefill on `/v1/messages` gives. `num_predict` is
/// a ceiling: beyond the window's room the reply ends when the window is full, not refused.
#[actix_rt::test]
async fn a_final_assistant_message_is_continued_and_num_predict_is_a_ceiling() {
    let s = server();
    let messages = json!([
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Lyon, and the capital of Germany is"},
    ]);
    let ollama = post(
        &s.at("/api/chat"),
        &json!({"messages": messages, "stream": false,
                "options": {"temperature": 0, "num_predict": 8}}),
    )
    .await
    .json();
    let model = get(&s.at("/v1/models")).await.json()["data"][0]["id"].clone();
    let anthropic = post(
        &s.at("/v1/messages"),
        &json!({"model": model, "messages": messages, "max_tokens": 8, "temperature": 0}),
    )
    .await
    .json();
    let continued = ollama["message"]["content"].as_str().unwrap();
    assert_eq!(continued, anthropic["content"][0]["text"], "{ollama}");
    assert!(continued.contains("Berlin"), "{ollama}");
    assert!(
        !continued.contains("capital of Germany"),
        "a new turn: {ollama}"
    );
    let u = &anthropic["usage"];
    let anthropic_prompt =
        u["input_tokens"].as_u64().unwrap() + u["cache_read_input_tokens"].as_u64().unwrap();
    assert_eq!(ollama["prompt_eval_count"], anthropic_prompt, "{ollama}");

    // The window is 2,048 tokens: a `num_predict` past it runs until the window is full.
    let body = json!({"prompt": "Count from 1 to 10000, one number a line.", "stream": false,
                      "options": {"temperature": 0, "num_predict": 1_000_000}});
    let long = post(&s.at("/api/generate"), &body).await;
    assert_eq!(long.status, 200, "{}", long.text());
    let long = long.json();
    let used = long["prompt_eval_count"].as_u64().unwrap() + long["eval_count"].as_u64().unwrap();
    assert!(used <= 2048, "{used} tokens in a 2,048-token window");
    assert!(
        long["done_reason"] == "length" || long["done_reason"] == "stop",
        "{long}"
    );
}
