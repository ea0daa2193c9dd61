//! Embeddings: a prompt's hidden states after the model's final norm (what the output
//! projection reads), pooled into one vector. The worker pools each step's rows while the
//! hidden states are at hand; the scheduler adds the steps of a prompt up.

use super::batch::ForwardOutput;
use crate::model::Transformer;

/// How a prompt's per-token hidden states become one vector (llama.cpp's `--pooling`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Pooling {
    /// The mean over every token: the usual choice for a model not trained for embeddings.
    #[default]
    Mean,
    /// The last token's, the only one that has read the whole text in a causal model (how
    /// decoder embedding models such as gte-Qwen2 and Qwen3-Embedding are trained).
    Last,
}

impl std::str::FromStr for Pooling {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "mean" => Ok(Pooling::Mean),
            "last" => Ok(Pooling::Last),
            other => Err(format!("unknown pooling `{other}`: use mean or last")),
        }
    }
}

/// One sequence's rows of a step to pool: rows `skip..` of its share of the batch (the first
/// `skip` were pooled in an earlier step, before a preemption made it compute them again).
/// With [`Pooling::Last`] only the prompt's last row counts; `last_row` is its index in the
/// step's rows, when this step computes it.
#[derive(Debug, Clone)]
pub struct EmbedJob {
    /// The sequence's index in the step.
    pub step: usize,
    pub pooling: Pooling,
    pub skip: usize,
    pub last_row: Option<usize>,
}

/// What a step adds to a sequence's embedding: the sum of its pooled rows after the final
/// norm, and how many rows that is.
#[derive(Debug, Clone, PartialEq)]
pub struct PooledRows {
    pub step: usize,
    pub sum: Vec<f32>,
    pub rows: usize,
}

impl EmbedJob {
    /// Pools the job's rows of `out`, whose `hidden` holds every batch row before the norm.
    pub fn run(&self, out: &ForwardOutput, model: &Transformer) -> PooledRows {
        let hs = out.hidden_size;
        let hidden = out.hidden_of(self.step);
        let rows = match self.pooling {
            Pooling::Mean => self.skip.min(hidden.len() / hs)..hidden.len() / hs,
            Pooling::Last => match self.last_row {
                Some(r) => r..r + 1,
                None => 0..0,
            },
        };
        let mut normed = Vec::new();
        model.final_norm(&hidden[rows.start * hs..rows.end * hs], &mut normed);
        let mut sum = vec![0f32; hs];
        for row in normed.chunks_exact(hs) {
            for (s, v) in sum.iter_mut().zip(row) {
                *s += v;
            }
        }
        PooledRows {
            step: self.step,
            sum,
            rows: rows.len(),
        }
    }
}

/// A sequence's embedding so far: the running sum of its pooled rows and the positions they
/// cover (`0..covered`).
#[derive(Debug, Clone)]
pub struct Pooled {
    pub pooling: Pooling,
    pub sum: Vec<f32>,
    pub rows: usize,
    pub covered: usize,
}

impl Pooled {
    pub fn new(pooling: Pooling) -> Self {
        Self {
            pooling,
            sum: Vec::new(),
            rows: 0,
            covered: 0,
        }
    }

    /// The job for a step computing positions `start..start + num_rows` of a prompt of
    /// `num_prompt` tokens.
    pub fn job(&self, start: usize, num_rows: usize, num_prompt: usize) -> EmbedJob {
        let last = num_prompt - 1;
        EmbedJob {
            step: 0,
            pooling: self.pooling,
            skip: self.covered.saturating_sub(start),
            last_row: (start..start + num_rows)
                .contains(&last)
                .then(|| last - start),
        }
    }

    /// Adds a step's pooled rows, which end at position `end`.
    pub fn add(&mut self, pooled: PooledRows, end: usize) {
        if self.sum.is_empty() {
            self.sum = vec![0.0; pooled.sum.len()];
        }
        for (s, v) in self.sum.iter_mut().zip(&pooled.sum) {
            *s += v;
        }
        self.rows += pooled.rows;
        self.covered = self.covered.max(end);
    }

    /// The pooled vector: the mean of the rows taken (for `Last`, the one row).
    pub fn vector(&self) -> Vec<f32> {
        let n = self.rows.max(1) as f32;
        self.sum.iter().map(|s| s / n).collect()
    }
}

/// `v / |v|` (OpenAI's and Ollama's embeddings have unit length); a zero vector stays zero.
pub fn normalized(v: &[f32]) -> Vec<f32> {
    let norm = v
        .iter()
        .map(|x| (*x as f64) * (*x as f64))
        .sum::<f64>()
        .sqrt();
    if norm == 0.0 {
        return v.to_vec();
    }
    v.iter().map(|x| (*x as f64 / norm) as f32).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_recomputed_prompt_pools_each_position_once() {
        let mut p = Pooled::new(Pooling::Mean);
        // Positions 0..4 pooled, then a preemption: 0..6 computed again in one step.
        let first = p.job(0, 4, 10);
        assert_eq!((first.skip, first.last_row), (0, None));
        p.add(
            PooledRows {
                step: 0,
                sum: vec![4.0, 8.0],
                rows: 4,
            },
            4,
        );
        let again = p.job(0, 6, 10);
        assert_eq!(again.skip, 4);
        p.add(
            PooledRows {
                step: 0,
                sum: vec![2.0, 2.0],
                rows: 2,
            },
            6,
        );
        let last = p.job(6, 4, 10);
        assert_eq!((last.skip, last.last_row), (0, Some(3)));
        p.add(
            PooledRows {
                step: 0,
                sum: vec![4.0, 0.0],
                rows: 4,
            },
            10,
        );
        assert_eq!(p.rows, 10);
        assert_eq!(p.vector(), vec![1.0, 1.0]);
    }

    #[test]
    fn normalized_vectors_have_unit_length() {
        assert_eq!(normalized(&[3.0, 4.0]), vec![0.6, 0.8]);
        assert_eq!(normalized(&[0.0, 0.0]), vec![0.0, 0.0]);
    }

    #[test]
    fn pooling_names_parse() {
        assert_eq!("mean".parse::<Pooling>(), Ok(Pooling::Mean));
        assert_eq!("last".parse::<Pooling>(), Ok(Pooling::Last));
        assert!("cls"
            .parse::<Pooling>()
            .unwrap_err()
            .contains("mean or last"));
    }
}
