//! `mtpx bench --ws [URL]`: an agent session over one Responses WebSocket, turn by turn against
//! a cold peer measured in the same run.
//!
//! Each turn sends only its new items (a tool call and its output of about `--ws-tool-tokens`
//! tokens) with `previous_response_id`, so the server resumes the session's KV pages. Right
//! after it, the peer sends the same whole conversation as a fresh request under a salted
//! instruction, so nothing of it can come from a cache: the KV-reuse saving is the ratio of the
//! two times to first token. Without a URL the command serves `--model` itself on a loopback
//! port (the same server `mtpx serve` runs).

use super::ModelArgs;
use crate::api::responses::types::ResponseObject;
use crate::api::testing::TestServer;
use crate::api::ApiConfig;
use crate::client::ws::{ResponsesSocket, Turn};
use crate::engine::EngineConfig;
use crate::pull::resolve_model;
use anyhow::{Context, Result};
use serde_json::{json, Value};
use std::time::Duration;

/// What one turn measured: the session's continuation and the cold peer.
#[derive(Debug, Clone, serde::Serialize)]
pub struct TurnFigures {
    pub turn: usize,
    pub input_tokens: usize,
    pub cached_tokens: usize,
    pub session_ttft_ms: f64,
    /// Prompt tokens the cold peer found cached (a page's worth at most: the salt is early).
    pub cold_cached_tokens: usize,
    pub cold_ttft_ms: f64,
    pub cold_over_session: f64,
}

/// The options of a WebSocket session benchmark.
#[derive(Debug, Clone)]
pub struct WsBench {
    pub turns: usize,
    pub tool_tokens: usize,
    pub max_output_tokens: usize,
    pub api_key: Option<String>,
}

const INSTRUCTIONS: &str = "You are a coding agent. Use the tools to read and edit files.";
const TASK: &str = "Rename the function `parse` to `parse_config` everywhere in the project.";

/// About `num_tokens` tokens (4 characters each, on average, for code) of file text.
fn file_text(num_tokens: usize, salt: usize) -> String {
    let mut text = String::new();
    let mut i = salt * 7919;
    while text.len() < num_tokens * 4 {
        i += 1;
        text.push_str(&format!(
            "fn step_{i}(state: &mut State) -> u32 {{ state.value = parse(\"{}\"); {} }}\n",
            i % 97,
            i * 13 % 1000
        ));
    }
    text
}

/// The new items of tool round `turn`: the agent's call and the tool's output.
fn tool_round(turn: usize, tool_tokens: usize) -> Vec<Value> {
    let call_id = format!("call_{turn}");
    vec![
        json!({"type": "function_call", "call_id": call_id, "name": "read",
               "arguments": json!({"path": format!("src/part_{turn}.rs")}).to_string()}),
        json!({"type": "function_call_output", "call_id": call_id,
               "output": file_text(tool_tokens, turn)}),
    ]
}

fn tools() -> Value {
    json!([{"type": "function", "name": "read", "description": "Read a file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                           "required": ["path"]}}])
}

/// A `response.create` body; `previous`: continue that response's session.
fn body(
    opts: &WsBench,
    instructions: &str,
    input: Vec<Value>,
    previous: Option<&str>,
    store: bool,
) -> Value {
    let mut b = json!({
        "instructions": instructions,
        "input": input,
        "tools": tools(),
        "tool_choice": "none",
        "temperature": 0,
        "max_output_tokens": opts.max_output_tokens,
        "store": store,
    });
    if let Some(p) = previous {
        b["previous_response_id"] = json!(p);
    }
    b
}

/// The reply of a turn as the input item the conversation carries forward.
fn reply_items(response: &ResponseObject) -> Vec<Value> {
    vec![json!({"type": "message", "role": "assistant",
                "content": [{"type": "output_text", "text": response.output_text()}]})]
}

fn ttft_ms(t: &Turn) -> f64 {
    t.ttft.unwrap_or(t.elapsed).as_secs_f64() * 1e3
}

/// Runs the session against the server at `url`; returns one row per continuation turn.
pub async fn run_ws_bench(url: &str, opts: &WsBench) -> Result<Vec<TurnFigures>> {
    let key = opts.api_key.as_deref();
    // One connection for both: an idle socket answers no pings (it is not read), and the
    // server drops peers that stay silent for two ping intervals.
    let mut session = ResponsesSocket::connect(url, key).await?;
    let first_input = vec![json!({"type": "message", "role": "user", "content": TASK})];
    let mut history = first_input.clone();
    let mut previous = session
        .turn(&body(opts, INSTRUCTIONS, first_input, None, true))
        .await
        .context("the first turn")?
        .response;
    history.extend(reply_items(&previous));
    let mut rows = Vec::with_capacity(opts.turns);
    for turn in 1..=opts.turns {
        let items = tool_round(turn, opts.tool_tokens);
        let t = session
            .turn(&body(
                opts,
                INSTRUCTIONS,
                items.clone(),
                Some(&previous.id),
                true,
            ))
            .await
            .with_context(|| format!("turn {turn}"))?;
        history.extend(items);
        // The salt leads, so no page of the peer's prompt matches an earlier one.
        let salted = format!("[cold run {turn}-{}] {INSTRUCTIONS}", rand::random::<u32>());
        let cold = session
            .turn(&body(opts, &salted, history.clone(), None, false))
            .await
            .with_context(|| format!("cold peer of turn {turn}"))?;
        let usage = t.response.usage.unwrap_or_default();
        let (session_ms, cold_ms) = (ttft_ms(&t), ttft_ms(&cold));
        rows.push(TurnFigures {
            turn,
            input_tokens: usage.input_tokens,
            cached_tokens: usage.input_tokens_details.cached_tokens,
            session_ttft_ms: session_ms,
            cold_cached_tokens: cold
                .response
                .usage
                .unwrap_or_default()
                .input_tokens_details
                .cached_tokens,
            cold_ttft_ms: cold_ms,
            cold_over_session: cold_ms / session_ms.max(1e-3),
        });
        history.extend(reply_items(&t.response));
        previous = t.response;
    }
    let _ = session.close().await;
    Ok(rows)
}

/// `mtpx bench --ws`: against `url`, or against `model` served in-process when `url` is empty.
pub fn bench_ws(url: &str, model: &ModelArgs, opts: &WsBench, as_json: bool) -> Result<()> {
    actix_rt::System::new().block_on(async {
        let local;
        let url = if url.is_empty() {
            let path = resolve_model(&model.model, true)?;
            let engine = EngineConfig {
                kv_memory: model.kv_memory,
                kv_dtype: model.kv_dtype,
                page_size: model.page_size,
                ..EngineConfig::default()
            };
            let mut config = ApiConfig::new(&model.model);
            config.keep_alive = Duration::from_secs(15);
            local = TestServer::start_model(path, engine, config)?;
            local.url.clone()
        } else {
            url.to_string()
        };
        let rows = run_ws_bench(&url, opts).await?;
        print_report(&url, opts, &rows, as_json);
        Ok(())
    })
}

fn print_report(url: &str, opts: &WsBench, rows: &[TurnFigures], as_json: bool) {
    let ratio = super::median_f64(rows.iter().map(|r| r.cold_over_session).collect());
    if as_json {
        let report = json!({
            "url": url,
            "turns": opts.turns,
            "tool_tokens": opts.tool_tokens,
            "rows": rows,
            "median_cold_over_session_ttft": ratio,
        });
        println!("{report}");
        return;
    }
    println!("turn  input  cached  session TTFT  cold TTFT  cold/session");
    for r in rows {
        println!(
            "{:>4}  {:>5}  {:>6}  {:>9.1} ms  {:>6.1} ms  {:>11.2}x",
            r.turn,
            r.input_tokens,
            r.cached_tokens,
            r.session_ttft_ms,
            r.cold_ttft_ms,
            r.cold_over_session
        );
    }
    println!("median cold/session TTFT: {ratio:.2}x (session turns prefill only their new items)");
}

#[cfg(test)]
mod tests {
    #[test]
    fn file_text_grows_with_the_requested_size() {
        let small = super::file_text(100, 1);
        let large = super::file_text(1000, 1);
        assert!(small.len() >= 400 && large.len() >= 4000);
        assert_ne!(super::file_text(100, 2), small, "salted per turn");
    }
}
