//! What callers hand the engine and what they get back. Token ids and text only; the wire
//! formats (OpenAI chunks, SSE, WebSocket events) live in the API layer.

use crate::error::EngineError;
use crate::sampling::SamplingParams;
use crate::scheduler::{FinishReason, Usage};
use crate::session::SessionKey;

#[derive(Debug, Clone)]
pub enum Prompt {
    /// Plain text, tokenized as-is.
    Text(String),
    /// Token ids, used as given.
    Tokens(Vec<u32>),
    /// OpenAI-style messages (and tools), rendered with the model's chat template.
    Chat {
        messages: serde_json::Value,
        tools: Option<serde_json::Value>,
    },
    /// A chat whose assistant reply is already begun with `assistant_prefix` (the text after the
    /// generation prompt): how a forced tool call (`tool_choice: required` or a named function)
    /// is made. The model continues from the prefix; the prefix is not part of the output.
    ChatContinued {
        messages: serde_json::Value,
        tools: Option<serde_json::Value>,
        assistant_prefix: String,
    },
}

#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub prompt: Prompt,
    /// Most tokens to generate; `None` means up to the context window.
    pub max_tokens: Option<usize>,
    pub sampling: SamplingParams,
    /// Generation stops before any of these strings; they are not part of the output.
    pub stop: Vec<String>,
    /// A persistent session to continue (its KV is reused up to the first differing token).
    pub session: Option<SessionKey>,
    /// Higher is scheduled first and preempted last.
    pub priority: i32,
    /// `Some(Off)` turns speculative decoding off for this request, `Some(Only(d))` restricts
    /// it to one drafter; `None` follows the server.
    pub speculative: Option<crate::spec::SpecChoice>,
    /// A predicted output (OpenAI Predicted Outputs), tokenized: a source of drafts.
    pub prediction: Option<Vec<u32>>,
    /// How sampled drafts are verified; `None`: coupled (output identical to plain sampling)
    /// when the request has a seed, rejection sampling when it has none.
    pub verification: Option<crate::spec::Verification>,
    /// What the output must be (`response_format`): every token is sampled from those that
    /// keep it valid.
    pub format: Option<crate::sampling::OutputFormat>,
    /// Score the prompt's own tokens (`echo` with `logprobs`), with this many most likely
    /// alternatives each: an [`EngineEvent::PromptLogprobs`] comes before the first token. The
    /// prompt is then computed in full (no reuse from the session or the prefix cache).
    pub prompt_logprobs: Option<usize>,
    /// Never end on a stop token (they are banned): only `max_tokens`, a stop string or a
    /// complete output grammar end the reply. For benchmarks and fixed-length generation.
    pub ignore_eos: bool,
    /// `max_tokens` is a ceiling, cut to the room the window leaves after the prompt instead of
    /// refused when the two do not fit (Ollama's `num_predict`). A prompt that fills the
    /// window is still refused.
    pub max_tokens_ceiling: bool,
    /// Refuse the request (`SessionBusy`) while its session has a turn in progress. Otherwise
    /// it runs without the session, its prompt still served by the prefix cache: a client's
    /// session key is often an affinity key it sends with concurrent requests too (opencode's
    /// `x-session-id` on its title request, a router's sticky key).
    pub exclusive_session: bool,
}

impl GenerateRequest {
    pub fn new(prompt: Prompt) -> Self {
        Self {
            prompt,
            max_tokens: None,
            sampling: SamplingParams::default(),
            stop: Vec::new(),
            session: None,
            priority: 0,
            speculative: None,
            prediction: None,
            verification: None,
            format: None,
            prompt_logprobs: None,
            ignore_eos: false,
            max_tokens_ceiling: false,
            exclusive_session: false,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum EngineEvent {
    /// Admitted: the prompt's size and how much of it was already in KV pages.
    Started {
        prompt_tokens: usize,
        cached_tokens: usize,
    },
    /// Newly committed tokens and the text they complete (possibly empty while a character is
    /// still incomplete, or held back while it might start a stop string).
    Delta {
        text: String,
        token_ids: Vec<u32>,
        logprobs: Vec<Option<f32>>,
        top_logprobs: Vec<Vec<(u32, f32)>>,
        /// Per token, as in [`crate::scheduler::SeqEvent::Token`]: the depth of an accepted
        /// speculative draft, or 0.
        draft_depths: Vec<u8>,
    },
    /// The prompt scored (see [`GenerateRequest::prompt_logprobs`]): per prompt token, its
    /// log-probability given the ones before (`None` for the first) and the most likely tokens
    /// there.
    PromptLogprobs {
        token_ids: Vec<u32>,
        logprobs: Vec<Option<f32>>,
        top_logprobs: Vec<Vec<(u32, f32)>>,
    },
    Finished {
        reason: FinishReason,
        usage: Usage,
        /// The stop string that ended the reply, when one did (`reason` is then `Stop`).
        stop_string: Option<String>,
    },
    Error(EngineError),
}
