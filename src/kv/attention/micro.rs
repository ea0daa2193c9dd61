//! The two products of a block of attention, as register-blocked microkernels:
//!
//! - `scores`: `s[lane][j] = Σ_d q[lane][d] · kt[d][j]`, up to [`MAX_LANES`] lanes against keys
//!   in runs of 16 (one SIMD vector of keys per row of K^T; each query element is broadcast);
//! - `accumulate`: `o[lane][..] += Σ_j p[lane][j] · v[j][..]`, the same lanes against rows of V.
//!
//! plus the per-lane online-softmax step and the decoding of a page's transposed K.
//!
//! The portable versions are plain loops; the AVX-512 and AVX2 ones keep every accumulator in a
//! register and use FMA, so results differ between paths in rounding only. On each path a
//! lane's arithmetic is the same whichever other lanes share the call.

use crate::kernels::math::exp_nonpositive;
use crate::kernels::Dispatch;
use crate::kv::storage::HeadRows;

/// Lanes one call handles.
pub const MAX_LANES: usize = 8;

/// `s[l * s_stride + j] = Σ_{d < head_dim} q[l * q_stride + d] · kt[d * kt_stride + j]` for every
/// lane `l < q.len() / q_stride` (at most [`MAX_LANES`]) and `j < keys` (a multiple of 16).
#[allow(clippy::too_many_arguments)]
pub fn scores(
    path: Dispatch,
    q: &[f32],
    q_stride: usize,
    head_dim: usize,
    kt: &[f32],
    kt_stride: usize,
    keys: usize,
    s: &mut [f32],
    s_stride: usize,
) {
    let lanes = q.len() / q_stride;
    assert!((1..=MAX_LANES).contains(&lanes) && q.len() == lanes * q_stride);
    assert!(head_dim <= q_stride && keys.is_multiple_of(16) && keys <= kt_stride);
    assert!(kt.len() >= (head_dim - 1) * kt_stride + keys);
    assert!(keys <= s_stride && s.len() >= (lanes - 1) * s_stride + keys);
    match path {
        #[cfg(target_arch = "x86_64")]
        Dispatch::Avx512 => {
            // SAFETY: the asserts above bound every read and write; the caller checked the path.
            unsafe {
                avx512::scores(
                    q, q_stride, lanes, head_dim, kt, kt_stride, keys, s, s_stride,
                )
            }
        }
        #[cfg(target_arch = "x86_64")]
        Dispatch::Avx2 => {
            // SAFETY: as above.
            unsafe {
                avx2::scores(
                    q, q_stride, lanes, head_dim, kt, kt_stride, keys, s, s_stride,
                )
            }
        }
        _ => scores_portable(
            q, q_stride, lanes, head_dim, kt, kt_stride, keys, s, s_stride,
        ),
    }
}

/// `o[l * o_stride + d] += Σ_{j < keys} p[l * p_stride + j] · v[j * o_stride + d]` for every lane
/// `l < o.len() / o_stride` (at most [`MAX_LANES`]) and `d < o_stride` (a multiple of 16).
pub fn accumulate(
    path: Dispatch,
    p: &[f32],
    p_stride: usize,
    v: &[f32],
    o_stride: usize,
    keys: usize,
    o: &mut [f32],
) {
    let lanes = o.len() / o_stride;
    assert!((1..=MAX_LANES).contains(&lanes) && o.len() == lanes * o_stride);
    assert!(o_stride.is_multiple_of(16) && v.len() >= keys * o_stride);
    assert!(keys <= p_stride && p.len() >= (lanes - 1) * p_stride + keys);
    match path {
        #[cfg(target_arch = "x86_64")]
        Dispatch::Avx512 => {
            // SAFETY: the asserts above bound every read and write; the caller checked the path.
            unsafe { avx512::accumulate(p, p_stride, lanes, v, o_stride, keys, o) }
        }
        #[cfg(target_arch = "x86_64")]
        Dispatch::Avx2 => {
            // SAFETY: as above.
            unsafe { avx2::accumulate(p, p_stride, lanes, v, o_stride, keys, o) }
        }
        _ => accumulate_portable(p, p_stride, lanes, v, o_stride, keys, o),
    }
}

/// K: the first `num_slots` slots of every row of a transposed page block into
/// `out[d * out_stride..][..num_slots]` (see [`HeadRows::decode_columns`]).
pub fn decode_columns(
    path: Dispatch,
    rows: &HeadRows,
    num_slots: usize,
    head_dim: usize,
    out: &mut [f32],
    out_stride: usize,
) {
    let page_size = rows.len() / head_dim;
    assert!(num_slots <= page_size && num_slots <= out_stride);
    assert!(out.len() >= (head_dim - 1) * out_stride + num_slots);
    match path {
        #[cfg(target_arch = "x86_64")]
        Dispatch::Avx512 if !matches!(rows, HeadRows::F32(_)) => {
            // SAFETY: the asserts above bound every read and write; the caller checked the path.
            unsafe { avx512::decode_columns(rows, page_size, num_slots, head_dim, out, out_stride) }
        }
        #[cfg(target_arch = "x86_64")]
        Dispatch::Avx2 if !matches!(rows, HeadRows::F32(_)) => {
            // SAFETY: as above.
            unsafe { avx2::decode_columns(rows, page_size, num_slots, head_dim, out, out_stride) }
        }
        _ => rows.decode_columns(num_slots, head_dim, out, out_stride),
    }
}

/// One lane's online-softmax step over a block: with `m = max(running_max, max(row))`,
/// replaces `row` by `exp(row - m)` and returns `(m, Σ row)`. `row` must not be empty.
pub fn softmax(path: Dispatch, row: &mut [f32], running_max: f32) -> (f32, f32) {
    assert!(!row.is_empty());
    match path {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the caller checked the path; the kernel stays inside `row`.
        Dispatch::Avx512 => unsafe { avx512::softmax(row, running_max) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Dispatch::Avx2 => unsafe { avx2::softmax(row, running_max) },
        _ => softmax_portable(row, running_max),
    }
}

fn softmax_portable(row: &mut [f32], running_max: f32) -> (f32, f32) {
    let m = running_max.max(max(row));
    // A separate pass so the branch-free exp vectorises.
    for x in row.iter_mut() {
        *x = exp_nonpositive(*x - m);
    }
    (m, sum(row))
}

#[inline]
fn max(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 16];
    let mut chunks = x.chunks_exact(16);
    for c in &mut chunks {
        for i in 0..16 {
            acc[i] = acc[i].max(c[i]);
        }
    }
    for (a, &t) in acc.iter_mut().zip(chunks.remainder()) {
        *a = a.max(t);
    }
    // A tree, not a chain: the halves fold into each other as vectors.
    for width in [8, 4, 2, 1] {
        for i in 0..width {
            acc[i] = acc[i].max(acc[i + width]);
        }
    }
    acc[0]
}

#[inline]
fn sum(x: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let mut chunks = x.chunks_exact(16);
    for c in &mut chunks {
        for i in 0..16 {
            acc[i] += c[i];
        }
    }
    for (a, &t) in acc.iter_mut().zip(chunks.remainder()) {
        *a += t;
    }
    for width in [8, 4, 2, 1] {
        for i in 0..width {
            acc[i] += acc[i + width];
        }
    }
    acc[0]
}

/// Lanes of one portable tile: 4 × 16 accumulators fit the vector registers of most targets.
const PORTABLE_LANES: usize = 4;

#[allow(clippy::too_many_arguments)]
fn scores_portable(
    q: &[f32],
    q_stride: usize,
    lanes: usize,
    head_dim: usize,
    kt: &[f32],
    kt_stride: usize,
    keys: usize,
    s: &mut [f32],
    s_stride: usize,
) {
    for l0 in (0..lanes).step_by(PORTABLE_LANES) {
        let n = (lanes - l0).min(PORTABLE_LANES);
        for j0 in (0..keys).step_by(16) {
            let mut acc = [[0f32; 16]; PORTABLE_LANES];
            for d in 0..head_dim {
                let k: &[f32; 16] = kt[d * kt_stride + j0..][..16].try_into().unwrap();
                for (l, acc) in acc.iter_mut().enumerate().take(n) {
                    let x = q[(l0 + l) * q_stride + d];
                    for t in 0..16 {
                        acc[t] += x * k[t];
                    }
                }
            }
            for (l, acc) in acc.iter().enumerate().take(n) {
                s[(l0 + l) * s_stride + j0..][..16].copy_from_slice(acc);
            }
        }
    }
}

fn accumulate_portable(
    p: &[f32],
    p_stride: usize,
    lanes: usize,
    v: &[f32],
    o_stride: usize,
    keys: usize,
    o: &mut [f32],
) {
    for l0 in (0..lanes).step_by(PORTABLE_LANES) {
        let n = (lanes - l0).min(PORTABLE_LANES);
        for d0 in (0..o_stride).step_by(16) {
            let mut acc = [[0f32; 16]; PORTABLE_LANES];
            for (l, acc) in acc.iter_mut().enumerate().take(n) {
                acc.copy_from_slice(&o[(l0 + l) * o_stride + d0..][..16]);
            }
            for j in 0..keys {
                let x: &[f32; 16] = v[j * o_stride + d0..][..16].try_into().unwrap();
                for (l, acc) in acc.iter_mut().enumerate().take(n) {
                    let w = p[(l0 + l) * p_stride + j];
                    for t in 0..16 {
                        acc[t] += w * x[t];
                    }
                }
            }
            for (l, acc) in acc.iter().enumerate().take(n) {
                o[(l0 + l) * o_stride + d0..][..16].copy_from_slice(acc);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use crate::kv::storage::HeadRows;
    use std::arch::x86_64::*;

    /// `exp_nonpositive` on 16 lanes (the same Cephes reduction and polynomial, with FMA):
    /// 0 below −87 and for NaN, positive inputs treated as 0.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn exp16(x: __m512) -> __m512 {
        const MAGIC: f32 = 12_582_912.0;
        let live = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(x, _mm512_set1_ps(-87.0));
        let x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0)), _mm512_setzero_ps());
        let magic = _mm512_set1_ps(MAGIC);
        let shifted = _mm512_fmadd_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E), magic);
        let n = _mm512_sub_ps(shifted, magic);
        let n_bits = _mm512_sub_epi32(_mm512_castps_si512(shifted), _mm512_castps_si512(magic));
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_359_4), x);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.121_944_4e-4), r);
        let mut poly = _mm512_set1_ps(1.987_569_2e-4);
        for c in [
            1.398_199_9e-3,
            8.333_452e-3,
            4.166_579_6e-2,
            1.666_666_5e-1,
            0.5,
        ] {
            poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(c));
        }
        let e_r = _mm512_fmadd_ps(
            poly,
            _mm512_mul_ps(r, r),
            _mm512_add_ps(r, _mm512_set1_ps(1.0)),
        );
        let scale = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(
            n_bits,
            _mm512_set1_epi32(127),
        )));
        _mm512_maskz_mul_ps(live, e_r, scale)
    }

    #[target_feature(enable = "avx512f")]
    pub unsafe fn softmax(row: &mut [f32], running_max: f32) -> (f32, f32) {
        let (p, n) = (row.as_mut_ptr(), row.len());
        let neg_inf = _mm512_set1_ps(f32::NEG_INFINITY);
        let mut m = neg_inf;
        for j in (0..n).step_by(16) {
            let x = _mm512_mask_loadu_ps(neg_inf, first((n - j).min(16)), p.add(j));
            m = _mm512_max_ps(m, x);
        }
        let m = running_max.max(_mm512_reduce_max_ps(m));
        let mv = _mm512_set1_ps(m);
        let mut total = _mm512_setzero_ps();
        for j in (0..n).step_by(16) {
            let mask = first((n - j).min(16));
            let e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, p.add(j)), mv));
            let e = _mm512_maskz_mov_ps(mask, e);
            _mm512_mask_storeu_ps(p.add(j), mask, e);
            total = _mm512_add_ps(total, e);
        }
        (m, _mm512_reduce_add_ps(total))
    }

    /// Mask of the first `n` (≤ 16) lanes.
    #[inline]
    fn first(n: usize) -> __mmask16 {
        ((1u32 << n) - 1) as __mmask16
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
    pub unsafe fn decode_columns(
        rows: &HeadRows,
        page_size: usize,
        num_slots: usize,
        head_dim: usize,
        out: &mut [f32],
        out_stride: usize,
    ) {
        let out = out.as_mut_ptr();
        match *rows {
            HeadRows::F16(src) => {
                let src = src.as_ptr().cast::<u16>();
                for d in 0..head_dim {
                    let (s, o) = (src.add(d * page_size), out.add(d * out_stride));
                    let mut j = 0;
                    while j + 16 <= num_slots {
                        let h = _mm256_loadu_si256(s.add(j).cast());
                        _mm512_storeu_ps(o.add(j), _mm512_cvtph_ps(h));
                        j += 16;
                    }
                    if j < num_slots {
                        let m = first(num_slots - j);
                        let h = _mm256_maskz_loadu_epi16(m, s.add(j).cast());
                        _mm512_mask_storeu_ps(o.add(j), m, _mm512_cvtph_ps(h));
                    }
                }
            }
            HeadRows::Q8 { values, scales } => {
                let (src, scales) = (values.as_ptr(), scales.as_ptr());
                for j in (0..num_slots).step_by(16) {
                    let m = first((num_slots - j).min(16));
                    let scale = _mm512_maskz_loadu_ps(m, scales.add(j));
                    for d in 0..head_dim {
                        let q = _mm_maskz_loadu_epi8(m, src.add(d * page_size + j).cast());
                        let x = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
                        _mm512_mask_storeu_ps(
                            out.add(d * out_stride + j),
                            m,
                            _mm512_mul_ps(x, scale),
                        );
                    }
                }
            }
            HeadRows::F32(_) => unreachable!("f32 columns are copied"),
        }
    }

    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn scores(
        q: &[f32],
        q_stride: usize,
        lanes: usize,
        head_dim: usize,
        kt: &[f32],
        kt_stride: usize,
        keys: usize,
        s: &mut [f32],
        s_stride: usize,
    ) {
        let (q, kt, s) = (q.as_ptr(), kt.as_ptr(), s.as_mut_ptr());
        by_tiles!(lanes, keys, j => scores_tile(
            q, q_stride, head_dim, kt.add(j), kt_stride, s.add(j), s_stride
        ));
    }

    /// `L` lanes × `16 · KC` keys, all accumulators in registers.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn scores_tile<const L: usize, const KC: usize>(
        q: *const f32,
        q_stride: usize,
        head_dim: usize,
        kt: *const f32,
        kt_stride: usize,
        s: *mut f32,
        s_stride: usize,
    ) {
        let mut acc = [[_mm512_setzero_ps(); KC]; L];
        for d in 0..head_dim {
            let row = kt.add(d * kt_stride);
            let mut k = [_mm512_setzero_ps(); KC];
            for (c, k) in k.iter_mut().enumerate() {
                *k = _mm512_loadu_ps(row.add(16 * c));
            }
            for (l, acc) in acc.iter_mut().enumerate() {
                let x = _mm512_set1_ps(*q.add(l * q_stride + d));
                for c in 0..KC {
                    acc[c] = _mm512_fmadd_ps(x, k[c], acc[c]);
                }
            }
        }
        for (l, acc) in acc.iter().enumerate() {
            for (c, acc) in acc.iter().enumerate() {
                _mm512_storeu_ps(s.add(l * s_stride + 16 * c), *acc);
            }
        }
    }

    #[target_feature(enable = "avx512f")]
    pub unsafe fn accumulate(
        p: &[f32],
        p_stride: usize,
        lanes: usize,
        v: &[f32],
        o_stride: usize,
        keys: usize,
        o: &mut [f32],
    ) {
        let (p, v, o) = (p.as_ptr(), v.as_ptr(), o.as_mut_ptr());
        by_tiles!(lanes, o_stride, d => accumulate_tile(
            p, p_stride, v.add(d), o_stride, keys, o.add(d)
        ));
    }

    /// `L` lanes × `16 · DC` output dimensions, all accumulators in registers.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn accumulate_tile<const L: usize, const DC: usize>(
        p: *const f32,
        p_stride: usize,
        v: *const f32,
        v_stride: usize,
        keys: usize,
        o: *mut f32,
    ) {
        let mut acc = [[_mm512_setzero_ps(); DC]; L];
        for (l, acc) in acc.iter_mut().enumerate() {
            for (c, acc) in acc.iter_mut().enumerate() {
                *acc = _mm512_loadu_ps(o.add(l * v_stride + 16 * c));
            }
        }
        for j in 0..keys {
            let row = v.add(j * v_stride);
            let mut x = [_mm512_setzero_ps(); DC];
            for (c, x) in x.iter_mut().enumerate() {
                *x = _mm512_loadu_ps(row.add(16 * c));
            }
            for (l, acc) in acc.iter_mut().enumerate() {
                let w = _mm512_set1_ps(*p.add(l * p_stride + j));
                for c in 0..DC {
                    acc[c] = _mm512_fmadd_ps(w, x[c], acc[c]);
                }
            }
        }
        for (l, acc) in acc.iter().enumerate() {
            for (c, acc) in acc.iter().enumerate() {
                _mm512_storeu_ps(o.add(l * v_stride + 16 * c), *acc);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! The same tiles in 8-lane vectors: 16 ymm registers hold at most 4 lanes × 16 keys (or
    //! 16 output dimensions) of accumulators, so a call's lanes go 4 at a time.
    use crate::kv::storage::HeadRows;
    use half::slice::HalfFloatSliceExt;
    use std::arch::x86_64::*;

    const LANES: usize = 4;

    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn scores(
        q: &[f32],
        q_stride: usize,
        lanes: usize,
        head_dim: usize,
        kt: &[f32],
        kt_stride: usize,
        keys: usize,
        s: &mut [f32],
        s_stride: usize,
    ) {
        let (q, kt, s) = (q.as_ptr(), kt.as_ptr(), s.as_mut_ptr());
        for l0 in (0..lanes).step_by(LANES) {
            let (q, s) = (q.add(l0 * q_stride), s.add(l0 * s_stride));
            for j in (0..keys).step_by(16) {
                let n = (lanes - l0).min(LANES);
                by_lanes4!(
                    n,
                    scores_tile(
                        q,
                        q_stride,
                        head_dim,
                        kt.add(j),
                        kt_stride,
                        s.add(j),
                        s_stride
                    )
                );
            }
        }
    }

    /// `L` lanes × 16 keys.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn scores_tile<const L: usize>(
        q: *const f32,
        q_stride: usize,
        head_dim: usize,
        kt: *const f32,
        kt_stride: usize,
        s: *mut f32,
        s_stride: usize,
    ) {
        let mut acc = [[_mm256_setzero_ps(); 2]; L];
        for d in 0..head_dim {
            let row = kt.add(d * kt_stride);
            let k = [_mm256_loadu_ps(row), _mm256_loadu_ps(row.add(8))];
            for (l, acc) in acc.iter_mut().enumerate() {
                let x = _mm256_broadcast_ss(&*q.add(l * q_stride + d));
                acc[0] = _mm256_fmadd_ps(x, k[0], acc[0]);
                acc[1] = _mm256_fmadd_ps(x, k[1], acc[1]);
            }
        }
        for (l, acc) in acc.iter().enumerate() {
            _mm256_storeu_ps(s.add(l * s_stride), acc[0]);
            _mm256_storeu_ps(s.add(l * s_stride + 8), acc[1]);
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn accumulate(
        p: &[f32],
        p_stride: usize,
        lanes: usize,
        v: &[f32],
        o_stride: usize,
        keys: usize,
        o: &mut [f32],
    ) {
        let (p, v, o) = (p.as_ptr(), v.as_ptr(), o.as_mut_ptr());
        for l0 in (0..lanes).step_by(LANES) {
            let (p, o) = (p.add(l0 * p_stride), o.add(l0 * o_stride));
            for d in (0..o_stride).step_by(16) {
                let n = (lanes - l0).min(LANES);
                by_lanes4!(
                    n,
                    accumulate_tile(p, p_stride, v.add(d), o_stride, keys, o.add(d))
                );
            }
        }
    }

    /// `L` lanes × 16 output dimensions.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn accumulate_tile<const L: usize>(
        p: *const f32,
        p_stride: usize,
        v: *const f32,
        v_stride: usize,
        keys: usize,
        o: *mut f32,
    ) {
        let mut acc = [[_mm256_setzero_ps(); 2]; L];
        for (l, acc) in acc.iter_mut().enumerate() {
            acc[0] = _mm256_loadu_ps(o.add(l * v_stride));
            acc[1] = _mm256_loadu_ps(o.add(l * v_stride + 8));
        }
        for j in 0..keys {
            let row = v.add(j * v_stride);
            let x = [_mm256_loadu_ps(row), _mm256_loadu_ps(row.add(8))];
            for (l, acc) in acc.iter_mut().enumerate() {
                let w = _mm256_broadcast_ss(&*p.add(l * p_stride + j));
                acc[0] = _mm256_fmadd_ps(w, x[0], acc[0]);
                acc[1] = _mm256_fmadd_ps(w, x[1], acc[1]);
            }
        }
        for (l, acc) in acc.iter().enumerate() {
            _mm256_storeu_ps(o.add(l * v_stride), acc[0]);
            _mm256_storeu_ps(o.add(l * v_stride + 8), acc[1]);
        }
    }

    /// `exp_nonpositive` on 8 lanes (see the AVX-512 `exp16`).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn exp8(x: __m256) -> __m256 {
        const MAGIC: f32 = 12_582_912.0;
        let live = _mm256_cmp_ps::<_CMP_GT_OQ>(x, _mm256_set1_ps(-87.0));
        let x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0)), _mm256_setzero_ps());
        let magic = _mm256_set1_ps(MAGIC);
        let shifted = _mm256_fmadd_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E), magic);
        let n = _mm256_sub_ps(shifted, magic);
        let n_bits = _mm256_sub_epi32(_mm256_castps_si256(shifted), _mm256_castps_si256(magic));
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
        let mut poly = _mm256_set1_ps(1.987_569_2e-4);
        for c in [
            1.398_199_9e-3,
            8.333_452e-3,
            4.166_579_6e-2,
            1.666_666_5e-1,
            0.5,
        ] {
            poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(c));
        }
        let e_r = _mm256_fmadd_ps(
            poly,
            _mm256_mul_ps(r, r),
            _mm256_add_ps(r, _mm256_set1_ps(1.0)),
        );
        let scale = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
            n_bits,
            _mm256_set1_epi32(127),
        )));
        _mm256_and_ps(live, _mm256_mul_ps(e_r, scale))
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    fn reduce(v: __m256, op: impl Fn(__m128, __m128) -> __m128) -> f32 {
        let x = op(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let x = op(x, _mm_movehl_ps(x, x));
        let x = op(x, _mm_movehdup_ps(x));
        _mm_cvtss_f32(x)
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn softmax(row: &mut [f32], running_max: f32) -> (f32, f32) {
        let n = row.len();
        let whole = n / 8 * 8;
        // The tail goes through a padded copy: −inf scores weigh 0.
        let mut tail = [f32::NEG_INFINITY; 8];
        tail[..n - whole].copy_from_slice(&row[whole..]);
        let p = row.as_mut_ptr();
        let mut m = _mm256_loadu_ps(tail.as_ptr());
        for j in (0..whole).step_by(8) {
            m = _mm256_max_ps(m, _mm256_loadu_ps(p.add(j)));
        }
        let m = running_max.max(reduce(m, |a, b| _mm_max_ps(a, b)));
        let mv = _mm256_set1_ps(m);
        let mut total = _mm256_setzero_ps();
        for j in (0..whole).step_by(8) {
            let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p.add(j)), mv));
            _mm256_storeu_ps(p.add(j), e);
            total = _mm256_add_ps(total, e);
        }
        if whole < n {
            let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(tail.as_ptr()), mv));
            _mm256_storeu_ps(tail.as_mut_ptr(), e);
            row[whole..].copy_from_slice(&tail[..n - whole]);
            total = _mm256_add_ps(total, e);
        }
        (m, reduce(total, |a, b| _mm_add_ps(a, b)))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn decode_columns(
        rows: &HeadRows,
        page_size: usize,
        num_slots: usize,
        head_dim: usize,
        out: &mut [f32],
        out_stride: usize,
    ) {
        let whole = num_slots / 8 * 8;
        for d in 0..head_dim {
            let at = d * page_size;
            let o = out.as_mut_ptr().add(d * out_stride);
            match *rows {
                HeadRows::F16(src) => {
                    let s = src.as_ptr().add(at).cast::<__m128i>();
                    for j in (0..whole).step_by(8) {
                        let h = _mm_loadu_si128(s.byte_add(2 * j));
                        _mm256_storeu_ps(o.add(j), _mm256_cvtph_ps(h));
                    }
                    let tail = &mut out[d * out_stride + whole..d * out_stride + num_slots];
                    src[at + whole..at + num_slots].convert_to_f32_slice(tail);
                }
                HeadRows::Q8 { values, scales } => {
                    let s = values.as_ptr().add(at);
                    for j in (0..whole).step_by(8) {
                        let q = _mm_loadl_epi64(s.add(j).cast());
                        let x = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
                        let scale = _mm256_loadu_ps(scales.as_ptr().add(j));
                        _mm256_storeu_ps(o.add(j), _mm256_mul_ps(x, scale));
                    }
                    for j in whole..num_slots {
                        *o.add(j) = values[at + j] as f32 * scales[j];
                    }
                }
                HeadRows::F32(_) => unreachable!("f32 columns are copied"),
            }
        }
    }
}
