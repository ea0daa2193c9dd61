//! Activation quantisation: each row of `x` becomes int8 blocks once per matmul, shared by all
//! output rows. One portable implementation serves every dispatch path, so every path sees the
//! same int8 activations (the precondition for bit-identical results across paths).

use rayon::prelude::*;

/// 32 activations as int8 with one scale, for Q8_0 and Q4_1 weights.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ActQ8 {
    /// `x[k] ≈ d · qs[k]`.
    pub qs: [i8; 32],
    pub d: f32,
    /// `Σ qs`.
    pub sum: i32,
}

/// 256 activations as int8 with one scale (GGUF's Q8_K), for Q4_K and Q6_K weights.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ActQ8K {
    pub qs: [i8; 256],
    pub d: f32,
    /// `Σ qs` over each 16 (Q6_K sub-blocks).
    pub bsum16: [i32; 16],
    /// `Σ qs` over each 32 (Q4_K sub-blocks); pairs are read as one i32 by `vpdpwssd`.
    pub bsum32: [i16; 8],
}

impl Default for ActQ8 {
    fn default() -> Self {
        ActQ8 {
            qs: [0; 32],
            d: 0.0,
            sum: 0,
        }
    }
}

impl Default for ActQ8K {
    fn default() -> Self {
        ActQ8K {
            qs: [0; 256],
            d: 0.0,
            bsum16: [0; 16],
            bsum32: [0; 8],
        }
    }
}

/// Below this many activations, quantise on the calling thread.
const PARALLEL_MIN: usize = 1 << 15;

/// Symmetric int8 quantisation of one block: `d = amax / 127`, round half to even.
pub fn quantize_block(x: &[f32], qs: &mut [i8]) -> f32 {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    if amax == 0.0 {
        qs.fill(0);
        return 0.0;
    }
    let id = 127.0 / amax;
    for (q, v) in qs.iter_mut().zip(x) {
        *q = (v * id).round_ties_even() as i8;
    }
    amax / 127.0
}

/// `x`: `[num_rows, in_dim]` → `out`: `[num_rows, in_dim / 32]`.
pub fn quantize_q8(x: &[f32], out: &mut [ActQ8]) {
    let run = |(xb, a): (&[f32], &mut ActQ8)| {
        a.d = quantize_block(xb, &mut a.qs);
        a.sum = a.qs.iter().map(|&q| q as i32).sum();
    };
    if x.len() >= PARALLEL_MIN {
        x.par_chunks(32).zip(out.par_iter_mut()).for_each(run);
    } else {
        x.chunks(32).zip(out.iter_mut()).for_each(run);
    }
}

/// `x`: `[num_rows, in_dim]` → `out`: `[num_rows, in_dim / 256]`.
pub fn quantize_q8k(x: &[f32], out: &mut [ActQ8K]) {
    let run = |(xb, a): (&[f32], &mut ActQ8K)| {
        a.d = quantize_block(xb, &mut a.qs);
        for (s, q) in a.qs.chunks_exact(16).enumerate() {
            a.bsum16[s] = q.iter().map(|&q| q as i32).sum();
        }
        for s in 0..8 {
            a.bsum32[s] = (a.bsum16[2 * s] + a.bsum16[2 * s + 1]) as i16;
        }
    };
    if x.len() >= PARALLEL_MIN {
        x.par_chunks(256).zip(out.par_iter_mut()).for_each(run);
    } else {
        x.chunks(256).zip(out.iter_mut()).for_each(run);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_quantisation_hits_plus_minus_127_and_keeps_zero() {
        let x: Vec<f32> = (0..32).map(|i| i as f32 - 16.0).collect();
        let mut q = [0i8; 32];
        let d = quantize_block(&x, &mut q);
        assert_eq!(q[0], -127);
        assert_eq!(q[16], 0);
        assert!((d - 16.0 / 127.0).abs() < 1e-7);
        assert_eq!(quantize_block(&[0.0; 32], &mut q), 0.0);
        assert!(q.iter().all(|&v| v == 0));
    }

    #[test]
    fn q8k_block_sums_match_the_quants() {
        let x: Vec<f32> = (0..256).map(|i| ((i * 37) % 101) as f32 - 50.0).collect();
        let mut a = [ActQ8K::default()];
        quantize_q8k(&x, &mut a);
        let total: i32 = a[0].qs.iter().map(|&q| q as i32).sum();
        assert_eq!(a[0].bsum16.iter().sum::<i32>(), total);
        assert_eq!(a[0].bsum32.iter().map(|&s| s as i32).sum::<i32>(), total);
    }
}
