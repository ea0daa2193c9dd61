//! Builds a response from the model's text, as the standard event sequence: `created`,
//! `in_progress`, then per output item `output_item.added`, its deltas (`content_part.added` /
//! `output_text.delta` / `output_text.done` / `content_part.done`, `reasoning_text.*`, or
//! `function_call_arguments.delta` / `.done`), `output_item.done`, and one terminal event
//! (`completed`, `incomplete`, `cancelled` or `failed`). Every event has the next
//! `sequence_number`. The text goes through the chat tool-call parser, so content, reasoning
//! and function calls are split the same way as in chat completions.

use super::super::tool_calls::{Piece, ToolCallParser};
use super::super::types::wire_draft_depths;
use super::tools::ToolNamespaces;
use super::types::*;
use crate::scheduler::Usage as EngineUsage;
use serde_json::Value;

/// A new item id: `prefix_` and 24 letters and digits.
pub fn new_item_id(prefix: &str) -> String {
    use rand::distr::{Alphanumeric, SampleString};
    format!(
        "{prefix}_{}",
        Alphanumeric.sample_string(&mut rand::rng(), 24)
    )
}

/// How a response ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Ending {
    Completed,
    /// Hit `max_output_tokens`.
    Length,
    Cancelled,
    Failed(Value),
}

/// The item being streamed (always the last of `response.output`).
enum Open {
    Message,
    Reasoning,
    Call { tool_index: usize },
}

pub struct Builder {
    response: ResponseObject,
    seq: u64,
    parser: ToolCallParser,
    open: Option<Open>,
    events: Vec<ResponseEvent>,
    /// The draft depths of the tokens being pushed, for the first delta they produce.
    draft_depths: Vec<u8>,
    /// Which offered tool names are a namespace's functions.
    namespaces: ToolNamespaces,
}

impl Builder {
    /// `template`: the response object as created (status `in_progress`, no output).
    pub fn new(template: ResponseObject, parser: ToolCallParser) -> Self {
        Self {
            response: template,
            seq: 0,
            parser,
            open: None,
            events: Vec::new(),
            draft_depths: Vec::new(),
            namespaces: ToolNamespaces::default(),
        }
    }

    /// Calls of a namespace's functions come out named as the client declared them.
    pub fn with_namespaces(mut self, namespaces: ToolNamespaces) -> Self {
        self.namespaces = namespaces;
        self
    }

    pub fn response(&self) -> &ResponseObject {
        &self.response
    }

    fn seq(&mut self) -> u64 {
        let s = self.seq;
        self.seq += 1;
        s
    }

    fn boxed(&self) -> Box<ResponseObject> {
        Box::new(self.response.clone())
    }

    /// `response.created` and `response.in_progress`.
    pub fn start(&mut self) -> Vec<ResponseEvent> {
        let (a, b) = (self.seq(), self.seq());
        vec![
            ResponseEvent::Created {
                sequence_number: a,
                response: self.boxed(),
            },
            ResponseEvent::InProgress {
                sequence_number: b,
                response: self.boxed(),
            },
        ]
    }

    /// Feeds a fragment of the model's text and its tokens' draft depths (see
    /// [`EngineEvent::Delta`](crate::engine::EngineEvent::Delta)).
    pub fn push_text(&mut self, text: &str, draft_depths: &[u8]) -> Vec<ResponseEvent> {
        self.draft_depths = wire_draft_depths(draft_depths);
        for piece in self.parser.push(text) {
            self.on_piece(piece);
        }
        self.draft_depths.clear();
        std::mem::take(&mut self.events)
    }

    /// Ends the response: flushes the parser, closes the open item, sets the status, usage and
    /// timings, and emits the terminal event. Returns the events and the final object.
    pub fn finish(
        mut self,
        ending: Ending,
        usage: Option<EngineUsage>,
    ) -> (Vec<ResponseEvent>, ResponseObject) {
        for piece in self.parser.finish() {
            self.on_piece(piece);
        }
        // The item the reply was cut in (or stopped in) is as unfinished as the response.
        self.close(match ending {
            Ending::Completed => "completed",
            _ => "incomplete",
        });
        if let Some(u) = usage {
            self.response.usage = Some(ResponseUsage {
                input_tokens: u.prompt_tokens,
                input_tokens_details: InputTokensDetails {
                    cached_tokens: u.cached_tokens,
                },
                output_tokens: u.completion_tokens,
                output_tokens_details: OutputTokensDetails::default(),
                total_tokens: u.prompt_tokens + u.completion_tokens,
                max_tokens_clamped: u.max_tokens_cut,
            });
            self.response.timings = Some(super::super::generate::timings(&u));
        }
        let sequence_number = self.seq();
        let status = match &ending {
            Ending::Completed => "completed",
            Ending::Length => "incomplete",
            Ending::Cancelled => "cancelled",
            Ending::Failed(_) => "failed",
        };
        self.response.status = status.into();
        let response = self.boxed();
        let terminal = match ending {
            Ending::Completed => ResponseEvent::Completed {
                sequence_number,
                response,
            },
            Ending::Length => {
                self.response.incomplete_details = Some(IncompleteDetails {
                    reason: "max_output_tokens".into(),
                });
                ResponseEvent::Incomplete {
                    sequence_number,
                    response: self.boxed(),
                }
            }
            Ending::Cancelled => ResponseEvent::Cancelled {
                sequence_number,
                response,
            },
            Ending::Failed(error) => {
                self.response.error = Some(error);
                ResponseEvent::Failed {
                    sequence_number,
                    response: self.boxed(),
                }
            }
        };
        self.events.push(terminal);
        (self.events, self.response)
    }

    fn on_piece(&mut self, piece: Piece) {
        match piece {
            Piece::Content(text) => {
                if !matches!(self.open, Some(Open::Message)) {
                    self.close("completed");
                    self.open_message();
                }
                self.append_text(text);
            }
            Piece::Reasoning(text) => {
                if !matches!(self.open, Some(Open::Reasoning)) {
                    self.close("completed");
                    self.open_reasoning();
                }
                self.append_text(text);
            }
            Piece::ToolCallStart { index, id, name } => {
                self.close("completed");
                let (name, namespace) = self.namespaces.split(&name);
                let item = OutputItem::FunctionCall {
                    id: new_item_id("fc"),
                    call_id: id,
                    name,
                    namespace,
                    arguments: String::new(),
                    status: "in_progress".into(),
                };
                self.add_item(item);
                self.open = Some(Open::Call { tool_index: index });
            }
            Piece::ToolCallArgs { index, fragment } => {
                if matches!(self.open, Some(Open::Call { tool_index }) if tool_index == index) {
                    let (item_id, output_index) = self.last_ids();
                    if let Some(OutputItem::FunctionCall { arguments, .. }) =
                        self.response.output.last_mut()
                    {
                        arguments.push_str(&fragment);
                    }
                    let sequence_number = self.seq();
                    self.events.push(ResponseEvent::FunctionCallArgumentsDelta {
                        sequence_number,
                        item_id,
                        output_index,
                        delta: fragment,
                        draft_depths: std::mem::take(&mut self.draft_depths),
                    });
                }
            }
        }
    }

    fn last_ids(&self) -> (String, usize) {
        let index = self.response.output.len().saturating_sub(1);
        let id = self
            .response
            .output
            .last()
            .map(|i| i.id().to_string())
            .unwrap_or_default();
        (id, index)
    }

    fn add_item(&mut self, item: OutputItem) {
        self.response.output.push(item.clone());
        let sequence_number = self.seq();
        self.events.push(ResponseEvent::OutputItemAdded {
            sequence_number,
            output_index: self.response.output.len() - 1,
            item,
        });
    }

    fn open_message(&mut self) {
        self.add_item(OutputItem::Message {
            id: new_item_id("msg"),
            status: "in_progress".into(),
            role: "assistant".into(),
            content: Vec::new(),
        });
        let part = OutputContent::OutputText {
            text: String::new(),
            annotations: Vec::new(),
            logprobs: Vec::new(),
        };
        if let Some(OutputItem::Message { content, .. }) = self.response.output.last_mut() {
            content.push(part.clone());
        }
        let (item_id, output_index) = self.last_ids();
        let sequence_number = self.seq();
        self.events.push(ResponseEvent::ContentPartAdded {
            sequence_number,
            item_id,
            output_index,
            content_index: 0,
            part,
        });
        self.open = Some(Open::Message);
    }

    fn open_reasoning(&mut self) {
        self.add_item(OutputItem::Reasoning {
            id: new_item_id("rs"),
            summary: Vec::new(),
            content: Vec::new(),
            status: "in_progress".into(),
        });
        if let Some(OutputItem::Reasoning { content, .. }) = self.response.output.last_mut() {
            content.push(OutputContent::ReasoningText {
                text: String::new(),
            });
        }
        self.open = Some(Open::Reasoning);
    }

    /// Appends to the open message's or reasoning's text and emits the delta.
    fn append_text(&mut self, delta: String) {
        if delta.is_empty() {
            return;
        }
        let (item_id, output_index) = self.last_ids();
        let reasoning = matches!(self.open, Some(Open::Reasoning));
        if let Some(OutputItem::Message { content, .. } | OutputItem::Reasoning { content, .. }) =
            self.response.output.last_mut()
        {
            if let Some(
                OutputContent::OutputText { text, .. } | OutputContent::ReasoningText { text },
            ) = content.last_mut()
            {
                text.push_str(&delta);
            }
        }
        let sequence_number = self.seq();
        let draft_depths = std::mem::take(&mut self.draft_depths);
        self.events.push(if reasoning {
            ResponseEvent::ReasoningTextDelta {
                sequence_number,
                item_id,
                output_index,
                content_index: 0,
                delta,
                draft_depths,
            }
        } else {
            ResponseEvent::OutputTextDelta {
                sequence_number,
                item_id,
                output_index,
                content_index: 0,
                delta,
                logprobs: Vec::new(),
                draft_depths,
            }
        });
    }

    /// Closes the open item with `status`: its `.done` events and `output_item.done`.
    fn close(&mut self, status: &str) {
        let Some(open) = self.open.take() else {
            return;
        };
        let (item_id, output_index) = self.last_ids();
        let Some(item) = self.response.output.last_mut() else {
            return;
        };
        match item {
            OutputItem::Message { status: s, .. }
            | OutputItem::FunctionCall { status: s, .. }
            | OutputItem::Reasoning { status: s, .. } => *s = status.into(),
        }
        let item = item.clone();
        match (open, &item) {
            (Open::Message, OutputItem::Message { content, .. }) => {
                let part = content.first().cloned();
                let text = match &part {
                    Some(OutputContent::OutputText { text, .. }) => text.clone(),
                    _ => String::new(),
                };
                let s = self.seq();
                self.events.push(ResponseEvent::OutputTextDone {
                    sequence_number: s,
                    item_id: item_id.clone(),
                    output_index,
                    content_index: 0,
                    text,
                    logprobs: Vec::new(),
                });
                if let Some(part) = part {
                    let s = self.seq();
                    self.events.push(ResponseEvent::ContentPartDone {
                        sequence_number: s,
                        item_id,
                        output_index,
                        content_index: 0,
                        part,
                    });
                }
            }
            (Open::Reasoning, OutputItem::Reasoning { content, .. }) => {
                let text = match content.first() {
                    Some(OutputContent::ReasoningText { text }) => text.clone(),
                    _ => String::new(),
                };
                let s = self.seq();
                self.events.push(ResponseEvent::ReasoningTextDone {
                    sequence_number: s,
                    item_id,
                    output_index,
                    content_index: 0,
                    text,
                });
            }
            (
                Open::Call { .. },
                OutputItem::FunctionCall {
                    name, arguments, ..
                },
            ) => {
                let s = self.seq();
                self.events.push(ResponseEvent::FunctionCallArgumentsDone {
                    sequence_number: s,
                    item_id,
                    output_index,
                    name: name.clone(),
                    arguments: arguments.clone(),
                });
            }
            _ => {}
        }
        let s = self.seq();
        self.events.push(ResponseEvent::OutputItemDone {
            sequence_number: s,
            output_index,
            item,
        });
    }
}

/// The assistant chat message a response's output adds to its conversation (its calls under
/// the names the model was offered, so that the next turn renders what the model wrote).
pub fn assistant_message(response: &ResponseObject, namespaces: &ToolNamespaces) -> Value {
    let content = response.output_text();
    let calls: Vec<Value> = response
        .output
        .iter()
        .filter_map(|item| match item {
            OutputItem::FunctionCall {
                call_id,
                name,
                namespace,
                arguments,
                ..
            } => Some((call_id, namespaces.offered(namespace.as_deref(), name), arguments)),
            _ => None,
        })
        .map(|(call_id, name, arguments)| {
            serde_json::json!({
                "id": call_id,
                "type": "function",
                "function": {
                    "name": name,
                    "arguments": super::items::arguments_value(Some(&Value::String(arguments.clone()))),
                },
            })
        })
        .collect();
    let mut m = serde_json::json!({"role": "assistant", "content": content});
    if !calls.is_empty() {
        m["tool_calls"] = Value::Array(calls);
    }
    m
}
