//! The ragged batch a forward pass runs: several sequences, each contributing a run of new
//! tokens at its own position (a prefill chunk, one decode token, or k+1 verify tokens), and
//! each saying which of its rows need logits.

use crate::kv::PageId;
use crate::sampling::{SampleOutput, Sampler, SamplingError};
use std::time::Duration;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutputRows {
    /// No logits (a prefill chunk that is not the prompt's last).
    None,
    /// Logits for the last row only (end of prompt, decode).
    Last,
    /// Logits for every row (speculative verification).
    All,
}

/// One sequence's share of a step.
#[derive(Debug, Clone, Copy)]
pub struct SeqStep<'a> {
    /// The tokens whose K/V this step computes, at positions `start_position..`.
    pub tokens: &'a [u32],
    pub start_position: usize,
    /// The sequence's page table; it must already cover `start_position + tokens.len()`.
    pub page_ids: &'a [PageId],
    pub outputs: OutputRows,
}

/// Which row of the batch an output row came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutputRow {
    /// Index of the sequence in the batch.
    pub seq: usize,
    /// Absolute position of the token whose next-token logits these are.
    pub position: usize,
}

#[derive(Debug, Default)]
pub struct ForwardOutput {
    /// `[rows.len(), vocab_size]`.
    pub logits: Vec<f32>,
    /// `[num batch rows, hidden_size]`: every row's last-layer hidden state before the final
    /// norm (what MTP heads take), in batch order; empty unless asked for.
    pub hidden: Vec<f32>,
    /// First batch row of each sequence, then the total (with `hidden`).
    pub row_starts: Vec<usize>,
    pub rows: Vec<OutputRow>,
    pub vocab_size: usize,
    pub hidden_size: usize,
    /// The rows the worker sampled (see `runner::worker::SampleJob`), and how long that took.
    pub sampled: Vec<Sampled>,
    pub sampling_time: Duration,
    /// Per step with a `PromptLogprobJob` (see `runner::worker`): `(step, one entry per output
    /// row)`, each the scored token's log-probability and the most likely tokens with theirs.
    pub prompt_logprobs: Vec<(usize, Vec<TokenLogprobs>)>,
    /// Per step with an `EmbedJob` (see `runner::embed`): its rows pooled.
    pub pooled: Vec<super::embed::PooledRows>,
}

/// `ln p` of a token (`None` where the row scores nothing) and the most likely tokens with
/// theirs, most likely first.
pub type TokenLogprobs = (Option<f32>, Vec<(u32, f32)>);

/// A sequence's sampler back from the worker with the token it drew from its last output row.
#[derive(Debug)]
pub struct Sampled {
    /// The sequence's index in the step.
    pub step: usize,
    pub sampler: Sampler,
    pub result: Result<SampleOutput, SamplingError>,
}

impl ForwardOutput {
    pub fn logits_row(&self, i: usize) -> &[f32] {
        &self.logits[i * self.vocab_size..(i + 1) * self.vocab_size]
    }

    /// `[num rows of seq, hidden_size]`: batch sequence `seq`'s hidden states, when asked for.
    pub fn hidden_of(&self, seq: usize) -> &[f32] {
        let hs = self.hidden_size;
        &self.hidden[self.row_starts[seq] * hs..self.row_starts[seq + 1] * hs]
    }

    /// Output rows belonging to batch sequence `seq`, in order.
    pub fn rows_of(&self, seq: usize) -> impl Iterator<Item = usize> + '_ {
        self.rows
            .iter()
            .enumerate()
            .filter(move |(_, r)| r.seq == seq)
            .map(|(i, _)| i)
    }
}
