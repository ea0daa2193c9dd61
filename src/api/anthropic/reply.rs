//! Engine events → Anthropic's replies: a `message` object, or its SSE stream (`message_start`,
//! per content block `content_block_start` / `_delta` / `_stop`, `message_delta` with the stop
//! reason and usage, `message_stop`).
//!
//! The text goes through the same [`ToolCallParser`] as `/v1/chat/completions`; its pieces
//! become content blocks in one place, [`Blocks`], for both shapes, so a streamed reply adds up
//! to exactly the message the same request gets whole: `<think>` text is a `thinking` block,
//! plain text a `text` block (whitespace alone does not open one), each tool call a `tool_use`
//! block whose `input_json_delta`s are the arguments' JSON.

use super::super::errors::ApiError;
use super::super::generate::{self, Collected};
use super::super::sse;
use super::super::tool_calls::{Piece, ToolCallParser};
use super::super::AppState;
use crate::engine::{EngineEvent, EventStream};
use crate::scheduler::{FinishReason, Usage as EngineUsage};
use actix_web::web::{self, Bytes};
use serde_json::{json, Value};
use std::collections::VecDeque;

/// What every part of a reply shares.
#[derive(Clone)]
pub struct ReplyContext {
    pub id: String,
    pub model: String,
    pub parser: ToolCallParser,
    /// Forced start of the reply (`tool_choice`), fed to the parser first.
    pub forced_prefix: String,
}

/// A change to the content blocks.
#[derive(Debug, Clone, PartialEq)]
enum BlockEvent {
    /// A block opens (`content_block` as Anthropic writes it, empty).
    Start(Value),
    /// A `delta` of the open block.
    Delta(Value),
    Stop,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Open {
    Text,
    Thinking,
    ToolUse,
}

/// Parser pieces → content-block events, each with its block's index.
#[derive(Default)]
struct Blocks {
    open: Option<Open>,
    /// Blocks opened so far.
    count: usize,
    /// Whitespace seen while no text block is open: sent if text follows, dropped otherwise.
    pending_space: String,
    /// `tool_use` blocks opened so far.
    tool_uses: usize,
    /// The open `tool_use` block's arguments so far.
    arguments: String,
}

impl Blocks {
    fn push(&mut self, piece: Piece, out: &mut Vec<(usize, BlockEvent)>) {
        match piece {
            Piece::Content(text) => {
                let mut text = text;
                if self.open != Some(Open::Text) {
                    if text.trim().is_empty() {
                        self.pending_space.push_str(&text);
                        return;
                    }
                    text = std::mem::take(&mut self.pending_space) + &text;
                    self.start(Open::Text, json!({"type": "text", "text": ""}), out);
                }
                self.delta(json!({"type": "text_delta", "text": text}), out);
            }
            Piece::Reasoning(text) => {
                if self.open != Some(Open::Thinking) && text.trim().is_empty() {
                    return;
                }
                if self.open != Some(Open::Thinking) {
                    let block = json!({"type": "thinking", "thinking": "", "signature": ""});
                    self.start(Open::Thinking, block, out);
                }
                self.delta(json!({"type": "thinking_delta", "thinking": text}), out);
            }
            Piece::ToolCallStart { id, name, .. } => {
                let block = json!({"type": "tool_use", "id": id, "name": name, "input": {}});
                self.start(Open::ToolUse, block, out);
                self.tool_uses += 1;
            }
            // Held until the call ends: a small model's arguments may not be valid JSON, and
            // clients parse each streamed `partial_json` as the start of a document.
            Piece::ToolCallArgs { fragment, .. } => {
                if self.open == Some(Open::ToolUse) {
                    self.arguments.push_str(&fragment);
                }
            }
        }
    }

    fn start(&mut self, kind: Open, block: Value, out: &mut Vec<(usize, BlockEvent)>) {
        self.close(out);
        self.pending_space.clear();
        self.open = Some(kind);
        self.count += 1;
        out.push((self.count - 1, BlockEvent::Start(block)));
    }

    fn delta(&self, delta: Value, out: &mut Vec<(usize, BlockEvent)>) {
        out.push((self.count - 1, BlockEvent::Delta(delta)));
    }

    fn close(&mut self, out: &mut Vec<(usize, BlockEvent)>) {
        if self.open == Some(Open::ToolUse) {
            // The arguments as one JSON object: `{}` when the model wrote none or no object.
            let arguments = std::mem::take(&mut self.arguments);
            let input = match serde_json::from_str::<Value>(&arguments) {
                Ok(v @ Value::Object(_)) => v,
                _ => json!({}),
            };
            let delta = json!({"type": "input_json_delta", "partial_json": input.to_string()});
            self.delta(delta, out);
        }
        if self.open.take().is_some() {
            out.push((self.count - 1, BlockEvent::Stop));
        }
    }
}

/// Anthropic's `stop_reason` and `stop_sequence`.
fn stop_reason(
    finish: FinishReason,
    stop_string: Option<&str>,
    tool_use: bool,
) -> (&'static str, Value) {
    match (finish, stop_string) {
        (FinishReason::Length, _) => ("max_tokens", Value::Null),
        (_, Some(s)) => ("stop_sequence", json!(s)),
        _ if tool_use => ("tool_use", Value::Null),
        _ => ("end_turn", Value::Null),
    }
}

/// Anthropic counts cache reads apart from `input_tokens`.
fn usage(u: &EngineUsage) -> Value {
    json!({
        "input_tokens": u.prompt_tokens - u.cached_tokens.min(u.prompt_tokens),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": u.cached_tokens,
        "output_tokens": u.completion_tokens,
    })
}

impl ReplyContext {
    fn message(&self, content: Vec<Value>, stop: (&str, Value), usage: Value) -> Value {
        json!({
            "id": self.id, "type": "message", "role": "assistant", "model": self.model,
            "content": content, "stop_reason": stop.0, "stop_sequence": stop.1, "usage": usage,
        })
    }

    /// The whole reply as one `message`.
    pub fn complete(mut self, state: &AppState, c: Collected) -> Value {
        generate::count_usage(&state.metrics, &c.usage);
        let prefix = std::mem::take(&mut self.forced_prefix);
        let mut pieces = self.parser.push(&prefix);
        pieces.extend(self.parser.push(&c.text));
        pieces.extend(self.parser.finish());
        let mut blocks = Blocks::default();
        let mut events = Vec::new();
        for piece in pieces {
            blocks.push(piece, &mut events);
        }
        blocks.close(&mut events);
        let mut content: Vec<Value> = Vec::new();
        let mut partial_json = String::new();
        for (_, event) in events {
            match event {
                BlockEvent::Start(block) => content.push(block),
                BlockEvent::Delta(d) => {
                    let block = content.last_mut().expect("a delta follows its start");
                    match d["type"].as_str() {
                        Some("text_delta") => append(block, "text", &d["text"]),
                        Some("thinking_delta") => append(block, "thinking", &d["thinking"]),
                        _ => partial_json.push_str(d["partial_json"].as_str().unwrap_or("")),
                    }
                }
                BlockEvent::Stop => {
                    let block = content.last_mut().expect("a stop follows its start");
                    if block["type"] == "tool_use" {
                        let json = std::mem::take(&mut partial_json);
                        block["input"] = serde_json::from_str(&json).unwrap_or_else(|_| json!({}));
                    }
                }
            }
        }
        let finish = c.finish.unwrap_or(FinishReason::Stop);
        let stop = stop_reason(finish, c.stop_string.as_deref(), blocks.tool_uses > 0);
        self.message(content, stop, usage(&c.usage))
    }

    /// The reply as Anthropic's SSE events (an `error` event when the engine fails mid-reply).
    pub fn events(
        self,
        state: web::Data<AppState>,
        events: EventStream,
    ) -> futures::stream::LocalBoxStream<'static, Bytes> {
        let reply = Streaming {
            ctx: self,
            blocks: Blocks::default(),
        };
        generate::event_frames(reply, events, VecDeque::new(), state)
    }
}

fn append(block: &mut Value, field: &str, text: &Value) {
    let joined = format!(
        "{}{}",
        block[field].as_str().unwrap_or(""),
        text.as_str().unwrap_or("")
    );
    block[field] = json!(joined);
}

struct Streaming {
    ctx: ReplyContext,
    blocks: Blocks,
}

impl generate::EventFrames for Streaming {
    fn on_event(&mut self, event: EngineEvent, queue: &mut VecDeque<Bytes>) -> bool {
        match event {
            EngineEvent::Started {
                prompt_tokens,
                cached_tokens,
            } => {
                let u = EngineUsage {
                    prompt_tokens,
                    cached_tokens,
                    ..EngineUsage::default()
                };
                let message = self.ctx.message(Vec::new(), ("", Value::Null), usage(&u));
                let mut message = message;
                message["stop_reason"] = Value::Null;
                queue.push_back(sse::event(
                    "message_start",
                    &json!({"type": "message_start", "message": message}),
                ));
                let prefix = std::mem::take(&mut self.ctx.forced_prefix);
                let pieces = self.ctx.parser.push(&prefix);
                self.send(pieces, queue);
                false
            }
            EngineEvent::PromptLogprobs { .. } => false,
            EngineEvent::Delta { text, .. } => {
                let pieces = self.ctx.parser.push(&text);
                self.send(pieces, queue);
                false
            }
            EngineEvent::Finished {
                reason,
                usage: u,
                stop_string,
            } => {
                let pieces = self.ctx.parser.finish();
                self.send(pieces, queue);
                let mut closing = Vec::new();
                self.blocks.close(&mut closing);
                self.frames(closing, queue);
                let (reason, sequence) =
                    stop_reason(reason, stop_string.as_deref(), self.blocks.tool_uses > 0);
                let delta = json!({"type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": usage(&u)});
                queue.push_back(sse::event("message_delta", &delta));
                queue.push_back(sse::event("message_stop", &json!({"type": "message_stop"})));
                true
            }
            EngineEvent::Error(e) => {
                let e = ApiError::from(e);
                let body = super::error_body(&e);
                queue.push_back(sse::event("error", &body));
                true
            }
        }
    }
}

impl Streaming {
    fn send(&mut self, pieces: Vec<Piece>, queue: &mut VecDeque<Bytes>) {
        let mut events = Vec::new();
        for piece in pieces {
            self.blocks.push(piece, &mut events);
        }
        self.frames(events, queue);
    }

    fn frames(&self, events: Vec<(usize, BlockEvent)>, queue: &mut VecDeque<Bytes>) {
        for (index, event) in events {
            let (name, value) = match event {
                BlockEvent::Start(block) => (
                    "content_block_start",
                    json!({"type": "content_block_start", "index": index, "content_block": block}),
                ),
                BlockEvent::Delta(delta) => (
                    "content_block_delta",
                    json!({"type": "content_block_delta", "index": index, "delta": delta}),
                ),
                BlockEvent::Stop => (
                    "content_block_stop",
                    json!({"type": "content_block_stop", "index": index}),
                ),
            };
            queue.push_back(sse::event(name, &value));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_open_and_close_blocks_in_order() {
        let mut blocks = Blocks::default();
        let mut out = Vec::new();
        for piece in [
            Piece::Reasoning("hmm".into()),
            Piece::Content("\n\n".into()),
            Piece::Content("Sure".into()),
            Piece::Content(".".into()),
            Piece::Content("\n".into()),
            Piece::ToolCallStart {
                index: 0,
                id: "call_1".into(),
                name: "f".into(),
            },
            Piece::ToolCallArgs {
                index: 0,
                fragment: "{\"a\":".into(),
            },
            Piece::ToolCallArgs {
                index: 0,
                fragment: " 1}".into(),
            },
            Piece::Content("\n".into()),
        ] {
            blocks.push(piece, &mut out);
        }
        blocks.close(&mut out);
        let kinds: Vec<(usize, &str)> = out
            .iter()
            .map(|(i, e)| {
                let kind = match e {
                    BlockEvent::Start(b) => b["type"].as_str().unwrap(),
                    BlockEvent::Delta(d) => d["type"].as_str().unwrap(),
                    BlockEvent::Stop => "stop",
                };
                (*i, kind)
            })
            .collect();
        assert_eq!(
            kinds,
            [
                (0, "thinking"),
                (0, "thinking_delta"),
                (0, "stop"),
                (1, "text"),
                (1, "text_delta"),
                (1, "text_delta"),
                (1, "text_delta"),
                (1, "stop"),
                (2, "tool_use"),
                (2, "input_json_delta"),
                (2, "stop"),
            ]
        );
        // Whitespace before text joins it; whitespace before a tool call stays in the text
        // block that is open; whitespace after the last block is dropped.
        assert_eq!(
            out[4].1,
            BlockEvent::Delta(json!({"type": "text_delta", "text": "\n\nSure"}))
        );
        assert_eq!(blocks.tool_uses, 1);
        assert_eq!(
            out[9].1,
            BlockEvent::Delta(json!({"type": "input_json_delta", "partial_json": "{\"a\":1}"}))
        );
        // Arguments that are not a JSON object become `{}`, streamed or not.
        let mut blocks = Blocks::default();
        let mut out = Vec::new();
        blocks.push(
            Piece::ToolCallStart {
                index: 0,
                id: "c".into(),
                name: "f".into(),
            },
            &mut out,
        );
        blocks.push(
            Piece::ToolCallArgs {
                index: 0,
                fragment: "{'a': 1".into(),
            },
            &mut out,
        );
        blocks.close(&mut out);
        assert_eq!(
            out[1].1,
            BlockEvent::Delta(json!({"type": "input_json_delta", "partial_json": "{}"}))
        );
    }

    #[test]
    fn empty_reasoning_opens_no_block() {
        let mut blocks = Blocks::default();
        let mut out = Vec::new();
        blocks.push(Piece::Reasoning("\n\n".into()), &mut out);
        blocks.push(Piece::Content("Hi".into()), &mut out);
        assert_eq!(
            out[0],
            (0, BlockEvent::Start(json!({"type": "text", "text": ""})))
        );
    }

    #[test]
    fn stop_reasons() {
        assert_eq!(
            stop_reason(FinishReason::Length, None, true).0,
            "max_tokens"
        );
        assert_eq!(
            stop_reason(FinishReason::Stop, Some("END"), false),
            ("stop_sequence", json!("END"))
        );
        assert_eq!(stop_reason(FinishReason::Stop, None, true).0, "tool_use");
        assert_eq!(stop_reason(FinishReason::Stop, None, false).0, "end_turn");
    }
}
