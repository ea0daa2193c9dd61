//! `Engine::embed`: a text's pooled hidden state. It goes through the same admission,
//! sessions and scheduler as a generation (so embeddings batch with running streams and never
//! stall them), computes the whole prompt (no reuse: every row is pooled) and generates nothing.

use super::{Engine, Prompt};
use crate::error::EngineError;
use crate::runner::embed::Pooling;
use crate::sampling::{Sampler, SamplingParams};
use crate::scheduler::{SeqEvent, Submission};
use crate::session::{BeginTurn, SessionActor};
use crate::spec::{DrafterSet, SeqSpec};
use actix::Actor;
use std::sync::atomic::Ordering;
use tokio::sync::mpsc::unbounded_channel;

#[derive(Debug, Clone)]
pub struct EmbedRequest {
    pub prompt: Prompt,
    /// `None`: the server's `--pooling`.
    pub pooling: Option<Pooling>,
    /// Keep the first context-window tokens of a longer text (Ollama's `truncate`) instead of
    /// refusing it.
    pub truncate: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Embedding {
    /// The pooled hidden state after the final norm, not normalised.
    pub vector: Vec<f32>,
    /// Tokens embedded (after any truncation).
    pub prompt_tokens: usize,
}

impl Engine {
    /// Embeds one text. Dropping the future cancels it, as dropping a stream does.
    pub async fn embed(&self, req: EmbedRequest) -> Result<Embedding, EngineError> {
        let mut tokens = self.tokenize(&req.prompt).await?;
        if req.truncate {
            tokens.truncate(self.info.context_window);
        }
        let prompt_tokens = tokens.len();
        if prompt_tokens == 0 {
            return Err(EngineError::InvalidRequest("the input is empty".into()));
        }
        self.check_fits(prompt_tokens, 0)?;
        let stream_id = self.next_stream_id.fetch_add(1, Ordering::Relaxed);
        let id = format!("embedding-{stream_id}");
        let session = SessionActor::new(id.clone(), self.pool.clone(), self.info.page_size).start();
        let turn = session
            .send(BeginTurn {
                prompt: tokens.clone(),
                reuse: false,
            })
            .await??;
        let (events, mut from_scheduler) = unbounded_channel();
        let submission = Submission {
            tokens,
            cached_tokens: turn.cached_tokens,
            num_pages: turn.num_pages,
            max_tokens: 1,
            priority: 0,
            sampler: Sampler::new(SamplingParams::greedy()).expect("greedy params are valid"),
            spec: SeqSpec::new(DrafterSet::NONE, None),
            session: session.clone(),
            ephemeral: true,
            draft_key: id.into(),
            prompt_logprobs: None,
            embed: Some(req.pooling.unwrap_or(self.info.pooling)),
            events,
            turn_ended: tokio::sync::oneshot::channel().0,
        };
        self.enqueue(submission).await?;
        let mut vector = None;
        while let Some(event) = from_scheduler.recv().await {
            match event {
                SeqEvent::Embedding { vector: v } => vector = Some(v),
                SeqEvent::Finished { .. } => break,
                SeqEvent::Error(e) => return Err(e),
                SeqEvent::Token { .. } | SeqEvent::PromptLogprobs { .. } => {}
            }
        }
        let vector = vector.ok_or_else(|| {
            EngineError::Internal("the scheduler ended an embedding without one".into())
        })?;
        Ok(Embedding {
            vector,
            prompt_tokens,
        })
    }
}
