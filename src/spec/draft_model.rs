//! The draft-model drafter: a second, smaller model with the target's vocabulary (Qwen2.5-Coder
//! 0.5B for the 1.5B) proposes `k` tokens autoregressively for every sequence that speculates,
//! batched across them, with its distribution `q` for rejection sampling.
//!
//! Owns, on its own thread ([`DraftWorker`]): the draft model's weights, its own page pool and KV
//! storage, and one page table per draft key (a persistent session's key, so an agent's next turn
//! finds its draft KV; a request id otherwise). Never touches: the target's pages, sessions or
//! model.
//!
//! Keeping in step: every round carries the sequence's committed tokens (the last one pending).
//! The worker keeps the longest common prefix of what its KV holds and those tokens, truncating
//! the rest — drafts the target rejected, or a divergent new turn — and computes the missing
//! tokens before drafting. A sequence far behind (a new prompt) catches up in chunks and drafts
//! nothing until it has. Capacity is the pages its table holds; when the pool is full, idle
//! keys are evicted least recently used first, and if that is not enough the sequence gets a
//! typed [`KvError`] and decodes plainly that step.

use crate::error::KvError;
use crate::kv::{KvDtype, KvStorage, PagePool, PageTable, PoolStats};
use crate::model::{ModelBundle, Transformer};
use crate::runner::batch::{OutputRows, SeqStep};
use crate::sampling::{Distribution, Sampler, SamplingParams, TokenHistory};
use crate::spec::MAX_DEPTH;
use actix::prelude::*;
use anyhow::{bail, Result};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Refuses a draft model whose vocabulary is not the target's: the same size, and the same
/// token string at every id.
pub fn check_same_vocabulary(target: &ModelBundle, draft: &ModelBundle) -> Result<()> {
    let (tv, dv) = (
        target.transformer.config.vocab_size,
        draft.transformer.config.vocab_size,
    );
    let names = format!(
        "the draft model {} cannot draft for {}",
        draft.path.display(),
        target.path.display()
    );
    if tv != dv {
        bail!("{names}: its vocabulary has {dv} tokens, the target's has {tv}; a draft model must share the target's tokenizer");
    }
    for id in 0..tv as u32 {
        let (t, d) = (
            target.tokenizer.id_to_token(id),
            draft.tokenizer.id_to_token(id),
        );
        if t != d {
            bail!(
                "{names}: token {id} is {} in the draft model but {} in the target; a draft model must share the target's tokenizer",
                d.as_deref().map_or("missing".into(), |s| format!("{s:?}")),
                t.as_deref().map_or("missing".into(), |s| format!("{s:?}")),
            );
        }
    }
    Ok(())
}

/// Identifies whose draft KV this is: a persistent session's key, or a request's id.
pub type DraftKey = Arc<str>;

/// One sequence's share of a draft round.
#[derive(Debug, Clone)]
pub struct DraftAsk {
    pub key: DraftKey,
    /// Committed tokens, prompt first; the last one is pending (its target K/V not computed).
    pub tokens: Vec<u32>,
    pub num_prompt: usize,
    /// Tokens to draft.
    pub num_drafts: usize,
}

/// What one sequence got from a round.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Drafted {
    pub drafts: Vec<u32>,
    /// The distribution each draft was drawn from (`None` when greedy: drafts are argmaxes).
    pub probs: Option<Vec<Distribution>>,
    /// Why nothing was drafted, when the pool could not hold the sequence.
    pub refused: Option<KvError>,
}

#[derive(Debug, Default)]
pub struct DraftReply {
    /// One per ask, in order.
    pub results: Vec<Drafted>,
    pub num_forwards: usize,
    /// Rows computed to bring sequences far behind up to date (a new prompt): a one-off cost
    /// per turn that says nothing about what drafting costs per token.
    pub num_catch_up_rows: usize,
    /// Time spent in this round's forwards and sampling.
    pub elapsed: Duration,
}

/// Most rows a round computes to bring sequences up to date before drafting; one that needs
/// more catches up over several rounds (decoding plainly meanwhile) so no step stalls long.
pub const MAX_CATCH_UP_ROWS: usize = 256;

#[derive(Debug, Default)]
struct DraftSeq {
    table: PageTable,
    /// The tokens whose K/V the table holds.
    tokens: Vec<u32>,
    /// Present while a turn is in progress.
    sampler: Option<Sampler>,
    last_used: u64,
}

pub struct DraftWorker {
    model: Arc<Transformer>,
    pool: PagePool,
    kv: KvStorage,
    seqs: HashMap<DraftKey, DraftSeq>,
    clock: u64,
}

/// A sequence being drafted for within a round.
struct Live {
    ask: usize,
    key: DraftKey,
    /// Tokens the next forward computes for it, at `start`.
    feed: Vec<u32>,
    start: usize,
    /// Committed tokens followed by the drafts so far (for penalties).
    history: Vec<u32>,
    drafted: Drafted,
}

impl DraftWorker {
    /// A worker with room for `num_pages` pages of `page_size` tokens of draft K/V.
    pub fn new(
        model: Arc<Transformer>,
        page_size: usize,
        dtype: KvDtype,
        num_pages: usize,
    ) -> Self {
        Self {
            kv: KvStorage::new(model.kv_shape(page_size), dtype, num_pages),
            pool: PagePool::new(num_pages, page_size),
            model,
            seqs: HashMap::new(),
            clock: 0,
        }
    }

    /// Starts the worker on its own thread.
    pub fn start(
        model: Arc<Transformer>,
        page_size: usize,
        dtype: KvDtype,
        num_pages: usize,
    ) -> Addr<Self> {
        SyncArbiter::start(1, move || {
            DraftWorker::new(model.clone(), page_size, dtype, num_pages)
        })
    }

    pub fn pool_stats(&self) -> PoolStats {
        self.pool.stats()
    }

    /// A turn begins for `key`: drafts are drawn with `params` (a greedy request's are argmaxes).
    pub fn begin(&mut self, key: DraftKey, params: &SamplingParams, seed: u64) {
        let params = SamplingParams {
            logprobs: false,
            top_logprobs: 0,
            seed: Some(seed),
            ..params.clone()
        };
        let sampler = Sampler::new(params).ok();
        self.seqs.entry(key).or_default().sampler = sampler;
    }

    /// A turn ends: a persistent session keeps its draft K/V (`keep`) for its next turn.
    pub fn end(&mut self, key: &DraftKey, keep: bool) {
        if keep {
            if let Some(s) = self.seqs.get_mut(key) {
                s.sampler = None;
            }
        } else if let Some(mut s) = self.seqs.remove(key) {
            let _ = s.table.release(&mut self.pool);
        }
    }

    /// Drops the draft K/V of every key with no turn in progress.
    pub fn clear_idle(&mut self) {
        let idle: Vec<DraftKey> = self
            .seqs
            .iter()
            .filter(|(_, s)| s.sampler.is_none())
            .map(|(k, _)| k.clone())
            .collect();
        for key in idle {
            self.end(&key, false);
        }
    }

    /// Drafts for every ask: brings each sequence's draft K/V up to its committed tokens, then
    /// runs `max(num_drafts)` batched decode steps of the draft model.
    pub fn round(&mut self, asks: Vec<DraftAsk>) -> DraftReply {
        let started = Instant::now();
        self.clock += 1;
        let protected: HashSet<DraftKey> = asks.iter().map(|a| a.key.clone()).collect();
        let mut results = vec![Drafted::default(); asks.len()];
        let mut live = Vec::new();
        let mut num_catch_up_rows = 0;
        let mut catch_up_budget = MAX_CATCH_UP_ROWS;
        for (i, ask) in asks.iter().enumerate() {
            let before = catch_up_budget;
            match self.prepare(i, ask, &mut catch_up_budget, &protected) {
                Ok(Some(l)) => live.push(l),
                Ok(None) => {}
                Err(e) => results[i].refused = Some(e),
            }
            num_catch_up_rows += before - catch_up_budget;
        }
        let mut done = Vec::new();
        let mut num_forwards = 0;
        let max_drafts = asks.iter().map(|a| a.num_drafts).max().unwrap_or(0);
        for depth in 0..max_drafts {
            // Sequences with all their drafts (or that could not sample) are done.
            let (next, finished): (Vec<Live>, Vec<Live>) =
                live.into_iter().partition(|l| !l.feed.is_empty());
            done.extend(finished);
            live = next;
            if depth > 0 {
                live = self.grow_for_next_draft(live, &mut done, &protected);
            }
            if live.is_empty() {
                break;
            }
            num_forwards += 1;
            if let Err(e) = self.forward_and_sample(&mut live, &asks) {
                tracing::warn!("draft model forward failed: {e:#}");
                for l in live.drain(..) {
                    self.end(&l.key, false);
                }
            }
        }
        for l in done.into_iter().chain(live) {
            results[l.ask] = l.drafted;
        }
        DraftReply {
            results,
            num_forwards,
            num_catch_up_rows,
            elapsed: started.elapsed(),
        }
    }

    /// Truncates `ask`'s draft K/V to what still matches and reserves pages for the tokens it
    /// lacks. `None` when the sequence only catches up this round (nothing to draft yet): its
    /// catch-up chunk is computed right away.
    fn prepare(
        &mut self,
        i: usize,
        ask: &DraftAsk,
        catch_up_budget: &mut usize,
        protected: &HashSet<DraftKey>,
    ) -> Result<Option<Live>, KvError> {
        let n = ask.tokens.len();
        let clock = self.clock;
        let seq = self.seqs.entry(ask.key.clone()).or_default();
        seq.last_used = clock;
        let common = seq
            .tokens
            .iter()
            .zip(&ask.tokens)
            .take_while(|(a, b)| a == b)
            .count();
        // At least the pending token is computed, so the round has logits to draft from.
        let keep = common.min(n.saturating_sub(1));
        seq.table.truncate(keep, &mut self.pool)?;
        seq.tokens.truncate(keep);
        // What a few rounds of other drafters committed is always computed; a long stretch
        // (a new prompt) only within the round's catch-up budget.
        let missing = n - keep;
        let num_feed = if missing <= MAX_DEPTH + 1 {
            missing
        } else {
            let n = missing.min(*catch_up_budget);
            *catch_up_budget -= n;
            n
        };
        if num_feed == 0 {
            return Ok(None);
        }
        self.try_grow(&ask.key, num_feed, protected)?;
        let feed = ask.tokens[keep..keep + num_feed].to_vec();
        if num_feed < missing || ask.num_drafts == 0 {
            self.catch_up(&ask.key, keep, &feed);
            return Ok(None);
        }
        Ok(Some(Live {
            ask: i,
            key: ask.key.clone(),
            feed,
            start: keep,
            history: ask.tokens.clone(),
            drafted: Drafted::default(),
        }))
    }

    /// Computes K/V for `feed` at `start` without drafting.
    fn catch_up(&mut self, key: &DraftKey, start: usize, feed: &[u32]) {
        let seq = &self.seqs[key];
        let step = SeqStep {
            tokens: feed,
            start_position: start,
            page_ids: seq.table.page_ids(),
            outputs: OutputRows::None,
        };
        match self.model.forward(&[step], &mut self.kv, false) {
            Ok(_) => self
                .seqs
                .get_mut(key)
                .unwrap()
                .tokens
                .extend_from_slice(feed),
            Err(e) => {
                tracing::warn!("draft model catch-up failed: {e:#}");
                self.end(key, false);
            }
        }
    }

    /// Pages for `num_new` more positions of `key`, evicting idle keys when the pool is short.
    fn try_grow(
        &mut self,
        key: &DraftKey,
        num_new: usize,
        protected: &HashSet<DraftKey>,
    ) -> Result<(), KvError> {
        let needed = self.seqs[key]
            .table
            .pages_needed(num_new, self.pool.page_size());
        while self.pool.num_free() < needed {
            let victim = self
                .seqs
                .iter()
                .filter(|(k, s)| !protected.contains(*k) && !s.table.page_ids().is_empty())
                .min_by_key(|(_, s)| (s.sampler.is_some(), s.last_used))
                .map(|(k, _)| k.clone());
            let Some(victim) = victim else { break };
            let s = self.seqs.get_mut(&victim).unwrap();
            s.table.release(&mut self.pool)?;
            s.tokens.clear();
        }
        let seq = self.seqs.get_mut(key).unwrap();
        seq.table.try_grow(num_new, &mut self.pool)
    }

    /// Reserves a position for each live sequence's next draft step; one that cannot get it
    /// stops drafting with what it has (moved to `done`).
    fn grow_for_next_draft(
        &mut self,
        live: Vec<Live>,
        done: &mut Vec<Live>,
        protected: &HashSet<DraftKey>,
    ) -> Vec<Live> {
        let mut kept = Vec::with_capacity(live.len());
        for l in live {
            match self.try_grow(&l.key, 1, protected) {
                Ok(()) => kept.push(l),
                Err(_) => done.push(l),
            }
        }
        kept
    }

    /// Forgets every table (after a panic left them in doubt); turns in progress keep their
    /// samplers and catch up again.
    fn reset(&mut self) {
        let (num_pages, page_size) = (self.pool.num_pages(), self.pool.page_size());
        self.pool = PagePool::new(num_pages, page_size);
        for s in self.seqs.values_mut() {
            s.table = PageTable::new();
            s.tokens.clear();
        }
    }

    /// One batched forward over every live sequence's feed, then one draft each from its last
    /// row. A sequence with all its drafts gets an empty feed.
    fn forward_and_sample(&mut self, live: &mut [Live], asks: &[DraftAsk]) -> Result<()> {
        let steps: Vec<SeqStep> = live
            .iter()
            .map(|l| SeqStep {
                tokens: &l.feed,
                start_position: l.start,
                page_ids: self.seqs[&l.key].table.page_ids(),
                outputs: OutputRows::Last,
            })
            .collect();
        let out = self.model.forward(&steps, &mut self.kv, false)?;
        for (b, l) in live.iter_mut().enumerate() {
            let seq = self.seqs.get_mut(&l.key).unwrap();
            seq.tokens.extend_from_slice(&l.feed);
            l.start += l.feed.len();
            l.feed.clear();
            let ask = &asks[l.ask];
            let row = out.rows_of(b).last().map(|r| out.logits_row(r));
            let (Some(row), Some(sampler)) = (row, seq.sampler.as_mut()) else {
                continue;
            };
            let (prompt, generated) = l.history.split_at(ask.num_prompt);
            let history = TokenHistory::new(prompt, generated);
            let token = if sampler.params().is_greedy() {
                sampler.sample(row, &history).map(|s| s.token)
            } else {
                sampler.final_distribution(row, &history).map(|q| {
                    let x = sampler.sample_distribution(&q);
                    l.drafted.probs.get_or_insert_with(Vec::new).push(q);
                    x
                })
            };
            let Ok(token) = token else { continue };
            l.drafted.drafts.push(token);
            l.history.push(token);
            if l.drafted.drafts.len() < ask.num_drafts {
                l.feed.push(token);
            }
        }
        Ok(())
    }
}

impl Actor for DraftWorker {
    type Context = SyncContext<Self>;
}

/// A turn begins: how its drafts are drawn.
#[derive(Message)]
#[rtype(result = "()")]
pub struct BeginDraft {
    pub key: DraftKey,
    pub params: SamplingParams,
    pub seed: u64,
}

impl Handler<BeginDraft> for DraftWorker {
    type Result = ();
    fn handle(&mut self, msg: BeginDraft, _: &mut SyncContext<Self>) {
        self.begin(msg.key, &msg.params, msg.seed);
    }
}

#[derive(Message)]
#[rtype(result = "DraftReply")]
pub struct DraftRound {
    pub asks: Vec<DraftAsk>,
}

impl Handler<DraftRound> for DraftWorker {
    type Result = MessageResult<DraftRound>;
    fn handle(&mut self, msg: DraftRound, _: &mut SyncContext<Self>) -> Self::Result {
        // A bug in a kernel must cost this round its drafts, not take the thread down.
        let n = msg.asks.len();
        let reply = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.round(msg.asks)));
        MessageResult(reply.unwrap_or_else(|_| {
            tracing::error!("the draft model panicked; its K/V is dropped");
            self.reset();
            DraftReply {
                results: vec![Drafted::default(); n],
                ..DraftReply::default()
            }
        }))
    }
}

/// A turn ends; `keep` keeps the draft K/V for the session's next turn.
#[derive(Message)]
#[rtype(result = "()")]
pub struct EndDraft {
    pub key: DraftKey,
    pub keep: bool,
}

impl Handler<EndDraft> for DraftWorker {
    type Result = ();
    fn handle(&mut self, msg: EndDraft, _: &mut SyncContext<Self>) {
        self.end(&msg.key, msg.keep);
    }
}

/// Drops the draft K/V of keys with no turn in progress.
#[derive(Message)]
#[rtype(result = "()")]
pub struct ClearIdleDrafts;

impl Handler<ClearIdleDrafts> for DraftWorker {
    type Result = ();
    fn handle(&mut self, _: ClearIdleDrafts, _: &mut SyncContext<Self>) {
        self.clear_idle();
    }
}

#[derive(Message)]
#[rtype(result = "PoolStats")]
pub struct GetDraftPoolStats;

impl Handler<GetDraftPoolStats> for DraftWorker {
    type Result = MessageResult<GetDraftPoolStats>;
    fn handle(&mut self, _: GetDraftPoolStats, _: &mut SyncContext<Self>) -> Self::Result {
        MessageResult(self.pool_stats())
    }
}
