//! The numeric building blocks shared by every architecture, one tested copy each: RMSNorm,
//! rotary embeddings, SwiGLU and the quantized linear layer. They work on plain row-major f32
//! slices (`[num_rows, width]`) so that the forward pass stays free of tensor-op allocations.

use super::config::RopeStyle;
use crate::kernels::math::exp_nonpositive;
use crate::kernels::{QuantMatrix, Scratch};
use anyhow::Result;
use std::cell::RefCell;

/// `x[r] = x[r] / rms(x[r]) * weight` for every row of width `weight.len()`.
pub fn rms_norm_in_place(x: &mut [f32], weight: &[f32], eps: f32) {
    for row in x.chunks_exact_mut(weight.len()) {
        let mean_sq = sum_of_squares(row) / row.len() as f32;
        let inv = 1.0 / (mean_sq + eps).sqrt();
        for (v, w) in row.iter_mut().zip(weight) {
            *v *= inv * w;
        }
    }
}

/// `Σ v²` in 16 interleaved partial sums (then added in order, then the tail): a loop the
/// compiler vectorises, where one running sum is a chain of dependent adds (~1 µs a 896-wide
/// row; 9 rows × 2 norms × 24 layers made a quarter of a millisecond of a verify step).
fn sum_of_squares(row: &[f32]) -> f32 {
    const LANES: usize = 16;
    let mut partial = [0f32; LANES];
    let chunks = row.chunks_exact(LANES);
    let tail = chunks.remainder();
    for chunk in chunks {
        for (p, v) in partial.iter_mut().zip(chunk) {
            *p += v * v;
        }
    }
    partial.iter().sum::<f32>() + tail.iter().map(|v| v * v).sum::<f32>()
}

/// `out = rms_norm(x)`, leaving `x` untouched.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut Vec<f32>) {
    out.clear();
    out.extend_from_slice(x);
    rms_norm_in_place(out, weight, eps);
}

/// Cosines and sines for each row's position: `[num_rows, head_dim / 2]` each.
pub struct RopeTable {
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
    half: usize,
}

impl RopeTable {
    pub fn new(positions: &[usize], head_dim: usize, theta: f32) -> Self {
        let half = head_dim / 2;
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        for &pos in positions {
            for i in 0..half {
                let freq = theta.powf(-2.0 * i as f32 / head_dim as f32);
                let angle = pos as f32 * freq;
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        Self { cos, sin, half }
    }

    /// Rotates `x`: `[num_rows, num_heads, head_dim]`, row `r` by position `r`'s angles.
    pub fn apply(&self, x: &mut [f32], num_heads: usize, style: RopeStyle) {
        let hd = self.half * 2;
        for (r, row) in x.chunks_exact_mut(num_heads * hd).enumerate() {
            let cos = &self.cos[r * self.half..(r + 1) * self.half];
            let sin = &self.sin[r * self.half..(r + 1) * self.half];
            for head in row.chunks_exact_mut(hd) {
                for i in 0..self.half {
                    let (a, b) = match style {
                        RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                        RopeStyle::Neox => (i, i + self.half),
                    };
                    let (x0, x1) = (head[a], head[b]);
                    head[a] = x0 * cos[i] - x1 * sin[i];
                    head[b] = x0 * sin[i] + x1 * cos[i];
                }
            }
        }
    }
}

/// `gate = silu(gate) * up`, element-wise. Branch-free on [`exp_nonpositive`] so that it
/// vectorises (a libm `expf` call per element was ~3% of a 9-row verify step of the 0.5B, and
/// more of a prefill), and spread over the forward's threads from a few rows up (a 9-row verify
/// step's 43,776 values: 22.7 µs in 16K chunks, 13.9 µs in 4K ones, on two threads).
pub fn silu_mul_in_place(gate: &mut [f32], up: &[f32]) {
    const CHUNK: usize = 4 << 10;
    let run = |gate: &mut [f32], up: &[f32]| {
        for (g, u) in gate.iter_mut().zip(up) {
            *g = silu(*g) * u;
        }
    };
    if gate.len() > CHUNK {
        crate::kernels::team::for_each_chunk_mut(gate, CHUNK, |i, gate| {
            run(gate, &up[i * CHUNK..i * CHUNK + gate.len()])
        });
    } else {
        run(gate, up);
    }
}

/// `g · σ(g)`, with σ taken from `e^{−|g|}` (never overflows).
#[inline(always)]
fn silu(g: f32) -> f32 {
    let e = exp_nonpositive(-g.abs());
    let sigmoid = if g >= 0.0 { 1.0 } else { e } / (1.0 + e);
    g * sigmoid
}

pub fn add_in_place(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// A linear layer `y = x · Wᵀ (+ b)` over quantized weights `W: [out_dim, in_dim]`, computed
/// by mtpx's own kernels (`crate::kernels`): each weight is read from memory once per call
/// whatever the number of rows, which is what makes verify steps cheap.
pub struct Linear {
    weight: QuantMatrix,
    bias: Option<Vec<f32>>,
    pub in_dim: usize,
    pub out_dim: usize,
}

thread_local! {
    /// Activation buffers of the thread running the forward pass (a thread of rayon's pool).
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::new());
}

impl Linear {
    pub fn new(weight: QuantMatrix, bias: Option<Vec<f32>>) -> Self {
        Self {
            in_dim: weight.in_dim(),
            out_dim: weight.out_dim(),
            weight,
            bias,
        }
    }

    /// The packed weights (for a sweep over a model's matrices, say).
    pub fn matrix(&self) -> &QuantMatrix {
        &self.weight
    }

    /// `x`: `[num_rows, in_dim]` → `[num_rows, out_dim]`.
    pub fn forward(&self, x: &[f32]) -> Result<Vec<f32>> {
        let mut y = Vec::new();
        self.forward_into(x, &mut y)?;
        Ok(y)
    }

    /// [`Linear::forward`] into `y`, reusing its allocation.
    pub fn forward_into(&self, x: &[f32], y: &mut Vec<f32>) -> Result<()> {
        let num_rows = x.len() / self.in_dim;
        y.resize(num_rows * self.out_dim, 0.0);
        SCRATCH.with(|s| match s.try_borrow_mut() {
            Ok(mut scratch) => self.weight.matmul(x, y, &mut scratch),
            // This thread is inside another matmul and, waiting for its parallel part, took
            // over a task of another forward (forwards run on rayon's pool): fresh buffers.
            Err(_) => self.weight.matmul(x, y, &mut Scratch::new()),
        });
        if let Some(bias) = &self.bias {
            for row in y.chunks_exact_mut(self.out_dim) {
                add_in_place(row, bias);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_of_constant_row_is_the_weight() {
        let mut x = vec![3.0, 3.0, 3.0, 3.0];
        rms_norm_in_place(&mut x, &[1.0, 2.0, 3.0, 4.0], 0.0);
        assert_eq!(x, vec![1.0, 2.0, 3.0, 4.0]);
    }

    #[test]
    fn rope_rotates_the_pairs_each_style_names() {
        // head_dim 4, position 1, theta 1 → every pair rotates by 1 radian.
        let table = RopeTable::new(&[1], 4, 1.0);
        let (c, s) = (1f32.cos(), 1f32.sin());
        let mut x = vec![1.0, 0.0, 0.0, 0.0];
        table.apply(&mut x, 1, RopeStyle::Interleaved);
        // Pair (0, 1): (1, 0) → (cos, sin).
        assert!((x[0] - c).abs() < 1e-6 && (x[1] - s).abs() < 1e-6 && x[2] == 0.0);
        let mut x = vec![1.0, 0.0, 0.0, 0.0];
        table.apply(&mut x, 1, RopeStyle::Neox);
        // Pair (0, 2): (1, 0) → (cos, sin).
        assert!((x[0] - c).abs() < 1e-6 && (x[2] - s).abs() < 1e-6 && x[1] == 0.0);
    }

    #[test]
    fn rope_at_position_zero_is_identity() {
        let table = RopeTable::new(&[0], 8, 10_000.0);
        let mut x: Vec<f32> = (0..16).map(|i| i as f32).collect();
        let before = x.clone();
        table.apply(&mut x, 2, RopeStyle::Neox);
        assert_eq!(x, before);
    }

    #[test]
    fn silu_matches_definition() {
        let mut g = vec![0.0, 1.0, -2.0];
        silu_mul_in_place(&mut g, &[1.0, 2.0, 3.0]);
        assert_eq!(g[0], 0.0);
        assert!((g[1] - 2.0 / (1.0 + (-1f32).exp())).abs() < 1e-6);
        assert!((g[2] - 3.0 * -2.0 / (1.0 + 2f32.exp())).abs() < 1e-6);
    }

    /// Against f64 `g / (1 + e^{−g})` over ±120 (both tails, where `e^{±g}` leaves f32's
    /// range), serial and split over the pool (more than one chunk of 16K).
    #[test]
    fn silu_matches_f64_on_both_tails_and_in_parallel() {
        let n = 40_000;
        let g: Vec<f32> = (0..n)
            .map(|i| (i as f32 / n as f32 - 0.5) * 240.0)
            .collect();
        let up: Vec<f32> = (0..n).map(|i| 1.0 + (i % 7) as f32 / 4.0).collect();
        let mut out = g.clone();
        silu_mul_in_place(&mut out, &up);
        for i in 0..n {
            let x = g[i] as f64;
            let want = x / (1.0 + (-x).exp()) * up[i] as f64;
            let err = (out[i] as f64 - want).abs();
            assert!(
                err <= 1e-6 * want.abs().max(1e-3),
                "g = {x}: {} vs {want}",
                out[i]
            );
        }
    }
}
