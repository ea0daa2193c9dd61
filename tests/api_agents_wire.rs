//! What real agents send, over real HTTP, on the real Qwen2.5-Coder-0.5B: the Codex CLI's
//! Responses requests (a `namespace` tool, a hosted `web_search`, `store: false` turns keyed by
//! `prompt_cache_key` and its `session-id` header), opencode's concurrent requests under one
//! `x-session-id`, and tool calls held to the tools' grammar once the model opens one
//! (compared with the same server without it). Needs `mtpx pull qwen2.5-coder-0.5b`.

#[path = "fixtures/api/client.rs"]
mod client;
mod common;

use client::*;
use common::pulled_model;
use mtpx::api::testing::{test_config, TestServer};
use mtpx::config::KvMemory;
use mtpx::engine::EngineConfig;
use mtpx::kv::KvDtype;
use mtpx::spec::{SpecConfig, SpecMode};
use serde_json::{json, Value};

fn engine(lazy_tool_grammar: bool) -> EngineConfig {
    EngineConfig {
        context_window: Some(4096),
        kv_memory: KvMemory::Bytes(256 << 20),
        kv_dtype: KvDtype::F16,
        lazy_tool_grammar,
        // Drafts from the context (a call copies paths and names) at a fixed depth.
        speculative: SpecConfig {
            mode: SpecMode::Auto,
            depth: Some(6),
            ..SpecConfig::default()
        },
        ..EngineConfig::default()
    }
}

fn server(lazy_tool_grammar: bool) -> TestServer {
    TestServer::start_model(
        pulled_model("qwen2.5-coder-0.5b"),
        engine(lazy_tool_grammar),
        test_config(),
    )
    .unwrap()
}

fn function(name: &str, description: &str, properties: Value) -> Value {
    let required: Vec<&String> = properties.as_object().unwrap().keys().collect();
    json!({"type": "function", "name": name, "description": description, "strict": false,
        "parameters": {"type": "object", "properties": properties, "required": required,
            "additionalProperties": false}})
}

/// The tools of a Codex CLI 0.171 request, cut down: a function, a namespace of functions and
/// a hosted tool.
fn codex_tools() -> Value {
    json!([
        function("exec_command", "Runs a command in a PTY, returning output.",
            json!({"cmd": {"type": "string", "description": "Shell command to execute."}})),
        {"type": "namespace", "name": "multi_agent_v1",
         "description": "Tools for spawning and managing sub-agents.",
         "tools": [function("wait_agent", "Wait for agents to finish.",
            json!({"targets": {"type": "array", "items": {"type": "string"}}}))]},
        {"type": "web_search", "external_web_access": false},
    ])
}

fn codex_input(task: &str) -> Vec<Value> {
    vec![
        json!({"type": "message", "role": "developer", "content": [{"type": "input_text",
            "text": "You are a coding agent running in the Codex CLI. Use the tools."}]}),
        json!({"type": "message", "role": "user", "content": [{"type": "input_text",
            "text": "<environment_context>\n  <cwd>/tmp/work</cwd>\n  <shell>bash</shell>\n</environment_context>"}]}),
        json!({"type": "message", "role": "user",
            "content": [{"type": "input_text", "text": task}]}),
    ]
}

fn codex_body(input: &[Value], extra: Value) -> Value {
    let mut body = json!({
        "input": input, "tools": codex_tools(),
        "tool_choice": "auto", "parallel_tool_calls": true, "reasoning": {"summary": "auto"},
        "store": false, "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "thread-1", "temperature": 0,
        "client_metadata": {"session_id": "thread-1"},
    });
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

const CODEX_HEADERS: [(&str, &str); 2] =
    [("session-id", "thread-1"), ("x-client-request-id", "r1")];

#[actix_rt::test]
async fn codex_requests_are_served_and_its_namespaced_calls_come_back_named_as_declared() {
    let s = server(true);
    let url = s.at("/v1/responses");
    let input = codex_input("List the files here.");
    // Streamed, as Codex asks: the events it parses, ending with `response.completed`.
    let reply = post_with(
        &url,
        &codex_body(&input, json!({"stream": true, "max_output_tokens": 48})),
        &CODEX_HEADERS,
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let events = reply.events();
    let kinds: Vec<&str> = events.iter().filter_map(|e| e["type"].as_str()).collect();
    assert_eq!(kinds.first(), Some(&"response.created"));
    let last = kinds.last().copied();
    assert!(
        matches!(last, Some("response.completed" | "response.incomplete")),
        "{last:?}"
    );
    assert!(kinds.contains(&"response.output_item.added"));
    assert!(kinds.contains(&"response.output_item.done"));
    let completed = &events.last().unwrap()["response"];
    let first_prompt = completed["usage"]["input_tokens"].as_u64().unwrap();
    assert!(first_prompt > 0);
    // The hosted tool is left out, not refused, and no call names it.
    for e in &events {
        assert_ne!(e["item"]["name"], "web_search", "{e}");
    }

    // Codex's next turn resends everything, the reply's items included: the session its
    // `prompt_cache_key` (and `session-id`) names still holds the first turn, reply included.
    let mut next = input.clone();
    next.extend(completed["output"].as_array().unwrap().iter().cloned());
    next.push(json!({"type": "message", "role": "user",
        "content": [{"type": "input_text", "text": "Thanks."}]}));
    let second = post_with(
        &url,
        &codex_body(&next, json!({"max_output_tokens": 8})),
        &CODEX_HEADERS,
    )
    .await;
    assert_eq!(second.status, 200, "{}", second.text());
    let cached = second.json()["usage"]["input_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        cached >= first_prompt,
        "the next turn reused {cached} tokens of the first turn's {first_prompt}"
    );

    // A call of the namespace's function (forced, to be sure of one) comes back with the
    // function's name and the namespace, as Codex routes it.
    let forced = json!({"type": "function", "name": "wait_agent", "namespace": "multi_agent_v1"});
    let first = post_with(
        &url,
        &codex_body(&input, json!({"tool_choice": forced})),
        &CODEX_HEADERS,
    )
    .await;
    assert_eq!(first.status, 200, "{}", first.text());
    let first = first.json();
    let call = first["output"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["type"] == "function_call")
        .unwrap_or_else(|| panic!("no call: {first}"))
        .clone();
    assert_eq!(call["name"], "wait_agent", "{call}");
    assert_eq!(call["namespace"], "multi_agent_v1", "{call}");
    let args: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
    assert!(args["targets"].is_array(), "{args}");

    // Sent back with its namespace and answered, the call is part of the conversation.
    let mut next = input.clone();
    next.push(call.clone());
    next.push(
        json!({"type": "function_call_output", "call_id": call["call_id"],
        "output": "agent a1 finished"}),
    );
    let answered = post_with(
        &url,
        &codex_body(&next, json!({"max_output_tokens": 8})),
        &CODEX_HEADERS,
    )
    .await;
    assert_eq!(answered.status, 200, "{}", answered.text());

    // Forcing a hosted tool is refused, naming it.
    let refused = post(
        &url,
        &codex_body(&input, json!({"tool_choice": {"type": "web_search"}})),
    )
    .await;
    assert_eq!(refused.status, 400);
    assert_eq!(refused.error()["code"], "unsupported_tool");
    assert_eq!(refused.error()["param"], "tool_choice.type");
    s.stop().await;
}

/// opencode sends its `x-session-id` with its title request too, at the same time as the turn:
/// both are served (the second without the busy session), neither gets a 409.
#[actix_rt::test]
async fn concurrent_requests_under_one_session_key_are_all_served() {
    let s = server(true);
    let url = s.at("/v1/chat/completions");
    let body = |text: &str| {
        json!({"messages": [{"role": "user", "content": text}], "max_tokens": 24,
            "temperature": 0})
    };
    let header = [("x-session-id", "ses_1")];
    let (turn, title) = (
        body("Write a haiku about caches."),
        body("Generate a title for: caches"),
    );
    let (a, b) = futures::join!(
        post_with(&url, &turn, &header),
        post_with(&url, &title, &header),
    );
    assert_eq!(
        (a.status, b.status),
        (200, 200),
        "{} / {}",
        a.text(),
        b.text()
    );
    // The session is kept by one of them; a next turn of it still reuses its K/V.
    let again = post_with(&url, &body("Write a haiku about caches."), &header).await;
    assert_eq!(again.status, 200);
    s.stop().await;
}

fn file_tools() -> Value {
    let object = |props: Value, required: Value| json!({"type": "object", "properties": props, "required": required});
    json!([
        {"type": "function", "function": {"name": "write", "description": "Write a file",
            "parameters": object(json!({"path": {"type": "string"}, "content": {"type": "string"}}),
                json!(["path", "content"]))}},
        {"type": "function", "function": {"name": "read", "description": "Read a file",
            "parameters": object(json!({"path": {"type": "string"}}), json!(["path"]))}},
    ])
}

fn dashboard_request(extra: Value) -> Value {
    let mut body = json!({"messages": [{"role": "user", "content":
        "Write dashboard.js, a small function that returns an HTML string built with a \
         template literal, using the write tool."}],
        "tools": file_tools(), "temperature": 0, "max_tokens": 200});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

/// The first call of a chat reply as (name, parsed arguments), if it has one.
fn first_call(reply: &Value) -> Option<(String, Value)> {
    let call = &reply["choices"][0]["message"]["tool_calls"][0]["function"];
    let name = call["name"].as_str()?.to_string();
    let args = serde_json::from_str(call["arguments"].as_str()?).ok()?;
    Some((name, args))
}

/// What the Claude Code run showed: asked for a tool call, the 0.5B writes a fenced
/// "call" naming a tool that does not exist (`dashboard.js`), which stays text. Held to the
/// tools' grammar once it opens the call, the same reply is a call of `write` whose arguments
/// are valid; speculative drafts (verified against the grammar's mask) change nothing.
#[actix_rt::test]
async fn a_call_the_model_opens_is_held_to_the_declared_tools() {
    let free = server(false);
    let url = free.at("/v1/chat/completions");
    let unconstrained = post(&url, &dashboard_request(json!({}))).await.json();
    free.stop().await;
    println!(
        "without the grammar: {}",
        unconstrained["choices"][0]["message"]
    );

    let s = server(true);
    let url = s.at("/v1/chat/completions");
    let reply = post(&url, &dashboard_request(json!({}))).await.json();
    let (name, args) = first_call(&reply).unwrap_or_else(|| panic!("no call: {reply}"));
    assert_eq!(name, "write", "{reply}");
    assert!(
        args["path"].is_string() && args["content"].is_string(),
        "{args}"
    );
    assert_eq!(reply["choices"][0]["finish_reason"], "tool_calls");
    if first_call(&unconstrained).is_some_and(|(n, _)| n == "write") {
        println!("note: this CPU's unconstrained reply was a call too");
    }

    // The same reply without speculation, and streamed: token for token.
    let plain = post(&url, &dashboard_request(json!({"speculative": false})))
        .await
        .json();
    assert_eq!(first_call(&plain), first_call(&reply));
    let drafts = &reply["usage"]["completion_tokens_details"];
    let verified = drafts["accepted_prediction_tokens"].as_u64().unwrap()
        + drafts["rejected_prediction_tokens"].as_u64().unwrap();
    assert!(
        verified > 0,
        "drafts were verified under the grammar: {drafts}"
    );
    let streamed = post(&url, &dashboard_request(json!({"stream": true}))).await;
    let mut args = String::new();
    for chunk in streamed.events() {
        if let Some(a) =
            chunk["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"].as_str()
        {
            args.push_str(a);
        }
    }
    let streamed_args: Value = serde_json::from_str(&args).unwrap();
    assert_eq!(
        Some(("write".to_string(), streamed_args)),
        first_call(&reply)
    );

    // A reply that opens no call is not constrained: the same text as without the grammar.
    let prose = json!({"messages": [{"role": "user", "content": "Say hello in three words."}],
        "tools": file_tools(), "temperature": 0, "max_tokens": 16});
    let with_tools = post(&url, &prose).await.json();
    assert!(
        with_tools["choices"][0]["message"]["tool_calls"].is_null(),
        "{with_tools}"
    );
    s.stop().await;
}
