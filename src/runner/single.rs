//! One sequence run directly against the model, without the scheduler: used by `mtpx run`,
//! `mtpx bench` and the tests that compare the forward pass against references. Its pages come
//! from a pool like everyone else's, so capacity is still exactly what was allocated.

use super::batch::{OutputRows, SeqStep};
use crate::kv::{KvDtype, KvStorage, PagePool, PageTable};
use crate::model::Transformer;
use anyhow::Result;

pub struct SingleSequence<'m> {
    model: &'m Transformer,
    pool: PagePool,
    pub(super) kv: KvStorage,
    pub(super) table: PageTable,
    pub(super) tokens: Vec<u32>,
    /// The logits buffer [`SingleSequence::step`] hands back to the model each step, as the
    /// model worker does: a fresh 5.5 MB vector for a 9-row step costs page faults that the
    /// engine never pays.
    logits: Vec<f32>,
}

impl<'m> SingleSequence<'m> {
    /// A sequence with room for `max_tokens` positions in pages of `page_size`.
    pub fn new(
        model: &'m Transformer,
        max_tokens: usize,
        page_size: usize,
        dtype: KvDtype,
    ) -> Self {
        let num_pages = max_tokens.div_ceil(page_size);
        Self {
            model,
            pool: PagePool::new(num_pages, page_size),
            kv: super::calibrate::kv_storage(model, page_size, dtype, num_pages),
            table: PageTable::new(),
            tokens: Vec::new(),
            logits: Vec::new(),
        }
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    pub fn kv_bytes(&self) -> usize {
        self.kv.bytes_allocated()
    }

    /// Appends `tokens` in chunks of at most `chunk` and returns the next-token logits of every
    /// appended position when `all_logits`, else of the last one only.
    pub fn append(&mut self, tokens: &[u32], chunk: usize, all_logits: bool) -> Result<Vec<f32>> {
        let mut logits = Vec::new();
        for (i, piece) in tokens.chunks(chunk.max(1)).enumerate() {
            let last = (i + 1) * chunk.max(1) >= tokens.len();
            let outputs = match (all_logits, last) {
                (true, _) => OutputRows::All,
                (false, true) => OutputRows::Last,
                (false, false) => OutputRows::None,
            };
            logits.extend_from_slice(self.forward(piece, outputs)?);
        }
        Ok(logits)
    }

    /// Appends `tokens` in one forward, as one step of the engine does (into a reused logits
    /// buffer), and returns the logits of every appended position when `all_logits`, else of
    /// the last one only.
    pub fn step(&mut self, tokens: &[u32], all_logits: bool) -> Result<&[f32]> {
        let outputs = if all_logits {
            OutputRows::All
        } else {
            OutputRows::Last
        };
        self.forward(tokens, outputs)
    }

    fn forward(&mut self, piece: &[u32], outputs: OutputRows) -> Result<&[f32]> {
        let start = self.table.len();
        self.table.try_grow(piece.len(), &mut self.pool)?;
        let step = SeqStep {
            tokens: piece,
            start_position: start,
            page_ids: self.table.page_ids(),
            outputs,
        };
        let buffer = std::mem::take(&mut self.logits);
        match self
            .model
            .forward_into(&[step], &mut self.kv, false, buffer)
        {
            Ok(out) => {
                self.tokens.extend_from_slice(piece);
                self.logits = out.logits;
                Ok(&self.logits)
            }
            Err(e) => {
                self.table.truncate(start, &mut self.pool)?;
                Err(e)
            }
        }
    }

    /// Fills `num_tokens` more positions with synthetic K/V (no forward pass): what a
    /// benchmark needs to time a step at long context without paying for the prefill.
    pub fn fill_synthetic(&mut self, num_tokens: usize, filler_token: u32) -> Result<()> {
        let start = self.table.len();
        self.table.try_grow(num_tokens, &mut self.pool)?;
        let shape = self.kv.shape();
        let width = shape.num_kv_heads * shape.head_dim;
        let row: Vec<f32> = (0..width)
            .map(|i| ((i * 31 % 17) as f32 - 8.0) / 8.0)
            .collect();
        for pos in start..start + num_tokens {
            let page_id = self.table.page_ids()[pos / shape.page_size];
            for layer in 0..shape.num_layers {
                self.kv
                    .write_token(page_id, pos % shape.page_size, layer, &row, &row);
            }
        }
        self.tokens.resize(start + num_tokens, filler_token);
        Ok(())
    }

    /// Drops positions past `len` (returning emptied pages to the pool).
    pub fn truncate(&mut self, len: usize) -> Result<()> {
        self.table.truncate(len, &mut self.pool)?;
        self.tokens.truncate(len);
        Ok(())
    }
}

/// Index of the largest logit; ties go to the lowest id.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}
