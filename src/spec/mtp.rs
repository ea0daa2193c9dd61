//! The MTP drafter: the target model's own multi-token-prediction modules (DeepSeek-V3, GGUF
//! `nextn`) draft from the target's hidden states.
//!
//! Owns, on its own thread ([`MtpWorker`]): K/V pages for the modules (one KV layer per module,
//! one page table per draft key, from the shared [`DrafterCache`]), the target's hidden states
//! it has been handed but not yet consumed, and for chaining the modules' outputs at committed
//! positions. The weights are the target's (`Arc<Transformer>`, shared with the model worker,
//! read only). Never touches: the target's pages.
//!
//! Indexing. Module `m`'s K/V at index `q` is computed from the hidden state "before" `q` in its
//! chain and the token `t_{q+1}`: for module 0 the target's `h_q`, for module `m > 0` module
//! `m−1`'s output at `q − 1` (DeepSeek-V3's depth-`m+1` module at `q − m`, shifted so every
//! module's committed indices end at the same place). Committed indices run to `i`, the position
//! before the pending token; module 0 at `i` predicts the first draft. Draft `s` (`s ≥ 2`)
//! comes from module `(s−1) mod M` at index `i + s − 1`, fed the previous step's output and
//! draft — past the committed indices, so these scratch K/V are recomputed from committed inputs
//! next round. With fewer modules than the depth, a module is reused cyclically.
//!
//! Positions the heads never saw the target compute — a prompt prefix reused from the prefix
//! cache, K/V they lost to eviction — have no hidden state to give them: those indices are
//! computed from the token embedding alone (a zero hidden state). The heads then attend over an
//! approximate prefix, which can only lower their acceptance; verification keeps the output
//! exact. (Recomputing the target over the prefix would cost the prefill the cache saved.)

use super::drafter_kv::{
    common_prefix, draft_forward_panicked, drafter_cache_handlers, draw, DraftKey, DraftReply,
    Drafted, DrafterCache, Refusal, MAX_CATCH_UP_ROWS,
};
use crate::kv::{KvDtype, PoolStats};
use crate::model::Transformer;
use crate::runner::batch::{OutputRows, SeqStep};
use crate::spec::MAX_DEPTH;
use actix::prelude::*;
use anyhow::Result;
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;

/// One sequence's share of an MTP round.
#[derive(Debug, Clone)]
pub struct MtpAsk {
    pub key: DraftKey,
    /// Committed tokens, prompt first; the last one is pending.
    pub tokens: Vec<u32>,
    pub num_prompt: usize,
    pub num_drafts: usize,
    /// `[rows, hidden_size]`: the target's hidden states (before the final norm) at positions
    /// `hidden_start..`, computed since the last ask.
    pub hidden: Vec<f32>,
    pub hidden_start: usize,
}

/// What a key keeps besides its K/V.
#[derive(Debug, Default)]
pub struct MtpState {
    /// Target hidden states not consumed yet, from position `pending_start`.
    pending: Vec<f32>,
    pending_start: usize,
    /// Per module `m < M − 1`: its outputs at committed indices (module `m + 1`'s inputs).
    outputs: Vec<Vec<f32>>,
}

pub struct MtpWorker {
    model: Arc<Transformer>,
    cache: DrafterCache<MtpState>,
}

/// A sequence followed within a round.
struct Live {
    ask: usize,
    key: DraftKey,
    /// First index computed this round and how many committed indices.
    start: usize,
    num_rows: usize,
    /// Drafting after the committed rows (else only catching up).
    drafting: bool,
    history: Vec<u32>,
    /// The last step's output hidden state (`[hidden_size]`) and draft.
    hidden: Vec<f32>,
    drafted: Drafted,
}

impl MtpWorker {
    pub fn new(
        model: Arc<Transformer>,
        page_size: usize,
        dtype: KvDtype,
        num_pages: usize,
    ) -> Self {
        Self {
            cache: DrafterCache::new(model.mtp_kv_shape(page_size), dtype, num_pages),
            model,
        }
    }

    pub fn start(
        model: Arc<Transformer>,
        page_size: usize,
        dtype: KvDtype,
        num_pages: usize,
    ) -> Addr<Self> {
        SyncArbiter::start(1, move || {
            MtpWorker::new(model.clone(), page_size, dtype, num_pages)
        })
    }

    pub fn pool_stats(&self) -> PoolStats {
        self.cache.pool_stats()
    }

    fn hidden_size(&self) -> usize {
        self.model.config.hidden_size
    }

    /// Brings every ask's module K/V up to its committed tokens from the hidden states handed
    /// in, then drafts `num_drafts` tokens each (batched across asks, one forward per module
    /// and per draft step).
    pub fn round(&mut self, asks: Vec<MtpAsk>) -> DraftReply {
        let started = Instant::now();
        self.cache.tick();
        let protected: HashSet<DraftKey> = asks.iter().map(|a| a.key.clone()).collect();
        let mut results = vec![Drafted::default(); asks.len()];
        let mut live = Vec::new();
        let mut budget = MAX_CATCH_UP_ROWS;
        let mut num_catch_up_rows = 0;
        for (i, ask) in asks.iter().enumerate() {
            match self.prepare(i, ask, &mut budget, &protected) {
                Ok(Some(l)) => {
                    if !l.drafting {
                        num_catch_up_rows += l.num_rows;
                    }
                    live.push(l);
                }
                Ok(None) => {}
                Err(r) => results[i].refused = Some(r),
            }
        }
        let mut num_forwards = 0;
        if !live.is_empty() {
            num_forwards += self.model.num_mtp_modules();
            if let Err(e) = self.sync(&mut live, &asks) {
                tracing::warn!("MTP forward failed: {e:#}");
                for l in live.drain(..) {
                    self.cache.end(&l.key, false);
                }
            }
        }
        live.retain(|l| l.drafting);
        let max_drafts = asks.iter().map(|a| a.num_drafts).max().unwrap_or(0);
        for step in 1..max_drafts {
            // Sequences with all their drafts (or that could not sample) are done.
            let (next, finished): (Vec<Live>, Vec<Live>) = live
                .into_iter()
                .partition(|l| l.drafted.drafts.len() == step && asks[l.ask].num_drafts > step);
            for l in finished {
                results[l.ask] = l.drafted;
            }
            let (grown, short): (Vec<Live>, Vec<Live>) = next
                .into_iter()
                .partition(|l| self.cache.try_grow(&l.key, 1, &protected).is_ok());
            for l in short {
                results[l.ask] = l.drafted;
            }
            live = grown;
            if live.is_empty() {
                break;
            }
            num_forwards += 1;
            if let Err(e) = self.draft_step(step, &mut live, &asks) {
                tracing::warn!("MTP draft step failed: {e:#}");
                break;
            }
        }
        for l in live {
            results[l.ask] = l.drafted;
        }
        // Scratch K/V past the committed indices is dropped.
        for ask in &asks {
            let committed = self.cache.get(&ask.key).tokens.len().saturating_sub(1);
            let _ = self.cache.truncate(&ask.key, committed);
        }
        DraftReply {
            results,
            num_forwards,
            num_catch_up_rows,
            // The MTP heads have no cost guard; all their catch-up is counted as prompt.
            num_prompt_catch_up_rows: num_catch_up_rows,
            elapsed: started.elapsed(),
        }
    }

    /// Takes `ask`'s hidden states, truncates what no longer matches, and reserves pages for
    /// the committed indices to compute (all of them, or a catch-up chunk).
    fn prepare(
        &mut self,
        i: usize,
        ask: &MtpAsk,
        budget: &mut usize,
        protected: &HashSet<DraftKey>,
    ) -> Result<Option<Live>, Refusal> {
        let hs = self.hidden_size();
        let n = ask.tokens.len();
        let seq = self.cache.touch(&ask.key);
        absorb(&mut seq.extra, &ask.hidden, ask.hidden_start, hs);
        if n < 2 {
            return Ok(None);
        }
        // Committed indices end at the position before the pending token.
        let last = n - 2;
        let valid = seq.table.len();
        // Index q needs t_{q+1}; at least index `last` is recomputed, for its logits.
        let keep = valid
            .min(common_prefix(&seq.tokens, &ask.tokens).saturating_sub(1))
            .min(last);
        let state = &mut seq.extra;
        cover(state, keep, last + 1, hs);
        for out in &mut state.outputs {
            out.truncate(keep * hs);
        }
        seq.tokens.truncate(keep + 1);
        let missing = last + 1 - keep;
        let num_rows = if missing <= MAX_DEPTH + 1 {
            missing
        } else {
            let r = missing.min(*budget);
            *budget -= r;
            r
        };
        self.cache.truncate(&ask.key, keep).map_err(Refusal::Pool)?;
        if num_rows == 0 {
            return Ok(None);
        }
        self.cache
            .try_grow(&ask.key, num_rows, protected)
            .map_err(Refusal::Pool)?;
        let drafting = num_rows == missing && ask.num_drafts > 0;
        Ok(Some(Live {
            ask: i,
            key: ask.key.clone(),
            start: keep,
            num_rows,
            drafting,
            history: ask.tokens.clone(),
            hidden: Vec::new(),
            drafted: Drafted::default(),
        }))
    }

    /// Computes the committed indices of every live sequence, module by module; module 0's
    /// last row of a drafting sequence gives its first draft.
    fn sync(&mut self, live: &mut [Live], asks: &[MtpAsk]) -> Result<()> {
        let hs = self.hidden_size();
        let num_modules = self.model.num_mtp_modules();
        // Per live sequence, the previous module's outputs at indices start−1 .. start+rows−1.
        let mut prev: Vec<Vec<f32>> = vec![Vec::new(); live.len()];
        for m in 0..num_modules {
            let mut inputs = Vec::new();
            for (l, prev) in live.iter().zip(&prev) {
                let state = &self.cache.get(&l.key).extra;
                if m == 0 {
                    inputs.extend_from_slice(&state.pending[..l.num_rows * hs]);
                } else {
                    // Module m at index q takes module m−1's output at q − 1 (zeros at q = 0).
                    inputs.extend_from_slice(&prev[..l.num_rows * hs]);
                }
            }
            let (tables, kv) = self.cache.split();
            let steps: Vec<SeqStep> = live
                .iter()
                .map(|l| SeqStep {
                    tokens: &asks[l.ask].tokens[l.start + 1..l.start + 1 + l.num_rows],
                    start_position: l.start,
                    page_ids: tables.page_ids(&l.key),
                    outputs: if m == 0 && l.drafting {
                        OutputRows::Last
                    } else {
                        OutputRows::None
                    },
                })
                .collect();
            let out = self.model.mtp_forward(m, &steps, &inputs, kv)?;
            for (b, l) in live.iter_mut().enumerate() {
                let rows = out.hidden_of(b);
                if m + 1 < num_modules {
                    let state = &mut self.cache.get_mut(&l.key).extra;
                    if state.outputs.len() < num_modules - 1 {
                        state.outputs.resize(num_modules - 1, Vec::new());
                    }
                    let before = &state.outputs[m];
                    let mut p = match l.start.checked_sub(1) {
                        Some(q) if before.len() >= (q + 1) * hs => {
                            before[q * hs..(q + 1) * hs].to_vec()
                        }
                        _ => vec![0.0; hs],
                    };
                    p.extend_from_slice(&rows[..(l.num_rows - 1) * hs]);
                    prev[b] = p;
                    state.outputs[m].extend_from_slice(rows);
                }
                if m == 0 {
                    l.hidden = rows[(l.num_rows - 1) * hs..].to_vec();
                    if l.drafting {
                        let row = out.rows_of(b).last().map(|r| out.logits_row(r));
                        self.sample(l, asks, row);
                    }
                }
            }
        }
        for l in live.iter() {
            let seq = self.cache.get_mut(&l.key);
            let end = l.start + l.num_rows;
            seq.tokens = asks[l.ask].tokens[..end + 1].to_vec();
            let hs_drop = l.num_rows * hs;
            seq.extra.pending.drain(..hs_drop);
            seq.extra.pending_start = end;
        }
        Ok(())
    }

    /// Draft `step + 1` for every live sequence: module `step mod M` at the index after the
    /// previous step's, fed that step's output and draft.
    fn draft_step(&mut self, step: usize, live: &mut [Live], asks: &[MtpAsk]) -> Result<()> {
        let module = step % self.model.num_mtp_modules();
        let inputs: Vec<f32> = live.iter().flat_map(|l| l.hidden.clone()).collect();
        let tokens: Vec<[u32; 1]> = live
            .iter()
            .map(|l| [*l.drafted.drafts.last().expect("a draft")])
            .collect();
        let (tables, kv) = self.cache.split();
        let steps: Vec<SeqStep> = live
            .iter()
            .zip(&tokens)
            .map(|(l, t)| SeqStep {
                tokens: t,
                start_position: l.start + l.num_rows - 1 + step,
                page_ids: tables.page_ids(&l.key),
                outputs: OutputRows::Last,
            })
            .collect();
        let out = self.model.mtp_forward(module, &steps, &inputs, kv)?;
        for (b, l) in live.iter_mut().enumerate() {
            l.hidden = out.hidden_of(b).to_vec();
            let row = out.rows_of(b).last().map(|r| out.logits_row(r));
            self.sample(l, asks, row);
        }
        Ok(())
    }

    fn sample(&mut self, l: &mut Live, asks: &[MtpAsk], row: Option<&[f32]>) {
        let seq = self.cache.get_mut(&l.key);
        let (Some(row), Some(sampler)) = (row, seq.sampler.as_mut()) else {
            return;
        };
        if let Some(t) = draw(
            sampler,
            row,
            &l.history,
            asks[l.ask].num_prompt,
            &mut l.drafted,
        ) {
            l.drafted.drafts.push(t);
            l.history.push(t);
        }
    }
}

/// Makes the held hidden states cover exactly positions `from..` (at least to `to`): rows
/// before `from` are dropped, missing ones are zeros (the heads never saw them computed).
fn cover(state: &mut MtpState, from: usize, to: usize, hs: usize) {
    if state.pending.is_empty() {
        state.pending_start = from;
    }
    if state.pending_start > from {
        let missing = (state.pending_start - from) * hs;
        state
            .pending
            .splice(0..0, std::iter::repeat_n(0.0, missing));
    } else {
        state.pending.drain(..(from - state.pending_start) * hs);
    }
    state.pending_start = from;
    if state.pending.len() < (to - from) * hs {
        state.pending.resize((to - from) * hs, 0.0);
    }
}

/// Appends hidden states for positions `start..` to what a key holds, replacing what they
/// overlap; a gap (or an earlier start) starts afresh.
fn absorb(state: &mut MtpState, hidden: &[f32], start: usize, hs: usize) {
    if hidden.is_empty() {
        return;
    }
    let held_end = state.pending_start + state.pending.len() / hs;
    if state.pending.is_empty() || start < state.pending_start || start > held_end {
        state.pending.clear();
        state.pending_start = start;
    } else {
        state.pending.truncate((start - state.pending_start) * hs);
    }
    state.pending.extend_from_slice(hidden);
}

impl Actor for MtpWorker {
    type Context = SyncContext<Self>;
}

drafter_cache_handlers!(MtpWorker);

#[derive(Message)]
#[rtype(result = "DraftReply")]
pub struct MtpRound {
    pub asks: Vec<MtpAsk>,
}

impl Handler<MtpRound> for MtpWorker {
    type Result = MessageResult<MtpRound>;
    fn handle(&mut self, msg: MtpRound, _: &mut SyncContext<Self>) -> Self::Result {
        let n = msg.asks.len();
        let reply = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.round(msg.asks)));
        MessageResult(reply.unwrap_or_else(|_| draft_forward_panicked(&mut self.cache, n)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::{KvStorage, PagePool, PageTable};
    use crate::model::test_model::{write_test_model, TestModelSpec};
    use crate::sampling::SamplingParams;

    fn model(mtp_depth: usize) -> (Arc<Transformer>, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let spec = TestModelSpec {
            mtp_depth,
            ..TestModelSpec::default()
        };
        let path = write_test_model(dir.path(), &spec).unwrap();
        (Arc::new(Transformer::load(&path).unwrap().0), dir)
    }

    /// The target's hidden states for every position of `tokens`: `[len, hidden]`.
    fn target_hidden(model: &Transformer, tokens: &[u32]) -> Vec<f32> {
        let mut pool = PagePool::new(64, 4);
        let mut table = PageTable::new();
        table.try_grow(tokens.len(), &mut pool).unwrap();
        let mut kv = KvStorage::new(model.kv_shape(4), KvDtype::F32, 64);
        let step = SeqStep {
            tokens,
            start_position: 0,
            page_ids: table.page_ids(),
            outputs: OutputRows::None,
        };
        model.forward(&[step], &mut kv, true).unwrap().hidden
    }

    fn ask(tokens: &[u32], hidden: &[f32], from: usize, hs: usize) -> MtpAsk {
        // Hidden states exist for every position but the pending token's.
        let to = tokens.len() - 1;
        MtpAsk {
            key: "k".into(),
            tokens: tokens.to_vec(),
            num_prompt: 4,
            num_drafts: 3,
            hidden: hidden[from * hs..to * hs].to_vec(),
            hidden_start: from,
        }
    }

    fn worker(model: &Arc<Transformer>) -> MtpWorker {
        let mut w = MtpWorker::new(model.clone(), 4, KvDtype::F32, 64);
        w.cache.begin("k".into(), &SamplingParams::greedy(), 0);
        w
    }

    /// Following a sequence round by round (drafting each time, so scratch K/V is written and
    /// dropped, with a divergent stretch in between) drafts what heads fed it all at once do.
    #[test]
    fn heads_followed_round_by_round_draft_what_heads_fed_at_once_draft() {
        for num_modules in [1, 2] {
            let (model, _dir) = model(num_modules);
            let hs = model.config.hidden_size;
            let tokens: Vec<u32> = (0..40).map(|i| (i * 37 + 11) % 500).collect();
            let hidden = target_hidden(&model, &tokens);
            let fresh = worker(&model).round(vec![ask(&tokens, &hidden, 0, hs)]);
            let want = &fresh.results[0].drafts;
            assert_eq!(want.len(), 3);

            let mut w = worker(&model);
            let mut sent = 0;
            for cut in [2, 5, 9, 10, 17, 25] {
                let r = w.round(vec![ask(&tokens[..cut], &hidden, sent, hs)]);
                assert_eq!(
                    r.results[0].drafts.len(),
                    3,
                    "cut {cut}: {:?}",
                    r.results[0]
                );
                sent = cut - 1;
            }
            // A divergent continuation (a new turn that edits the tail) and back again.
            let mut other = tokens[..30].to_vec();
            other[27] = 499;
            let other_hidden = target_hidden(&model, &other);
            w.round(vec![ask(&other, &other_hidden, 24, hs)]);
            let r = w.round(vec![ask(&tokens, &hidden, 26, hs)]);
            assert_eq!(&r.results[0].drafts, want, "{num_modules} modules");
            assert_eq!(w.pool_stats().num_used, 39usize.div_ceil(4));
            w.cache.end(&"k".into(), false);
            assert_eq!(w.pool_stats().num_used, 0);
        }
    }

    #[test]
    fn heads_fill_positions_they_never_saw_from_token_embeddings() {
        let (model, _dir) = model(1);
        let hs = model.config.hidden_size;
        let tokens: Vec<u32> = (0..20).map(|i| (i * 7 + 3) % 500).collect();
        let hidden = target_hidden(&model, &tokens);
        // As after a prefix-cache hit: hidden states from position 12 on only.
        let mut w = worker(&model);
        let r = w.round(vec![ask(&tokens, &hidden, 12, hs)]);
        assert_eq!(r.results[0].drafts.len(), 3, "{:?}", r.results[0]);
        assert_eq!(w.pool_stats().num_used, 19usize.div_ceil(4));
        // The same with zeros handed in explicitly.
        let mut zeros = hidden.clone();
        zeros[..12 * hs].fill(0.0);
        let same = worker(&model).round(vec![ask(&tokens, &zeros, 0, hs)]);
        assert_eq!(same.results[0].drafts, r.results[0].drafts);
    }
}
