//! Speculative decoding: drafters propose tokens, the target verifies them all in one forward
//! pass, and [`verify::verify`] keeps exactly what the target would have produced.
//!
//! Owns: the drafters (context n-gram, Predicted Outputs), the verifier, and each sequence's
//! speculation state ([`SeqSpec`]: its draft source, acceptance by depth, adaptive depth). The
//! scheduler actor calls into it once per step, before planning (drafts become verify rows of
//! the grant) and after the forward (verdicts commit tokens and roll the session back past
//! rejected drafts). Never touches: pages, sessions, the model — it sees token ids and logits.

pub mod cost;
pub mod depth;
pub mod ngram;
pub mod verify;

pub use depth::{Acceptance, MAX_DEPTH};
pub use verify::{verify, Verdict};

/// Which drafter the server uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SpecMode {
    /// No speculation.
    #[default]
    Off,
    /// Per step: a predicted output, else a context n-gram match, else plain decoding.
    Auto,
    /// Context n-gram lookup (and predicted outputs).
    Ngram,
}

#[derive(Debug, Clone, PartialEq)]
pub struct SpecConfig {
    pub mode: SpecMode,
    /// A fixed draft depth; `None` adapts it per sequence from measured acceptance.
    pub depth: Option<usize>,
    /// The deepest draft when adapting.
    pub max_depth: usize,
    /// Shortest and longest context suffix the n-gram drafter matches.
    pub min_ngram: usize,
    pub max_ngram: usize,
    /// With more decoding sequences than this in a step, decode is no longer memory-bound:
    /// plain batched decoding is used.
    pub max_batch_seqs: usize,
    /// The cost of one extra verify row relative to a one-row decode step (measured at
    /// start-up by the engine when speculation is on).
    pub row_cost: f64,
}

impl Default for SpecConfig {
    fn default() -> Self {
        Self {
            mode: SpecMode::Off,
            depth: None,
            max_depth: 8,
            min_ngram: 2,
            max_ngram: 16,
            max_batch_seqs: 4,
            row_cost: 0.1,
        }
    }
}

impl SpecConfig {
    pub fn is_on(&self) -> bool {
        self.mode != SpecMode::Off
    }
}

/// The speculative-decoding flags of `serve` and the benchmarks.
#[derive(Debug, Clone, clap::Args)]
pub struct SpecArgs {
    /// Speculative decoding: `auto` drafts from a predicted output or a context n-gram match
    /// when there is one; `off` decodes plainly.
    #[arg(long, value_enum, default_value_t = SpecMode::Auto)]
    pub speculative: SpecMode,
    /// A fixed draft depth (default: adapt per sequence from measured acceptance).
    #[arg(long)]
    pub spec_depth: Option<usize>,
    /// The deepest draft when adapting.
    #[arg(long, default_value_t = 8)]
    pub spec_max_depth: usize,
    /// Above this many decoding sequences per step, decode plainly.
    #[arg(long, default_value_t = 4)]
    pub spec_max_batch: usize,
}

impl SpecArgs {
    pub fn config(&self) -> SpecConfig {
        SpecConfig {
            mode: self.speculative,
            depth: self.spec_depth,
            max_depth: self.spec_max_depth.clamp(1, MAX_DEPTH),
            max_batch_seqs: self.spec_max_batch,
            ..SpecConfig::default()
        }
    }
}

/// Where a round's drafts came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DraftSource {
    /// The request's Predicted Output.
    Prediction,
    /// Context n-gram lookup.
    Ngram,
}

impl DraftSource {
    pub const ALL: [DraftSource; 2] = [DraftSource::Prediction, DraftSource::Ngram];

    pub fn name(self) -> &'static str {
        match self {
            DraftSource::Prediction => "prediction",
            DraftSource::Ngram => "ngram",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Engine-wide draft counters by drafter and depth position.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct SpecCounters {
    /// Verification rounds (steps with drafts) per source.
    pub rounds: [u64; 2],
    /// Drafts verified at each depth position, per source.
    pub drafted: [[u64; MAX_DEPTH]; 2],
    /// Drafts accepted at each depth position, per source.
    pub accepted: [[u64; MAX_DEPTH]; 2],
}

impl SpecCounters {
    pub fn record(&mut self, source: DraftSource, num_drafted: usize, num_accepted: usize) {
        let s = source.index();
        self.rounds[s] += 1;
        for d in 0..num_drafted.min(MAX_DEPTH) {
            self.drafted[s][d] += 1;
            if d < num_accepted {
                self.accepted[s][d] += 1;
            }
        }
    }

    pub fn num_drafted(&self, source: DraftSource) -> u64 {
        self.drafted[source.index()].iter().sum()
    }

    pub fn num_accepted(&self, source: DraftSource) -> u64 {
        self.accepted[source.index()].iter().sum()
    }
}

/// One sequence's speculation state.
#[derive(Debug, Clone, Default)]
pub struct SeqSpec {
    pub enabled: bool,
    /// The request's Predicted Output, tokenized.
    pub prediction: Option<Vec<u32>>,
    acceptance: [Acceptance; 2],
    /// The source of the drafts now being verified.
    pub source: Option<DraftSource>,
    /// Rounds since the last draft while the adaptive depth was 0 (to probe again later).
    num_idle_rounds: u32,
    pub num_drafted: usize,
    pub num_accepted: usize,
    pub by_depth: crate::scheduler::DepthCounts,
}

/// After this many rounds with an adaptive depth of 0, draft one token to re-measure.
const PROBE_EVERY: u32 = 16;

impl SeqSpec {
    pub fn new(enabled: bool, prediction: Option<Vec<u32>>) -> Self {
        Self {
            enabled,
            prediction: prediction.filter(|p| !p.is_empty()),
            ..Self::default()
        }
    }

    /// Drafts for a decoding sequence: at most `limit` tokens to follow `tokens` (prompt +
    /// generated, the last one pending). Remembers the source for [`SeqSpec::record`].
    pub fn propose(
        &mut self,
        cfg: &SpecConfig,
        tokens: &[u32],
        num_prompt: usize,
        limit: usize,
    ) -> Vec<u32> {
        self.source = None;
        if !self.enabled || !cfg.is_on() || limit == 0 {
            return Vec::new();
        }
        let num_generated = tokens.len() - num_prompt;
        let mut best: Option<(DraftSource, ngram::Match)> = None;
        if self.prediction.is_some() {
            let k = self.depth(cfg, DraftSource::Prediction).min(limit);
            let prediction = self.prediction.as_deref().unwrap_or_default();
            let m = ngram::lookup_prediction(prediction, tokens, num_generated, k, cfg.max_ngram);
            best = m.map(|m| (DraftSource::Prediction, m));
        }
        let k = self.depth(cfg, DraftSource::Ngram).min(limit);
        if let Some(m) = ngram::lookup(tokens, k, cfg.min_ngram, cfg.max_ngram) {
            // The context wins only on a strictly longer match.
            if best.as_ref().is_none_or(|(_, b)| m.len > b.len) {
                best = Some((DraftSource::Ngram, m));
            }
        }
        let (source, draft) = match best {
            Some((s, m)) if !m.draft.is_empty() => (s, m.draft),
            _ => (DraftSource::Ngram, Vec::new()),
        };
        if !draft.is_empty() {
            self.source = Some(source);
        }
        draft
    }

    /// The depth to draft from `source` this round.
    fn depth(&mut self, cfg: &SpecConfig, source: DraftSource) -> usize {
        if let Some(d) = cfg.depth {
            return d.min(MAX_DEPTH);
        }
        let best = self.acceptance[source.index()].best_depth(cfg.max_depth, cfg.row_cost);
        if best > 0 {
            return best;
        }
        self.num_idle_rounds += 1;
        if self.num_idle_rounds >= PROBE_EVERY {
            self.num_idle_rounds = 0;
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

#[cfg(test)]
mod tests {
    use super::*;

    fn on() -> SpecConfig {
        SpecConfig {
            mode: SpecMode::Auto,
            min_ngram: 1,
            ..SpecConfig::default()
        }
    }

    #[test]
    fn a_prediction_is_preferred_to_the_context() {
        let mut s = SeqSpec::new(true, Some(vec![7, 8, 9]));
        let d = s.propose(&on(), &[1, 2, 1, 2, 7], 4, 8);
        assert_eq!(s.source, Some(DraftSource::Prediction));
        assert_eq!(d, vec![8, 9]);
        // A longer match in the context beats a short one in the prediction.
        let d = s.propose(&on(), &[5, 6, 7, 1, 9, 5, 6, 7], 5, 8);
        assert_eq!(s.source, Some(DraftSource::Ngram));
        assert_eq!(d[0], 1);
        let tokens = [1, 2, 1, 2];
        let mut plain = SeqSpec::new(true, None);
        assert_eq!(plain.propose(&on(), &tokens, 3, 8)[0], 1);
        assert_eq!(plain.source, Some(DraftSource::Ngram));
    }

    #[test]
    fn drafts_respect_the_limit_and_the_switches() {
        let tokens = [1, 2, 1, 2, 1, 2, 1];
        let mut s = SeqSpec::new(true, None);
        let fixed = SpecConfig {
            depth: Some(6),
            ..on()
        };
        assert_eq!(s.propose(&fixed, &tokens, 1, 3).len(), 3);
        let mut off = SeqSpec::new(false, None);
        assert!(off.propose(&fixed, &tokens, 1, 3).is_empty());
        let server_off = SpecConfig {
            mode: SpecMode::Off,
            ..fixed
        };
        assert!(s.propose(&server_off, &tokens, 1, 3).is_empty());
    }
}
