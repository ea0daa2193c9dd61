//! The scheduler's side of speculative drafting: each step, which drafter drafts for which
//! decoding sequence; the model drafters' rounds on their own threads; the target's hidden
//! states handed to the MTP heads; and the draft model's cost guard fed from timed steps.

use super::{Active, SchedulerActor, Submission};
use crate::runner::batch::ForwardOutput;
use crate::scheduler::sequence::SeqId;
use crate::spec::draft_model::{DraftAsk, DraftRound};
use crate::spec::drafter_kv::{BeginDraft, DraftReply, EndDraft};
use crate::spec::mtp::{MtpAsk, MtpRound};
use crate::spec::{DraftSource, Proposal, Verification};
use std::future::Future;
use std::time::{Duration, Instant};

/// What one step did, as the draft model's cost guard needs to know.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct StepTally {
    /// Time of the draft-model round before the forward (zero without one).
    pub draft_time: Duration,
    /// The round drafted something.
    pub model_drafted: bool,
    /// The round also brought a sequence far behind up to date.
    pub draft_catch_up: bool,
    /// Some of that was a prompt's (a one-off per turn, not a cost of drafting).
    pub draft_prompt_catch_up: bool,
    /// Some grant prefilled prompt tokens (such steps are not comparable).
    pub prefill: bool,
    /// Some grant verified drafts.
    pub verified: bool,
    /// Plain decode grants.
    pub num_decode_rows: usize,
    pub tokens_before: u64,
}

/// This step's asks of the model drafters, with the sequences they belong to.
#[derive(Default)]
pub(super) struct ModelAsks {
    draft: Vec<(SeqId, DraftAsk)>,
    mtp: Vec<(SeqId, MtpAsk)>,
}

/// The model drafters' replies and how long the scheduler waited for each.
pub(super) struct ModelDrafts {
    draft: Option<(Vec<SeqId>, DraftReply, Duration)>,
    mtp: Option<(Vec<SeqId>, DraftReply)>,
}

impl SchedulerActor {
    /// Tells the model drafters a sequence's turn begins (how to draw its drafts).
    pub(super) fn begin_drafting(&self, sub: &Submission) {
        let mut params = sub.sampler.params().clone();
        if sub.spec.verification == Verification::Coupled {
            // A coupled draft is accepted iff the target samples it: the most likely token
            // under the drafter's (penalised) distribution is its best guess.
            params.temperature = 0.0;
        }
        let begin = || BeginDraft {
            key: sub.draft_key.clone(),
            params: params.clone(),
            seed: sub.sampler.seed() ^ 0x9e37_79b9_7f4a_7c15,
        };
        if let Some(d) = self
            .draft
            .as_ref()
            .filter(|_| sub.spec.may_use(DraftSource::DraftModel))
        {
            d.do_send(begin());
        }
        if let Some(m) = self
            .mtp
            .as_ref()
            .filter(|_| sub.spec.may_use(DraftSource::Mtp))
        {
            m.do_send(begin());
        }
    }

    /// Tells the model drafters a sequence's turn ended; a persistent session's MTP heads are
    /// first handed its last hidden states, so its next turn finds them up to date.
    pub(super) fn end_drafting(&self, a: &mut Active) {
        let key = a.sub.draft_key.clone();
        let keep = !a.sub.ephemeral;
        if let Some(d) = self
            .draft
            .as_ref()
            .filter(|_| a.sub.spec.may_use(DraftSource::DraftModel))
        {
            d.do_send(EndDraft {
                key: key.clone(),
                keep,
            });
        }
        if let Some(m) = self
            .mtp
            .as_ref()
            .filter(|_| a.sub.spec.may_use(DraftSource::Mtp))
        {
            if keep && !a.mtp_hidden.is_empty() {
                m.do_send(MtpRound {
                    asks: vec![mtp_ask(a, 0)],
                });
            }
            m.do_send(EndDraft { key, keep });
        }
    }

    /// Asks each decoding sequence's drafter for drafts, unless the batch is large enough that
    /// decode is no longer memory-bound (then plain batched decoding is cheaper). Context drafts
    /// are ready at once; model drafters get asks. Sequences that may use the MTP heads hand
    /// them their new hidden states every step, drafting or not.
    pub(super) fn propose_drafts(&mut self) -> ModelAsks {
        let num_decoding = self
            .active
            .values()
            .filter(|a| a.running && a.seq.num_pending() == 1)
            .count();
        let allowed = self.spec.is_on() && num_decoding <= self.spec.max_batch_seqs;
        let model_ok = self.draft.is_some()
            && (self.spec.depth.is_some()
                || self.draft_costs.as_ref().is_none_or(|c| c.draft_model_ok()));
        let mut asks = ModelAsks::default();
        for (&id, a) in self.active.iter_mut() {
            a.seq.drafts.clear();
            a.draft_probs = None;
            if !a.running || a.seq.num_pending() != 1 {
                continue;
            }
            let mut mtp_drafts = 0;
            if allowed {
                // Every committed token counts against max_tokens: the drafts plus the bonus.
                let remaining = a.sub.max_tokens.saturating_sub(a.seq.num_generated());
                let room = self.context_window.saturating_sub(a.seq.tokens.len());
                let limit = remaining.saturating_sub(1).min(room);
                let (tokens, num_prompt) = (&a.seq.tokens, a.seq.num_prompt);
                match a
                    .sub
                    .spec
                    .propose(&self.spec, tokens, num_prompt, limit, model_ok)
                {
                    Proposal::None => {}
                    Proposal::Drafts(d) => a.seq.drafts = d,
                    Proposal::DraftModel { num_drafts } => asks.draft.push((
                        id,
                        DraftAsk {
                            key: a.sub.draft_key.clone(),
                            tokens: a.seq.tokens.clone(),
                            num_prompt,
                            num_drafts,
                        },
                    )),
                    Proposal::Mtp { num_drafts } => mtp_drafts = num_drafts,
                }
            }
            let follow = self.mtp.is_some() && a.sub.spec.may_use(DraftSource::Mtp);
            if follow && (mtp_drafts > 0 || !a.mtp_hidden.is_empty()) {
                asks.mtp.push((id, mtp_ask(a, mtp_drafts)));
            }
        }
        asks
    }

    /// Sends the asks to the model drafters' threads (nothing to wait for without asks).
    pub(super) fn request_model_drafts(
        &self,
        asks: ModelAsks,
    ) -> impl Future<Output = ModelDrafts> {
        let draft = self.draft.clone().filter(|_| !asks.draft.is_empty());
        let mtp = self.mtp.clone().filter(|_| !asks.mtp.is_empty());
        async move {
            let (draft_ids, draft_asks): (Vec<_>, Vec<_>) = asks.draft.into_iter().unzip();
            let (mtp_ids, mtp_asks): (Vec<_>, Vec<_>) = asks.mtp.into_iter().unzip();
            // The MTP heads go first: they are cheap, and the draft model is timed alone.
            let mtp = match mtp {
                Some(m) => m
                    .send(MtpRound { asks: mtp_asks })
                    .await
                    .ok()
                    .map(|r| (mtp_ids, r)),
                None => None,
            };
            let draft = match draft {
                Some(d) => {
                    let started = Instant::now();
                    let reply = d.send(DraftRound { asks: draft_asks }).await.ok();
                    reply.map(|r| (draft_ids, r, started.elapsed()))
                }
                None => None,
            };
            ModelDrafts { draft, mtp }
        }
    }

    /// Hands each sequence the model drafters' drafts (and their distributions).
    pub(super) fn take_model_drafts(&mut self, drafts: ModelDrafts) {
        if let Some((ids, reply)) = drafts.mtp {
            self.take_drafts(ids, reply, DraftSource::Mtp);
        }
        let Some((ids, reply, elapsed)) = drafts.draft else {
            return;
        };
        self.tally.draft_time = elapsed;
        self.tally.draft_catch_up = reply.num_catch_up_rows > 0;
        self.tally.draft_prompt_catch_up = reply.num_prompt_catch_up_rows > 0;
        self.stats.draft_catch_up_rows += reply.num_catch_up_rows as u64;
        let (elapsed, num_forwards) = (reply.elapsed, reply.num_forwards);
        self.tally.model_drafted = self.take_drafts(ids, reply, DraftSource::DraftModel);
        if let Some(c) = self.draft_costs.as_mut() {
            if self.tally.model_drafted && !self.tally.draft_catch_up {
                c.observe_draft_round(elapsed, num_forwards);
            }
        }
    }

    /// Gives each sequence its drafts from `source`'s `reply`; true when any got some.
    fn take_drafts(&mut self, ids: Vec<SeqId>, reply: DraftReply, source: DraftSource) -> bool {
        let mut any = false;
        for (id, drafted) in ids.into_iter().zip(reply.results) {
            let Some(a) = self.active.get_mut(&id) else {
                continue;
            };
            if drafted.drafts.is_empty() {
                if a.sub.spec.source == Some(source) {
                    a.sub.spec.source = None;
                }
                continue;
            }
            any = true;
            a.seq.drafts = drafted.drafts;
            a.draft_probs = drafted.probs;
        }
        any
    }

    /// Keeps the hidden states of a sequence's newly committed positions (from `start`, the
    /// first `num_valid` rows of its share of the step) for the MTP heads.
    pub(super) fn collect_hidden(
        &mut self,
        id: SeqId,
        out: &ForwardOutput,
        batch_index: usize,
        start: usize,
        num_valid: usize,
    ) {
        let Some(a) = self.active.get_mut(&id) else {
            return;
        };
        if out.hidden.is_empty() || !a.sub.spec.may_use(DraftSource::Mtp) {
            return;
        }
        let hs = out.hidden_size;
        let rows = out.hidden_of(batch_index);
        for (r, h) in rows.chunks_exact(hs).take(num_valid).enumerate() {
            // A recompute after preemption repeats positions already handed over.
            if start + r == a.mtp_next {
                if a.mtp_hidden.is_empty() {
                    a.mtp_hidden_start = a.mtp_next;
                }
                a.mtp_hidden.extend_from_slice(h);
                a.mtp_next += 1;
            }
        }
    }

    /// Whether the step must return hidden states (someone follows with MTP heads).
    pub(super) fn wants_hidden(&self, ids: impl Iterator<Item = SeqId>) -> bool {
        self.mtp.is_some()
            && ids
                .filter_map(|id| self.active.get(&id))
                .any(|a| a.sub.spec.may_use(DraftSource::Mtp))
    }

    /// Feeds the step just applied to the draft model's cost guard.
    pub(super) fn observe_costs(&mut self, forward_time: Duration) {
        let t = self.tally;
        let Some(c) = self.draft_costs.as_mut() else {
            return;
        };
        let committed = (self.stats.tokens_generated - t.tokens_before) as usize;
        tracing::debug!(
            prefill = t.prefill,
            catch_up = t.draft_catch_up,
            model_drafted = t.model_drafted,
            verified = t.verified,
            draft_ms = t.draft_time.as_secs_f64() * 1e3,
            forward_ms = forward_time.as_secs_f64() * 1e3,
            committed,
            "step"
        );
        // Prefill steps and a turn's one-off catch-up on its prompt are not comparable; catching
        // up on tokens committed while the draft model paused or the n-gram drafter drafted
        // is what drafting with it costs, and counts.
        if !t.prefill && !t.draft_prompt_catch_up {
            if t.model_drafted {
                c.observe_speculative(t.draft_time + forward_time, committed);
            } else if !t.verified && t.draft_time.is_zero() {
                c.observe_plain(forward_time, t.num_decode_rows);
            }
        }
        if self.spec.depth.is_none() {
            self.spec.draft_cost = c.relative_draft_cost();
        }
        self.stats.draft_model_pauses = c.num_pauses;
        let (plain, spec) = c.per_token_s();
        self.stats.plain_ms_per_token = plain * 1e3;
        self.stats.draft_model_ms_per_token = spec * 1e3;
    }
}

/// An MTP ask for `a` handing over its collected hidden states.
fn mtp_ask(a: &mut Active, num_drafts: usize) -> MtpAsk {
    MtpAsk {
        key: a.sub.draft_key.clone(),
        tokens: a.seq.tokens.clone(),
        num_prompt: a.seq.num_prompt,
        num_drafts,
        hidden: std::mem::take(&mut a.mtp_hidden),
        hidden_start: a.mtp_hidden_start,
    }
}
