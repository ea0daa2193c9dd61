//! The model worker: a dedicated thread that owns the weights and the KV storage and runs one
//! forward per message. Only the scheduler talks to it; the batch it receives already names
//! every page each sequence may touch.

use super::batch::{ForwardOutput, OutputRows, Sampled, SeqStep, TokenLogprobs};
use super::embed::EmbedJob;
use crate::error::EngineError;
use crate::kv::{KvDtype, KvStorage, PageCopy, PageId};
use crate::model::Transformer;
use crate::sampling::{token_logprobs, Sampler, SamplingError, TokenHistory};
use crate::session::store::{ExportPages, ImportPages};
use actix::prelude::*;
use rayon::prelude::*;
use std::sync::Arc;
use std::time::Instant;

pub struct ModelWorker {
    model: Arc<Transformer>,
    kv: KvStorage,
    /// The last step's logits buffer, when nobody else needed its rows: reused for the next.
    spare_logits: Vec<f32>,
}

impl ModelWorker {
    /// Starts the worker thread. `num_pages` bounds the KV storage, which grows lazily.
    pub fn start(
        model: Arc<Transformer>,
        page_size: usize,
        dtype: KvDtype,
        num_pages: usize,
    ) -> Addr<Self> {
        SyncArbiter::start(1, move || ModelWorker {
            kv: super::calibrate::kv_storage(&model, page_size, dtype, num_pages),
            model: model.clone(),
            spare_logits: Vec::new(),
        })
    }
}

impl Actor for ModelWorker {
    type Context = SyncContext<Self>;
}

/// One sequence's share of a step, owned so it can cross threads.
#[derive(Debug, Clone)]
pub struct OwnedSeqStep {
    pub tokens: Vec<u32>,
    pub start_position: usize,
    pub page_ids: Vec<PageId>,
    pub outputs: OutputRows,
}

/// A sequence whose next token the worker draws from its last output row right after the
/// forward: the rows are sampled in parallel while the logits are at hand, and the scheduler's
/// step only commits tokens. The sampler travels here and back in [`Sampled`].
#[derive(Debug)]
pub struct SampleJob {
    /// The sequence's index in [`Forward::steps`].
    pub step: usize,
    pub sampler: Sampler,
    /// The sequence's tokens so far, of which the first `num_prompt` are the prompt; empty when
    /// the sampler reads no history (no penalty).
    pub tokens: Vec<u32>,
    pub num_prompt: usize,
}

impl SampleJob {
    fn run(mut self, out: &ForwardOutput) -> Sampled {
        let history = TokenHistory::new(
            &self.tokens[..self.num_prompt.min(self.tokens.len())],
            self.tokens.get(self.num_prompt..).unwrap_or(&[]),
        );
        let result = match out.rows_of(self.step).last() {
            Some(row) => self.sampler.sample(out.logits_row(row), &history),
            None => Err(SamplingError::EmptyLogits),
        };
        Sampled {
            step: self.step,
            sampler: self.sampler,
            result,
        }
    }
}

/// A sequence whose prompt is being scored (`echo` with `logprobs`): its step asks for every
/// row's logits, and output row `i` scores `next_tokens[i]`, the prompt token after that row's
/// position (`None` past the prompt). Scored in the worker, in parallel, while the logits are
/// at hand: a long prompt's 152K-wide rows would hold up the scheduler's thread.
#[derive(Debug, Clone)]
pub struct PromptLogprobJob {
    /// The sequence's index in [`Forward::steps`].
    pub step: usize,
    pub next_tokens: Vec<Option<u32>>,
    pub num_top: usize,
}

impl PromptLogprobJob {
    fn run(&self, out: &ForwardOutput) -> (usize, Vec<TokenLogprobs>) {
        let rows: Vec<usize> = out.rows_of(self.step).collect();
        let scored = rows
            .par_iter()
            .zip(&self.next_tokens)
            .map_init(Vec::new, |top, (&row, next)| match next {
                Some(token) => token_logprobs(out.logits_row(row), *token, self.num_top, top),
                None => (None, Vec::new()),
            })
            .collect();
        (self.step, scored)
    }
}

#[derive(Message)]
#[rtype(result = "Result<ForwardOutput, EngineError>")]
pub struct Forward {
    pub steps: Vec<OwnedSeqStep>,
    pub want_hidden: bool,
    /// Copy-on-write page copies, run before the forward reads or writes any page.
    pub copies: Vec<PageCopy>,
    /// Rows to sample after the forward.
    pub sample: Vec<SampleJob>,
    /// Prompts to score after the forward.
    pub prompt_logprobs: Vec<PromptLogprobJob>,
    /// Prompts being embedded: their rows pooled after the forward (`want_hidden` is set).
    pub embed: Vec<EmbedJob>,
}

impl Handler<Forward> for ModelWorker {
    type Result = Result<ForwardOutput, EngineError>;

    fn handle(&mut self, msg: Forward, _: &mut SyncContext<Self>) -> Self::Result {
        let steps: Vec<SeqStep> = msg
            .steps
            .iter()
            .map(|s| SeqStep {
                tokens: &s.tokens,
                start_position: s.start_position,
                page_ids: &s.page_ids,
                outputs: s.outputs,
            })
            .collect();
        // A bug in a kernel must fail this step's requests, not take the worker thread down.
        let logits = std::mem::take(&mut self.spare_logits);
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            for &copy in &msg.copies {
                self.kv.copy_slots(copy);
            }
            self.model
                .forward_into(&steps, &mut self.kv, msg.want_hidden, logits)
        }));
        // Only verify rows (`All`) are read after sampling; without them the logits stay here.
        let keep_logits = msg.steps.iter().all(|s| s.outputs != OutputRows::All);
        match result {
            Ok(Ok(mut out)) => {
                let started = Instant::now();
                out.sampled = msg
                    .sample
                    .into_par_iter()
                    .map(|job| job.run(&out))
                    .collect();
                out.prompt_logprobs = msg.prompt_logprobs.iter().map(|j| j.run(&out)).collect();
                out.pooled = msg.embed.iter().map(|j| j.run(&out, &self.model)).collect();
                out.sampling_time = started.elapsed();
                if keep_logits {
                    self.spare_logits = std::mem::take(&mut out.logits);
                }
                Ok(out)
            }
            Ok(Err(e)) => match e.downcast::<crate::error::KvError>() {
                Ok(kv) => Err(EngineError::Kv(kv)),
                Err(e) => Err(EngineError::Internal(format!("{e:#}"))),
            },
            Err(_) => Err(EngineError::Internal("the forward pass panicked".into())),
        }
    }
}

/// Bytes of KV storage allocated so far.
#[derive(Message)]
#[rtype(result = "usize")]
pub struct KvBytes;

impl Handler<KvBytes> for ModelWorker {
    type Result = usize;
    fn handle(&mut self, _: KvBytes, _: &mut SyncContext<Self>) -> usize {
        self.kv.bytes_allocated()
    }
}

impl Handler<ExportPages> for ModelWorker {
    type Result = ();
    fn handle(&mut self, msg: ExportPages, _: &mut SyncContext<Self>) {
        let _ = msg.reply.send(self.kv.export_pages(&msg.page_ids));
    }
}

impl Handler<ImportPages> for ModelWorker {
    type Result = ();
    fn handle(&mut self, msg: ImportPages, _: &mut SyncContext<Self>) {
        let started = Instant::now();
        self.kv.import_pages(&msg.page_ids, &msg.bytes);
        tracing::debug!(
            pages = msg.page_ids.len(),
            ms = started.elapsed().as_secs_f64() * 1e3,
            "pages imported"
        );
    }
}
