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
//! nothing until it has. Pages, eviction and sampling are the model drafters' shared
//! [`DrafterCache`].

use super::drafter_kv::{
    common_prefix, draft_forward_panicked, drafter_cache_handlers, draw, DraftKey, DraftReply,
    Drafted, DrafterCache, Refusal, MAX_CATCH_UP_ROWS,
};
use crate::error::KvError;
use crate::kv::{KvDtype, PoolStats};
use crate::model::{ModelBundle, Transformer};
use crate::runner::batch::{OutputRows, SeqStep};
use crate::runner::calibrate::apply_key_channels;
use crate::spec::MAX_DEPTH;
use actix::prelude::*;
use anyhow::{bail, Result};
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;

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

pub struct DraftWorker {
    model: Arc<Transformer>,
    cache: DrafterCache<()>,
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
        let mut cache = DrafterCache::new(model.kv_shape(page_size), dtype, num_pages);
        apply_key_channels(&model, &mut cache.kv);
        Self {
            cache: cache.with_leftovers(),
            model,
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
        self.cache.pool_stats()
    }

    /// Drafts for every ask: brings each sequence's draft K/V up to its committed tokens, then
    /// runs `max(num_drafts)` batched decode steps of the draft model.
    pub fn round(&mut self, asks: Vec<DraftAsk>) -> DraftReply {
        let started = Instant::now();
        self.cache.tick();
        let protected: HashSet<DraftKey> = asks.iter().map(|a| a.key.clone()).collect();
        let mut results = vec![Drafted::default(); asks.len()];
        let mut live = Vec::new();
        let mut num_catch_up_rows = 0;
        let mut num_prompt_catch_up_rows = 0;
        let mut catch_up_budget = MAX_CATCH_UP_ROWS;
        for (i, ask) in asks.iter().enumerate() {
            let before = catch_up_budget;
            match self.prepare(
                i,
                ask,
                &mut catch_up_budget,
                &mut num_prompt_catch_up_rows,
                &protected,
            ) {
                Ok(Some(l)) => live.push(l),
                Ok(None) => {}
                Err(e) => results[i].refused = Some(Refusal::Pool(e)),
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
                // One more position each; a sequence that cannot get it keeps what it has.
                let (grown, short): (Vec<Live>, Vec<Live>) = live
                    .into_iter()
                    .partition(|l| self.cache.try_grow(&l.key, 1, &protected).is_ok());
                done.extend(short);
                live = grown;
            }
            if live.is_empty() {
                break;
            }
            num_forwards += 1;
            if let Err(e) = self.forward_and_sample(&mut live, &asks) {
                tracing::warn!("draft model forward failed: {e:#}");
                for l in live.drain(..) {
                    self.cache.remove(&l.key);
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
            num_prompt_catch_up_rows,
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
        prompt_catch_up_rows: &mut usize,
        protected: &HashSet<DraftKey>,
    ) -> Result<Option<Live>, KvError> {
        let n = ask.tokens.len();
        self.cache.adopt_leftover(&ask.key, &ask.tokens);
        let seq = self.cache.touch(&ask.key);
        // At least the pending token is computed, so the round has logits to draft from.
        let keep = common_prefix(&seq.tokens, &ask.tokens).min(n.saturating_sub(1));
        seq.tokens.truncate(keep);
        self.cache.truncate(&ask.key, keep)?;
        // What a few rounds of other drafters committed is always computed; a long stretch
        // (a new prompt) only within the round's catch-up budget.
        let missing = n - keep;
        let num_feed = if missing <= MAX_DEPTH + 1 {
            missing
        } else {
            let n = missing.min(*catch_up_budget);
            *catch_up_budget -= n;
            // Positions keep..keep + n; those before `num_prompt` are the prompt's.
            *prompt_catch_up_rows += (keep + n).min(ask.num_prompt).saturating_sub(keep);
            n
        };
        if num_feed == 0 {
            return Ok(None);
        }
        self.cache.try_grow(&ask.key, num_feed, protected)?;
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
        let (tables, kv) = self.cache.split();
        let step = SeqStep {
            tokens: feed,
            start_position: start,
            page_ids: tables.page_ids(key),
            outputs: OutputRows::None,
        };
        match self.model.forward(&[step], kv, false) {
            Ok(_) => self.cache.get_mut(key).tokens.extend_from_slice(feed),
            Err(e) => {
                tracing::warn!("draft model catch-up failed: {e:#}");
                self.cache.remove(key);
            }
        }
    }

    /// One batched forward over every live sequence's feed, then one draft each from its last
    /// row. A sequence with all its drafts gets an empty feed.
    fn forward_and_sample(&mut self, live: &mut [Live], asks: &[DraftAsk]) -> Result<()> {
        let (tables, kv) = self.cache.split();
        let steps: Vec<SeqStep> = live
            .iter()
            .map(|l| SeqStep {
                tokens: &l.feed,
                start_position: l.start,
                page_ids: tables.page_ids(&l.key),
                outputs: OutputRows::Last,
            })
            .collect();
        let out = self.model.forward(&steps, kv, false)?;
        for (b, l) in live.iter_mut().enumerate() {
            let seq = self.cache.get_mut(&l.key);
            seq.tokens.extend_from_slice(&l.feed);
            l.start += l.feed.len();
            l.feed.clear();
            let ask = &asks[l.ask];
            let row = out.rows_of(b).last().map(|r| out.logits_row(r));
            let (Some(row), Some(sampler)) = (row, seq.sampler.as_mut()) else {
                continue;
            };
            let Some(token) = draw(sampler, row, &l.history, ask.num_prompt, &mut l.drafted) else {
                continue;
            };
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

drafter_cache_handlers!(DraftWorker);

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
        MessageResult(reply.unwrap_or_else(|_| draft_forward_panicked(&mut self.cache, n)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::KvError;
    use crate::model::test_model::{write_test_model, TestModelSpec};
    use crate::sampling::SamplingParams;

    fn worker(num_pages: usize) -> (DraftWorker, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let path = write_test_model(dir.path(), &TestModelSpec::default()).unwrap();
        let model = Arc::new(Transformer::load(&path).unwrap().0);
        let mut w = DraftWorker::new(model, 4, KvDtype::F32, num_pages);
        for key in ["a", "b"] {
            w.cache.begin(key.into(), &SamplingParams::greedy(), 0);
        }
        (w, dir)
    }

    fn ask(key: &str, len: usize) -> DraftAsk {
        DraftAsk {
            key: key.into(),
            tokens: (0..len as u32).map(|t| t * 7 % 500).collect(),
            num_prompt: 2,
            num_drafts: 3,
        }
    }

    #[test]
    fn a_full_pool_is_a_typed_refusal_and_idle_keys_make_room() {
        let (mut w, _dir) = worker(4);
        // 11 committed positions + 2 draft positions fit in 4 pages of 4.
        let r = w.round(vec![ask("a", 12)]);
        assert_eq!(r.results[0].drafts.len(), 3);
        assert_eq!(w.pool_stats().num_used, 4);
        // Another key needs the pages "a" holds: "a" is not in this round, so it is evicted.
        let r = w.round(vec![ask("b", 10)]);
        assert_eq!(r.results[0].drafts.len(), 3, "{:?}", r.results[0]);
        // Both at once cannot fit: the second is refused, typed, and the first drafts.
        let r = w.round(vec![ask("b", 11), ask("a", 8)]);
        assert_eq!(r.results[0].drafts.len(), 3);
        assert!(matches!(
            r.results[1].refused,
            Some(Refusal::Pool(KvError::PoolExhausted { .. }))
        ));
        // Longer than the whole pool: refused, nothing held beyond what "b" had.
        let r = w.round(vec![ask("a", 40)]);
        assert!(r.results[0].refused.is_some());
        w.cache.end(&"a".into(), false);
        w.cache.end(&"b".into(), false);
        w.cache.clear_idle();
        assert_eq!(w.pool_stats().num_used, 0);
    }

    /// A request repeating an ended request's tokens (the next turn of a stateless
    /// conversation) takes over its K/V: it computes only what differs, and drafts exactly what
    /// a freshly computed K/V drafts.
    #[test]
    fn a_later_request_takes_over_an_ended_requests_draft_kv() {
        let (mut w, _dir) = worker(64);
        let first = ask("a", 40);
        assert_eq!(w.round(vec![first.clone()]).results[0].drafts.len(), 3);
        w.cache.end(&"a".into(), false);
        assert!(w.pool_stats().num_used > 0, "the ended request's K/V stays");
        // The next turn: the same 40 tokens and 5 more.
        let next = DraftAsk {
            key: "c".into(),
            tokens: first.tokens.iter().copied().chain(300..305).collect(),
            ..first.clone()
        };
        w.cache.begin("c".into(), &SamplingParams::greedy(), 0);
        let taken_over = w.round(vec![next.clone()]);
        assert_eq!(
            taken_over.num_catch_up_rows, 0,
            "only the 5 new tokens are computed"
        );
        // The same turn on a fresh worker computes all 45.
        let (mut fresh, _dir2) = worker(64);
        fresh.cache.begin("c".into(), &SamplingParams::greedy(), 0);
        let computed = fresh.round(vec![next.clone()]);
        assert_eq!(computed.num_catch_up_rows, 45, "{computed:?}");
        assert_eq!(taken_over.results[0].drafts.len(), 3);
        assert_eq!(taken_over.results[0].drafts, computed.results[0].drafts);
        // Caches cleared: nothing is held.
        w.cache.end(&"c".into(), false);
        w.cache.clear_idle();
        assert_eq!(w.pool_stats().num_used, 0);
    }
}
