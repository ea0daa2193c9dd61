//! Engine events → Ollama's replies: one JSON object per line (`application/x-ndjson`) while
//! streaming, ending with a `"done": true` object that carries the counts and durations; or
//! that last object alone, holding the whole reply, when `stream` is false.
//!
//! The text goes through the same [`ToolCallParser`] as `/v1/chat/completions`, so `<think>`
//! becomes `thinking` and `<tool_call>` blocks become `tool_calls` (whole calls, with the
//! arguments as an object, as Ollama sends them).

use super::super::errors::ApiError;
use super::super::generate::{self, Collected};
use super::super::tool_calls::{Piece, ToolCallParser};
use super::super::types::ToolCall;
use super::super::AppState;
use super::rfc3339_now;
use crate::engine::{EngineEvent, EventStream};
use crate::scheduler::{FinishReason, Usage as EngineUsage};
use actix_web::web::{self, Bytes};
use serde::Serialize;
use serde_json::Value;
use std::collections::VecDeque;
use std::time::Instant;

/// Which endpoint's shape a reply takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `/api/chat`: `message: {role, content, thinking?, tool_calls?}`.
    Chat,
    /// `/api/generate`: `response` and `thinking?`.
    Generate,
}

/// What each line of a reply shares, and how its text is read.
#[derive(Clone)]
pub struct ReplyContext {
    pub endpoint: Endpoint,
    pub model: String,
    /// When the request arrived (`total_duration`).
    pub received: Instant,
    pub parser: ToolCallParser,
    /// Forced start of the reply (`tool_choice`), fed to the parser first.
    pub forced_prefix: String,
}

/// One line of a reply.
#[derive(Debug, Serialize)]
struct Line {
    model: String,
    created_at: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    message: Option<Message>,
    #[serde(skip_serializing_if = "Option::is_none")]
    response: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    thinking: Option<String>,
    done: bool,
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    stats: Option<Stats>,
}

#[derive(Debug, Default, Serialize)]
struct Message {
    role: &'static str,
    content: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    thinking: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tool_calls: Vec<Value>,
}

/// The last line's counts. Durations are in nanoseconds, as Ollama gives them.
/// `prompt_eval_count` is the whole prompt (`usage.prompt_tokens`), cached tokens included, so
/// that it plus `eval_count` is the context the conversation fills.
#[derive(Debug, Serialize)]
struct Stats {
    done_reason: &'static str,
    total_duration: u64,
    load_duration: u64,
    prompt_eval_count: usize,
    prompt_eval_duration: u64,
    eval_count: usize,
    eval_duration: u64,
}

/// Text, reasoning and completed tool calls decided so far.
#[derive(Debug, Default)]
struct Parts {
    content: String,
    thinking: String,
    tool_calls: Vec<Value>,
}

impl Parts {
    fn is_empty(&self) -> bool {
        self.content.is_empty() && self.thinking.is_empty() && self.tool_calls.is_empty()
    }
}

impl ReplyContext {
    fn line(&self, parts: Parts, stats: Option<Stats>) -> Line {
        let thinking = (!parts.thinking.is_empty()).then_some(parts.thinking);
        let (message, response, thinking) = match self.endpoint {
            Endpoint::Chat => (
                Some(Message {
                    role: "assistant",
                    content: parts.content,
                    thinking,
                    tool_calls: parts.tool_calls,
                }),
                None,
                None,
            ),
            Endpoint::Generate => (None, Some(parts.content), thinking),
        };
        Line {
            model: self.model.clone(),
            created_at: rfc3339_now(),
            message,
            response,
            thinking,
            done: stats.is_some(),
            stats,
        }
    }

    fn stats(&self, reason: FinishReason, usage: &EngineUsage) -> Stats {
        let ns = |ms: f64| (ms * 1e6).max(0.0) as u64;
        Stats {
            done_reason: match reason {
                FinishReason::Length => "length",
                FinishReason::Stop | FinishReason::Cancelled => "stop",
            },
            total_duration: self.received.elapsed().as_nanos() as u64,
            load_duration: 0,
            prompt_eval_count: usage.prompt_tokens,
            prompt_eval_duration: ns(usage.prompt_ms),
            eval_count: usage.completion_tokens,
            eval_duration: ns(usage.decode_ms),
        }
    }

    /// The whole reply as one object (`"stream": false`).
    pub fn complete(mut self, state: &AppState, collected: Collected) -> Value {
        let usage = collected.usage;
        generate::count_usage(&state.metrics, &usage);
        let mut parts = Parts::default();
        let prefix = std::mem::take(&mut self.forced_prefix);
        let mut pieces = self.parser.push(&prefix);
        pieces.extend(self.parser.push(&collected.text));
        pieces.extend(self.parser.finish());
        absorb(&mut parts, pieces);
        parts.tool_calls = self.parser.tool_calls().iter().map(ollama_call).collect();
        let reason = collected.finish.unwrap_or(FinishReason::Stop);
        let stats = self.stats(reason, &usage);
        serde_json::to_value(self.line(parts, Some(stats))).unwrap_or(Value::Null)
    }

    /// The reply as NDJSON lines, the last one with `"done": true` (or `{"error": …}` when
    /// the engine fails mid-reply).
    pub fn lines(
        self,
        state: web::Data<AppState>,
        events: EventStream,
    ) -> futures::stream::LocalBoxStream<'static, Bytes> {
        let mut reply = Streaming {
            ctx: self,
            sent_calls: 0,
        };
        let prefix = std::mem::take(&mut reply.ctx.forced_prefix);
        let pieces = reply.ctx.parser.push(&prefix);
        let mut queue = VecDeque::new();
        reply.send(pieces, &mut queue);
        generate::event_frames(reply, events, queue, state)
    }
}

/// The state of a streamed reply.
struct Streaming {
    ctx: ReplyContext,
    /// Tool calls already sent (each is sent once, whole).
    sent_calls: usize,
}

impl generate::EventFrames for Streaming {
    fn on_event(&mut self, event: EngineEvent, queue: &mut VecDeque<Bytes>) -> bool {
        match event {
            EngineEvent::Started { .. } | EngineEvent::PromptLogprobs { .. } => false,
            EngineEvent::Delta { text, .. } => {
                let pieces = self.ctx.parser.push(&text);
                self.send(pieces, queue);
                false
            }
            EngineEvent::Finished { reason, usage, .. } => {
                let pieces = self.ctx.parser.finish();
                self.send(pieces, queue);
                let stats = self.ctx.stats(reason, &usage);
                queue.push_back(ndjson(&self.ctx.line(Parts::default(), Some(stats))));
                true
            }
            EngineEvent::Error(e) => {
                queue.push_back(error_line(&ApiError::from(e)));
                true
            }
        }
    }
}

impl Streaming {
    /// A line for what `pieces` decided, if anything: text and reasoning as they come, tool
    /// calls once complete.
    fn send(&mut self, pieces: Vec<Piece>, queue: &mut VecDeque<Bytes>) {
        let mut parts = Parts::default();
        absorb(&mut parts, pieces);
        let calls = self.ctx.parser.tool_calls();
        parts.tool_calls = calls[self.sent_calls..].iter().map(ollama_call).collect();
        self.sent_calls = calls.len();
        if !parts.is_empty() {
            queue.push_back(ndjson(&self.ctx.line(parts, None)));
        }
    }
}

fn absorb(parts: &mut Parts, pieces: Vec<Piece>) {
    for piece in pieces {
        match piece {
            Piece::Content(t) => parts.content.push_str(&t),
            Piece::Reasoning(t) => parts.thinking.push_str(&t),
            Piece::ToolCallStart { .. } | Piece::ToolCallArgs { .. } => {}
        }
    }
}

/// A tool call as Ollama writes it: no id, the arguments as an object.
fn ollama_call(call: &ToolCall) -> Value {
    let arguments = match &call.function.arguments {
        Value::String(s) => serde_json::from_str(s).unwrap_or_else(|_| Value::String(s.clone())),
        other => other.clone(),
    };
    serde_json::json!({"function": {"name": call.function.name, "arguments": arguments}})
}

/// One NDJSON line.
pub fn ndjson(value: &impl Serialize) -> Bytes {
    let mut line = serde_json::to_vec(value)
        .unwrap_or_else(|e| format!("{{\"error\":\"serializing a reply: {e}\"}}").into_bytes());
    line.push(b'\n');
    Bytes::from(line)
}

/// Ollama's error object, `{"error": "message"}`, as a line.
pub fn error_line(e: &ApiError) -> Bytes {
    ndjson(&serde_json::json!({"error": e.message}))
}
