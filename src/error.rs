//! Typed errors of the engine. Every refusal the engine can give a request is a value here, so
//! that the API layer can map it to a precise client error instead of a crash.

use thiserror::Error;

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum KvError {
    /// The pool cannot hand out `needed` pages; only `free` remain. Nothing was allocated.
    #[error("KV page pool exhausted: needed {needed} pages, {free} free")]
    PoolExhausted { needed: usize, free: usize },
    /// A write or read addressed a position the page table holds no page for.
    #[error("position {position} is past the page table's capacity of {capacity} tokens")]
    PastCapacity { position: usize, capacity: usize },
    /// A page id was released that is not currently allocated (a double free).
    #[error("page {page_id} is not allocated")]
    NotAllocated { page_id: u32 },
}

/// Why the engine refused or ended a request. Every variant is something a client can act on;
/// the API layer maps each to an OpenAI-shaped error with the right status.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum EngineError {
    #[error(
        "this request needs {prompt_tokens} prompt tokens plus max_tokens {max_tokens}, \
         {} in all, but the context window is {context_window} tokens",
        prompt_tokens + max_tokens
    )]
    ContextLengthExceeded {
        prompt_tokens: usize,
        max_tokens: usize,
        context_window: usize,
    },
    #[error(
        "this request needs {needed_tokens} tokens of KV memory but the whole KV budget \
         holds {budget_tokens}; raise --kv-memory or shorten the request"
    )]
    InsufficientKvMemory {
        needed_tokens: usize,
        budget_tokens: usize,
    },
    #[error("the server is overloaded; retry in {retry_after_s} s")]
    Overloaded { retry_after_s: u64 },
    #[error("session `{session_id}` already has a turn in progress")]
    SessionBusy { session_id: String },
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// A request field out of its range or not valid for this model (`param` names it).
    #[error("invalid `{param}`: {message}")]
    InvalidParam {
        param: &'static str,
        message: String,
    },
    #[error(transparent)]
    Kv(#[from] KvError),
    #[error("internal error: {0}")]
    Internal(String),
}

impl From<actix::MailboxError> for EngineError {
    fn from(e: actix::MailboxError) -> Self {
        EngineError::Internal(format!("engine actor unavailable: {e}"))
    }
}
