//! What the model drafters (the draft model, the MTP heads) share: K/V pages of their own, one
//! page table per draft key kept in step with the sequence's committed tokens, the turn's
//! sampler that draws drafts (and reports `q`), and the messages their worker threads answer.
//!
//! Owns: a page pool and KV storage separate from the target's, and per key the table, the
//! tokens its K/V was computed from, and the sampler. Never touches: the target's pages.
//!
//! Capacity is the pages a table holds. When the pool is short, the least recently used keys
//! outside the current round lose their K/V (idle sessions first); if that is not enough the
//! sequence gets a typed [`KvError`] and decodes plainly that step.

use crate::error::KvError;
use crate::kv::{KvDtype, KvShape, KvStorage, PagePool, PageTable, PoolStats};
use crate::sampling::{Distribution, Sampler, SamplingParams, TokenHistory};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

/// Identifies whose draft K/V this is: a persistent session's key, or a request's id.
pub type DraftKey = Arc<str>;

/// Most rows a round computes to bring sequences up to date before drafting; one that needs
/// more catches up over several rounds (decoding plainly meanwhile) so no step stalls long.
pub const MAX_CATCH_UP_ROWS: usize = 256;

/// What one sequence got from a round.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Drafted {
    pub drafts: Vec<u32>,
    /// The distribution each draft was drawn from (`None` when greedy: drafts are argmaxes).
    pub probs: Option<Vec<Distribution>>,
    /// Why nothing was drafted, when the drafter could not hold or follow the sequence.
    pub refused: Option<Refusal>,
}

/// Why a model drafter drafted nothing for a sequence.
#[derive(Debug, Clone, PartialEq)]
pub enum Refusal {
    /// Its page pool could not hold the sequence this step.
    Pool(KvError),
}

#[derive(Debug, Default)]
pub struct DraftReply {
    /// One per ask, in order.
    pub results: Vec<Drafted>,
    pub num_forwards: usize,
    /// Rows computed to bring sequences far behind up to date (a new prompt, or a long stretch
    /// committed while this drafter was not drafting): they say nothing about what one draft
    /// forward costs.
    pub num_catch_up_rows: usize,
    /// Of those, the rows of prompt positions: the turn's one-off catch-up. The rest caught up
    /// on tokens committed while this drafter was not drafting (paused, or another drafter's
    /// rounds) — a cost of drafting with it, which its cost guard must see.
    pub num_prompt_catch_up_rows: usize,
    /// Time spent in this round's forwards and sampling.
    pub elapsed: Duration,
}

/// One key's state.
#[derive(Debug, Default)]
pub struct Entry<X> {
    pub table: PageTable,
    /// The committed tokens the table's K/V was computed from.
    pub tokens: Vec<u32>,
    /// Present while a turn is in progress.
    pub sampler: Option<Sampler>,
    last_used: u64,
    /// Ended with no session to come back for it: another request repeating its tokens (the
    /// next turn of a stateless conversation) may take its K/V over.
    pub leftover: bool,
    /// What a drafter keeps besides.
    pub extra: X,
}

pub struct DrafterCache<X> {
    pub pool: PagePool,
    pub kv: KvStorage,
    seqs: HashMap<DraftKey, Entry<X>>,
    clock: u64,
    /// Whether ended requests' K/V stays for [`DrafterCache::adopt_leftover`].
    keeps_leftovers: bool,
}

impl<X: Default> DrafterCache<X> {
    pub fn new(shape: KvShape, dtype: KvDtype, num_pages: usize) -> Self {
        Self {
            pool: PagePool::new(num_pages, shape.page_size),
            kv: KvStorage::new(shape, dtype, num_pages),
            seqs: HashMap::new(),
            clock: 0,
            keeps_leftovers: false,
        }
    }

    /// Keeps ended requests' K/V for later requests that repeat their tokens.
    pub fn with_leftovers(mut self) -> Self {
        self.keeps_leftovers = true;
        self
    }

    pub fn pool_stats(&self) -> PoolStats {
        self.pool.stats()
    }

    /// A new round begins (for least-recently-used eviction).
    pub fn tick(&mut self) {
        self.clock += 1;
    }

    /// `key`'s entry, created empty if need be, marked used this round.
    pub fn touch(&mut self, key: &DraftKey) -> &mut Entry<X> {
        let clock = self.clock;
        let e = self.seqs.entry(key.clone()).or_default();
        e.last_used = clock;
        e
    }

    /// The page tables to read and the storage to write, borrowed together for a forward.
    pub fn split(&mut self) -> (Tables<'_, X>, &mut KvStorage) {
        (Tables(&self.seqs), &mut self.kv)
    }

    pub fn get(&self, key: &DraftKey) -> &Entry<X> {
        &self.seqs[key]
    }

    pub fn get_mut(&mut self, key: &DraftKey) -> &mut Entry<X> {
        self.seqs.get_mut(key).expect("touched this round")
    }

    /// A turn begins for `key`: drafts are drawn with `params` (a greedy request's are argmaxes).
    pub fn begin(&mut self, key: DraftKey, params: &SamplingParams, seed: u64) {
        let params = SamplingParams {
            logprobs: false,
            top_logprobs: 0,
            seed: Some(seed),
            ..params.clone()
        };
        self.seqs.entry(key).or_default().sampler = Sampler::new(params).ok();
    }

    /// A turn ends: a persistent session keeps its K/V for its next turn (`keep`); a request's
    /// stays as a leftover that a later request with the same leading tokens takes over (an
    /// OpenAI-style client resends the whole conversation each turn), until the pool needs
    /// its pages or caches are cleared.
    pub fn end(&mut self, key: &DraftKey, keep: bool) {
        let holds_nothing = self.seqs.get(key).is_some_and(|s| s.tokens.is_empty());
        if !keep && (!self.keeps_leftovers || holds_nothing) {
            return self.remove(key);
        }
        if let Some(s) = self.seqs.get_mut(key) {
            s.sampler = None;
            s.leftover = !keep;
        }
    }

    /// Before `key` (holding nothing yet) starts on `tokens`: takes over the leftover whose
    /// K/V shares the longest run of leading tokens with them, when that covers at least a
    /// page. The caller truncates the taken-over K/V to what matches, as for its own.
    pub fn adopt_leftover(&mut self, key: &DraftKey, tokens: &[u32]) {
        if self.seqs.get(key).is_some_and(|s| !s.tokens.is_empty()) {
            return;
        }
        let best = self
            .seqs
            .iter()
            .filter(|(k, s)| s.leftover && *k != key)
            .map(|(k, s)| (common_prefix(&s.tokens, tokens), k))
            .max_by_key(|(n, _)| *n);
        let Some((n, donor)) = best else { return };
        if n < self.pool.page_size() {
            return;
        }
        let donor = donor.clone();
        let mut entry = self.seqs.remove(&donor).expect("found above");
        entry.leftover = false;
        entry.last_used = self.clock;
        entry.sampler = self.seqs.get_mut(key).and_then(|s| s.sampler.take());
        self.remove(key);
        self.seqs.insert(key.clone(), entry);
    }

    /// Whether `key` has no turn in progress (a session expires only when idle, but a new
    /// turn of it may have begun since).
    pub fn is_idle(&self, key: &DraftKey) -> bool {
        self.seqs.get(key).is_none_or(|s| s.sampler.is_none())
    }

    /// Drops the K/V of every key with no turn in progress.
    pub fn clear_idle(&mut self) {
        let idle: Vec<DraftKey> = self
            .seqs
            .iter()
            .filter(|(_, s)| s.sampler.is_none())
            .map(|(k, _)| k.clone())
            .collect();
        for key in idle {
            self.remove(&key);
        }
    }

    /// Forgets `key` and frees its pages (its K/V is in doubt after a failed forward).
    pub fn remove(&mut self, key: &DraftKey) {
        if let Some(mut s) = self.seqs.remove(key) {
            let _ = s.table.release(&mut self.pool);
        }
    }

    /// Forgets every table (after a panic left them in doubt); turns in progress keep their
    /// samplers and catch up again.
    pub fn reset(&mut self) {
        let (num_pages, page_size) = (self.pool.num_pages(), self.pool.page_size());
        self.pool = PagePool::new(num_pages, page_size);
        for s in self.seqs.values_mut() {
            s.table = PageTable::new();
            s.tokens.clear();
            s.extra = X::default();
        }
    }

    /// Shrinks `key`'s K/V to `len` positions.
    pub fn truncate(&mut self, key: &DraftKey, len: usize) -> Result<(), KvError> {
        let s = self.seqs.get_mut(key).expect("touched this round");
        s.table.truncate(len, &mut self.pool)
    }

    /// Pages for `num_new` more positions of `key`, evicting keys not in `protected` (least
    /// recently used first, idle sessions before turns in progress) when the pool is short.
    pub fn try_grow(
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
            if self.seqs[&victim].leftover {
                self.remove(&victim);
                continue;
            }
            let s = self.seqs.get_mut(&victim).unwrap();
            s.table.release(&mut self.pool)?;
            s.tokens.clear();
            s.extra = X::default();
        }
        let seq = self.seqs.get_mut(key).unwrap();
        seq.table.try_grow(num_new, &mut self.pool)
    }
}

/// Read access to every key's page table while the storage is borrowed for writing.
pub struct Tables<'a, X>(&'a HashMap<DraftKey, Entry<X>>);

impl<'a, X> Tables<'a, X> {
    pub fn page_ids(&self, key: &DraftKey) -> &'a [crate::kv::PageId] {
        self.0[key].table.page_ids()
    }
}

pub use crate::tokenizer::common_prefix;

/// Draws the next draft from a drafter's logits `row` (`[num_vocab]`) given `history` (the
/// committed tokens, then the drafts so far; the first `num_prompt` are the prompt): the argmax
/// for a greedy request, else a draw from the request's sampling distribution, which is
/// recorded in `drafted.probs` as `q`. `None` when nothing can be sampled.
pub fn draw(
    sampler: &mut Sampler,
    row: &[f32],
    history: &[u32],
    num_prompt: usize,
    drafted: &mut Drafted,
) -> Option<u32> {
    let (prompt, generated) = history.split_at(num_prompt.min(history.len()));
    let history = TokenHistory::new(prompt, generated);
    if sampler.params().is_greedy() {
        return sampler.sample(row, &history).ok().map(|s| s.token);
    }
    let q = sampler.final_distribution(row, &history).ok()?;
    let x = sampler.sample_distribution(&q);
    drafted.probs.get_or_insert_with(Vec::new).push(q);
    Some(x)
}

/// After a drafter panicked: its K/V is in doubt and dropped; the round drafts nothing.
pub fn draft_forward_panicked<X: Default>(
    cache: &mut DrafterCache<X>,
    num_asks: usize,
) -> DraftReply {
    tracing::error!("a drafter panicked; its K/V is dropped");
    cache.reset();
    DraftReply {
        results: vec![Drafted::default(); num_asks],
        ..DraftReply::default()
    }
}

/// A turn begins: how its drafts are drawn.
#[derive(actix::Message)]
#[rtype(result = "()")]
pub struct BeginDraft {
    pub key: DraftKey,
    pub params: SamplingParams,
    pub seed: u64,
}

/// A turn ends; `keep` keeps the drafter's K/V for the session's next turn.
#[derive(actix::Message)]
#[rtype(result = "()")]
pub struct EndDraft {
    pub key: DraftKey,
    pub keep: bool,
}

/// Drops the drafter K/V of keys with no turn in progress.
#[derive(actix::Message)]
#[rtype(result = "()")]
pub struct ClearIdleDrafts;

#[derive(actix::Message)]
#[rtype(result = "PoolStats")]
pub struct GetDraftPoolStats;

/// Implements the shared messages for a worker with a `cache: DrafterCache<_>` field.
macro_rules! drafter_cache_handlers {
    ($worker:ty) => {
        impl actix::Handler<$crate::spec::drafter_kv::BeginDraft> for $worker {
            type Result = ();
            fn handle(
                &mut self,
                msg: $crate::spec::drafter_kv::BeginDraft,
                _: &mut actix::SyncContext<Self>,
            ) {
                self.cache.begin(msg.key, &msg.params, msg.seed);
            }
        }

        impl actix::Handler<$crate::spec::drafter_kv::EndDraft> for $worker {
            type Result = ();
            fn handle(
                &mut self,
                msg: $crate::spec::drafter_kv::EndDraft,
                _: &mut actix::SyncContext<Self>,
            ) {
                self.cache.end(&msg.key, msg.keep);
            }
        }

        /// A session gone from memory takes its drafter K/V along.
        impl actix::Handler<$crate::session::SessionLeftMemory> for $worker {
            type Result = ();
            fn handle(
                &mut self,
                msg: $crate::session::SessionLeftMemory,
                _: &mut actix::SyncContext<Self>,
            ) {
                let key = msg.draft_key.into();
                if self.cache.is_idle(&key) {
                    self.cache.remove(&key);
                }
            }
        }

        impl actix::Handler<$crate::spec::drafter_kv::ClearIdleDrafts> for $worker {
            type Result = ();
            fn handle(
                &mut self,
                _: $crate::spec::drafter_kv::ClearIdleDrafts,
                _: &mut actix::SyncContext<Self>,
            ) {
                self.cache.clear_idle();
            }
        }

        impl actix::Handler<$crate::spec::drafter_kv::GetDraftPoolStats> for $worker {
            type Result = actix::MessageResult<$crate::spec::drafter_kv::GetDraftPoolStats>;
            fn handle(
                &mut self,
                _: $crate::spec::drafter_kv::GetDraftPoolStats,
                _: &mut actix::SyncContext<Self>,
            ) -> Self::Result {
                actix::MessageResult(self.cache.pool_stats())
            }
        }
    };
}
pub(crate) use drafter_cache_handlers;
