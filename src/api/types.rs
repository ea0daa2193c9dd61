//! OpenAI wire types (serde + utoipa schemas). Requests ignore unknown fields; a known field of
//! the wrong type is refused naming its path (see [`super::errors::from_value`]).

use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;
use utoipa::ToSchema;

// ---------------------------------------------------------------- requests

/// Fields shared by chat and text completions.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct GenerationParams {
    /// The served model's id; may be omitted.
    pub model: Option<String>,
    pub max_tokens: Option<u32>,
    /// Preferred over `max_tokens` when both are given.
    pub max_completion_tokens: Option<u32>,
    /// 0..=2; 0 is greedy. Default 1.
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    /// 0 = off.
    pub top_k: Option<i32>,
    pub min_p: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    /// Token id (as a string) to a bias in -100..=100.
    pub logit_bias: Option<BTreeMap<String, f32>>,
    pub seed: Option<i64>,
    pub stop: Option<StopSpec>,
    /// Number of choices, 1..=8.
    pub n: Option<u32>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub user: Option<String>,
    /// OpenAI Predicted Outputs: text the reply is expected to largely repeat (a file being
    /// edited); used as a source of speculative drafts. Never changes the output.
    pub prediction: Option<Prediction>,
    /// mtpx extension: `false` turns speculative decoding off for this request; a drafter's
    /// name (`"ngram"`, `"prediction"`, `"mtp"`, `"draft"`) restricts it to that drafter.
    pub speculative: Option<Speculative>,
    /// `{"type": "text"}`, `{"type": "json_object"}` or `{"type": "json_schema", "json_schema":
    /// {"name": …, "schema": {…}}}`: the output is sampled under a grammar that keeps it valid.
    #[schema(value_type = Option<Object>)]
    pub response_format: Option<serde_json::Value>,
    /// vLLM extension: the output is JSON valid against this JSON Schema.
    #[schema(value_type = Option<Object>)]
    pub guided_json: Option<serde_json::Value>,
    /// vLLM extension: the output matches this regular expression (Rust `regex` syntax).
    pub guided_regex: Option<String>,
    /// vLLM extension: the output is exactly one of these strings.
    pub guided_choice: Option<Vec<String>>,
    /// vLLM extension: the output matches this grammar, GBNF (llama.cpp's format, told by its
    /// `::=`) or Lark (llguidance's dialect, from a `start` rule).
    pub guided_grammar: Option<String>,
    /// llama.cpp extension: the output matches this GBNF grammar (Lark when it begins with
    /// `%llguidance`); empty means none.
    pub grammar: Option<String>,
    /// vLLM / llama.cpp extension: never stop on the model's end tokens (they are banned), only
    /// at `max_tokens`, a stop string or the end of an output grammar.
    pub ignore_eos: Option<bool>,
}

/// The request field `speculative`: on/off, or one drafter by name.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum Speculative {
    Switch(bool),
    Drafter(String),
}

/// `{"type": "content", "content": "..." | [{"type": "text", "text": "..."}]}`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct Prediction {
    #[serde(rename = "type")]
    pub kind: String,
    pub content: MessageContent,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum StopSpec {
    One(String),
    Many(Vec<String>),
}

impl StopSpec {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            StopSpec::One(s) => vec![s],
            StopSpec::Many(v) => v,
        }
    }
}

#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct ChatCompletionRequest {
    pub messages: Vec<ChatMessage>,
    pub tools: Option<Vec<Tool>>,
    pub tool_choice: Option<ToolChoice>,
    /// `false` keeps only the first tool call of a reply.
    pub parallel_tool_calls: Option<bool>,
    pub logprobs: Option<bool>,
    /// 0..=20; needs `logprobs`.
    pub top_logprobs: Option<u32>,
    #[serde(flatten)]
    pub params: GenerationParams,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    System,
    /// Treated as `system` (the chat templates mtpx serves have no developer role).
    Developer,
    User,
    Assistant,
    Tool,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct ChatMessage {
    pub role: Role,
    /// A string or an array of text parts; may be null for an assistant message with tool calls.
    pub content: Option<MessageContent>,
    pub name: Option<String>,
    pub tool_calls: Option<Vec<ToolCall>>,
    pub tool_call_id: Option<String>,
    pub reasoning_content: Option<String>,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct ContentPart {
    /// Only `text` is supported.
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Tool {
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionDef,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct FunctionDef {
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// JSON Schema of the arguments.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub parameters: Option<Value>,
}

/// `"auto"`, `"none"`, `"required"`, or `{"type": "function", "function": {"name": …}}`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum ToolChoice {
    Mode(String),
    Named(NamedToolChoice),
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct NamedToolChoice {
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionName,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct FunctionName {
    pub name: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ToolCall {
    pub id: String,
    #[serde(rename = "type", default = "function_kind")]
    pub kind: String,
    pub function: FunctionCall,
}

fn function_kind() -> String {
    "function".into()
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct FunctionCall {
    pub name: String,
    /// The arguments as a JSON-encoded string (an object is accepted in requests).
    #[schema(value_type = String)]
    pub arguments: Value,
}

/// `POST /v1/completions`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct CompletionRequest {
    pub prompt: PromptInput,
    /// Put the prompt before the completion; with `logprobs`, score the prompt's tokens too
    /// (the first one's logprob is null).
    pub echo: Option<bool>,
    /// The text after the insertion point: a non-empty suffix asks the model to fill in the
    /// middle between `prompt` and it (models with FIM tokens, such as Qwen2.5-Coder).
    pub suffix: Option<String>,
    /// Number of most likely alternatives to report per token, 0..=20.
    pub logprobs: Option<u32>,
    #[serde(flatten)]
    pub params: GenerationParams,
}

/// A string or token ids, or a batch of either (each prompt answered by its own choices).
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum PromptInput {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

// ---------------------------------------------------------------- responses

#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    pub prompt_tokens_details: PromptTokensDetails,
    pub completion_tokens_details: CompletionTokensDetails,
    /// Present when the request's `max_tokens` reached past the context window and was cut to
    /// the room the prompt leaves (an mtpx extension; `--strict-max-tokens` refuses instead).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens_clamped: Option<crate::scheduler::MaxTokensCut>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
pub struct CompletionTokensDetails {
    /// Speculative draft tokens (from the prediction or any other drafter) that were accepted.
    pub accepted_prediction_tokens: usize,
    /// Draft tokens that were verified and rejected.
    pub rejected_prediction_tokens: usize,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
pub struct PromptTokensDetails {
    /// Prompt tokens whose KV was reused instead of prefilled.
    pub cached_tokens: usize,
}

/// llama.cpp-style timings.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Timings {
    /// Prompt tokens reused from KV.
    pub cache_n: usize,
    /// Prompt tokens prefilled.
    pub prompt_n: usize,
    pub prompt_ms: f64,
    pub prompt_per_second: f64,
    pub predicted_n: usize,
    pub predicted_ms: f64,
    pub predicted_per_second: f64,
    /// Speculative draft tokens verified, and how many were accepted.
    pub draft_n: usize,
    pub draft_n_accepted: usize,
    /// The same per draft position, depth 1 first (empty without speculation).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub draft_by_depth: Vec<DepthAcceptance>,
}

/// Drafts verified and accepted at one draft position.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct DepthAcceptance {
    /// 1 for the first draft token of a round.
    pub depth: usize,
    pub drafted: u32,
    pub accepted: u32,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ChatCompletionResponse {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    pub usage: Usage,
    pub timings: Timings,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ChatChoice {
    pub index: usize,
    pub message: AssistantMessage,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<String>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
pub struct AssistantMessage {
    pub role: String,
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty", default)]
    pub tool_calls: Vec<ToolCall>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
pub struct ChatLogprobs {
    pub content: Vec<TokenLogprob>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<TopLogprob>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

/// One SSE `data:` object of a streamed chat completion.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ChatCompletionChunk {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChunkChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timings: Option<Timings>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ChunkChoice {
    pub index: usize,
    pub delta: ChunkDelta,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<String>,
    /// mtpx extension, present only when this chunk's tokens include accepted speculative
    /// drafts: per token, its depth in its draft round (1 = first draft), 0 for a token the
    /// model sampled itself.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub draft_depths: Vec<u8>,
}

/// `draft_depths` as the wire carries it: empty unless some token was an accepted draft.
pub fn wire_draft_depths(depths: &[u8]) -> Vec<u8> {
    if depths.iter().any(|&d| d > 0) {
        depths.to_vec()
    } else {
        Vec::new()
    }
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
pub struct ChunkDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty", default)]
    pub tool_calls: Vec<ToolCallDelta>,
}

/// A streamed piece of a tool call: the first carries `id` and `function.name`, the rest
/// carry `function.arguments` fragments.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ToolCallDelta {
    pub index: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    pub function: FunctionCallDelta,
}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, ToSchema)]
pub struct FunctionCallDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub arguments: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct CompletionResponse {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timings: Option<Timings>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct CompletionChoice {
    pub index: usize,
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: Option<String>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<Option<f32>>,
    /// Per token, its most likely alternatives, most likely first (`null` for the prompt's
    /// first token, which has no score).
    #[schema(value_type = Vec<Option<Object>>)]
    pub top_logprobs: Vec<Option<serde_json::Map<String, serde_json::Value>>>,
    /// Where each token's text starts in the reply's text, in characters.
    pub text_offset: Vec<usize>,
}

impl CompletionLogprobs {
    /// `other`'s tokens after these.
    pub fn append(&mut self, other: CompletionLogprobs) {
        self.tokens.extend(other.tokens);
        self.token_logprobs.extend(other.token_logprobs);
        self.top_logprobs.extend(other.top_logprobs);
        self.text_offset.extend(other.text_offset);
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ModelObject {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub owned_by: String,
    /// The enforced context window (prompt + max_tokens).
    pub context_window: usize,
    /// Same as `context_window` (vLLM's name).
    pub max_model_len: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ModelList {
    pub object: String,
    pub data: Vec<ModelObject>,
}

/// `POST /tokenize`: text (`prompt` or `content`) or a chat (`messages`, `tools`).
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct TokenizeRequest {
    pub model: Option<String>,
    pub prompt: Option<String>,
    pub content: Option<String>,
    #[schema(value_type = Option<Vec<Object>>)]
    pub messages: Option<Vec<Value>>,
    #[schema(value_type = Option<Vec<Object>>)]
    pub tools: Option<Vec<Value>>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct TokenizeResponse {
    pub tokens: Vec<u32>,
    pub count: usize,
    pub max_model_len: usize,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct DetokenizeRequest {
    pub model: Option<String>,
    pub tokens: Vec<u32>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct DetokenizeResponse {
    /// vLLM's name for the text.
    pub prompt: String,
    /// llama.cpp's name for the same text.
    pub content: String,
}

/// `POST /v1/chat/completions/count`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct CountResponse {
    pub object: String,
    pub prompt_tokens: usize,
    pub context_window: usize,
    /// Tokens left for the reply: `context_window - prompt_tokens` (0 when over).
    pub remaining_tokens: usize,
}

/// The OpenAI error envelope.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ErrorResponse {
    pub error: ErrorBody,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ErrorBody {
    pub message: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub param: Option<String>,
    pub code: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct HealthResponse {
    /// `ok` or `loading`.
    pub status: String,
}
