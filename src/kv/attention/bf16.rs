//! The weighted values of a block of attention with AVX-512 BF16 (`vdpbf16ps`): each
//! instruction multiplies 16 pairs of bf16 values and adds both products to 16 f32 sums, twice
//! the multiply-adds of an f32 FMA, at the cost of rounding the softmax weights and V to bf16 (8
//! significant bits; the sums stay f32). The weights lie in [0, 1] and their rounding errors are
//! independent, so the output moves by about 2^-9 of its size. The scores stay f32 (see
//! `scores` in the parent module): there, rounding Q and K moves large logits too far.
//!
//! `vdpbf16ps` pairs adjacent bf16 values, so the operands are stored as pairs along the keys
//! being summed over: V is packed `[key / 2][d]` as (`v[key][d]`, `v[key + 1][d]`) pairs, and
//! each lane's weights are a bf16 row whose pairs are broadcast.
//!
//! A lane's arithmetic is the same whichever lanes share a call (weights past a lane's visible
//! keys are exact zeros, so the keys another lane adds contribute nothing), which keeps rows
//! bit-identical across batches.

use std::arch::x86_64::*;

/// Whether this CPU runs the kernels (AVX-512 F/BW and BF16).
pub fn is_supported() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512bf16")
}

/// Lanes one `accumulate` call handles (as the f32 microkernels).
pub const MAX_LANES: usize = 8;

/// `_mm512_permutexvar_epi16` indices that interleave the two halves of a
/// `_mm512_cvtne2ps_pbh(b, a)` result into (a[i], b[i]) pairs.
const INTERLEAVE: [u16; 32] = {
    let mut idx = [0u16; 32];
    let mut i = 0;
    while i < 16 {
        idx[2 * i] = i as u16;
        idx[2 * i + 1] = (i + 16) as u16;
        i += 1;
    }
    idx
};

/// `out[i] = (bf16(a[i]), bf16(b[i]))` for `i < n` (a multiple of 16), as 32-bit pairs.
///
/// # Safety
/// The CPU must support the kernels; `a`, `b` hold `n` floats and `out` `n` pairs.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub unsafe fn pack_pairs(a: *const f32, b: *const f32, n: usize, out: *mut u32) {
    let idx = _mm512_loadu_si512(INTERLEAVE.as_ptr().cast());
    for i in (0..n).step_by(16) {
        let halves = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(b.add(i)), _mm512_loadu_ps(a.add(i)));
        let pairs = _mm512_permutexvar_epi16(idx, std::mem::transmute::<__m512bh, __m512i>(halves));
        _mm512_storeu_si512(out.add(i).cast(), pairs);
    }
}

/// One lane's online-softmax step over a block, for the bf16 products: with
/// `m = max(running_max, max(row[..visible]))`, writes `bf16(exp(row[j] - m))` to `out[j]` for
/// `j < visible` and 0 up to `n` (a multiple of 16), and returns `(m, Σ exp(row[j] - m))` summed
/// in f32. The exponential is a degree-4 polynomial of 2^f (relative error under 5e-5, far below
/// the bf16 rounding of the weights that follows). `visible` must be at least 1.
///
/// # Safety
/// The CPU must support the kernels; `row` holds `visible` floats and `out` `n` values.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub unsafe fn softmax_to_bf16(
    row: *const f32,
    visible: usize,
    n: usize,
    running_max: f32,
    out: *mut u16,
) -> (f32, f32) {
    let neg_inf = _mm512_set1_ps(f32::NEG_INFINITY);
    let mut mv = neg_inf;
    for j in (0..visible).step_by(16) {
        let x = _mm512_mask_loadu_ps(neg_inf, live(visible, j), row.add(j));
        mv = _mm512_max_ps(mv, x);
    }
    let m = running_max.max(_mm512_reduce_max_ps(mv));
    let log2e = _mm512_set1_ps(std::f32::consts::LOG2_E);
    let m_log2e = _mm512_set1_ps(m * std::f32::consts::LOG2_E);
    let mut total = _mm512_setzero_ps();
    for j in (0..n).step_by(16) {
        let mask = live(visible, j);
        // 2^t with t = (x - m)·log2(e) ≤ 0: 2^round(t) · 2^f, |f| ≤ 1/2.
        let t = _mm512_fmsub_ps(_mm512_maskz_loadu_ps(mask, row.add(j)), log2e, m_log2e);
        let k = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(t);
        let f = _mm512_sub_ps(t, k);
        let mut poly = _mm512_set1_ps(9.618_129e-3);
        for c in [5.550_411e-2, 0.240_226_5, std::f32::consts::LN_2, 1.0] {
            poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(c));
        }
        let e = _mm512_maskz_scalef_ps(mask, poly, k);
        total = _mm512_add_ps(total, e);
        _mm256_storeu_si256(
            out.add(j).cast(),
            std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(e)),
        );
    }
    (m, _mm512_reduce_add_ps(total))
}

/// Mask of the lanes of the 16 starting at `j` that are below `visible`.
#[inline]
fn live(visible: usize, j: usize) -> __mmask16 {
    let n = visible.saturating_sub(j).min(16);
    ((1u32 << n) - 1) as __mmask16
}

/// `o[l * o_stride + d] += Σ_{p < pairs} w[l][p] · v[p][d]` (bf16 pairs) for `lanes` lanes (`w`
/// rows `w_stride` bf16 apart) and `d < o_stride` (a multiple of 16; `v` rows `o_stride` pairs
/// apart).
///
/// # Safety
/// The CPU must support the kernels and every index above must be inside its buffer.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub unsafe fn accumulate(
    w: *const u16,
    w_stride: usize,
    lanes: usize,
    v: *const u32,
    o_stride: usize,
    pairs: usize,
    o: *mut f32,
) {
    debug_assert!((1..=MAX_LANES).contains(&lanes) && o_stride.is_multiple_of(16));
    let mut d = 0;
    while d + 32 <= o_stride {
        by_lanes!(
            lanes,
            accumulate_tile::<_, 2>(w, w_stride, v.add(d), o_stride, pairs, o.add(d))
        );
        d += 32;
    }
    if d < o_stride {
        by_lanes!(
            lanes,
            accumulate_tile::<_, 1>(w, w_stride, v.add(d), o_stride, pairs, o.add(d))
        );
    }
}

/// `L` lanes × `16 · DC` output dimensions, all accumulators in registers.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn accumulate_tile<const L: usize, const DC: usize>(
    w: *const u16,
    w_stride: usize,
    v: *const u32,
    v_stride: usize,
    pairs: usize,
    o: *mut f32,
) {
    let mut acc = [[_mm512_setzero_ps(); DC]; L];
    for (l, acc) in acc.iter_mut().enumerate() {
        for (c, acc) in acc.iter_mut().enumerate() {
            *acc = _mm512_loadu_ps(o.add(l * v_stride + 16 * c));
        }
    }
    for p in 0..pairs {
        let row = v.add(p * v_stride);
        let mut x = [_mm512_setzero_si512(); DC];
        for (c, x) in x.iter_mut().enumerate() {
            *x = _mm512_loadu_si512(row.add(16 * c).cast());
        }
        for (l, acc) in acc.iter_mut().enumerate() {
            let y = bcast_pair(w.add(l * w_stride + 2 * p));
            for c in 0..DC {
                acc[c] =
                    _mm512_dpbf16_ps(acc[c], y, std::mem::transmute::<__m512i, __m512bh>(x[c]));
            }
        }
    }
    for (l, acc) in acc.iter().enumerate() {
        for (c, acc) in acc.iter().enumerate() {
            _mm512_storeu_ps(o.add(l * v_stride + 16 * c), *acc);
        }
    }
}

/// The bf16 pair at `p` in all 16 lanes.
#[inline]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn bcast_pair(p: *const u16) -> __m512bh {
    std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(p.cast::<i32>().read_unaligned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bf16(x: f32) -> f32 {
        half::bf16::from_f32(x).to_f32()
    }

    fn from_bits(b: u16) -> f32 {
        half::bf16::from_bits(b).to_f32()
    }

    #[test]
    fn softmax_weights_and_weighted_values_match_an_f64_reference() {
        if !is_supported() {
            return;
        }
        let val = |i: usize| ((i * 37 % 101) as f32 - 50.0) / 7.0;
        // Two lanes over 6 keys (the second sees 5), head_dim 16 (one vector).
        let (n, hdp) = (16, 16);
        let scores: Vec<f32> = (0..2 * n).map(val).collect();
        let v: Vec<f32> = (0..6 * hdp).map(|i| val(i + 11)).collect(); // [key][d]
        let mut w = vec![0xffffu16; 2 * n];
        let mut state = Vec::new();
        for (lane, visible) in [(0, 6), (1, 5)] {
            let row = &scores[lane * n..];
            let out = w[lane * n..].as_mut_ptr();
            let (m, sum) = unsafe { softmax_to_bf16(row.as_ptr(), visible, n, -1.0, out) };
            let want_m = row[..visible].iter().fold(-1f32, |a, &b| a.max(b));
            assert_eq!(m, want_m);
            let want: Vec<f64> = row[..visible]
                .iter()
                .map(|&x| ((x - m) as f64).exp())
                .collect();
            let want_sum: f64 = want.iter().sum();
            assert!(
                (sum as f64 - want_sum).abs() < 1e-4 * want_sum,
                "{sum} {want_sum}"
            );
            for (j, &bits) in w[lane * n..(lane + 1) * n].iter().enumerate() {
                let got = from_bits(bits) as f64;
                match want.get(j) {
                    Some(&e) => assert!((got - e).abs() <= e / 128.0, "lane {lane} key {j}"),
                    None => assert_eq!(bits, 0, "lane {lane} key {j} is past what it sees"),
                }
            }
            state.push(sum);
        }
        let mut vp = vec![0u32; 3 * hdp];
        let mut o = vec![1f32; 2 * hdp];
        unsafe {
            for p in 0..3 {
                let (a, b) = (v[2 * p * hdp..].as_ptr(), v[(2 * p + 1) * hdp..].as_ptr());
                pack_pairs(a, b, hdp, vp[p * hdp..].as_mut_ptr());
            }
            accumulate(w.as_ptr(), n, 2, vp.as_ptr(), hdp, 3, o.as_mut_ptr());
        }
        for lane in 0..2 {
            for d in 0..hdp {
                let want: f64 = 1.0
                    + (0..6)
                        .map(|j| from_bits(w[lane * n + j]) as f64 * bf16(v[j * hdp + d]) as f64)
                        .sum::<f64>();
                let got = o[lane * hdp + d] as f64;
                assert!(
                    (got - want).abs() < 1e-5 * want.abs().max(1.0),
                    "{lane} {d}"
                );
            }
        }
    }
}
