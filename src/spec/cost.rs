//! The cost of one extra verify row, measured on the running machine: the adaptive depth
//! trades it against expected accepted tokens.

use crate::kv::KvDtype;
use crate::model::Transformer;
use crate::runner::SingleSequence;
use anyhow::Result;
use std::time::{Duration, Instant};

/// Rows of the verify step timed against a one-row decode step.
const VERIFY_ROWS: usize = 9;

/// `(t(9 rows) / t(1 row) − 1) / 8`: the cost of an extra row relative to a decode step, from
/// the median of a few steps after a short prefill. Clamped to `0.005..=2`.
pub fn measure_row_cost(model: &Transformer, page_size: usize, dtype: KvDtype) -> Result<f64> {
    let prefill = 32;
    let mut seq = SingleSequence::new(model, prefill + VERIFY_ROWS + 1, page_size, dtype);
    let prompt: Vec<u32> = (0..prefill as u32).collect();
    seq.append(&prompt, prefill, false)?;
    let one = median_step(&mut seq, &[1], prefill)?;
    let many = median_step(&mut seq, &[1; VERIFY_ROWS], prefill)?;
    let ratio = many.as_secs_f64() / one.as_secs_f64().max(1e-9);
    Ok(((ratio - 1.0) / (VERIFY_ROWS - 1) as f64).clamp(0.005, 2.0))
}

fn median_step(seq: &mut SingleSequence, tokens: &[u32], len: usize) -> Result<Duration> {
    let mut times = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        seq.append(tokens, tokens.len(), true)?;
        times.push(t.elapsed());
        seq.truncate(len)?;
    }
    times.sort();
    Ok(times[times.len() / 2])
}
