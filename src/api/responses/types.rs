//! Responses API wire types: the request body (shared by `POST /v1/responses` and the
//! WebSocket `response.create` event), the response object, its output items and the streamed
//! events. The events are one serde enum so the server and the crate's client speak the same
//! shapes.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

/// `POST /v1/responses` (and the body of a WebSocket `response.create`). Unknown fields are
/// ignored; the sampling fields (`temperature`, `top_p`, `top_k`, `seed`, penalties, …) are
/// read as in chat completions.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct ResponsesRequest {
    pub model: Option<String>,
    /// A string (one user message) or a list of items.
    pub input: Option<Input>,
    /// A system message put before the conversation (not carried over by
    /// `previous_response_id`).
    pub instructions: Option<String>,
    #[schema(value_type = Option<Vec<Object>>)]
    pub tools: Option<Vec<Value>>,
    #[schema(value_type = Option<Object>)]
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    pub max_output_tokens: Option<u32>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub previous_response_id: Option<String>,
    /// Keep the response so `previous_response_id` can continue it (default true).
    pub store: Option<bool>,
    /// Names the conversation when it is not stored (`store: false`, the whole conversation
    /// resent each turn, as Codex sends it): its turns continue one engine session, like
    /// `X-Session-Id`.
    pub prompt_cache_key: Option<String>,
    pub stream: Option<bool>,
    /// Answer at once with the response `in_progress` and run it without the client: poll
    /// `GET /v1/responses/{id}`, stop it with `POST /v1/responses/{id}/cancel` (needs `store`).
    pub background: Option<bool>,
    #[schema(value_type = Option<Object>)]
    pub metadata: Option<Value>,
    /// `{"format": {"type": "text" | "json_object" | "json_schema", "name": …, "schema": {…}}}`:
    /// the output is sampled under a grammar that keeps it valid.
    #[schema(value_type = Option<Object>)]
    pub text: Option<Value>,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum Input {
    Text(String),
    Items(Vec<Value>),
}

/// The response object (`"object": "response"`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ResponseObject {
    pub id: String,
    pub object: String,
    pub created_at: u64,
    /// `in_progress`, `completed`, `incomplete`, `cancelled` or `failed`.
    pub status: String,
    #[schema(value_type = Option<Object>)]
    pub error: Option<Value>,
    pub incomplete_details: Option<IncompleteDetails>,
    pub instructions: Option<String>,
    pub max_output_tokens: Option<u32>,
    pub model: String,
    pub output: Vec<OutputItem>,
    pub parallel_tool_calls: bool,
    pub previous_response_id: Option<String>,
    pub store: bool,
    /// Created with `background: true` (runs without the client; can be cancelled).
    #[serde(default)]
    pub background: bool,
    pub temperature: Option<f32>,
    #[schema(value_type = Object)]
    pub tool_choice: Value,
    #[schema(value_type = Vec<Object>)]
    pub tools: Vec<Value>,
    pub top_p: Option<f32>,
    pub truncation: String,
    pub usage: Option<ResponseUsage>,
    #[schema(value_type = Object)]
    pub metadata: Value,
    #[schema(value_type = Object)]
    pub text: Value,
    /// The conversation this response belongs to (names its engine session).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub conversation: Option<Value>,
    /// llama.cpp-style timings (an mtpx extension).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timings: Option<super::super::types::Timings>,
}

impl ResponseObject {
    /// The concatenated `output_text` parts of the message items.
    pub fn output_text(&self) -> String {
        self.output
            .iter()
            .filter_map(|item| match item {
                OutputItem::Message { content, .. } => Some(content),
                _ => None,
            })
            .flatten()
            .filter_map(|c| match c {
                OutputContent::OutputText { text, .. } => Some(text.as_str()),
                _ => None,
            })
            .collect()
    }

    /// The function calls among the output items: `(call_id, name, arguments)`.
    pub fn function_calls(&self) -> Vec<(String, String, String)> {
        self.output
            .iter()
            .filter_map(|item| match item {
                OutputItem::FunctionCall {
                    call_id,
                    name,
                    arguments,
                    ..
                } => Some((call_id.clone(), name.clone(), arguments.clone())),
                _ => None,
            })
            .collect()
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct IncompleteDetails {
    pub reason: String,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ResponseUsage {
    pub input_tokens: usize,
    pub input_tokens_details: InputTokensDetails,
    pub output_tokens: usize,
    pub output_tokens_details: OutputTokensDetails,
    pub total_tokens: usize,
    /// Present when `max_output_tokens` reached past the context window and was cut to the room
    /// the input leaves (an mtpx extension; `--strict-max-tokens` refuses instead).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens_clamped: Option<crate::scheduler::MaxTokensCut>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct InputTokensDetails {
    /// Input tokens whose KV was reused instead of prefilled.
    pub cached_tokens: usize,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct OutputTokensDetails {
    pub reasoning_tokens: usize,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "type")]
pub enum OutputItem {
    #[serde(rename = "message")]
    Message {
        id: String,
        status: String,
        role: String,
        content: Vec<OutputContent>,
    },
    #[serde(rename = "function_call")]
    FunctionCall {
        id: String,
        call_id: String,
        name: String,
        /// The `namespace` tool the function belongs to (Codex routes calls by it).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        namespace: Option<String>,
        arguments: String,
        status: String,
    },
    #[serde(rename = "reasoning")]
    Reasoning {
        id: String,
        #[schema(value_type = Vec<Object>)]
        summary: Vec<Value>,
        content: Vec<OutputContent>,
        status: String,
    },
}

impl OutputItem {
    pub fn id(&self) -> &str {
        match self {
            OutputItem::Message { id, .. }
            | OutputItem::FunctionCall { id, .. }
            | OutputItem::Reasoning { id, .. } => id,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "type")]
pub enum OutputContent {
    #[serde(rename = "output_text")]
    OutputText {
        text: String,
        #[schema(value_type = Vec<Object>)]
        annotations: Vec<Value>,
        #[schema(value_type = Vec<Object>)]
        logprobs: Vec<Value>,
    },
    #[serde(rename = "reasoning_text")]
    ReasoningText { text: String },
}

/// A streamed event (an SSE `data:` object, or a WebSocket text frame). On the WebSocket, the
/// events of a tagged `response.create` also carry its `tag`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "type")]
pub enum ResponseEvent {
    #[serde(rename = "response.created")]
    Created {
        sequence_number: u64,
        response: Box<ResponseObject>,
    },
    #[serde(rename = "response.in_progress")]
    InProgress {
        sequence_number: u64,
        response: Box<ResponseObject>,
    },
    #[serde(rename = "response.output_item.added")]
    OutputItemAdded {
        sequence_number: u64,
        output_index: usize,
        item: OutputItem,
    },
    #[serde(rename = "response.output_item.done")]
    OutputItemDone {
        sequence_number: u64,
        output_index: usize,
        item: OutputItem,
    },
    #[serde(rename = "response.content_part.added")]
    ContentPartAdded {
        sequence_number: u64,
        item_id: String,
        output_index: usize,
        content_index: usize,
        part: OutputContent,
    },
    #[serde(rename = "response.content_part.done")]
    ContentPartDone {
        sequence_number: u64,
        item_id: String,
        output_index: usize,
        content_index: usize,
        part: OutputContent,
    },
    #[serde(rename = "response.output_text.delta")]
    OutputTextDelta {
        sequence_number: u64,
        item_id: String,
        output_index: usize,
        content_index: usize,
        delta: String,
        #[schema(value_type = Vec<Object>)]
        logprobs: Vec<Value>,
        /// mtpx extension, as in chat completion chunks: per token of the delta, its depth as
        /// an accepted speculative draft (0: sampled by the model); absent without drafts.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        draft_depths: Vec<u8>,
    },
    #[serde(rename = "response.output_text.done")]
    OutputTextDone {
        sequence_number: u64,
        item_id: String,
        output_index: usize,
        content_index: usize,
        text: String,
        #[schema(value_type = Vec<Object>)]
        logprobs: Vec<Value>,
    },
    #[serde(rename = "response.reasoning_text.delta")]
    ReasoningTextDelta {
        sequence_number: u64,
        item_id: String,
        output_index: usize,
        content_index: usize,
        delta: String,
        /// mtpx extension, as in chat completion chunks: per token of the delta, its depth as
        /// an accepted speculative draft (0: sampled by the model); absent without drafts.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        draft_depths: Vec<u8>,
    },
    #[serde(rename = "response.reasoning_text.done")]
    ReasoningTextDone {
        sequence_number: u64,
        item_id: String,
        output_index: usize,
        content_index: usize,
        text: String,
    },
    #[serde(rename = "response.function_call_arguments.delta")]
    FunctionCallArgumentsDelta {
        sequence_number: u64,
        item_id: String,
        output_index: usize,
        delta: String,
        /// mtpx extension, as in chat completion chunks: per token of the delta, its depth as
        /// an accepted speculative draft (0: sampled by the model); absent without drafts.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        draft_depths: Vec<u8>,
    },
    #[serde(rename = "response.function_call_arguments.done")]
    FunctionCallArgumentsDone {
        sequence_number: u64,
        item_id: String,
        output_index: usize,
        name: String,
        arguments: String,
    },
    #[serde(rename = "response.completed")]
    Completed {
        sequence_number: u64,
        response: Box<ResponseObject>,
    },
    #[serde(rename = "response.incomplete")]
    Incomplete {
        sequence_number: u64,
        response: Box<ResponseObject>,
    },
    #[serde(rename = "response.cancelled")]
    Cancelled {
        sequence_number: u64,
        response: Box<ResponseObject>,
    },
    #[serde(rename = "response.failed")]
    Failed {
        sequence_number: u64,
        response: Box<ResponseObject>,
    },
    /// A refused request or a malformed frame: `error` has the OpenAI error shape.
    #[serde(rename = "error")]
    Error { error: Value },
    /// An event type this version does not know (clients only).
    #[serde(other)]
    Unknown,
}

impl ResponseEvent {
    /// The final response object, for the terminal events.
    pub fn terminal_response(&self) -> Option<&ResponseObject> {
        match self {
            ResponseEvent::Completed { response, .. }
            | ResponseEvent::Incomplete { response, .. }
            | ResponseEvent::Cancelled { response, .. }
            | ResponseEvent::Failed { response, .. } => Some(response),
            _ => None,
        }
    }

    /// The event's `type` string (what serde writes as its tag).
    pub fn kind(&self) -> &'static str {
        use ResponseEvent::*;
        match self {
            Created { .. } => "response.created",
            InProgress { .. } => "response.in_progress",
            OutputItemAdded { .. } => "response.output_item.added",
            OutputItemDone { .. } => "response.output_item.done",
            ContentPartAdded { .. } => "response.content_part.added",
            ContentPartDone { .. } => "response.content_part.done",
            OutputTextDelta { .. } => "response.output_text.delta",
            OutputTextDone { .. } => "response.output_text.done",
            ReasoningTextDelta { .. } => "response.reasoning_text.delta",
            ReasoningTextDone { .. } => "response.reasoning_text.done",
            FunctionCallArgumentsDelta { .. } => "response.function_call_arguments.delta",
            FunctionCallArgumentsDone { .. } => "response.function_call_arguments.done",
            Completed { .. } => "response.completed",
            Incomplete { .. } => "response.incomplete",
            Cancelled { .. } => "response.cancelled",
            Failed { .. } => "response.failed",
            Error { .. } => "error",
            Unknown => "unknown",
        }
    }

    pub fn sequence_number(&self) -> Option<u64> {
        use ResponseEvent::*;
        match self {
            Created {
                sequence_number, ..
            }
            | InProgress {
                sequence_number, ..
            }
            | OutputItemAdded {
                sequence_number, ..
            }
            | OutputItemDone {
                sequence_number, ..
            }
            | ContentPartAdded {
                sequence_number, ..
            }
            | ContentPartDone {
                sequence_number, ..
            }
            | OutputTextDelta {
                sequence_number, ..
            }
            | OutputTextDone {
                sequence_number, ..
            }
            | ReasoningTextDelta {
                sequence_number, ..
            }
            | ReasoningTextDone {
                sequence_number, ..
            }
            | FunctionCallArgumentsDelta {
                sequence_number, ..
            }
            | FunctionCallArgumentsDone {
                sequence_number, ..
            }
            | Completed {
                sequence_number, ..
            }
            | Incomplete {
                sequence_number, ..
            }
            | Cancelled {
                sequence_number, ..
            }
            | Failed {
                sequence_number, ..
            } => Some(*sequence_number),
            Error { .. } | Unknown => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::ResponseEvent;
    use serde_json::json;

    /// `kind()` and `sequence_number()` read the variant; they must say what serde writes.
    #[test]
    fn kind_and_sequence_number_match_the_serialized_event() {
        let response = json!({"id": "resp_1", "object": "response", "created_at": 0,
            "status": "completed", "model": "m", "output": [], "parallel_tool_calls": true,
            "store": true, "tool_choice": "auto", "tools": [], "truncation": "disabled",
            "metadata": {}, "text": {}});
        let item = json!({"type": "message", "id": "msg_1", "status": "completed",
            "role": "assistant", "content": []});
        for kind in [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.output_item.done",
            "response.content_part.added",
            "response.content_part.done",
            "response.output_text.delta",
            "response.output_text.done",
            "response.reasoning_text.delta",
            "response.reasoning_text.done",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.completed",
            "response.incomplete",
            "response.cancelled",
            "response.failed",
            "error",
        ] {
            // Fields a variant does not have are ignored when reading it.
            let raw = json!({"type": kind, "sequence_number": 7, "response": response,
                "output_index": 0, "item": item, "item_id": "msg_1", "content_index": 0,
                "part": {"type": "reasoning_text", "text": ""}, "delta": "", "text": "",
                "logprobs": [], "name": "f", "arguments": "{}", "error": {}});
            let event: ResponseEvent = serde_json::from_value(raw).unwrap();
            let written = serde_json::to_value(&event).unwrap();
            assert_eq!(written["type"], event.kind(), "{kind}");
            assert_eq!(written["sequence_number"].as_u64(), event.sequence_number());
        }
    }
}
