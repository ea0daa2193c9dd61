//! One sequence's speculation state: which drafters it may use, their acceptance by depth, and
//! the choice each step of which drafter proposes how many tokens.

use super::{ngram, Acceptance, DraftSource, DrafterSet, SpecConfig, MAX_DEPTH, NUM_SOURCES};

/// What a sequence drafts this step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Proposal {
    /// Plain decoding.
    None,
    /// Drafts ready now (n-gram or prediction).
    Drafts(Vec<u32>),
    /// Ask the draft model for this many tokens.
    DraftModel { num_drafts: usize },
    /// Ask the MTP heads for this many tokens.
    Mtp { num_drafts: usize },
}

/// One sequence's speculation state.
#[derive(Debug, Clone, Default)]
pub struct SeqSpec {
    /// The drafters this sequence may use (the server's, narrowed by the request).
    pub allowed: DrafterSet,
    /// The request's Predicted Output, tokenized.
    pub prediction: Option<Vec<u32>>,
    acceptance: [Acceptance; NUM_SOURCES],
    /// The source of the drafts now being verified.
    pub source: Option<DraftSource>,
    /// Per source: rounds since its last draft while its adaptive depth was 0 (to probe again).
    num_idle_rounds: [u32; NUM_SOURCES],
    pub num_drafted: usize,
    pub num_accepted: usize,
    pub by_depth: crate::scheduler::DepthCounts,
    /// How this sequence's sampled drafts are verified.
    pub verification: super::Verification,
}

/// After this many rounds with an adaptive depth of 0, draft one token to re-measure.
const PROBE_EVERY: u32 = 16;

impl SeqSpec {
    pub fn new(allowed: DrafterSet, prediction: Option<Vec<u32>>) -> Self {
        Self {
            allowed,
            prediction: prediction.filter(|p| !p.is_empty()),
            ..Self::default()
        }
    }

    pub fn verified(self, verification: super::Verification) -> Self {
        Self {
            verification,
            ..self
        }
    }

    /// The drafts verified and accepted so far, for the stream.
    pub fn tally(&self) -> crate::scheduler::DraftTally {
        crate::scheduler::DraftTally {
            draft_tokens: self.num_drafted,
            accepted_draft_tokens: self.num_accepted,
            draft_by_depth: self.by_depth,
        }
    }

    pub fn may_use(&self, source: DraftSource) -> bool {
        self.allowed.contains(source)
    }

    /// Drafts for a decoding sequence: at most `limit` tokens to follow `tokens` (prompt +
    /// generated, the last one pending). `draft_model_ok` is false while the cost guard pauses
    /// the draft model. Remembers the source for [`SeqSpec::record`].
    pub fn propose(
        &mut self,
        cfg: &SpecConfig,
        tokens: &[u32],
        num_prompt: usize,
        limit: usize,
        draft_model_ok: bool,
    ) -> Proposal {
        self.source = None;
        if self.allowed.is_empty() || limit == 0 {
            return Proposal::None;
        }
        let draft_next = self.may_use(DraftSource::DraftModel) && draft_model_ok;
        let model_next = draft_next || self.may_use(DraftSource::Mtp);
        if let Some((source, m)) = self.context_match(cfg, tokens, num_prompt, limit) {
            // With a model drafter to fall back on, a short context match is not worth it.
            let useful =
                source == DraftSource::Prediction || !model_next || m.len >= cfg.useful_ngram;
            if useful && !m.draft.is_empty() {
                self.source = Some(source);
                return Proposal::Drafts(m.draft);
            }
        }
        if self.may_use(DraftSource::Mtp) {
            let k = self.depth(cfg, DraftSource::Mtp).min(limit);
            if k > 0 {
                self.source = Some(DraftSource::Mtp);
                return Proposal::Mtp { num_drafts: k };
            }
        }
        if draft_next {
            let k = self.depth(cfg, DraftSource::DraftModel).min(limit);
            if k > 0 {
                self.source = Some(DraftSource::DraftModel);
                return Proposal::DraftModel { num_drafts: k };
            }
        }
        Proposal::None
    }

    /// The best of a Predicted Output match and a context n-gram match (the context wins only on
    /// a strictly longer match).
    fn context_match(
        &mut self,
        cfg: &SpecConfig,
        tokens: &[u32],
        num_prompt: usize,
        limit: usize,
    ) -> Option<(DraftSource, ngram::Match)> {
        let num_generated = tokens.len() - num_prompt;
        let mut best: Option<(DraftSource, ngram::Match)> = None;
        if self.prediction.is_some() && self.may_use(DraftSource::Prediction) {
            let k = self.depth(cfg, DraftSource::Prediction).min(limit);
            let prediction = self.prediction.as_deref().unwrap_or_default();
            let m = ngram::lookup_prediction(prediction, tokens, num_generated, k, cfg.max_ngram);
            best = m.map(|m| (DraftSource::Prediction, m));
        }
        if self.may_use(DraftSource::Ngram) {
            let k = self.depth(cfg, DraftSource::Ngram).min(limit);
            if let Some(m) = ngram::lookup(tokens, k, cfg.min_ngram, cfg.max_ngram) {
                if best.as_ref().is_none_or(|(_, b)| m.len > b.len) {
                    best = Some((DraftSource::Ngram, m));
                }
            }
        }
        best
    }

    /// The depth to draft from `source` this round.
    fn depth(&mut self, cfg: &SpecConfig, source: DraftSource) -> usize {
        if let Some(d) = cfg.depth {
            return d.min(MAX_DEPTH);
        }
        let s = source.index();
        let per_row = cfg.row_cost
            + match source {
                DraftSource::DraftModel => cfg.draft_cost,
                DraftSource::Mtp => cfg.mtp_cost,
                _ => 0.0,
            };
        let best = self.acceptance[s].best_depth(cfg.max_depth, per_row, first_prior(source));
        if best > 0 {
            return best;
        }
        self.num_idle_rounds[s] += 1;
        if self.num_idle_rounds[s] >= PROBE_EVERY {
            self.num_idle_rounds[s] = 0;
            return 1;
        }
        0
    }

    /// Records a verified round.
    pub fn record(&mut self, num_drafted: usize, num_accepted: usize) {
        if let Some(source) = self.source {
            self.acceptance[source.index()].record(num_drafted, num_accepted);
        }
        self.num_drafted += num_drafted;
        self.num_accepted += num_accepted;
        for (d, counts) in self.by_depth.iter_mut().take(num_drafted).enumerate() {
            counts[0] += 1;
            counts[1] += u32::from(d < num_accepted);
        }
    }
}

/// The acceptance expected of a drafter's first draft before any is measured. A model trained
/// on the same data is usually right; a context lookup is a coin toss until it has been tried.
fn first_prior(source: DraftSource) -> f64 {
    match source {
        DraftSource::DraftModel | DraftSource::Mtp => 0.8,
        DraftSource::Prediction | DraftSource::Ngram => 0.5,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::SpecMode;

    fn on() -> SpecConfig {
        SpecConfig {
            mode: SpecMode::Auto,
            min_ngram: 1,
            ..SpecConfig::default()
        }
    }

    fn drafts(p: Proposal) -> Vec<u32> {
        match p {
            Proposal::Drafts(d) => d,
            other => panic!("expected drafts, got {other:?}"),
        }
    }

    #[test]
    fn a_prediction_is_preferred_to_the_context() {
        let all = on().drafters();
        let mut s = SeqSpec::new(all, Some(vec![7, 8, 9]));
        let d = drafts(s.propose(&on(), &[1, 2, 1, 2, 7], 4, 8, true));
        assert_eq!(s.source, Some(DraftSource::Prediction));
        assert_eq!(d, vec![8, 9]);
        // A longer match in the context beats a short one in the prediction.
        let d = drafts(s.propose(&on(), &[5, 6, 7, 1, 9, 5, 6, 7], 5, 8, true));
        assert_eq!(s.source, Some(DraftSource::Ngram));
        assert_eq!(d[0], 1);
        let tokens = [1, 2, 1, 2];
        let mut plain = SeqSpec::new(all, None);
        assert_eq!(drafts(plain.propose(&on(), &tokens, 3, 8, true))[0], 1);
        assert_eq!(plain.source, Some(DraftSource::Ngram));
    }

    #[test]
    fn drafts_respect_the_limit_and_the_switches() {
        let tokens = [1, 2, 1, 2, 1, 2, 1];
        let fixed = SpecConfig {
            depth: Some(6),
            ..on()
        };
        let mut s = SeqSpec::new(fixed.drafters(), None);
        assert_eq!(drafts(s.propose(&fixed, &tokens, 1, 3, true)).len(), 3);
        let mut off = SeqSpec::new(DrafterSet::NONE, None);
        assert_eq!(off.propose(&fixed, &tokens, 1, 3, true), Proposal::None);
        let server_off = SpecConfig {
            mode: SpecMode::Off,
            ..fixed
        };
        let mut s = SeqSpec::new(server_off.drafters(), None);
        assert_eq!(s.propose(&server_off, &tokens, 1, 3, true), Proposal::None);
    }

    #[test]
    fn auto_falls_back_from_a_short_match_to_the_draft_model_then_to_plain() {
        let cfg = SpecConfig {
            has_draft_model: true,
            min_ngram: 1,
            ..on()
        };
        let mut s = SeqSpec::new(cfg.drafters(), None);
        // A 1-token match only: the draft model drafts instead.
        let tokens = [4, 9, 5, 6, 4];
        assert!(matches!(
            s.propose(&cfg, &tokens, 2, 8, true),
            Proposal::DraftModel { num_drafts } if num_drafts > 0
        ));
        assert_eq!(s.source, Some(DraftSource::DraftModel));
        // A long match still wins.
        let tokens = [1, 2, 3, 4, 5, 1, 2, 3, 4];
        assert!(matches!(
            s.propose(&cfg, &tokens, 2, 8, true),
            Proposal::Drafts(_)
        ));
        // The cost guard pauses the draft model: the short match is used after all.
        let tokens = [4, 9, 5, 6, 4];
        assert!(matches!(
            s.propose(&cfg, &tokens, 2, 8, false),
            Proposal::Drafts(_)
        ));
        // A request restricted to the draft model never drafts from the context.
        let mut only = SeqSpec::new(DrafterSet::only(DraftSource::DraftModel), None);
        let tokens = [1, 2, 3, 4, 5, 1, 2, 3, 4];
        assert!(matches!(
            only.propose(&cfg, &tokens, 2, 8, true),
            Proposal::DraftModel { .. }
        ));
        assert_eq!(only.propose(&cfg, &tokens, 2, 8, false), Proposal::None);
    }

    #[test]
    fn a_costly_draft_model_that_is_often_wrong_is_not_used() {
        let cfg = SpecConfig {
            has_draft_model: true,
            mode: SpecMode::Draft,
            draft_cost: 0.5,
            row_cost: 0.15,
            ..SpecConfig::default()
        };
        let mut s = SeqSpec::new(cfg.drafters(), None);
        for _ in 0..10 {
            if let Proposal::DraftModel { num_drafts } = s.propose(&cfg, &[1, 2, 3], 1, 8, true) {
                s.record(num_drafts, 0);
            }
        }
        assert_eq!(s.propose(&cfg, &[1, 2, 3], 1, 8, true), Proposal::None);
    }
}
