//! The f32 path's two products on AVX2 with f16 K and V read in place from the pages, instead
//! of decoding each block into f32 scratch first. At one decode row a block's decoding and the
//! scratch's round trip through L1 cost more than its products (criterion `paged_attention`,
//! one row at 16K context on a Zen 3: see BENCHMARKS.md). Here each f16 vector is converted in
//! registers (`vcvtph2ps`, exact) where the scratch path loads its f32 copy, and the
//! multiply-adds run in the same order, so the results are bit-identical to that path.
//!
//! Used when pages hold a multiple of 16 slots and `head_dim` is a multiple of 16 (whole
//! vectors in every page and row); [`usable`] says so.

use half::f16;
use std::arch::x86_64::*;

/// Pages one block spans at most: `plan::BLOCK_KEYS` / 16 (pages hold at least 16 slots here).
pub const MAX_PAGES: usize = 8;

/// Lanes one tile keeps in registers (16 ymm: 4 lanes × 2 vectors of accumulators).
const LANES: usize = 4;

/// Whether the in-place kernels can run for this layout on this CPU.
pub fn usable(page_size: usize, head_dim: usize) -> bool {
    page_size.is_multiple_of(16)
        && head_dim.is_multiple_of(16)
        && std::is_x86_feature_detected!("avx2")
        && std::is_x86_feature_detected!("fma")
        && std::is_x86_feature_detected!("f16c")
}

/// `s[l][j] = Σ_d q[l][d] · K[d][j]` for the block's keys `j < keys` (rounded up to 16), K read
/// from `k_pages` (each `[head_dim][page_size]`, transposed as stored), for every lane
/// `l < q.len() / q_stride`.
#[allow(clippy::too_many_arguments)]
pub fn scores(
    q: &[f32],
    q_stride: usize,
    head_dim: usize,
    k_pages: &[&[f16]],
    page_size: usize,
    keys: usize,
    s: &mut [f32],
    s_stride: usize,
) {
    let lanes = q.len() / q_stride;
    let keys = keys.next_multiple_of(16);
    assert!(usable(page_size, head_dim) && head_dim <= q_stride && lanes > 0);
    assert!(keys <= k_pages.len() * page_size && keys <= s_stride);
    assert!(k_pages.iter().all(|k| k.len() >= head_dim * page_size));
    assert!(s.len() >= (lanes - 1) * s_stride + keys);
    for l0 in (0..lanes).step_by(LANES) {
        let (q, s) = (&q[l0 * q_stride..], &mut s[l0 * s_stride..]);
        for j in (0..keys).step_by(16) {
            let page = k_pages[j / page_size][j % page_size..]
                .as_ptr()
                .cast::<u16>();
            // SAFETY: `usable` proved the CPU features; the asserts bound the reads of the
            // page (`head_dim` rows of `page_size`, 16 from `j % page_size`), of `q` and the
            // writes to `s`.
            unsafe {
                by_lanes4!(
                    (lanes - l0).min(LANES),
                    scores_tile(
                        q.as_ptr(),
                        q_stride,
                        head_dim,
                        page,
                        page_size,
                        s[j..].as_mut_ptr(),
                        s_stride
                    )
                );
            }
        }
    }
}

/// `L` lanes × 16 keys of one page.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scores_tile<const L: usize>(
    q: *const f32,
    q_stride: usize,
    head_dim: usize,
    kt: *const u16,
    kt_stride: usize,
    s: *mut f32,
    s_stride: usize,
) {
    let mut acc = [[_mm256_setzero_ps(); 2]; L];
    for d in 0..head_dim {
        let k = f16x16(kt.add(d * kt_stride));
        fma_lanes(&mut acc, k, |l| q.add(l * q_stride + d));
    }
    store_lanes(&acc, s, s_stride);
}

/// 16 f16 at `p` as two vectors of 8 f32.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn f16x16(p: *const u16) -> [__m256; 2] {
    [
        _mm256_cvtph_ps(_mm_loadu_si128(p.cast())),
        _mm256_cvtph_ps(_mm_loadu_si128(p.add(8).cast())),
    ]
}

/// `acc[l] += *factor(l) · x` for every lane `l`.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn fma_lanes<const L: usize>(
    acc: &mut [[__m256; 2]; L],
    x: [__m256; 2],
    factor: impl Fn(usize) -> *const f32,
) {
    for (l, acc) in acc.iter_mut().enumerate() {
        let f = _mm256_broadcast_ss(&*factor(l));
        acc[0] = _mm256_fmadd_ps(f, x[0], acc[0]);
        acc[1] = _mm256_fmadd_ps(f, x[1], acc[1]);
    }
}

/// Stores lane `l`'s 16 sums at `out + l * stride`.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn store_lanes<const L: usize>(acc: &[[__m256; 2]; L], out: *mut f32, stride: usize) {
    for (l, acc) in acc.iter().enumerate() {
        _mm256_storeu_ps(out.add(l * stride), acc[0]);
        _mm256_storeu_ps(out.add(l * stride + 8), acc[1]);
    }
}

/// `o[l][d] += Σ_{j < keys} p[l][j] · V[j][d]` for every lane `l < o.len() / o_stride` and
/// `d < head_dim`, V read from `v_pages` (each `[page_size][head_dim]`).
#[allow(clippy::too_many_arguments)]
pub fn accumulate(
    p: &[f32],
    p_stride: usize,
    v_pages: &[&[f16]],
    page_size: usize,
    head_dim: usize,
    keys: usize,
    o: &mut [f32],
    o_stride: usize,
) {
    let lanes = o.len() / o_stride;
    assert!(usable(page_size, head_dim) && head_dim <= o_stride && lanes > 0);
    assert!(keys <= v_pages.len() * page_size && keys <= p_stride);
    assert!(v_pages.iter().all(|v| v.len() >= head_dim * page_size));
    assert!(p.len() >= (lanes - 1) * p_stride + keys);
    let mut rows = [std::ptr::null(); MAX_PAGES];
    for (row, page) in rows.iter_mut().zip(v_pages) {
        *row = page.as_ptr().cast::<u16>();
    }
    let pages = &rows[..keys.div_ceil(page_size)];
    for l0 in (0..lanes).step_by(LANES) {
        let (p, o) = (&p[l0 * p_stride..], &mut o[l0 * o_stride..]);
        for d in (0..head_dim).step_by(16) {
            // SAFETY: `usable` proved the CPU features; the asserts bound the reads of the
            // pages (`keys` rows of `head_dim` in all, 16 from `d` in each), of `p` and the
            // reads and writes of `o`.
            unsafe {
                by_lanes4!(
                    (lanes - l0).min(LANES),
                    accumulate_tile(
                        p.as_ptr(),
                        p_stride,
                        pages,
                        page_size,
                        head_dim,
                        d,
                        keys,
                        o[d..].as_mut_ptr(),
                        o_stride
                    )
                );
            }
        }
    }
}

/// `L` lanes × 16 output dimensions from `d`, over the keys of every page in turn.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn accumulate_tile<const L: usize>(
    p: *const f32,
    p_stride: usize,
    pages: &[*const u16],
    page_size: usize,
    head_dim: usize,
    d: usize,
    keys: usize,
    o: *mut f32,
    o_stride: usize,
) {
    let mut acc = [[_mm256_setzero_ps(); 2]; L];
    for (l, acc) in acc.iter_mut().enumerate() {
        acc[0] = _mm256_loadu_ps(o.add(l * o_stride));
        acc[1] = _mm256_loadu_ps(o.add(l * o_stride + 8));
    }
    for (i, &page) in pages.iter().enumerate() {
        let first = i * page_size;
        for j in first..keys.min(first + page_size) {
            let x = f16x16(page.add((j - first) * head_dim + d));
            fma_lanes(&mut acc, x, |l| p.add(l * p_stride + j));
        }
    }
    store_lanes(&acc, o, o_stride);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::Dispatch;
    use crate::kv::attention::micro;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn random_f16(rng: &mut ChaCha8Rng, n: usize) -> Vec<f16> {
        (0..n)
            .map(|_| f16::from_f32(rng.random_range(-2.0..2.0)))
            .collect()
    }

    /// The in-place kernels on f16 pages give, bit for bit, what the AVX2 scratch kernels give
    /// on the same pages decoded to f32 (a block of 3 pages of 32 slots, 7 lanes, keys ending
    /// inside the last page).
    #[test]
    fn in_place_products_equal_the_scratch_kernels_bit_for_bit() {
        let (page_size, hd, lanes, keys) = (32, 64, 7, 80);
        if !usable(page_size, hd) {
            return;
        }
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let k_pages: Vec<Vec<f16>> = (0..3)
            .map(|_| random_f16(&mut rng, hd * page_size))
            .collect();
        let v_pages: Vec<Vec<f16>> = (0..3)
            .map(|_| random_f16(&mut rng, hd * page_size))
            .collect();
        let q: Vec<f32> = (0..lanes * hd)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let bs = 3 * page_size;
        // Scratch layout: K^T `[hd][bs]`, V `[bs][hd]`.
        let mut kt = vec![0f32; hd * bs];
        let mut v = vec![0f32; bs * hd];
        for (i, (kp, vp)) in k_pages.iter().zip(&v_pages).enumerate() {
            for d in 0..hd {
                for j in 0..page_size {
                    kt[d * bs + i * page_size + j] = kp[d * page_size + j].to_f32();
                    v[(i * page_size + j) * hd + d] = vp[j * hd + d].to_f32();
                }
            }
        }
        let k_refs: Vec<&[f16]> = k_pages.iter().map(|p| p.as_slice()).collect();
        let v_refs: Vec<&[f16]> = v_pages.iter().map(|p| p.as_slice()).collect();

        let mut s_ref = vec![0f32; lanes * bs];
        let mut s = vec![0f32; lanes * bs];
        for l0 in (0..lanes).step_by(micro::MAX_LANES) {
            let l1 = (l0 + micro::MAX_LANES).min(lanes);
            let (qs, out) = (&q[l0 * hd..l1 * hd], &mut s_ref[l0 * bs..l1 * bs]);
            micro::scores(Dispatch::Avx2, qs, hd, hd, &kt, bs, keys, out, bs);
            scores(
                qs,
                hd,
                hd,
                &k_refs,
                page_size,
                keys,
                &mut s[l0 * bs..l1 * bs],
                bs,
            );
        }
        assert!(s
            .iter()
            .zip(&s_ref)
            .all(|(a, b)| a.to_bits() == b.to_bits()));

        let p: Vec<f32> = (0..lanes * bs)
            .map(|_| rng.random_range(0.0..1.0))
            .collect();
        let o_start: Vec<f32> = (0..lanes * hd)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let (mut o_ref, mut o) = (o_start.clone(), o_start);
        micro::accumulate(Dispatch::Avx2, &p, bs, &v, hd, keys, &mut o_ref);
        accumulate(&p, bs, &v_refs, page_size, hd, keys, &mut o, hd);
        assert!(o
            .iter()
            .zip(&o_ref)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
    }
}
