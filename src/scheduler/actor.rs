//! The scheduler actor: holds every admitted sequence, decides each step with
//! [`plan_step`](super::plan::plan_step), asks sessions for the pages the step needs, runs the
//! step on the model worker, samples, and streams committed tokens to each request.
//!
//! One step is in flight at a time. Cancellation is a closed event channel, noticed when the
//! next step is planned; the sequence's pages go back at once.

use super::events::{FinishReason, SeqEvent, Usage};
use super::plan::{plan_step, unblock_prefill, Grant, SchedulerConfig, StepPlan};
use super::sequence::{SeqId, Sequence};
use crate::error::{EngineError, KvError};
use crate::kv::pool_actor::{GetPoolStats, PagePoolActor, Release};
use crate::kv::PageId;
use crate::runner::batch::{ForwardOutput, OutputRows, Sampled, TokenLogprobs};
use crate::runner::embed::{EmbedJob, Pooled, PooledRows, Pooling};
use crate::runner::worker::{Forward, ModelWorker, OwnedSeqStep, PromptLogprobJob, SampleJob};
use crate::sampling::{
    Distribution, SampleOutput, Sampler, SamplingError, SamplingParams, TokenHistory,
};
use crate::session::registry::{EvictLeastRecentlyUsed, SessionRegistry};
use crate::session::{EndTurn, Flush, Grow, ReleaseAll, SessionActor, Truncate};
use crate::spec::cost::DraftModelCosts;
use crate::spec::draft_model::DraftWorker;
use crate::spec::drafter_kv::DraftKey;
use crate::spec::mtp::MtpWorker;
use crate::spec::{self, SeqSpec, SpecConfig, SpecCounters};
use drafting::StepTally;

mod drafting;
mod prompt_rows;
use actix::prelude::*;
use prompt_rows::{PromptScore, SCORED_PROMPT_CHUNK};
use std::collections::HashMap;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::oneshot::error::TryRecvError;

/// An admitted request, as the engine hands it over.
pub struct Submission {
    pub tokens: Vec<u32>,
    pub cached_tokens: usize,
    pub num_pages: usize,
    pub max_tokens: usize,
    pub priority: i32,
    pub sampler: Sampler,
    /// Whether and from what this sequence drafts.
    pub spec: SeqSpec,
    pub session: Addr<SessionActor>,
    /// A throwaway session (no session id): its pages are released when the turn ends.
    pub ephemeral: bool,
    /// Names this sequence's draft-model K/V (the session's key when it persists).
    pub draft_key: DraftKey,
    /// Score the prompt's own tokens, with this many most likely alternatives each (the
    /// session reused nothing, so every prompt row is computed).
    pub prompt_logprobs: Option<usize>,
    /// Embed the prompt instead of generating: its hidden states pooled so, sent as
    /// [`SeqEvent::Embedding`] once the prompt is computed, and then the sequence ends.
    pub embed: Option<Pooling>,
    pub events: UnboundedSender<SeqEvent>,
    /// Never sent: dropped when the scheduler lets the sequence go, after the end of its
    /// session's turn is on its way to the session. A stream that ends itself (a stop string)
    /// waits for it before it answers, so that the client's next turn finds the session free.
    pub turn_ended: tokio::sync::oneshot::Sender<()>,
}

struct Active {
    seq: Sequence,
    running: bool,
    sub: Submission,
    page_ids: Vec<PageId>,
    /// The draft model's distributions for `seq.drafts` (sampled requests only).
    draft_probs: Option<Vec<Distribution>>,
    /// Target hidden states of committed positions not yet handed to the MTP heads
    /// (`[rows, hidden]` from `mtp_hidden_start`), and the next position to collect.
    mtp_hidden: Vec<f32>,
    mtp_hidden_start: usize,
    mtp_next: usize,
    admitted_at: Instant,
    first_token_at: Option<Instant>,
    prompt_score: Option<PromptScore>,
    embedding: Option<Pooled>,
}

pub struct SchedulerActor {
    cfg: SchedulerConfig,
    max_queue: usize,
    context_window: usize,
    stop_token_ids: Vec<u32>,
    spec: SpecConfig,
    worker: Addr<ModelWorker>,
    pool: Addr<PagePoolActor>,
    registry: Addr<SessionRegistry>,
    active: HashMap<SeqId, Active>,
    next_id: SeqId,
    step_in_flight: bool,
    step_started: Instant,
    stats: SchedulerStats,
    /// The draft model's thread, when one is loaded.
    draft: Option<Addr<DraftWorker>>,
    /// The MTP heads' thread, when the model has heads and the server uses them.
    mtp: Option<Addr<MtpWorker>>,
    /// Its measured costs and the guard that pauses it while it is slower than plain decoding.
    draft_costs: Option<DraftModelCosts>,
    /// What the step in flight did, for the cost guard.
    tally: StepTally,
    /// Finished sequences' sessions that have not yet handled the end of their turn (see
    /// [`Settle`]).
    turn_ends: Vec<tokio::sync::oneshot::Receiver<()>>,
    /// The last step ran nothing and no idle session was left to give up pages: the next
    /// plan may preempt to let a prompt go on ([`unblock_prefill`]).
    stalled: bool,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct SchedulerStats {
    pub num_running: usize,
    pub num_waiting: usize,
    pub num_steps: u64,
    pub num_preemptions: u64,
    pub prompt_tokens_computed: u64,
    pub tokens_generated: u64,
    /// Time spent per step outside the forward pass (planning, page messages, sampling,
    /// streaming), summed over steps that ran a forward.
    pub overhead_us_total: u64,
    pub overhead_us_max: u64,
    pub forward_steps: u64,
    /// Time the model worker spent sampling decode rows after the forward (in parallel over
    /// rows), summed over steps; part of the forward's time above, not of the overhead.
    pub sampling_us_total: u64,
    /// Drafted and accepted tokens by drafter and depth position.
    pub spec: SpecCounters,
    /// Times the cost guard paused the draft model for being slower than plain decoding.
    pub draft_model_pauses: u32,
    /// Rows the draft model computed to bring sequences far behind up to date (a new prompt,
    /// less what it could take over from an earlier request's draft K/V).
    pub draft_catch_up_rows: u64,
    /// Milliseconds per committed token, measured: plain decode steps, and steps verifying
    /// draft-model drafts (draft + verify); zero without a draft model.
    pub plain_ms_per_token: f64,
    pub draft_model_ms_per_token: f64,
}

pub struct SchedulerParts {
    pub cfg: SchedulerConfig,
    pub max_queue: usize,
    pub context_window: usize,
    pub stop_token_ids: Vec<u32>,
    pub spec: SpecConfig,
    pub worker: Addr<ModelWorker>,
    pub pool: Addr<PagePoolActor>,
    pub registry: Addr<SessionRegistry>,
    pub draft: Option<Addr<DraftWorker>>,
    pub mtp: Option<Addr<MtpWorker>>,
    pub draft_costs: Option<DraftModelCosts>,
}

impl SchedulerActor {
    pub fn new(p: SchedulerParts) -> Self {
        Self {
            cfg: p.cfg,
            max_queue: p.max_queue,
            context_window: p.context_window,
            stop_token_ids: p.stop_token_ids,
            spec: p.spec,
            worker: p.worker,
            pool: p.pool,
            registry: p.registry,
            active: HashMap::new(),
            next_id: 0,
            step_in_flight: false,
            step_started: Instant::now(),
            stats: SchedulerStats::default(),
            draft: p.draft,
            mtp: p.mtp,
            draft_costs: p.draft_costs,
            tally: StepTally::default(),
            turn_ends: Vec::new(),
            stalled: false,
        }
    }

    fn num_waiting(&self) -> usize {
        self.active.values().filter(|a| !a.running).count()
    }

    /// Ends a sequence: tells its stream, closes its session turn, frees throwaway pages.
    fn finish(&mut self, id: SeqId, outcome: Result<FinishReason, EngineError>) {
        let Some(mut a) = self.active.remove(&id) else {
            return;
        };
        let event = match outcome {
            Ok(reason) => {
                let now = Instant::now();
                let first = a.first_token_at.unwrap_or(now);
                SeqEvent::Finished {
                    reason,
                    usage: Usage {
                        prompt_tokens: a.seq.num_prompt,
                        completion_tokens: a.seq.num_generated(),
                        cached_tokens: a.sub.cached_tokens,
                        prompt_ms: first.duration_since(a.admitted_at).as_secs_f64() * 1e3,
                        decode_ms: now.duration_since(first).as_secs_f64() * 1e3,
                        ..Usage::default()
                    }
                    .with_drafts(a.sub.spec.tally()),
                }
            }
            Err(e) => SeqEvent::Error(e),
        };
        self.end_drafting(&mut a);
        // The session hears of the end first: a client told of it may start its next turn.
        a.sub.session.do_send(EndTurn { publish: true });
        if a.sub.ephemeral {
            a.sub.session.do_send(ReleaseAll);
        }
        let _ = a.sub.events.send(event);
        let flushed = a.sub.session.send(Flush);
        let (done, ended) = tokio::sync::oneshot::channel();
        actix_rt::spawn(async move {
            let _ = flushed.await;
            let _ = done.send(());
        });
        self.turn_ends
            .retain_mut(|e| matches!(e.try_recv(), Err(TryRecvError::Empty)));
        self.turn_ends.push(ended);
    }

    fn reap_cancelled(&mut self) {
        let gone: Vec<SeqId> = self
            .active
            .iter()
            .filter(|(_, a)| a.sub.events.is_closed())
            .map(|(id, _)| *id)
            .collect();
        for id in gone {
            self.finish(id, Ok(FinishReason::Cancelled));
        }
    }

    fn plan(&self, available_pages: usize) -> StepPlan {
        let mut running = Vec::new();
        let mut waiting = Vec::new();
        for a in self.active.values() {
            if a.running {
                running.push(&a.seq);
            } else {
                waiting.push(&a.seq);
            }
        }
        let plan = plan_step(&running, &waiting, available_pages, &self.cfg);
        if self.stalled && plan.is_empty() && plan.preempted.is_empty() {
            return unblock_prefill(&running, available_pages, &self.cfg);
        }
        plan
    }

    fn preempt(&mut self, ids: &[SeqId]) {
        for id in ids {
            if let Some(a) = self.active.get_mut(id) {
                a.sub.session.do_send(ReleaseAll);
                a.seq.num_computed = 0;
                a.seq.num_pages = 0;
                a.seq.drafts.clear();
                a.draft_probs = None;
                a.page_ids.clear();
                a.running = false;
                self.stats.num_preemptions += 1;
            }
        }
    }

    /// The tokens a grant computes: pending tokens, then drafts.
    fn grant_tokens(&self, g: &Grant) -> Vec<u32> {
        let seq = &self.active[&g.seq_id].seq;
        let from = seq.num_computed;
        let plain = g.num_tokens - g.num_drafts;
        let mut t = seq.tokens[from..from + plain].to_vec();
        t.extend_from_slice(&seq.drafts[..g.num_drafts]);
        t
    }

    /// Asks sessions for pages, then runs the forward: the asynchronous half of a step.
    fn execute(&mut self, plan: StepPlan) -> impl ActorFuture<Self, Output = StepOutcome> {
        self.preempt(&plan.preempted);
        let grows: Vec<_> = plan
            .grants
            .iter()
            .map(|g| {
                let tokens = self.grant_tokens(g);
                let a = &self.active[&g.seq_id];
                let grow = a.sub.session.send(Grow {
                    tokens: tokens.clone(),
                });
                (*g, a.seq.num_computed, tokens, grow)
            })
            .collect();
        // Rows the worker samples: their samplers go with the step and come back in `apply`.
        let sampled: Vec<SeqId> = plan
            .grants
            .iter()
            .filter(|g| g.wants_logits && g.num_drafts == 0 && !self.is_embedding(g.seq_id))
            .map(|g| g.seq_id)
            .collect();
        let mut jobs: HashMap<SeqId, SampleJob> = sampled
            .into_iter()
            .map(|id| (id, self.take_sample_job(id)))
            .collect();
        let mut pooling: HashMap<SeqId, EmbedJob> = plan
            .grants
            .iter()
            .filter_map(|g| Some((g.seq_id, self.embed_job(g)?)))
            .collect();
        let mut scoring: HashMap<SeqId, PromptLogprobJob> = plan
            .grants
            .iter()
            .filter_map(|g| Some((g.seq_id, self.prompt_logprob_job(g)?)))
            .collect();
        let worker = self.worker.clone();
        let pool = self.pool.clone();
        let want_hidden =
            self.wants_hidden(plan.grants.iter().map(|g| g.seq_id)) || !pooling.is_empty();
        async move {
            let mut granted = Vec::new();
            let mut refused = Vec::new();
            let mut copies = Vec::new();
            for (grant, start, tokens, grow) in grows {
                match grow.await.map_err(EngineError::from).and_then(|r| r) {
                    Ok(grown) => {
                        copies.extend(grown.copies);
                        granted.push(Granted {
                            grant,
                            start,
                            tokens,
                            page_ids: grown.page_ids,
                        })
                    }
                    Err(e) => refused.push((grant.seq_id, e)),
                }
            }
            let copy_sources: Vec<PageId> = copies.iter().map(|c| c.src).collect();
            let mut sample = Vec::new();
            let mut prompt_logprobs = Vec::new();
            let mut embed = Vec::new();
            for (step, g) in granted.iter().enumerate() {
                if let Some(mut job) = pooling.remove(&g.grant.seq_id) {
                    job.step = step;
                    embed.push(job);
                }
                if let Some(mut job) = jobs.remove(&g.grant.seq_id) {
                    job.step = step;
                    sample.push(job);
                }
                if let Some(mut job) = scoring.remove(&g.grant.seq_id) {
                    job.step = step;
                    prompt_logprobs.push(job);
                }
            }
            let scored: Vec<usize> = prompt_logprobs.iter().map(|j| j.step).collect();
            let embedded: Vec<usize> = embed.iter().map(|j| j.step).collect();
            let steps: Vec<OwnedSeqStep> = granted
                .iter()
                .enumerate()
                .map(|(step, g)| OwnedSeqStep {
                    tokens: g.tokens.clone(),
                    start_position: g.start,
                    page_ids: g.page_ids.clone(),
                    outputs: match (g.grant.wants_logits, g.grant.num_drafts) {
                        _ if scored.contains(&step) => OutputRows::All,
                        _ if embedded.contains(&step) => OutputRows::None,
                        (false, _) => OutputRows::None,
                        (true, 0) => OutputRows::Last,
                        (true, _) => OutputRows::All,
                    },
                })
                .collect();
            let mut forward_time = Duration::ZERO;
            // Refused grants' samplers stay here; with no forward, every one does.
            let mut unsent: Vec<(SeqId, Sampler)> =
                jobs.into_iter().map(|(id, j)| (id, j.sampler)).collect();
            let forward = if steps.is_empty() {
                unsent.extend(
                    sample
                        .into_iter()
                        .map(|j| (granted[j.step].grant.seq_id, j.sampler)),
                );
                None
            } else {
                let started = Instant::now();
                let out = worker.send(Forward {
                    steps,
                    want_hidden,
                    copies,
                    sample,
                    prompt_logprobs,
                    embed,
                });
                let out = out.await.map_err(EngineError::from).and_then(|r| r);
                forward_time = started.elapsed();
                Some(out)
            };
            // The copies are done (or their sequences failed): their sources go back.
            if !copy_sources.is_empty() {
                pool.do_send(Release {
                    page_ids: copy_sources,
                });
            }
            StepOutcome {
                granted,
                refused,
                forward,
                forward_time,
                unsent,
            }
        }
        .into_actor(self)
    }

    /// The synchronous half of a step: commit computed positions, sample, stream, finish.
    fn apply(&mut self, outcome: StepOutcome) {
        self.stats.num_steps += 1;
        for (id, sampler) in outcome.unsent {
            if let Some(a) = self.active.get_mut(&id) {
                a.sub.sampler = sampler;
            }
        }
        for (id, e) in outcome.refused {
            match e {
                // The pool changed between planning and growing: try again next step.
                EngineError::Kv(KvError::PoolExhausted { .. }) => {}
                other => self.finish(id, Err(other)),
            }
        }
        let mut out = match outcome.forward {
            None => return,
            Some(Ok(out)) => out,
            Some(Err(e)) => {
                for g in outcome.granted {
                    // The step's K/V may be half written: nothing the session holds is kept,
                    // published or stored.
                    if let Some(a) = self.active.get(&g.grant.seq_id) {
                        a.sub.session.do_send(ReleaseAll);
                    }
                    self.finish(g.grant.seq_id, Err(e.clone()));
                }
                return;
            }
        };
        self.stats.sampling_us_total += out.sampling_time.as_micros() as u64;
        let mut sampled: Vec<Option<Sampled>> = Vec::new();
        sampled.resize_with(outcome.granted.len(), || None);
        for s in std::mem::take(&mut out.sampled) {
            let step = s.step;
            sampled[step] = Some(s);
        }
        let mut scored: HashMap<usize, Vec<TokenLogprobs>> =
            std::mem::take(&mut out.prompt_logprobs)
                .into_iter()
                .collect();
        let mut pooled: HashMap<usize, PooledRows> = std::mem::take(&mut out.pooled)
            .into_iter()
            .map(|p| (p.step, p))
            .collect();
        for (batch_index, granted) in outcome.granted.into_iter().enumerate() {
            let Granted {
                grant: g,
                tokens,
                page_ids,
                start,
            } = granted;
            let id = g.seq_id;
            let Some(a) = self.active.get_mut(&id) else {
                continue;
            };
            a.seq.num_computed += tokens.len();
            a.seq.num_pages = page_ids.len();
            a.page_ids = page_ids;
            if !a.running {
                a.running = true;
            }
            if a.seq.num_computed <= a.seq.num_prompt {
                self.stats.prompt_tokens_computed += tokens.len() as u64;
            }
            let plain_rows = g.num_tokens - g.num_drafts;
            self.tally.prefill |= plain_rows > 1 || !g.wants_logits;
            self.tally.verified |= g.num_drafts > 0;
            self.tally.num_decode_rows += usize::from(g.num_drafts == 0 && plain_rows == 1);
            self.record_prompt_logprobs(id, start, scored.remove(&batch_index));
            if let Some(rows) = pooled.remove(&batch_index) {
                self.record_pooled(id, rows, start + tokens.len());
                continue;
            }
            // Rows whose K/V (and hidden state) stay: all, or up to the last accepted draft.
            let mut num_valid = tokens.len();
            if g.num_drafts > 0 {
                num_valid = self.verify_and_commit(id, &out, batch_index, tokens.len());
            } else if let Some(s) = sampled[batch_index].take() {
                self.commit_sampled(id, s);
            }
            self.collect_hidden(id, &out, batch_index, start, num_valid);
        }
    }

    /// Verifies a grant's drafts, rolls the session back past the rejected ones, and commits
    /// the accepted drafts and the bonus or correction token. Returns how many of the grant's
    /// rows keep their K/V.
    fn verify_and_commit(
        &mut self,
        id: SeqId,
        out: &ForwardOutput,
        batch_index: usize,
        num_rows: usize,
    ) -> usize {
        let page_size = self.cfg.page_size;
        let a = self.active.get_mut(&id).unwrap();
        let rows: Vec<&[f32]> = out
            .rows_of(batch_index)
            .map(|r| out.logits_row(r))
            .collect();
        let drafts = std::mem::take(&mut a.seq.drafts);
        let probs = a.draft_probs.take();
        let (prompt, generated) = a.seq.tokens.split_at(a.seq.num_prompt);
        let history = TokenHistory::new(prompt, generated);
        let verdict = match spec::verify(
            &mut a.sub.sampler,
            &history,
            &drafts,
            probs.as_deref(),
            &rows,
            a.sub.spec.verification,
        ) {
            Ok(v) => v,
            Err(e) => {
                self.finish(id, Err(EngineError::InvalidRequest(e.to_string())));
                return 0;
            }
        };
        if let Some(source) = a.sub.spec.source {
            self.stats
                .spec
                .record(source, drafts.len(), verdict.num_accepted);
        }
        a.sub.spec.record(drafts.len(), verdict.num_accepted);
        let num_commit = self.num_to_commit(id, &verdict.emitted);
        let a = self.active.get_mut(&id).unwrap();
        // Valid K/V: the pending token and the drafts committed before the last token, which
        // becomes the new pending one.
        let keep = a.seq.num_computed - num_rows + num_commit;
        if keep < a.seq.num_computed {
            a.sub.session.do_send(Truncate { len: keep });
            a.seq.num_computed = keep;
            a.seq.num_pages = keep.div_ceil(page_size);
            a.page_ids.truncate(a.seq.num_pages);
        }
        for (i, sampled) in verdict.emitted.into_iter().take(num_commit).enumerate() {
            // The first `num_accepted` emitted tokens are the accepted drafts, in order.
            let draft_depth = if i < verdict.num_accepted { i + 1 } else { 0 };
            if self.emit(id, sampled, draft_depth as u8) {
                break;
            }
        }
        num_commit
    }

    /// How many of `emitted` to commit: up to and including the first that ends the sequence.
    fn num_to_commit(&self, id: SeqId, emitted: &[SampleOutput]) -> usize {
        let a = &self.active[&id];
        for (i, sampled) in emitted.iter().enumerate() {
            let num_generated = a.seq.num_generated() + i + 1;
            let len = a.seq.tokens.len() + i + 1;
            if self.stop_token_ids.contains(&sampled.token)
                || num_generated >= a.sub.max_tokens
                || len >= self.context_window
            {
                return i + 1;
            }
        }
        emitted.len()
    }

    /// Takes a sequence's sampler (and, when it reads them, its tokens) for the worker to
    /// sample its next token with; a stand-in holds its place until [`Self::commit_sampled`].
    fn take_sample_job(&mut self, id: SeqId) -> SampleJob {
        let a = self
            .active
            .get_mut(&id)
            .expect("a granted sequence is active");
        let stand_in = Sampler::new(SamplingParams::greedy()).expect("greedy params are valid");
        let sampler = std::mem::replace(&mut a.sub.sampler, stand_in);
        let params = sampler.params();
        let (prompt, generated) = a.seq.tokens.split_at(a.seq.num_prompt);
        // Only what the penalties read at this step, so a long prompt is not copied every token.
        let prompt = TokenHistory::new(prompt, generated).prompt_read_by(params);
        let (tokens, num_prompt) = if params.reads_history() {
            ([prompt, generated].concat(), prompt.len())
        } else {
            (Vec::new(), 0)
        };
        SampleJob {
            step: 0,
            sampler,
            tokens,
            num_prompt,
        }
    }

    /// Puts back the sampler the worker used and commits the token it drew.
    fn commit_sampled(&mut self, id: SeqId, s: Sampled) {
        let a = self.active.get_mut(&id).unwrap();
        a.sub.sampler = s.sampler;
        match s.result {
            Ok(out) => {
                self.emit(id, out, 0);
            }
            Err(e) => self.finish(id, Err(sampling_error(e))),
        }
    }

    /// Commits one token (`draft_depth` as in [`SeqEvent::Token`]): appends it, streams it, and
    /// finishes the sequence when it ends there (then returns `true`).
    fn emit(&mut self, id: SeqId, s: SampleOutput, draft_depth: u8) -> bool {
        let a = self.active.get_mut(&id).unwrap();
        a.seq.tokens.push(s.token);
        a.first_token_at.get_or_insert_with(Instant::now);
        self.stats.tokens_generated += 1;
        let _ = a.sub.events.send(SeqEvent::Token {
            token_id: s.token,
            logprob: s.logprob,
            top_logprobs: s.top_logprobs,
            draft_depth,
            drafts: a.sub.spec.tally(),
        });
        let reason = if self.stop_token_ids.contains(&s.token) {
            Some(FinishReason::Stop)
        } else if a.seq.num_generated() >= a.sub.max_tokens
            || a.seq.tokens.len() >= self.context_window
        {
            Some(FinishReason::Length)
        } else {
            None
        };
        if let Some(reason) = reason {
            self.finish(id, Ok(reason));
            return true;
        }
        false
    }
}

fn sampling_error(e: SamplingError) -> EngineError {
    EngineError::InvalidRequest(e.to_string())
}

/// A grant whose session found the pages: what the forward computes for it.
struct Granted {
    grant: Grant,
    /// Position of `tokens[0]`.
    start: usize,
    tokens: Vec<u32>,
    page_ids: Vec<PageId>,
}

struct StepOutcome {
    granted: Vec<Granted>,
    refused: Vec<(SeqId, EngineError)>,
    forward: Option<Result<ForwardOutput, EngineError>>,
    forward_time: Duration,
    /// Samplers taken for rows that were not computed, to put back.
    unsent: Vec<(SeqId, Sampler)>,
}

impl Actor for SchedulerActor {
    type Context = Context<Self>;
}

#[derive(Message)]
#[rtype(result = "()")]
struct Step;

impl Handler<Step> for SchedulerActor {
    type Result = ();

    fn handle(&mut self, _: Step, ctx: &mut Context<Self>) {
        if self.step_in_flight {
            return;
        }
        self.reap_cancelled();
        if self.active.is_empty() {
            return;
        }
        self.step_in_flight = true;
        self.step_started = Instant::now();
        self.tally = StepTally {
            tokens_before: self.stats.tokens_generated,
            ..StepTally::default()
        };
        let step = self
            .pool
            .send(GetPoolStats)
            .into_actor(self)
            .then(|stats, act, _| {
                let available = stats.map(|s| s.num_available()).unwrap_or(0);
                let asks = act.propose_drafts();
                act.request_model_drafts(asks)
                    .into_actor(act)
                    .then(move |drafts, act, _| {
                        act.take_model_drafts(drafts);
                        let plan = act.plan(available);
                        act.execute(plan)
                    })
            })
            .map(|outcome, act, ctx| {
                let idle = outcome.forward.is_none();
                let forward_time = outcome.forward_time;
                act.apply(outcome);
                if !idle {
                    act.observe_costs(forward_time);
                }
                if !idle {
                    let overhead = act.step_started.elapsed().saturating_sub(forward_time);
                    let us = overhead.as_micros() as u64;
                    act.stats.overhead_us_total += us;
                    act.stats.overhead_us_max = act.stats.overhead_us_max.max(us);
                    act.stats.forward_steps += 1;
                }
                act.step_in_flight = false;
                if act.active.is_empty() {
                    return;
                }
                if idle {
                    // Nothing could run: prompts need pages that idle sessions hold, or that
                    // running prompts hold between them (then the next plan unblocks them).
                    let evict = act.registry.send(EvictLeastRecentlyUsed);
                    ctx.spawn(evict.into_actor(act).map(|evicted, act, ctx| {
                        act.stalled = !evicted.unwrap_or(false);
                        ctx.notify_later(Step, Duration::from_millis(5));
                    }));
                } else {
                    act.stalled = false;
                    ctx.notify(Step);
                }
            });
        ctx.spawn(step);
    }
}

/// Admit a request into the queue (or refuse it when the queue is full).
#[derive(Message)]
#[rtype(result = "Result<(), EngineError>")]
pub struct Enqueue(pub Submission);

impl Handler<Enqueue> for SchedulerActor {
    type Result = Result<(), EngineError>;

    fn handle(&mut self, msg: Enqueue, ctx: &mut Context<Self>) -> Self::Result {
        if self.num_waiting() >= self.max_queue {
            return Err(EngineError::Overloaded {
                retry_after_s: 1 + self.num_waiting() as u64 / 8,
            });
        }
        let sub = msg.0;
        self.begin_drafting(&sub);
        let id = self.next_id;
        self.next_id += 1;
        let mut seq = Sequence::new(id, id, sub.tokens.clone(), sub.cached_tokens, sub.num_pages);
        let seq_computed = seq.num_computed;
        let prompt_score = sub.prompt_logprobs.map(PromptScore::new);
        let sub_embed = sub.embed;
        if prompt_score.is_some() {
            seq.max_chunk = Some(SCORED_PROMPT_CHUNK);
        }
        seq.priority = sub.priority;
        self.active.insert(
            id,
            Active {
                seq,
                running: false,
                sub,
                page_ids: Vec::new(),
                draft_probs: None,
                mtp_hidden: Vec::new(),
                mtp_hidden_start: 0,
                mtp_next: seq_computed,
                admitted_at: Instant::now(),
                first_token_at: None,
                prompt_score,
                embedding: sub_embed.map(Pooled::new),
            },
        );
        ctx.notify(Step);
        Ok(())
    }
}

/// Replies once the sessions of every sequence finished so far have handled the end of their
/// turn, so that their page releases and prefix publications are in the pool's mailbox: a
/// `ClearCache` sent after it finds them done (`Engine::clear_caches`).
#[derive(Message)]
#[rtype(result = "()")]
pub struct Settle;

impl Handler<Settle> for SchedulerActor {
    type Result = ResponseFuture<()>;
    fn handle(&mut self, _: Settle, _: &mut Context<Self>) -> Self::Result {
        let pending = std::mem::take(&mut self.turn_ends);
        Box::pin(async move {
            futures::future::join_all(pending).await;
        })
    }
}

#[derive(Message)]
#[rtype(result = "SchedulerStats")]
pub struct GetSchedulerStats;

impl Handler<GetSchedulerStats> for SchedulerActor {
    type Result = MessageResult<GetSchedulerStats>;
    fn handle(&mut self, _: GetSchedulerStats, _: &mut Context<Self>) -> Self::Result {
        let mut stats = self.stats;
        stats.num_waiting = self.num_waiting();
        stats.num_running = self.active.len() - stats.num_waiting;
        MessageResult(stats)
    }
}
