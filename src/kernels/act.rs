//! Activation quantisation: each row of `x` becomes int8 blocks once per matmul, shared by all
//! output rows. One portable implementation serves every dispatch path, so every path sees the
//! same int8 activations (the precondition for bit-identical results across paths).

/// 32 activations as int8 with one scale, for Q8_0 and Q4_1 weights.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ActQ8 {
    /// `x[k] ≈ d · qs[k]`.
    pub qs: [i8; 32],
    pub d: f32,
    /// `Σ qs`.
    pub sum: i32,
    /// `−128 · Σ qs` and `−16 · Σ qs`: where the AVX-512 Q8_0 kernel (weights flipped to
    /// `w + 128`) and the Q5_0 kernels (weights as `u = w + 16`) start a block's integer sum, so
    /// that each row takes one broadcast from memory per block instead of a load, multiply and
    /// move into a vector register.
    pub q8_offset: i32,
    pub q5_offset: i32,
}

/// 256 activations as int8 with one scale (GGUF's Q8_K), for Q4_K and Q6_K weights.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ActQ8K {
    pub qs: [i8; 256],
    pub d: f32,
    /// `−32 · Σ qs` over each 16: Q6_K's `q − 32` offset for each sub-block, what the AVX-512
    /// kernel starts a sub-block's sum from (one broadcast from memory, not a load, shift,
    /// negation and move per sub-block and row).
    pub q6k_offset16: [i32; 16],
    /// `Σ qs` over each 32 (Q4_K sub-blocks); pairs are read as one i32 by `vpdpwssd`.
    pub bsum32: [i16; 8],
    /// `−8 · Σ qs` over each 32: where the AVX-512 Q4_K kernel starts a sub-block's sum, so that
    /// the sum is `Σ (u − 8) · x` (`u` the 4-bit weight), which fits in 16 bits
    /// (|Σ| ≤ 32 · 8 · 127, as `quantize_block` never gives −128) and takes its sub-block scale
    /// in one `vpdpwssd`.
    pub q4k_offset32: [i32; 8],
    /// `Σ qs` over each 16 as i16 (|Σ| ≤ 16 · 127), whose pairs the AVX2 Q6_K kernel reads as
    /// one i32.
    pub bsum16_i16: [i16; 16],
}

impl Default for ActQ8 {
    fn default() -> Self {
        ActQ8 {
            qs: [0; 32],
            d: 0.0,
            sum: 0,
            q8_offset: 0,
            q5_offset: 0,
        }
    }
}

impl Default for ActQ8K {
    fn default() -> Self {
        ActQ8K {
            qs: [0; 256],
            d: 0.0,
            q6k_offset16: [0; 16],
            bsum32: [0; 8],
            q4k_offset32: [0; 8],
            bsum16_i16: [0; 16],
        }
    }
}

/// Below this many activations, quantise on the calling thread.
const PARALLEL_MIN: usize = 1 << 15;

/// Adding 1.5 · 2²³ rounds an |f32| < 2²² to an integer, half to even (the default rounding
/// mode), in plain arithmetic that vectorises; `round_ties_even` would be a libm call.
const ROUND_MAGIC: f32 = 12_582_912.0;

/// Symmetric int8 quantisation of one block: `d = amax / 127`, round half to even.
#[inline(always)]
pub fn quantize_block(x: &[f32], qs: &mut [i8]) -> f32 {
    // |v| as bits orders like |v| for every non-NaN f32, and an integer max vectorises.
    let amax_bits = x.iter().fold(0u32, |m, v| m.max(v.to_bits() & 0x7FFF_FFFF));
    let amax = f32::from_bits(amax_bits);
    if amax == 0.0 {
        qs.fill(0);
        return 0.0;
    }
    let id = 127.0 / amax;
    for (q, v) in qs.iter_mut().zip(x) {
        // In [2²³, 2²⁴) the ulp is 1, so the sum's low mantissa bits are the rounded integer.
        *q = ((v * id + ROUND_MAGIC).to_bits() as i32 - ROUND_MAGIC.to_bits() as i32) as i8;
    }
    amax / 127.0
}

#[inline(always)]
fn q8_blocks(x: &[f32], out: &mut [ActQ8]) {
    for (xb, a) in x.chunks_exact(32).zip(out) {
        a.d = quantize_block(xb, &mut a.qs);
        a.sum = a.qs.iter().map(|&q| q as i32).sum();
        a.q8_offset = -128 * a.sum;
        a.q5_offset = -16 * a.sum;
    }
}

#[inline(always)]
fn q8k_blocks(x: &[f32], out: &mut [ActQ8K]) {
    for (xb, a) in x.chunks_exact(256).zip(out) {
        a.d = quantize_block(xb, &mut a.qs);
        for (s, q) in a.qs.chunks_exact(16).enumerate() {
            let sum: i32 = q.iter().map(|&q| q as i32).sum();
            a.q6k_offset16[s] = -32 * sum;
            a.bsum16_i16[s] = sum as i16;
        }
        for s in 0..8 {
            a.bsum32[s] = a.bsum16_i16[2 * s] + a.bsum16_i16[2 * s + 1];
            a.q4k_offset32[s] = -8 * a.bsum32[s] as i32;
        }
    }
}

/// Compiles `$body` a second time with AVX2 enabled so the loops vectorise; the arithmetic is
/// the same IEEE operations either way, so the quants are identical.
macro_rules! multiversion {
    ($name:ident, $avx2:ident, $body:ident, $act:ty) => {
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2")]
        unsafe fn $avx2(x: &[f32], out: &mut [$act]) {
            $body(x, out)
        }

        fn $name(x: &[f32], out: &mut [$act]) {
            #[cfg(target_arch = "x86_64")]
            if std::is_x86_feature_detected!("avx2") {
                // SAFETY: AVX2 was just detected; the body is safe code.
                return unsafe { $avx2(x, out) };
            }
            $body(x, out)
        }
    };
}

multiversion!(q8_rows, q8_rows_avx2, q8_blocks, ActQ8);
multiversion!(q8k_rows, q8k_rows_avx2, q8k_blocks, ActQ8K);

/// `x`: `[num_rows, in_dim]` → `out`: `[num_rows, in_dim / 32]`.
pub fn quantize_q8(x: &[f32], out: &mut [ActQ8]) {
    if x.len() >= PARALLEL_MIN {
        let per_task = 64;
        super::team::for_each_chunk_mut(out, per_task, |i, out| {
            q8_rows(&x[32 * per_task * i..][..32 * out.len()], out)
        });
    } else {
        q8_rows(x, out);
    }
}

/// `x`: `[num_rows, in_dim]` → `out`: `[num_rows, in_dim / 256]`.
pub fn quantize_q8k(x: &[f32], out: &mut [ActQ8K]) {
    if x.len() >= PARALLEL_MIN {
        let per_task = 8;
        super::team::for_each_chunk_mut(out, per_task, |i, out| {
            q8k_rows(&x[256 * per_task * i..][..256 * out.len()], out)
        });
    } else {
        q8k_rows(x, out);
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
        assert_eq!(a[0].q6k_offset16.iter().sum::<i32>(), -32 * total);
        assert_eq!(
            a[0].bsum16_i16.iter().map(|&s| s as i32).sum::<i32>(),
            total
        );
        assert_eq!(a[0].bsum32.iter().map(|&s| s as i32).sum::<i32>(), total);
    }
}
