//! What drafting costs, measured on the running machine: the cost of one extra verify row (at
//! start-up), and for a draft model the time of its forwards and of whole speculative steps
//! against plain ones (online). The adaptive depth trades these against expected accepted
//! tokens; [`DraftModelCosts`] switches the draft model off while it makes decoding slower.

use crate::kv::{KvDtype, KvStorage, PageId};
use crate::model::Transformer;
use crate::runner::batch::{OutputRows, SeqStep};
use crate::runner::SingleSequence;
use anyhow::Result;
use std::time::{Duration, Instant};

/// Rows of the verify step timed against a one-row decode step.
const VERIFY_ROWS: usize = 9;

/// `(t(9 rows) / t(1 row) − 1) / 8`: the cost of an extra row relative to a decode step
/// (`one`: [`measure_step`] of 1 row), from the median of a few steps after a short prefill.
/// Clamped to `0.005..=2`.
pub fn measure_row_cost(
    model: &Transformer,
    page_size: usize,
    dtype: KvDtype,
    one: Duration,
) -> Result<f64> {
    let many = measure_step(model, page_size, dtype, VERIFY_ROWS)?;
    let ratio = many.as_secs_f64() / one.as_secs_f64().max(1e-9);
    Ok(((ratio - 1.0) / (VERIFY_ROWS - 1) as f64).clamp(0.005, 2.0))
}

/// The median time of a step of `rows` rows after a 32-token prefill.
pub fn measure_step(
    model: &Transformer,
    page_size: usize,
    dtype: KvDtype,
    rows: usize,
) -> Result<Duration> {
    let prefill = 32;
    let mut seq = SingleSequence::new(model, prefill + rows + 1, page_size, dtype);
    let prompt: Vec<u32> = (0..prefill as u32).collect();
    seq.append(&prompt, prefill, false)?;
    median_step(&mut seq, &vec![1; rows], prefill)
}

/// The median time of one MTP module step of one row (module 0, after 32 positions): what
/// each MTP draft costs, to compare with [`measure_step`] of the model.
pub fn measure_mtp_step(model: &Transformer, page_size: usize, dtype: KvDtype) -> Result<Duration> {
    let prefill: usize = 32;
    let num_pages = (prefill + 1).div_ceil(page_size);
    let mut kv = KvStorage::new(model.mtp_kv_shape(page_size), dtype, num_pages);
    let page_ids: Vec<PageId> = (0..num_pages as PageId).collect();
    let hidden = vec![0.01f32; prefill * model.config.hidden_size];
    let tokens: Vec<u32> = (0..prefill as u32).collect();
    let step = |tokens, start_position, outputs| SeqStep {
        tokens,
        start_position,
        page_ids: &page_ids,
        outputs,
    };
    model.mtp_forward(0, &[step(&tokens, 0, OutputRows::None)], &hidden, &mut kv)?;
    median_time(|| {
        let one = step(&[1], prefill, OutputRows::Last);
        model.mtp_forward(0, &[one], &hidden[..model.config.hidden_size], &mut kv)?;
        Ok(())
    })
}

fn median_step(seq: &mut SingleSequence, tokens: &[u32], len: usize) -> Result<Duration> {
    median_time(|| {
        seq.step(tokens, true)?;
        seq.truncate(len)?;
        Ok(())
    })
}

/// The median time of 5 runs of `step`.
fn median_time(mut step: impl FnMut() -> Result<()>) -> Result<Duration> {
    let mut times = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        step()?;
        times.push(t.elapsed());
    }
    times.sort();
    Ok(times[times.len() / 2])
}

/// An exponentially weighted moving average.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Ewma {
    value: f64,
    num_samples: u32,
}

impl Ewma {
    const WEIGHT: f64 = 0.2;

    /// Starts at `estimate`, which counts as no sample.
    pub fn new(estimate: f64) -> Self {
        Self {
            value: estimate,
            num_samples: 0,
        }
    }

    pub fn observe(&mut self, x: f64) {
        self.value = if self.num_samples == 0 {
            x
        } else {
            self.value + Self::WEIGHT * (x - self.value)
        };
        self.num_samples = self.num_samples.saturating_add(1);
    }

    pub fn value(&self) -> f64 {
        self.value
    }

    pub fn num_samples(&self) -> u32 {
        self.num_samples
    }
}

/// The draft model's measured costs and the guard that keeps it from making decoding slower
/// than plain: steps that verified draft-model drafts are timed whole (the draft forwards plus
/// the verify forward) per committed token, against plain decode steps per committed token.
/// While drafting is the slower of the two, the draft model is paused for a number of steps
/// (doubling each time it loses again), then tried again — so a change of load or of text is
/// noticed.
#[derive(Debug, Clone, PartialEq)]
pub struct DraftModelCosts {
    /// Seconds per committed token of plain decode steps.
    plain_token_s: Ewma,
    /// Seconds of a plain one-row decode step (the unit of the relative costs).
    plain_step_s: Ewma,
    /// Seconds of one draft-model forward.
    draft_forward_s: Ewma,
    /// Seconds per committed token of steps that verified draft-model drafts.
    spec_token_s: Ewma,
    /// Plain steps left before the draft model is tried again.
    paused_for: u32,
    /// How long the next pause lasts.
    next_pause: u32,
    /// Times the guard paused the draft model.
    pub num_pauses: u32,
}

/// Speculative steps measured before the guard judges.
const MIN_SPEC_STEPS: u32 = 4;
const FIRST_PAUSE: u32 = 32;
const LONGEST_PAUSE: u32 = 2048;

impl DraftModelCosts {
    /// Starts from start-up measurements of a one-row target step and a one-row draft step.
    pub fn new(target_step: Duration, draft_step: Duration) -> Self {
        let t = target_step.as_secs_f64().max(1e-6);
        Self {
            plain_token_s: Ewma::new(t),
            plain_step_s: Ewma::new(t),
            draft_forward_s: Ewma::new(draft_step.as_secs_f64()),
            spec_token_s: Ewma::new(t),
            paused_for: 0,
            next_pause: FIRST_PAUSE,
            num_pauses: 0,
        }
    }

    /// A draft-model forward relative to a one-row target decode step.
    pub fn relative_draft_cost(&self) -> f64 {
        (self.draft_forward_s.value() / self.plain_step_s.value().max(1e-9)).clamp(0.0, 4.0)
    }

    /// Whether the draft model may draft this step.
    pub fn draft_model_ok(&self) -> bool {
        self.paused_for == 0
    }

    /// A step of plain decode rows only (`num_rows` sequences, one token each).
    pub fn observe_plain(&mut self, step: Duration, num_rows: usize) {
        if num_rows == 0 {
            return;
        }
        let s = step.as_secs_f64();
        self.plain_token_s.observe(s / num_rows as f64);
        if num_rows == 1 {
            self.plain_step_s.observe(s);
        }
        self.paused_for = self.paused_for.saturating_sub(1);
    }

    /// A draft-model round of `num_forwards` forwards that took `elapsed` in all.
    pub fn observe_draft_round(&mut self, elapsed: Duration, num_forwards: usize) {
        if num_forwards > 0 {
            self.draft_forward_s
                .observe(elapsed.as_secs_f64() / num_forwards as f64);
        }
    }

    /// A step that verified draft-model drafts: drafting plus verifying took `step` and
    /// committed `num_committed` tokens.
    pub fn observe_speculative(&mut self, step: Duration, num_committed: usize) {
        if num_committed == 0 {
            return;
        }
        self.spec_token_s
            .observe(step.as_secs_f64() / num_committed as f64);
        if self.spec_token_s.num_samples() >= MIN_SPEC_STEPS {
            if self.spec_token_s.value() > self.plain_token_s.value() {
                self.pause();
            } else {
                self.next_pause = FIRST_PAUSE;
            }
        }
    }

    fn pause(&mut self) {
        self.paused_for = self.next_pause;
        self.next_pause = (self.next_pause * 2).min(LONGEST_PAUSE);
        self.num_pauses += 1;
        // Judge afresh when it is tried again.
        self.spec_token_s = Ewma::new(self.plain_token_s.value());
    }

    /// Seconds per committed token: (plain, speculative with the draft model).
    pub fn per_token_s(&self) -> (f64, f64) {
        (self.plain_token_s.value(), self.spec_token_s.value())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(x: u64) -> Duration {
        Duration::from_millis(x)
    }

    #[test]
    fn a_draft_model_slower_than_plain_is_paused_then_tried_again() {
        let mut c = DraftModelCosts::new(ms(50), ms(20));
        assert!(c.draft_model_ok());
        for _ in 0..MIN_SPEC_STEPS {
            // 3 forwards of 20 ms + a 60 ms verify for 2 tokens: 60 ms a token, plain is 50.
            c.observe_draft_round(ms(60), 3);
            c.observe_speculative(ms(120), 2);
        }
        assert!(!c.draft_model_ok());
        assert_eq!(c.num_pauses, 1);
        for _ in 0..FIRST_PAUSE {
            c.observe_plain(ms(50), 1);
        }
        assert!(c.draft_model_ok(), "tried again after the pause");
        for _ in 0..MIN_SPEC_STEPS {
            c.observe_speculative(ms(120), 2);
        }
        assert!(!c.draft_model_ok());
        for _ in 0..FIRST_PAUSE {
            c.observe_plain(ms(50), 1);
        }
        assert!(!c.draft_model_ok(), "the second pause is longer");
    }

    #[test]
    fn a_draft_model_faster_than_plain_keeps_drafting() {
        let mut c = DraftModelCosts::new(ms(50), ms(10));
        for _ in 0..20 {
            c.observe_draft_round(ms(40), 4);
            c.observe_speculative(ms(100), 4);
        }
        assert!(c.draft_model_ok());
        assert!((c.relative_draft_cost() - 0.2).abs() < 1e-9);
        let (plain, spec) = c.per_token_s();
        assert!(spec < plain);
    }
}
