//! AVX2 kernels: the AVX-512 scheme on 8 output rows at a time (each group is run as two
//! halves), with `vpmaddubsw` + `vpmaddwd` in place of `vpdpbusd`. No i16 saturation is
//! possible: u8 weights are ≤ 63 (Q4/Q6) and Q8_0 uses |w| ≤ 128 against |x| ≤ 127, so a pair
//! sums to at most 32,512. The float epilogue mirrors `scalar` op for op.

use std::arch::x86_64::*;

use super::act::{ActQ8, ActQ8K};
use super::avx512::PREFETCH_DISTANCE;
use super::dispatch::Dispatch;
use super::layout::{Format, GROUP};
use super::MAX_KERNEL_ROWS;

const HALF: usize = GROUP / 2;

/// Checks what the `unsafe` kernels rely on: the CPU has the features and the slices hold
/// `num_rows ≤ 16` rows of `num_blocks` blocks. Returns `(num_rows, num_blocks)`.
fn check<A>(format: Format, w: &[u8], acts: &[A], out: &[f32]) -> (usize, usize) {
    assert!(
        Dispatch::Avx2.is_supported(),
        "AVX2 is not supported by this CPU"
    );
    let num_rows = out.len() / GROUP;
    assert!(num_rows > 0 && num_rows <= MAX_KERNEL_ROWS && out.len() == num_rows * GROUP);
    assert!(acts.len().is_multiple_of(num_rows));
    let num_blocks = acts.len() / num_rows;
    assert!(w.len() >= num_blocks * format.group_block_bytes());
    (num_rows, num_blocks)
}

macro_rules! safe_kernel {
    ($name:ident, $imp:ident, $format:expr, $act:ty) => {
        pub fn $name(w: &[u8], acts: &[$act], out: &mut [f32]) {
            let (num_rows, num_blocks) = check($format, w, acts, out);
            for half in 0..2 {
                // SAFETY: `check` proved the CPU features `$imp` enables, and the slice lengths
                // its pointer arithmetic assumes (`num_blocks` blocks of `w`, `num_rows` rows).
                unsafe { $imp(w, acts, out, num_rows, num_blocks, half) }
            }
        }
    };
}

safe_kernel!(q8_0, q8_0_impl, Format::Q8_0, ActQ8);
safe_kernel!(q4_1, q4_1_impl, Format::Q4_1, ActQ8);
safe_kernel!(q5_0, q5_0_impl, Format::Q5_0, ActQ8);
safe_kernel!(q4k, q4k_impl, Format::Q4K, ActQ8K);
safe_kernel!(q6k, q6k_impl, Format::Q6K, ActQ8K);
safe_kernel!(f16, f16_impl, Format::F16, f32);
safe_kernel!(f32, f32_impl, Format::F32, f32);

/// 8 little-endian f16 at `p` as f32.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn f16x8(p: *const u8) -> __m256 {
    _mm256_cvtph_ps(_mm_loadu_si128(p.cast()))
}

/// Prefetches the block `PREFETCH_DISTANCE` bytes after the one at `p` (`len` bytes): the
/// hardware prefetchers alone leave a one-row matmul well short of the read bandwidth (see
/// `avx512::PREFETCH_DISTANCE`). Past the matrix's end the hints touch nothing.
#[inline(always)]
unsafe fn prefetch_block(p: *const u8, len: usize) {
    for offset in (0..len).step_by(64) {
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(PREFETCH_DISTANCE + offset).cast());
    }
}

#[inline]
#[target_feature(enable = "avx2")]
unsafe fn load(p: *const u8) -> __m256i {
    _mm256_loadu_si256(p.cast())
}

/// 8 bytes at `p` widened to i32 lanes, unsigned or signed.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn u8x8(p: *const u8) -> __m256i {
    _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.cast()))
}

#[inline]
#[target_feature(enable = "avx2")]
unsafe fn i8x8(p: *const u8) -> __m256i {
    _mm256_cvtepi8_epi32(_mm_loadl_epi64(p.cast()))
}

/// The 4 bytes at `p` in every i32 lane.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn bcast4(p: *const i8) -> __m256i {
    _mm256_set1_epi32(p.cast::<i32>().read_unaligned())
}

/// `acc + Σ₄ w·x` per i32 lane, `w` unsigned (≤ 63 here), `x` signed.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn dot(acc: __m256i, w: __m256i, x: __m256i) -> __m256i {
    let pairs = _mm256_maddubs_epi16(w, x);
    _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
}

/// `acc + Σ₄ w·x` per i32 lane with signed `w` (as `|w| · sign(x, w)`).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn dot_signed(acc: __m256i, w: __m256i, x: __m256i) -> __m256i {
    dot(acc, _mm256_abs_epi8(w), _mm256_sign_epi8(x, w))
}

/// `acc + (d_w · d_x) · isum`, the epilogue every format shares.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn scaled_add(acc: __m256, dw: __m256, dx: f32, isum: __m256i) -> __m256 {
    _mm256_add_ps(
        acc,
        _mm256_mul_ps(
            _mm256_mul_ps(dw, _mm256_set1_ps(dx)),
            _mm256_cvtepi32_ps(isum),
        ),
    )
}

#[inline]
#[target_feature(enable = "avx2")]
unsafe fn store_rows(acc: &[__m256; MAX_KERNEL_ROWS], out: &mut [f32], rows: usize, half: usize) {
    for (r, acc) in acc.iter().enumerate().take(rows) {
        _mm256_storeu_ps(out.as_mut_ptr().add(r * GROUP + HALF * half), *acc);
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_0_impl(w: &[u8], acts: &[ActQ8], out: &mut [f32], rows: usize, nb: usize, h: usize) {
    let mut acc = [_mm256_setzero_ps(); MAX_KERNEL_ROWS];
    for b in 0..nb {
        let p = w.as_ptr().add(b * Format::Q8_0.group_block_bytes());
        prefetch_block(p, Format::Q8_0.group_block_bytes());
        let dw = f16x8(p.add(16 * h));
        for (r, acc) in acc.iter_mut().enumerate().take(rows) {
            let a = acts.get_unchecked(r * nb + b);
            let mut isum = _mm256_setzero_si256();
            for t in 0..8 {
                let q = load(p.add(32 + 64 * t + 32 * h));
                isum = dot_signed(isum, q, bcast4(a.qs.as_ptr().add(4 * t)));
            }
            *acc = scaled_add(*acc, dw, a.d, isum);
        }
    }
    store_rows(&acc, out, rows, h);
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_1_impl(w: &[u8], acts: &[ActQ8], out: &mut [f32], rows: usize, nb: usize, h: usize) {
    let mut acc = [_mm256_setzero_ps(); MAX_KERNEL_ROWS];
    let m4 = _mm256_set1_epi8(0x0F);
    for b in 0..nb {
        let p = w.as_ptr().add(b * Format::Q4_1.group_block_bytes());
        prefetch_block(p, Format::Q4_1.group_block_bytes());
        let (dw, mw) = (f16x8(p.add(16 * h)), f16x8(p.add(32 + 16 * h)));
        let mut q = [_mm256_setzero_si256(); 8];
        for t in 0..4 {
            let v = load(p.add(64 + 64 * t + 32 * h));
            q[t] = _mm256_and_si256(v, m4);
            q[t + 4] = _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4);
        }
        for (r, acc) in acc.iter_mut().enumerate().take(rows) {
            let a = acts.get_unchecked(r * nb + b);
            let mut isum = _mm256_setzero_si256();
            for (t, &q) in q.iter().enumerate() {
                isum = dot(isum, q, bcast4(a.qs.as_ptr().add(4 * t)));
            }
            let with_dot = scaled_add(*acc, dw, a.d, isum);
            let min = _mm256_mul_ps(
                _mm256_mul_ps(mw, _mm256_set1_ps(a.d)),
                _mm256_set1_ps(a.sum as f32),
            );
            *acc = _mm256_add_ps(with_dot, min);
        }
    }
    store_rows(&acc, out, rows, h);
}

/// Q5_0 as `Σ u · x − 16 · Σ x` (see `avx512::q5_0_impl`); 8 rows of the group per half.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5_0_impl(w: &[u8], acts: &[ActQ8], out: &mut [f32], rows: usize, nb: usize, h: usize) {
    let mut acc = [_mm256_setzero_ps(); MAX_KERNEL_ROWS];
    let m4 = _mm256_set1_epi8(0x0F);
    let m10 = _mm256_set1_epi8(0x10);
    for b in 0..nb {
        let p = w.as_ptr().add(b * Format::Q5_0.group_block_bytes());
        prefetch_block(p, Format::Q5_0.group_block_bytes());
        let dw = f16x8(p.add(16 * h));
        let hb = load(p.add(288 + 32 * h));
        let mut q = [_mm256_setzero_si256(); 8];
        for t in 0..4 {
            let v = load(p.add(32 + 64 * t + 32 * h));
            let (fifth_low, fifth_high) = match t {
                0 => (_mm256_slli_epi16::<4>(hb), hb),
                1 => (_mm256_slli_epi16::<3>(hb), _mm256_srli_epi16::<1>(hb)),
                2 => (_mm256_slli_epi16::<2>(hb), _mm256_srli_epi16::<2>(hb)),
                _ => (_mm256_slli_epi16::<1>(hb), _mm256_srli_epi16::<3>(hb)),
            };
            let low = _mm256_and_si256(v, m4);
            let high = _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4);
            q[t] = _mm256_or_si256(low, _mm256_and_si256(fifth_low, m10));
            q[t + 4] = _mm256_or_si256(high, _mm256_and_si256(fifth_high, m10));
        }
        for (r, acc) in acc.iter_mut().enumerate().take(rows) {
            let a = acts.get_unchecked(r * nb + b);
            let mut isum = _mm256_set1_epi32(-16 * a.sum);
            for (t, &q) in q.iter().enumerate() {
                isum = dot(isum, q, bcast4(a.qs.as_ptr().add(4 * t)));
            }
            *acc = scaled_add(*acc, dw, a.d, isum);
        }
    }
    store_rows(&acc, out, rows, h);
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4k_impl(w: &[u8], acts: &[ActQ8K], out: &mut [f32], rows: usize, nb: usize, h: usize) {
    let mut acc = [_mm256_setzero_ps(); MAX_KERNEL_ROWS];
    let m4 = _mm256_set1_epi8(0x0F);
    for b in 0..nb {
        let p = w.as_ptr().add(b * Format::Q4K.group_block_bytes());
        prefetch_block(p, Format::Q4K.group_block_bytes());
        let mut sacc = [_mm256_setzero_si256(); MAX_KERNEL_ROWS];
        for pair in 0..4 {
            let sc_lo = u8x8(p.add(64 + 32 * pair + 8 * h));
            let sc_hi = u8x8(p.add(80 + 32 * pair + 8 * h));
            for (r, sacc) in sacc.iter_mut().enumerate().take(rows) {
                let x = acts.get_unchecked(r * nb + b).qs.as_ptr().add(64 * pair);
                let (mut il, mut ih) = (_mm256_setzero_si256(), _mm256_setzero_si256());
                for t in 0..8 {
                    let v = load(p.add(320 + 512 * pair + 64 * t + 32 * h));
                    let lo = _mm256_and_si256(v, m4);
                    let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4);
                    il = dot(il, lo, bcast4(x.add(4 * t)));
                    ih = dot(ih, hi, bcast4(x.add(32 + 4 * t)));
                }
                let scaled =
                    _mm256_add_epi32(_mm256_mullo_epi32(il, sc_lo), _mm256_mullo_epi32(ih, sc_hi));
                *sacc = _mm256_add_epi32(*sacc, scaled);
            }
        }
        let (d, dmin) = (f16x8(p.add(16 * h)), f16x8(p.add(32 + 16 * h)));
        for (r, acc) in acc.iter_mut().enumerate().take(rows) {
            let a = acts.get_unchecked(r * nb + b);
            let bsum = a.bsum32.as_ptr().cast::<i32>();
            let mut macc = _mm256_setzero_si256();
            for q in 0..4 {
                let m = _mm256_cvtepu8_epi16(_mm_loadu_si128(p.add(192 + 32 * q + 16 * h).cast()));
                let pair = _mm256_set1_epi32(bsum.add(q).read_unaligned());
                macc = _mm256_add_epi32(macc, _mm256_madd_epi16(m, pair));
            }
            let with_dot = scaled_add(*acc, d, a.d, sacc[r]);
            let min = _mm256_mul_ps(
                _mm256_mul_ps(dmin, _mm256_set1_ps(a.d)),
                _mm256_cvtepi32_ps(macc),
            );
            *acc = _mm256_sub_ps(with_dot, min);
        }
    }
    store_rows(&acc, out, rows, h);
}

/// The two top bits of weight part `i` (bits `2i..2i + 2` of each qh byte) moved to bits 4–5.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn q6_high(qh: __m256i, i: usize) -> __m256i {
    let shifted = match i {
        0 => _mm256_slli_epi16::<4>(qh),
        1 => _mm256_slli_epi16::<2>(qh),
        2 => qh,
        _ => _mm256_srli_epi16::<2>(qh),
    };
    _mm256_and_si256(shifted, _mm256_set1_epi8(0x30))
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6k_impl(w: &[u8], acts: &[ActQ8K], out: &mut [f32], rows: usize, nb: usize, h: usize) {
    let mut acc = [_mm256_setzero_ps(); MAX_KERNEL_ROWS];
    let m4 = _mm256_set1_epi8(0x0F);
    for b in 0..nb {
        let p = w.as_ptr().add(b * Format::Q6K.group_block_bytes());
        prefetch_block(p, Format::Q6K.group_block_bytes());
        let mut sacc = [_mm256_setzero_si256(); MAX_KERNEL_ROWS];
        for n in 0..2 {
            for i in 0..4 {
                let mut q = [_mm256_setzero_si256(); 8];
                for (t, q) in q.iter_mut().enumerate() {
                    let l = load(p.add(288 + 1024 * n + 512 * (i % 2) + 64 * t + 32 * h));
                    let l = if i >= 2 { _mm256_srli_epi16::<4>(l) } else { l };
                    let hb = q6_high(load(p.add(2336 + 512 * n + 64 * t + 32 * h)), i);
                    *q = _mm256_or_si256(_mm256_and_si256(l, m4), hb);
                }
                let s = 8 * n + 2 * i;
                let sc0 = i8x8(p.add(32 + 16 * s + 8 * h));
                let sc1 = i8x8(p.add(48 + 16 * s + 8 * h));
                for (r, sacc) in sacc.iter_mut().enumerate().take(rows) {
                    let a = acts.get_unchecked(r * nb + b);
                    let x = a.qs.as_ptr().add(128 * n + 32 * i);
                    let mut i0 = _mm256_set1_epi32(-32 * a.bsum16[s]);
                    let mut i1 = _mm256_set1_epi32(-32 * a.bsum16[s + 1]);
                    for t in 0..4 {
                        i0 = dot(i0, q[t], bcast4(x.add(4 * t)));
                        i1 = dot(i1, q[t + 4], bcast4(x.add(16 + 4 * t)));
                    }
                    let scaled =
                        _mm256_add_epi32(_mm256_mullo_epi32(i0, sc0), _mm256_mullo_epi32(i1, sc1));
                    *sacc = _mm256_add_epi32(*sacc, scaled);
                }
            }
        }
        let d = f16x8(p.add(16 * h));
        for (r, acc) in acc.iter_mut().enumerate().take(rows) {
            let a = acts.get_unchecked(r * nb + b);
            *acc = scaled_add(*acc, d, a.d, sacc[r]);
        }
    }
    store_rows(&acc, out, rows, h);
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16_impl(w: &[u8], x: &[f32], out: &mut [f32], rows: usize, in_dim: usize, h: usize) {
    let mut acc = [_mm256_setzero_ps(); MAX_KERNEL_ROWS];
    for k in 0..in_dim {
        let wk = f16x8(w.as_ptr().add(32 * k + 16 * h));
        for (r, acc) in acc.iter_mut().enumerate().take(rows) {
            let xk = _mm256_set1_ps(*x.get_unchecked(r * in_dim + k));
            *acc = _mm256_add_ps(*acc, _mm256_mul_ps(wk, xk));
        }
    }
    store_rows(&acc, out, rows, h);
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f32_impl(w: &[u8], x: &[f32], out: &mut [f32], rows: usize, in_dim: usize, h: usize) {
    let mut acc = [_mm256_setzero_ps(); MAX_KERNEL_ROWS];
    for k in 0..in_dim {
        let wk = _mm256_loadu_ps(w.as_ptr().add(64 * k + 32 * h).cast());
        for (r, acc) in acc.iter_mut().enumerate().take(rows) {
            let xk = _mm256_set1_ps(*x.get_unchecked(r * in_dim + k));
            *acc = _mm256_add_ps(*acc, _mm256_mul_ps(wk, xk));
        }
    }
    store_rows(&acc, out, rows, h);
}
