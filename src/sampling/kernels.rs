//! The numeric loops over a whole row of logits, written so the compiler vectorises them:
//! fixed-width lanes, no branches inside a lane, and a branch-free `exp`.
//!
//! Conventions shared by every sampling step: a logit is *live* when it is `> -inf` (NaN is
//! treated as `-inf`, never chosen); `+inf` counts as `f32::MAX`.

use super::select::Candidate;

/// Lanes per step of the vectorised loops (two AVX or four SSE registers of f32).
const LANES: usize = 8;

/// True when `logit` can be chosen at all.
#[inline(always)]
pub(crate) fn is_live(logit: f32) -> bool {
    logit > f32::NEG_INFINITY
}

/// `+inf` becomes `f32::MAX`; everything else (NaN included) is unchanged.
#[inline(always)]
fn clamp_inf(logit: f32) -> f32 {
    if logit > f32::MAX {
        f32::MAX
    } else {
        logit
    }
}

pub(crate) use crate::kernels::math::exp_nonpositive;

/// The largest live logit (`+inf` as `f32::MAX`), or `None` when none is live.
pub(crate) fn max_live(logits: &[f32]) -> Option<f32> {
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = logits.chunks_exact(LANES);
    let tail = chunks.remainder();
    for chunk in chunks {
        for (m, &l) in lanes.iter_mut().zip(chunk) {
            *m = if l > *m { l } else { *m };
        }
    }
    let max = tail
        .iter()
        .chain(&lanes)
        .fold(f32::NEG_INFINITY, |m, &l| if l > m { l } else { m });
    is_live(max).then(|| clamp_inf(max))
}

/// Index of the largest live logit, the lowest index among equals; `None` if none is live.
pub(crate) fn argmax(logits: &[f32]) -> Option<u32> {
    // Each lane keeps its first maximum; the lanes are then merged by (value, lowest index).
    let mut values = [f32::NEG_INFINITY; LANES];
    let mut indices = [u32::MAX; LANES];
    let chunks = logits.chunks_exact(LANES);
    let tail_start = logits.len() - chunks.remainder().len();
    for (c, chunk) in chunks.enumerate() {
        for j in 0..LANES {
            let better = chunk[j] > values[j];
            values[j] = if better { chunk[j] } else { values[j] };
            indices[j] = if better {
                (c * LANES + j) as u32
            } else {
                indices[j]
            };
        }
    }
    let mut best = (f32::NEG_INFINITY, u32::MAX);
    let tail = logits[tail_start..]
        .iter()
        .enumerate()
        .map(|(i, &l)| (l, (tail_start + i) as u32));
    for (value, index) in values.into_iter().zip(indices).chain(tail) {
        if value > best.0 || (value == best.0 && index < best.1) {
            best = (value, index);
        }
    }
    is_live(best.0).then_some(best.1)
}

/// The softmax of a row at a temperature: `p(l) = e^((l − max) / t) / Σ e^((l_i − max) / t)`.
/// Every step that needs a probability computes it through [`Softmax::prob`], so the same token
/// always gets the same value.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Softmax {
    max: f32,
    inv_t: f32,
    inv_sum: f32,
    sum: f64,
}

impl Softmax {
    /// Over the live logits of a whole row; `None` when none is live.
    pub(crate) fn over_row(logits: &[f32], temperature: f32) -> Option<Self> {
        let max = max_live(logits)?;
        let inv_t = 1.0 / temperature;
        Some(Self::from_sum(
            max,
            inv_t,
            sum_unnormalised(logits, max, inv_t),
        ))
    }

    /// Over a few logits given one by one; `None` when none is live.
    pub(crate) fn over(
        logits: impl Iterator<Item = f32> + Clone,
        temperature: f32,
    ) -> Option<Self> {
        let max = logits
            .clone()
            .fold(f32::NEG_INFINITY, |m, l| if l > m { l } else { m });
        if !is_live(max) {
            return None;
        }
        let (max, inv_t) = (clamp_inf(max), 1.0 / temperature);
        let sum = logits.map(|l| unnormalised(l, max, inv_t) as f64).sum();
        Some(Self::from_sum(max, inv_t, sum))
    }

    fn from_sum(max: f32, inv_t: f32, sum: f64) -> Self {
        Self {
            max,
            inv_t,
            inv_sum: (1.0 / sum) as f32,
            sum,
        }
    }

    /// The probability of a token with this logit.
    #[inline(always)]
    pub(crate) fn prob(&self, logit: f32) -> f32 {
        unnormalised(logit, self.max, self.inv_t) * self.inv_sum
    }

    /// The probability of the most likely token.
    pub(crate) fn max_prob(&self) -> f32 {
        self.inv_sum
    }

    /// `log Σ e^(l / t)`: at temperature 1 the normaliser of the log-probabilities.
    pub(crate) fn log_normaliser(&self) -> f32 {
        (self.max as f64 * self.inv_t as f64 + self.sum.ln()) as f32
    }

    /// `ln p(l)` at temperature 1 (exact in f64 terms, not through the rounded probability).
    pub(crate) fn log_prob(&self, logit: f32) -> f32 {
        clamp_inf(logit) - self.log_normaliser()
    }

    /// Appends to `out`, in id order, every token of `logits` that [`keeps`] at `min_prob`,
    /// with its probability. Uses AVX2 where the CPU has it (same results).
    pub(crate) fn collect_kept(&self, logits: &[f32], min_prob: f32, out: &mut Vec<Candidate>) {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2, checked just above.
            return unsafe { self.collect_kept_avx2(logits, min_prob, out) };
        }
        self.collect_kept_lanes(logits, min_prob, out);
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    fn collect_kept_avx2(&self, logits: &[f32], min_prob: f32, out: &mut Vec<Candidate>) {
        self.collect_kept_lanes(logits, min_prob, out);
    }

    #[inline(always)]
    fn collect_kept_lanes(&self, logits: &[f32], min_prob: f32, out: &mut Vec<Candidate>) {
        let chunks = logits.chunks_exact(LANES);
        let tail_start = logits.len() - chunks.remainder().len();
        for (c, chunk) in chunks.enumerate() {
            let mut probs = [0.0f32; LANES];
            for (p, &l) in probs.iter_mut().zip(chunk) {
                *p = self.prob(l);
            }
            for (j, &value) in probs.iter().enumerate() {
                if keeps(value, min_prob) {
                    out.push(Candidate {
                        id: (c * LANES + j) as u32,
                        value,
                    });
                }
            }
        }
        for (i, &l) in logits.iter().enumerate().skip(tail_start) {
            let value = self.prob(l);
            if keeps(value, min_prob) {
                out.push(Candidate {
                    id: i as u32,
                    value,
                });
            }
        }
    }
}

/// `Σ e^((l − max) · inv_t)` over a row: the one pass over the vocabulary every sampled (not
/// greedy) token pays for. Uses AVX2 where the CPU has it; the arithmetic, and so the result, is
/// the same either way (no fused multiply-add).
fn sum_unnormalised(logits: &[f32], max: f32, inv_t: f32) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, checked just above.
        return unsafe { sum_unnormalised_avx2(logits, max, inv_t) };
    }
    sum_unnormalised_lanes(logits, max, inv_t)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn sum_unnormalised_avx2(logits: &[f32], max: f32, inv_t: f32) -> f64 {
    sum_unnormalised_lanes(logits, max, inv_t)
}

#[inline(always)]
fn sum_unnormalised_lanes(logits: &[f32], max: f32, inv_t: f32) -> f64 {
    // f32 lanes within a block of 256 (each lane adds 32 terms in [0, 1], so its rounding error
    // stays below 2e-6 relative), f64 across blocks.
    let mut total = 0.0f64;
    for block in logits.chunks(32 * LANES) {
        let mut lanes = [0.0f32; LANES];
        let chunks = block.chunks_exact(LANES);
        let tail = chunks.remainder();
        for chunk in chunks {
            for (acc, &l) in lanes.iter_mut().zip(chunk) {
                *acc += unnormalised(l, max, inv_t);
            }
        }
        let block_sum: f32 = tail.iter().map(|&l| unnormalised(l, max, inv_t)).sum();
        total += lanes.iter().map(|&s| s as f64).sum::<f64>() + block_sum as f64;
    }
    total
}

/// Whether a token with probability `p` survives a floor of `min_prob`: tokens whose probability
/// underflowed to 0 never do.
#[inline(always)]
pub(crate) fn keeps(p: f32, min_prob: f32) -> bool {
    p > 0.0 && p >= min_prob
}

#[inline(always)]
fn unnormalised(logit: f32, max: f32, inv_t: f32) -> f32 {
    exp_nonpositive((clamp_inf(logit) - max) * inv_t)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_accurate_over_its_whole_range() {
        let mut worst = 0.0f64;
        for i in 0..=2_000_000 {
            let x = -86.999 * i as f32 / 2_000_000.0;
            let exact = (x as f64).exp();
            worst = worst.max((exp_nonpositive(x) as f64 - exact).abs() / exact);
        }
        assert!(worst < 3e-7, "max relative error {worst:e}");
        assert_eq!(exp_nonpositive(0.0), 1.0);
        for x in [f32::NEG_INFINITY, f32::NAN, -87.5, -1e30] {
            assert_eq!(exp_nonpositive(x), 0.0, "{x}");
        }
    }

    #[test]
    fn argmax_takes_the_lowest_index_among_equal_maxima_across_lanes() {
        let mut row = vec![0.0f32; 37];
        row[13] = 5.0;
        row[29] = 5.0;
        row[3] = 5.0;
        assert_eq!(argmax(&row), Some(3));
        row[36] = f32::INFINITY;
        assert_eq!(argmax(&row), Some(36), "the tail is merged too");
        assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NAN, -5.0]), Some(2));
        assert_eq!(argmax(&[f32::NEG_INFINITY; 20]), None);
        assert_eq!(argmax(&[]), None);
    }

    #[test]
    fn softmax_over_a_row_matches_f64() {
        let row: Vec<f32> = (0..1000)
            .map(|i| ((i * 7919) % 113) as f32 * 0.1 - 5.0)
            .collect();
        for t in [0.3f32, 1.0, 1.7] {
            let softmax = Softmax::over_row(&row, t).unwrap();
            let exps: Vec<f64> = row.iter().map(|&l| (l as f64 / t as f64).exp()).collect();
            let sum: f64 = exps.iter().sum();
            for (&l, e) in row.iter().zip(&exps) {
                // f32 rounding of the scaled logit x costs |x|·6e-8 relative (|x| < 40 here).
                let rel = softmax.prob(l) as f64 / (e / sum) - 1.0;
                assert!(rel.abs() < 5e-6, "t {t} l {l} rel {rel:e}");
            }
            let lse = (row.iter().map(|&l| (l as f64).exp()).sum::<f64>()).ln();
            if t == 1.0 {
                assert!((softmax.log_normaliser() as f64 - lse).abs() < 1e-5);
            }
        }
    }

    #[test]
    fn the_avx2_path_gives_bit_identical_results() {
        let row: Vec<f32> = (0..10_007)
            .map(|i| ((i * 7919) % 4001) as f32 * 0.01 - 20.0)
            .collect();
        let softmax = Softmax::over_row(&row, 0.7).unwrap();
        let (max, inv_t) = (max_live(&row).unwrap(), 1.0 / 0.7);
        let dispatched = sum_unnormalised(&row, max, inv_t);
        assert_eq!(
            dispatched.to_bits(),
            sum_unnormalised_lanes(&row, max, inv_t).to_bits()
        );
        let (mut dispatched, mut portable) = (Vec::new(), Vec::new());
        softmax.collect_kept(&row, 1e-9, &mut dispatched);
        softmax.collect_kept_lanes(&row, 1e-9, &mut portable);
        assert_eq!(dispatched, portable);
    }

    #[test]
    fn infinities_and_nans_follow_the_conventions() {
        let row = [f32::NAN, 1.0, f32::INFINITY, f32::NEG_INFINITY];
        let softmax = Softmax::over_row(&row, 1.0).unwrap();
        assert_eq!(
            (softmax.prob(f32::INFINITY), softmax.prob(f32::NAN)),
            (1.0, 0.0)
        );
        assert_eq!(softmax.prob(f32::NEG_INFINITY), 0.0);
        assert!(Softmax::over_row(&[f32::NAN, f32::NEG_INFINITY], 1.0).is_none());
        let mut kept = Vec::new();
        softmax.collect_kept(&row, 0.0, &mut kept);
        assert_eq!(kept, vec![Candidate { id: 2, value: 1.0 }]);
    }
}
