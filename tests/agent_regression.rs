//! The regression this project exists for: a coding agent's session, driven turn by turn the
//! way a real agent drives it (system prompt with tools, a task, a `write` tool call carrying a
//! 3,400-token file, the tool result, then continuations), growing past 16,384 and 19,295
//! tokens and on to a 66,560-token window. Every turn completes and prefills only its new
//! tokens; the turn that would cross the window is refused before inference with the right
//! counts; the session still works afterwards.

#[path = "fixtures/agent.rs"]
mod agent;
mod common;

use agent::*;

use common::*;
use mtpx::config::KvMemory;
use mtpx::engine::{Engine, EngineConfig, GenerateRequest, Prompt};
use mtpx::error::EngineError;
use mtpx::kv::KvDtype;
use mtpx::model::test_model::TestModelSpec;
use mtpx::sampling::SamplingParams;
use mtpx::session::SessionKey;
use mtpx::spec::{SpecConfig, SpecCounters, SpecMode};
use serde_json::{json, Value};

/// A file of about `num_tokens` tokens of HTML/CSS/JS-like text (measured with the model's
/// own tokenizer).
async fn file_of(engine: &Engine, num_tokens: usize, salt: usize) -> String {
    let mut text = String::new();
    let mut i = salt * 7919;
    loop {
        extend_file(&mut text, &mut i);
        let n = engine
            .tokenize(&Prompt::Text(text.clone()))
            .await
            .unwrap()
            .len();
        if n >= num_tokens {
            return text;
        }
    }
}

fn request(messages: &[Value], session: &SessionKey, max_tokens: usize) -> GenerateRequest {
    let mut req = GenerateRequest::new(Prompt::Chat {
        messages: Value::Array(messages.to_vec()),
        tools: Some(agent_tools()),
    });
    req.max_tokens = Some(max_tokens);
    req.session = Some(session.clone());
    req.sampling = SamplingParams::greedy();
    req
}

#[actix_rt::test]
async fn an_agent_session_grows_past_16k_and_19k_to_a_66k_window() {
    agent_session(SpecConfig::default()).await;
}

#[actix_rt::test]
async fn an_agent_session_with_speculation_grows_to_a_66k_window() {
    let stats = agent_session(SpecConfig {
        mode: SpecMode::Auto,
        ..SpecConfig::default()
    })
    .await;
    println!("{stats:?}");
}

/// Drives the session; returns the engine's draft counters.
async fn agent_session(speculative: SpecConfig) -> SpecCounters {
    // A narrow model keeps 66K-token attention affordable on two cores.
    let spec = TestModelSpec {
        layers: 1,
        hidden: 32,
        heads: 2,
        kv_heads: 1,
        head_dim: 16,
        intermediate: 64,
        ..TestModelSpec::default()
    };
    // Strict: the turn past the window is refused rather than cut (the default serves it up
    // to the window; `tests/engine.rs` checks both).
    let cfg = EngineConfig {
        context_window: Some(WINDOW),
        kv_memory: KvMemory::Bytes(256 << 20),
        kv_dtype: KvDtype::F16,
        speculative,
        strict_max_tokens: true,
        ..EngineConfig::default()
    };
    let t = start_engine(&spec, cfg);
    let engine = &t.engine;
    assert_eq!(
        engine.info().context_window,
        WINDOW,
        "advertised window is the enforced one"
    );
    let session = SessionKey {
        scope: String::new(),
        session_id: "agent".into(),
    };
    let mut messages = vec![
        json!({"role": "system", "content": "You are a coding agent. Use the tools to edit files."}),
        json!({"role": "user", "content": "Create an HTML/CSS/JS future-city energy dashboard with an SVG map, a chart, controls and a modal."}),
    ];

    // Turn 1: the task. The agent then "writes" index.html: a 3,400-token tool call.
    let first = run(engine, request(&messages, &session, 16)).await;
    assert!(first.error.is_none(), "{:?}", first.error);
    let index_html = file_of(engine, 3_400, 0).await;
    messages.push(
        json!({"role": "assistant", "content": "", "tool_calls": [{"id": "call_1",
        "type": "function", "function": {"name": "write",
        "arguments": json!({"path": "index.html", "content": index_html}).to_string()}}]}),
    );
    messages.push(json!({"role": "tool", "tool_call_id": "call_1", "content": "wrote index.html"}));

    let mut previous_prompt = first.prompt_tokens;
    let mut crossed = (false, false);
    let mut turn = 1;
    loop {
        let out = run(engine, request(&messages, &session, 32)).await;
        turn += 1;
        assert!(out.error.is_none(), "turn {turn}: {:?}", out.error);
        assert!(out.finish.is_some(), "turn {turn} did not finish");
        let prefilled = out.prompt_tokens - out.cached_tokens;
        println!(
            "turn {turn}: prompt {} tokens, cached {}, prefilled {prefilled}",
            out.prompt_tokens, out.cached_tokens
        );
        // Only the new tokens are prefilled: everything up to the previous prompt is reused
        // (less at most one page, where the new turn diverges inside a cached page).
        assert!(
            out.cached_tokens + 16 > previous_prompt,
            "turn {turn} lost its KV"
        );
        assert!(prefilled < out.prompt_tokens - previous_prompt + 16);
        crossed.0 |= out.prompt_tokens > 16_384;
        crossed.1 |= out.prompt_tokens > 19_295;
        previous_prompt = out.prompt_tokens;
        if out.prompt_tokens + 6_000 > WINDOW {
            break;
        }
        // The agent reads another large file and continues.
        messages.push(json!({"role": "assistant", "content": "", "tool_calls": [{"id": format!("call_{turn}"),
            "type": "function", "function": {"name": "read", "arguments": "{\"path\": \"part.js\"}"}}]}));
        let content = file_of(engine, 5_000, turn).await;
        messages.push(
            json!({"role": "tool", "tool_call_id": format!("call_{turn}"), "content": content}),
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

    // A turn that would cross the window is refused before inference, with the counts.
    messages.push(json!({"role": "user", "content": "Now write the whole app again."}));
    let prompt_tokens = engine
        .tokenize(&Prompt::Chat {
            messages: Value::Array(messages.clone()),
            tools: Some(agent_tools()),
        })
        .await
        .unwrap()
        .len();
    let too_many = WINDOW - prompt_tokens + 1;
    let refused = run(engine, request(&messages, &session, too_many)).await;
    assert_eq!(
        refused.error,
        Some(EngineError::ContextLengthExceeded {
            prompt_tokens,
            max_tokens: too_many,
            context_window: WINDOW
        })
    );
    // The session is still usable with a shorter max_tokens, and still reuses its KV.
    let after = run(engine, request(&messages, &session, 8)).await;
    assert!(after.error.is_none(), "{:?}", after.error);
    assert!(after.cached_tokens + 16 > previous_prompt);
    assert!(after.prompt_tokens + 8 <= WINDOW);

    engine.clear_caches().await;
    assert_eq!(engine.pool_stats().await.num_used, 0, "no page leaks");
    engine.scheduler_stats().await.spec
}
