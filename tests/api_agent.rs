//! The agent regression over HTTP, shaped like a coding agent's OpenAI traffic: system prompt
//! and tool definitions, a task, the assistant's `write` tool call carrying a 3,400-token file,
//! the tool result, then continuation turns past 16,384 and 19,295 tokens toward a 66,560
//! window, all in one `X-Session-Id`. Every turn is a 200 whose `cached_tokens` shows the
//! reuse; the over-window turn is a 400 `context_length_exceeded` with its counts; the server
//! keeps serving afterwards.

#[path = "fixtures/agent.rs"]
mod agent;
#[path = "fixtures/api/client.rs"]
mod client;

use agent::*;

use client::*;
use mtpx::api::testing::{test_config, TestServer};
use mtpx::config::KvMemory;
use mtpx::engine::EngineConfig;
use mtpx::kv::KvDtype;
use mtpx::model::test_model::TestModelSpec;
use serde_json::{json, Value};

const SESSION: (&str, &str) = ("x-session-id", "agent-1");

/// About `num_tokens` tokens of HTML/CSS/JS-like text, measured with `/tokenize`.
async fn file_of(s: &TestServer, num_tokens: usize, salt: usize) -> String {
    let mut text = String::new();
    let mut i = salt * 7919;
    loop {
        extend_file(&mut text, &mut i);
        let n = post(&s.at("/tokenize"), &json!({"prompt": text}))
            .await
            .json()["count"]
            .as_u64()
            .unwrap() as usize;
        if n >= num_tokens {
            return text;
        }
    }
}

fn turn(messages: &[Value], max_tokens: usize, stream: bool) -> Value {
    json!({
        "model": "test-model",
        "messages": messages,
        "tools": agent_tools(),
        "tool_choice": "auto",
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream": stream,
        "stream_options": {"include_usage": true},
    })
}

/// (prompt_tokens, cached_tokens) of a turn that must succeed.
async fn run_turn(
    s: &TestServer,
    messages: &[Value],
    max_tokens: usize,
    stream: bool,
) -> (usize, usize) {
    let reply = post_with(
        &s.at("/v1/chat/completions"),
        &turn(messages, max_tokens, stream),
        &[SESSION],
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let usage = if stream {
        let events = reply.events();
        assert_eq!(events.last().unwrap(), "[DONE]");
        events
            .iter()
            .find_map(|e| e.get("usage").filter(|u| !u.is_null()).cloned())
            .expect("a usage chunk")
    } else {
        reply.json()["usage"].clone()
    };
    let n = |v: &Value| v.as_u64().unwrap() as usize;
    (
        n(&usage["prompt_tokens"]),
        n(&usage["prompt_tokens_details"]["cached_tokens"]),
    )
}

#[actix_rt::test]
async fn an_agent_session_over_http_grows_past_16k_and_19k_to_a_66k_window() {
    let spec = TestModelSpec {
        layers: 1,
        hidden: 32,
        heads: 2,
        kv_heads: 1,
        head_dim: 16,
        intermediate: 64,
        ..TestModelSpec::default()
    };
    let cfg = EngineConfig {
        context_window: Some(WINDOW),
        kv_memory: KvMemory::Bytes(256 << 20),
        kv_dtype: KvDtype::F16,
        ..EngineConfig::default()
    };
    let s = TestServer::start(&spec, cfg, test_config()).unwrap();
    let models = get(&s.at("/v1/models")).await.json();
    assert_eq!(
        models["data"][0]["context_window"], WINDOW,
        "the advertised window"
    );

    let mut messages = vec![
        json!({"role": "system", "content": "You are a coding agent. Use the tools to edit files."}),
        json!({"role": "user", "content": "Create an HTML/CSS/JS future-city energy dashboard with an SVG map, a chart, controls and a modal."}),
    ];
    let (first_prompt, _) = run_turn(&s, &messages, 16, false).await;
    let index_html = file_of(&s, 3_400, 0).await;
    messages.push(
        json!({"role": "assistant", "content": null, "tool_calls": [{"id": "call_1",
        "type": "function", "function": {"name": "write",
        "arguments": json!({"path": "index.html", "content": index_html}).to_string()}}]}),
    );
    messages.push(json!({"role": "tool", "tool_call_id": "call_1", "content": "wrote index.html"}));

    let mut previous_prompt = first_prompt;
    let mut crossed = (false, false);
    let mut n_turn = 1;
    loop {
        n_turn += 1;
        let (prompt, cached) = run_turn(&s, &messages, 32, n_turn % 2 == 0).await;
        println!("turn {n_turn}: prompt {prompt} tokens, cached {cached}");
        assert!(
            cached + 16 > previous_prompt,
            "turn {n_turn} lost its KV: cached {cached}, previous prompt {previous_prompt}"
        );
        crossed.0 |= prompt > 16_384;
        crossed.1 |= prompt > 19_295;
        previous_prompt = prompt;
        if prompt + 6_000 > WINDOW {
            break;
        }
        messages.push(json!({"role": "assistant", "content": "", "tool_calls": [{"id": format!("call_{n_turn}"),
            "type": "function", "function": {"name": "read", "arguments": "{\"path\": \"part.js\"}"}}]}));
        let content = file_of(&s, 5_000, n_turn).await;
        messages.push(
            json!({"role": "tool", "tool_call_id": format!("call_{n_turn}"), "content": content}),
        );
    }
    assert!(
        crossed.0 && crossed.1,
        "the session must pass 16,384 and 19,295 tokens"
    );
    assert!(
        previous_prompt > 60_000,
        "the session must approach the window"
    );

    // The over-window turn: refused before inference, with its counts.
    messages.push(json!({"role": "user", "content": "Now write the whole app again."}));
    let count = post(
        &s.at("/v1/chat/completions/count"),
        &turn(&messages, 1, false),
    )
    .await
    .json();
    let prompt_tokens = count["prompt_tokens"].as_u64().unwrap() as usize;
    let too_many = WINDOW - prompt_tokens + 1;
    let refused = post_with(
        &s.at("/v1/chat/completions"),
        &turn(&messages, too_many, false),
        &[SESSION],
    )
    .await;
    assert_eq!(refused.status, 400);
    let e = refused.error();
    assert_eq!(e["code"], "context_length_exceeded");
    assert_eq!(e["prompt_tokens"], prompt_tokens);
    assert_eq!(e["max_tokens"], too_many);
    assert_eq!(e["context_window"], WINDOW);

    // The server and the session keep serving, still reusing the KV.
    let (prompt, cached) = run_turn(&s, &messages, 8, true).await;
    assert!(cached + 16 > previous_prompt);
    assert!(prompt + 8 <= WINDOW);
    assert_eq!(get(&s.at("/health")).await.status, 200);
    let other = post(
        &s.at("/v1/chat/completions"),
        &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    )
    .await;
    assert_eq!(other.status, 200);

    s.engine().clear_caches().await;
    assert_eq!(s.engine().pool_stats().await.num_used, 0, "no page leaks");
    s.stop().await;
}
