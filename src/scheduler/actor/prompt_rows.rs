//! What a sequence's prompt rows give besides K/V: scores of the prompt's own tokens (`echo`
//! with `logprobs`) and, for an embedding, its pooled hidden state. The worker computes both
//! after the forward; here the scheduler asks for them and collects them across steps.

use super::{SchedulerActor, SeqEvent};
use crate::runner::batch::TokenLogprobs;
use crate::runner::embed::{EmbedJob, PooledRows};
use crate::runner::worker::PromptLogprobJob;
use crate::scheduler::events::FinishReason;
use crate::scheduler::plan::Grant;
use crate::scheduler::sequence::SeqId;

/// Prompt rows a step computes for a scored prompt: each keeps its whole row of logits until
/// scored (128 rows of a 152K vocabulary: 78 MB), where a 512-row chunk would hold 311 MB.
pub(super) const SCORED_PROMPT_CHUNK: usize = 128;

/// A prompt being scored: the entries so far, in position order (the first token's is `None`).
pub(super) struct PromptScore {
    num_top: usize,
    logprobs: Vec<Option<f32>>,
    top_logprobs: Vec<Vec<(u32, f32)>>,
    sent: bool,
}

impl PromptScore {
    pub(super) fn new(num_top: usize) -> Self {
        Self {
            num_top,
            logprobs: vec![None],
            top_logprobs: vec![Vec::new()],
            sent: false,
        }
    }
}

impl SchedulerActor {
    pub(super) fn is_embedding(&self, id: SeqId) -> bool {
        self.active.get(&id).is_some_and(|a| a.embedding.is_some())
    }

    /// The pooling a grant's rows need, when its sequence is being embedded.
    pub(super) fn embed_job(&self, g: &Grant) -> Option<EmbedJob> {
        let a = &self.active[&g.seq_id];
        let pooled = a.embedding.as_ref()?;
        Some(pooled.job(a.seq.num_computed, g.num_tokens, a.seq.num_prompt))
    }

    /// Adds a step's pooled rows (ending at position `end`) to its sequence's embedding; once
    /// the whole prompt is pooled, sends the embedding and ends the sequence.
    pub(super) fn record_pooled(&mut self, id: SeqId, rows: PooledRows, end: usize) {
        let Some(a) = self.active.get_mut(&id) else {
            return;
        };
        let Some(pooled) = a.embedding.as_mut() else {
            return;
        };
        pooled.add(rows, end);
        if a.seq.num_computed >= a.seq.num_prompt {
            let _ = a.sub.events.send(SeqEvent::Embedding {
                vector: pooled.vector(),
            });
            self.finish(id, Ok(FinishReason::Stop));
        }
    }

    /// The scoring a grant's rows need, when its sequence's prompt is being scored and the
    /// grant computes prompt rows not yet scored.
    pub(super) fn prompt_logprob_job(&self, g: &Grant) -> Option<PromptLogprobJob> {
        let a = &self.active[&g.seq_id];
        let score = a.prompt_score.as_ref().filter(|s| !s.sent)?;
        let (start, num_prompt) = (a.seq.num_computed, a.seq.num_prompt);
        if g.num_drafts > 0 || start + 1 >= num_prompt {
            return None;
        }
        let next_tokens = (start..start + g.num_tokens)
            .map(|p| (p + 1 < num_prompt).then(|| a.seq.tokens[p + 1]))
            .collect();
        Some(PromptLogprobJob {
            step: 0,
            next_tokens,
            num_top: score.num_top,
        })
    }

    /// Adds the scores of rows computed from position `start` (those not recorded already: a
    /// preempted sequence computes its prompt again), and sends them all once the prompt is
    /// complete, before its first generated token.
    pub(super) fn record_prompt_logprobs(
        &mut self,
        id: SeqId,
        start: usize,
        rows: Option<Vec<TokenLogprobs>>,
    ) {
        let Some(a) = self.active.get_mut(&id) else {
            return;
        };
        let num_prompt = a.seq.num_prompt;
        let Some(score) = a.prompt_score.as_mut().filter(|s| !s.sent) else {
            return;
        };
        for (i, (logprob, top)) in rows.into_iter().flatten().enumerate() {
            let scores = start + i + 1;
            if scores == score.logprobs.len() && scores < num_prompt {
                score.logprobs.push(logprob);
                score.top_logprobs.push(top);
            }
        }
        if score.logprobs.len() == num_prompt {
            score.sent = true;
            let _ = a.sub.events.send(SeqEvent::PromptLogprobs {
                token_ids: a.seq.tokens[..num_prompt].to_vec(),
                logprobs: std::mem::take(&mut score.logprobs),
                top_logprobs: std::mem::take(&mut score.top_logprobs),
            });
        }
    }
}
