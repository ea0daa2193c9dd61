//! What the scheduler tells a request's stream: token ids as they are committed, then how the
//! generation ended. Text is made from the ids further out (the tokenizer actor).

use crate::error::EngineError;

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// An end-of-turn token or a stop string.
    Stop,
    /// `max_tokens`, or the context window is full.
    Length,
    /// The client went away or asked to stop.
    Cancelled,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens whose K/V was reused instead of prefilled.
    pub cached_tokens: usize,
    /// From admission to the first generated token.
    pub prompt_ms: f64,
    /// From the first generated token to the last.
    pub decode_ms: f64,
    /// Draft tokens verified (speculative decoding), and how many of them were accepted.
    pub draft_tokens: usize,
    pub accepted_draft_tokens: usize,
    /// Per draft position (depth 1 first): how many drafts were verified there, and how many
    /// of those were accepted.
    pub draft_by_depth: DepthCounts,
    /// The request's `max_tokens`, when it reached past the window and was cut to fit.
    pub max_tokens_cut: Option<MaxTokensCut>,
}

/// A `max_tokens` cut to the room the context window leaves after the prompt: the request is
/// served up to the window (ending `length` there) instead of refused.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, utoipa::ToSchema,
)]
pub struct MaxTokensCut {
    /// What the request asked for.
    pub requested: usize,
    /// What it was served: the window less the prompt.
    pub served: usize,
}

impl Usage {
    /// This usage with the draft counts of `t`.
    pub fn with_drafts(self, t: DraftTally) -> Self {
        Self {
            draft_tokens: t.draft_tokens,
            accepted_draft_tokens: t.accepted_draft_tokens,
            draft_by_depth: t.draft_by_depth,
            ..self
        }
    }
}

/// `[verified, accepted]` per draft position, depth 1 first.
pub type DepthCounts = [[u32; 2]; crate::spec::MAX_DEPTH];

/// A sequence's speculative decoding so far (the fields of [`Usage`] of the same names).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DraftTally {
    pub draft_tokens: usize,
    pub accepted_draft_tokens: usize,
    pub draft_by_depth: DepthCounts,
}

#[derive(Debug, Clone, PartialEq)]
pub enum SeqEvent {
    Token {
        token_id: u32,
        logprob: Option<f32>,
        top_logprobs: Vec<(u32, f32)>,
        /// The token's position in its speculative round when it was an accepted draft (1 =
        /// first draft), 0 when the model sampled it (plain decoding, or a round's bonus or
        /// correction token).
        draft_depth: u8,
        /// The sequence's drafts up to and including this token's round, so that a stream
        /// ending itself (a stop string) can still report them.
        drafts: DraftTally,
    },
    /// The prompt's own tokens scored by the model (`echo` with `logprobs`), sent once the
    /// whole prompt is computed and before the first generated token: per prompt token, `ln p`
    /// given the tokens before it (`None` for the first) and the most likely tokens there.
    PromptLogprobs {
        token_ids: Vec<u32>,
        logprobs: Vec<Option<f32>>,
        top_logprobs: Vec<Vec<(u32, f32)>>,
    },
    /// The prompt's pooled hidden state, for a sequence that embeds its prompt (see
    /// `Submission::embed`); the sequence then finishes without generating.
    Embedding {
        vector: Vec<f32>,
    },
    Finished {
        reason: FinishReason,
        usage: Usage,
    },
    Error(EngineError),
}
