//! The two products of a block of attention, as register-blocked microkernels:
//!
//! - `scores`: `s[lane][j] = Σ_d q[lane][d] · kt[d][j]`, up to [`MAX_LANES`] lanes against keys
//!   in runs of 16 (one SIMD vector of keys per row of K^T; each query element is broadcast);
//! - `accumulate`: `o[lane][..] += Σ_j p[lane][j] · v[j][..]`, the same lanes against rows of V.
//!
//! The portable versions are plain loops; the AVX-512 ones keep every accumulator in a register
//! and use FMA, so results differ from the portable path in rounding only.

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
        _ => rows.decode_columns(num_slots, head_dim, out, out_stride),
    }
}

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
    for j0 in (0..keys).step_by(16) {
        let mut acc = [[0f32; 16]; MAX_LANES];
        for d in 0..head_dim {
            let k: &[f32; 16] = kt[d * kt_stride + j0..][..16].try_into().unwrap();
            for (l, acc) in acc.iter_mut().enumerate().take(lanes) {
                let x = q[l * q_stride + d];
                for t in 0..16 {
                    acc[t] += x * k[t];
                }
            }
        }
        for (l, acc) in acc.iter().enumerate().take(lanes) {
            s[l * s_stride + j0..][..16].copy_from_slice(acc);
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
    for l in 0..lanes {
        let o = &mut o[l * o_stride..(l + 1) * o_stride];
        for (j, &w) in p[l * p_stride..l * p_stride + keys].iter().enumerate() {
            if w == 0.0 {
                continue;
            }
            for (a, x) in o.iter_mut().zip(&v[j * o_stride..(j + 1) * o_stride]) {
                *a += w * x;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use crate::kv::storage::HeadRows;
    use std::arch::x86_64::*;

    /// Mask of the first `n` (≤ 16) lanes.
    #[inline]
    fn first(n: usize) -> __mmask16 {
        ((1u32 << n) - 1) as __mmask16
    }

    #[target_feature(enable = "avx512f,f16c")]
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

    /// Dispatches a run-time lane count to a kernel instantiated for it.
    macro_rules! by_lanes {
        ($lanes:expr, $f:ident :: <_, $c:tt>($($arg:expr),*)) => {
            match $lanes {
                1 => $f::<1, $c>($($arg),*),
                2 => $f::<2, $c>($($arg),*),
                3 => $f::<3, $c>($($arg),*),
                4 => $f::<4, $c>($($arg),*),
                5 => $f::<5, $c>($($arg),*),
                6 => $f::<6, $c>($($arg),*),
                7 => $f::<7, $c>($($arg),*),
                _ => $f::<8, $c>($($arg),*),
            }
        };
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
        let mut j = 0;
        while j + 32 <= keys {
            by_lanes!(
                lanes,
                scores_tile::<_, 2>(
                    q,
                    q_stride,
                    head_dim,
                    kt.add(j),
                    kt_stride,
                    s.add(j),
                    s_stride
                )
            );
            j += 32;
        }
        if j < keys {
            by_lanes!(
                lanes,
                scores_tile::<_, 1>(
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
        let mut d = 0;
        while d + 32 <= o_stride {
            by_lanes!(
                lanes,
                accumulate_tile::<_, 2>(p, p_stride, v.add(d), o_stride, keys, o.add(d))
            );
            d += 32;
        }
        if d < o_stride {
            by_lanes!(
                lanes,
                accumulate_tile::<_, 1>(p, p_stride, v.add(d), o_stride, keys, o.add(d))
            );
        }
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
