//! Speculative decoding: drafters propose tokens, the target verifies them all in one forward
//! pass, and [`verify::verify`] keeps exactly what the target would have produced.
//!
//! Owns: the drafters (context n-gram, Predicted Outputs, a draft model on its own thread with
//! its own KV pages), the verifier, the measured costs that decide whether drafting pays, and
//! each sequence's speculation state ([`SeqSpec`]: the drafters it may use, acceptance by depth,
//! adaptive depth). The scheduler actor calls into it once per step, before planning (drafts
//! become verify rows of the grant) and after the forward (verdicts commit tokens and roll the
//! session back past rejected drafts). Never touches: the target's pages, sessions, the target
//! model — it sees token ids and logits.

pub mod cost;
pub mod depth;
pub mod draft_model;
pub mod drafter_kv;
pub mod mtp;
pub mod ngram;
mod seq;
pub mod verify;

pub use depth::{Acceptance, MAX_DEPTH};
pub use seq::{Proposal, SeqSpec};
pub use verify::{verify, Verdict, Verification};

/// Which drafters the server uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SpecMode {
    /// No speculation.
    #[default]
    Off,
    /// Per step: a predicted output or a context n-gram match of useful length, else the MTP
    /// heads if the model has them, else the draft model if one is loaded, else plain decoding.
    Auto,
    /// Context n-gram lookup (and predicted outputs).
    Ngram,
    /// The model's MTP heads only.
    Mtp,
    /// The draft model (`--draft-model`) only.
    Draft,
}

/// Where a round's drafts came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DraftSource {
    /// The request's Predicted Output.
    Prediction,
    /// Context n-gram lookup.
    Ngram,
    /// A smaller model with the same vocabulary (`--draft-model`).
    DraftModel,
    /// The target model's own MTP (`nextn`) heads.
    Mtp,
}

impl DraftSource {
    pub const ALL: [DraftSource; NUM_SOURCES] = [
        DraftSource::Prediction,
        DraftSource::Ngram,
        DraftSource::DraftModel,
        DraftSource::Mtp,
    ];

    /// The name used by `--speculative`, the request field `speculative` and the metrics.
    pub fn name(self) -> &'static str {
        match self {
            DraftSource::Prediction => "prediction",
            DraftSource::Ngram => "ngram",
            DraftSource::DraftModel => "draft",
            DraftSource::Mtp => "mtp",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|s| s.name() == name)
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// How many drafters exist.
pub const NUM_SOURCES: usize = 4;

/// A set of drafters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DrafterSet(u8);

impl DrafterSet {
    pub const NONE: DrafterSet = DrafterSet(0);

    pub fn only(source: DraftSource) -> Self {
        DrafterSet(1 << source.index())
    }

    pub fn of(sources: &[DraftSource]) -> Self {
        sources.iter().fold(Self::NONE, |s, &d| s.with(d))
    }

    pub fn with(self, source: DraftSource) -> Self {
        DrafterSet(self.0 | (1 << source.index()))
    }

    pub fn contains(self, source: DraftSource) -> bool {
        self.0 & (1 << source.index()) != 0
    }

    pub fn intersect(self, other: DrafterSet) -> Self {
        DrafterSet(self.0 & other.0)
    }

    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    pub fn names(self) -> Vec<&'static str> {
        DraftSource::ALL
            .into_iter()
            .filter(|s| self.contains(*s))
            .map(DraftSource::name)
            .collect()
    }
}

/// What a request asks of speculation (the request field `speculative`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SpecChoice {
    /// Whatever the server runs.
    #[default]
    On,
    /// Plain decoding.
    Off,
    /// Only this drafter (if the server runs it).
    Only(DraftSource),
}

impl From<bool> for SpecChoice {
    fn from(on: bool) -> Self {
        if on {
            SpecChoice::On
        } else {
            SpecChoice::Off
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct SpecConfig {
    pub mode: SpecMode,
    /// A fixed draft depth (always drafted, never paused by the cost guard: for measurements
    /// and tests); `None` adapts it per sequence from measured acceptance and cost.
    pub depth: Option<usize>,
    /// The deepest draft when adapting.
    pub max_depth: usize,
    /// Shortest and longest context suffix the n-gram drafter matches.
    pub min_ngram: usize,
    pub max_ngram: usize,
    /// In `auto` mode with a model drafter loaded, a shorter context match than this defers to
    /// the model drafter.
    pub useful_ngram: usize,
    /// With more decoding sequences than this in a step, decode is no longer memory-bound:
    /// plain batched decoding is used.
    pub max_batch_seqs: usize,
    /// The cost of one extra verify row relative to a one-row decode step (measured at
    /// start-up by the engine when speculation is on).
    pub row_cost: f64,
    /// One draft-model forward relative to a one-row target decode step (measured at start-up,
    /// then kept up to date by the scheduler from the steps it times).
    pub draft_cost: f64,
    /// One MTP module's forward relative to a one-row target decode step: measured at start-up
    /// with an adaptive depth, else estimated from the parameter counts (decode is
    /// memory-bound).
    pub mtp_cost: f64,
    /// Whether a draft model is loaded (set by the engine).
    pub has_draft_model: bool,
    /// Whether the target's MTP heads are loaded (set by the engine).
    pub has_mtp: bool,
}

impl Default for SpecConfig {
    fn default() -> Self {
        Self {
            mode: SpecMode::Off,
            depth: None,
            max_depth: 8,
            min_ngram: 2,
            max_ngram: 16,
            useful_ngram: 3,
            max_batch_seqs: 4,
            row_cost: 0.1,
            draft_cost: 0.5,
            mtp_cost: 0.1,
            has_draft_model: false,
            has_mtp: false,
        }
    }
}

impl SpecConfig {
    pub fn is_on(&self) -> bool {
        !self.drafters().is_empty()
    }

    /// The drafters this server runs: those its mode names that are loaded.
    pub fn drafters(&self) -> DrafterSet {
        use DraftSource::*;
        let loaded = self.loaded();
        let wanted = match self.mode {
            SpecMode::Off => DrafterSet::NONE,
            SpecMode::Auto => DrafterSet::of(&[Prediction, Ngram, DraftModel, Mtp]),
            SpecMode::Ngram => DrafterSet::of(&[Prediction, Ngram]),
            SpecMode::Mtp => DrafterSet::only(Mtp),
            SpecMode::Draft => DrafterSet::only(DraftModel),
        };
        wanted.intersect(loaded)
    }

    /// The drafters this server could run: the context ones and the models it has loaded.
    pub fn loaded(&self) -> DrafterSet {
        let mut set = DrafterSet::of(&[DraftSource::Prediction, DraftSource::Ngram]);
        if self.has_draft_model {
            set = set.with(DraftSource::DraftModel);
        }
        if self.has_mtp {
            set = set.with(DraftSource::Mtp);
        }
        set
    }

    /// The drafters a request may use, or why its choice cannot be honoured.
    pub fn drafters_for(&self, choice: SpecChoice) -> Result<DrafterSet, String> {
        match choice {
            SpecChoice::On => Ok(self.drafters()),
            SpecChoice::Off => Ok(DrafterSet::NONE),
            SpecChoice::Only(source) if !self.loaded().contains(source) => Err(format!(
                "`speculative`: \"{}\" is not available on this server ({})",
                source.name(),
                match source {
                    DraftSource::DraftModel => "it was started without --draft-model",
                    _ => "the model has no MTP heads",
                }
            )),
            SpecChoice::Only(source) => Ok(self.drafters().intersect(DrafterSet::only(source))),
        }
    }
}

/// The speculative-decoding flags of `serve` and the benchmarks.
#[derive(Debug, Clone, clap::Args)]
pub struct SpecArgs {
    /// Speculative decoding: `auto` drafts from a predicted output or a context n-gram match
    /// when there is one, else from the MTP heads or the draft model when loaded; `ngram`,
    /// `mtp` and `draft` use only that drafter; `off` decodes plainly.
    #[arg(long, value_enum, default_value_t = SpecMode::Auto)]
    pub speculative: SpecMode,
    /// A fixed draft depth (default: adapt per sequence from measured acceptance and cost).
    #[arg(long)]
    pub spec_depth: Option<usize>,
    /// The deepest draft when adapting.
    #[arg(long, default_value_t = 8)]
    pub spec_max_depth: usize,
    /// Above this many decoding sequences per step, decode plainly.
    #[arg(long, default_value_t = 4)]
    pub spec_max_batch: usize,
    /// A smaller model with the same vocabulary that drafts for the target (NAME|PATH).
    #[arg(long)]
    pub draft_model: Option<String>,
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

    /// The draft model's file, pulled on first use when it is a known name.
    pub fn draft_model_path(&self) -> anyhow::Result<Option<std::path::PathBuf>> {
        self.draft_model
            .as_deref()
            .map(|name| crate::pull::resolve_model(name, true))
            .transpose()
    }
}

/// Engine-wide draft counters by drafter and depth position.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct SpecCounters {
    /// Verification rounds (steps with drafts) per source.
    pub rounds: [u64; NUM_SOURCES],
    /// Drafts verified at each depth position, per source.
    pub drafted: [[u64; MAX_DEPTH]; NUM_SOURCES],
    /// Drafts accepted at each depth position, per source.
    pub accepted: [[u64; MAX_DEPTH]; NUM_SOURCES],
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
