//! AVX-512 VNNI kernels: one zmm holds 4 consecutive weights of each of a group's 16 output
//! rows, and `vpdpbusd` (u8 weights × i8 activations, summed per 4 into i32 lanes) applies it to
//! one activation row's 4 values broadcast to every lane. Each weight block is loaded once and
//! applied to up to 16 activation rows; the float epilogue mirrors `scalar` op for op.
//!
//! Signed Q8_0 weights are flipped to `w + 128` (u8) and the i32 sums start at `−128 · Σx`;
//! Q6_K's `q − 32` offset is folded in the same way.

use std::arch::x86_64::*;

use super::act::{ActQ8, ActQ8K};
use super::dispatch::Dispatch;
use super::layout::{Format, GROUP};
use super::MAX_KERNEL_ROWS;

/// Checks what the `unsafe` kernels rely on: the CPU has the features and the slices hold
/// `num_rows ≤ 16` rows of `num_blocks` blocks. Returns `(num_rows, num_blocks)`.
fn check<A>(format: Format, w: &[u8], acts: &[A], out: &[f32]) -> (usize, usize) {
    assert!(Dispatch::Avx512.is_supported(), "AVX-512 VNNI is not supported by this CPU");
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
            // SAFETY: `check` proved the CPU features `$imp` enables, and the slice lengths its
            // pointer arithmetic assumes (`num_blocks` blocks of `w`, `num_rows` rows).
            unsafe { $imp(w, acts, out, num_rows, num_blocks) }
        }
    };
}

safe_kernel!(q8_0, q8_0_impl, Format::Q8_0, ActQ8);
safe_kernel!(q4_1, q4_1_impl, Format::Q4_1, ActQ8);
safe_kernel!(q4k, q4k_impl, Format::Q4K, ActQ8K);
safe_kernel!(q6k, q6k_impl, Format::Q6K, ActQ8K);
safe_kernel!(f16, f16_impl, Format::F16, f32);
safe_kernel!(f32, f32_impl, Format::F32, f32);

/// 16 little-endian f16 at `p` as f32.
#[inline]
#[target_feature(enable = "avx512f,f16c")]
unsafe fn f16x16(p: *const u8) -> __m512 {
    _mm512_cvtph_ps(_mm256_loadu_si256(p.cast()))
}

#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn load(p: *const u8) -> __m512i {
    _mm512_loadu_si512(p.cast())
}

/// The 4 bytes at `p` in every i32 lane.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn bcast4(p: *const i8) -> __m512i {
    _mm512_set1_epi32(p.cast::<i32>().read_unaligned())
}

/// `acc + (d_w · d_x) · isum`, the epilogue every format shares.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn scaled_add(acc: __m512, dw: __m512, dx: f32, isum: __m512i) -> __m512 {
    _mm512_add_ps(
        acc,
        _mm512_mul_ps(_mm512_mul_ps(dw, _mm512_set1_ps(dx)), _mm512_cvtepi32_ps(isum)),
    )
}

#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn store_rows(acc: &[__m512; MAX_KERNEL_ROWS], out: &mut [f32], num_rows: usize) {
    for (r, acc) in acc.iter().enumerate().take(num_rows) {
        _mm512_storeu_ps(out.as_mut_ptr().add(r * GROUP), *acc);
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q8_0_impl(w: &[u8], acts: &[ActQ8], out: &mut [f32], num_rows: usize, nb: usize) {
    let mut acc = [_mm512_setzero_ps(); MAX_KERNEL_ROWS];
    let flip = _mm512_set1_epi8(-128);
    for b in 0..nb {
        let p = w.as_ptr().add(b * Format::Q8_0.group_block_bytes());
        let dw = f16x16(p);
        let mut q = [_mm512_setzero_si512(); 8];
        for (t, q) in q.iter_mut().enumerate() {
            *q = _mm512_xor_si512(load(p.add(32 + 64 * t)), flip);
        }
        for (r, acc) in acc.iter_mut().enumerate().take(num_rows) {
            let a = acts.get_unchecked(r * nb + b);
            let mut isum = _mm512_set1_epi32(-128 * a.sum);
            for (t, &q) in q.iter().enumerate() {
                isum = _mm512_dpbusd_epi32(isum, q, bcast4(a.qs.as_ptr().add(4 * t)));
            }
            *acc = scaled_add(*acc, dw, a.d, isum);
        }
    }
    store_rows(&acc, out, num_rows);
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q4_1_impl(w: &[u8], acts: &[ActQ8], out: &mut [f32], num_rows: usize, nb: usize) {
    let mut acc = [_mm512_setzero_ps(); MAX_KERNEL_ROWS];
    let m4 = _mm512_set1_epi8(0x0F);
    for b in 0..nb {
        let p = w.as_ptr().add(b * Format::Q4_1.group_block_bytes());
        let (dw, mw) = (f16x16(p), f16x16(p.add(32)));
        let mut q = [_mm512_setzero_si512(); 8];
        for t in 0..4 {
            let v = load(p.add(64 + 64 * t));
            q[t] = _mm512_and_si512(v, m4);
            q[t + 4] = _mm512_and_si512(_mm512_srli_epi16::<4>(v), m4);
        }
        for (r, acc) in acc.iter_mut().enumerate().take(num_rows) {
            let a = acts.get_unchecked(r * nb + b);
            let mut isum = _mm512_setzero_si512();
            for (t, &q) in q.iter().enumerate() {
                isum = _mm512_dpbusd_epi32(isum, q, bcast4(a.qs.as_ptr().add(4 * t)));
            }
            let with_dot = scaled_add(*acc, dw, a.d, isum);
            let min = _mm512_mul_ps(
                _mm512_mul_ps(mw, _mm512_set1_ps(a.d)),
                _mm512_set1_ps(a.sum as f32),
            );
            *acc = _mm512_add_ps(with_dot, min);
        }
    }
    store_rows(&acc, out, num_rows);
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q4k_impl(w: &[u8], acts: &[ActQ8K], out: &mut [f32], num_rows: usize, nb: usize) {
    let mut acc = [_mm512_setzero_ps(); MAX_KERNEL_ROWS];
    let m4 = _mm512_set1_epi8(0x0F);
    for b in 0..nb {
        let p = w.as_ptr().add(b * Format::Q4K.group_block_bytes());
        let mut sacc = [_mm512_setzero_si512(); MAX_KERNEL_ROWS];
        for pair in 0..4 {
            let sc_lo = _mm512_cvtepu8_epi32(_mm_loadu_si128(p.add(64 + 32 * pair).cast()));
            let sc_hi = _mm512_cvtepu8_epi32(_mm_loadu_si128(p.add(80 + 32 * pair).cast()));
            let mut lo = [_mm512_setzero_si512(); 8];
            let mut hi = [_mm512_setzero_si512(); 8];
            for t in 0..8 {
                let v = load(p.add(320 + 512 * pair + 64 * t));
                lo[t] = _mm512_and_si512(v, m4);
                hi[t] = _mm512_and_si512(_mm512_srli_epi16::<4>(v), m4);
            }
            for (r, sacc) in sacc.iter_mut().enumerate().take(num_rows) {
                let x = acts.get_unchecked(r * nb + b).qs.as_ptr().add(64 * pair);
                let (mut il, mut ih) = (_mm512_setzero_si512(), _mm512_setzero_si512());
                for t in 0..8 {
                    il = _mm512_dpbusd_epi32(il, lo[t], bcast4(x.add(4 * t)));
                    ih = _mm512_dpbusd_epi32(ih, hi[t], bcast4(x.add(32 + 4 * t)));
                }
                let scaled = _mm512_add_epi32(
                    _mm512_mullo_epi32(il, sc_lo),
                    _mm512_mullo_epi32(ih, sc_hi),
                );
                *sacc = _mm512_add_epi32(*sacc, scaled);
            }
        }
        let (d, dmin) = (f16x16(p), f16x16(p.add(32)));
        let mut mins = [_mm512_setzero_si512(); 4];
        for (q, m) in mins.iter_mut().enumerate() {
            *m = _mm512_cvtepu8_epi16(_mm256_loadu_si256(p.add(192 + 32 * q).cast()));
        }
        for (r, acc) in acc.iter_mut().enumerate().take(num_rows) {
            let a = acts.get_unchecked(r * nb + b);
            let bsum = a.bsum32.as_ptr().cast::<i32>();
            let mut macc = _mm512_setzero_si512();
            for (q, &m) in mins.iter().enumerate() {
                let pair = _mm512_set1_epi32(bsum.add(q).read_unaligned());
                macc = _mm512_dpwssd_epi32(macc, m, pair);
            }
            let with_dot = scaled_add(*acc, d, a.d, sacc[r]);
            let min = _mm512_mul_ps(
                _mm512_mul_ps(dmin, _mm512_set1_ps(a.d)),
                _mm512_cvtepi32_ps(macc),
            );
            *acc = _mm512_sub_ps(with_dot, min);
        }
    }
    store_rows(&acc, out, num_rows);
}

/// The two top bits of weight part `i` (bits `2i..2i + 2` of each qh byte) moved to bits 4–5.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn q6_high(h: __m512i, i: usize) -> __m512i {
    let shifted = match i {
        0 => _mm512_slli_epi16::<4>(h),
        1 => _mm512_slli_epi16::<2>(h),
        2 => h,
        _ => _mm512_srli_epi16::<2>(h),
    };
    _mm512_and_si512(shifted, _mm512_set1_epi8(0x30))
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q6k_impl(w: &[u8], acts: &[ActQ8K], out: &mut [f32], num_rows: usize, nb: usize) {
    let mut acc = [_mm512_setzero_ps(); MAX_KERNEL_ROWS];
    let m4 = _mm512_set1_epi8(0x0F);
    for b in 0..nb {
        let p = w.as_ptr().add(b * Format::Q6K.group_block_bytes());
        let mut sacc = [_mm512_setzero_si512(); MAX_KERNEL_ROWS];
        for n in 0..2 {
            for i in 0..4 {
                let mut q = [_mm512_setzero_si512(); 8];
                for (t, q) in q.iter_mut().enumerate() {
                    let l = load(p.add(288 + 1024 * n + 512 * (i % 2) + 64 * t));
                    let l = if i >= 2 { _mm512_srli_epi16::<4>(l) } else { l };
                    let h = q6_high(load(p.add(2336 + 512 * n + 64 * t)), i);
                    *q = _mm512_or_si512(_mm512_and_si512(l, m4), h);
                }
                let s = 8 * n + 2 * i;
                let sc0 = _mm512_cvtepi8_epi32(_mm_loadu_si128(p.add(32 + 16 * s).cast()));
                let sc1 = _mm512_cvtepi8_epi32(_mm_loadu_si128(p.add(48 + 16 * s).cast()));
                for (r, sacc) in sacc.iter_mut().enumerate().take(num_rows) {
                    let a = acts.get_unchecked(r * nb + b);
                    let x = a.qs.as_ptr().add(128 * n + 32 * i);
                    let mut i0 = _mm512_set1_epi32(-32 * a.bsum16[s]);
                    let mut i1 = _mm512_set1_epi32(-32 * a.bsum16[s + 1]);
                    for t in 0..4 {
                        i0 = _mm512_dpbusd_epi32(i0, q[t], bcast4(x.add(4 * t)));
                        i1 = _mm512_dpbusd_epi32(i1, q[t + 4], bcast4(x.add(16 + 4 * t)));
                    }
                    let scaled =
                        _mm512_add_epi32(_mm512_mullo_epi32(i0, sc0), _mm512_mullo_epi32(i1, sc1));
                    *sacc = _mm512_add_epi32(*sacc, scaled);
                }
            }
        }
        let d = f16x16(p);
        for (r, acc) in acc.iter_mut().enumerate().take(num_rows) {
            let a = acts.get_unchecked(r * nb + b);
            *acc = scaled_add(*acc, d, a.d, sacc[r]);
        }
    }
    store_rows(&acc, out, num_rows);
}

#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn f16_impl(w: &[u8], x: &[f32], out: &mut [f32], num_rows: usize, in_dim: usize) {
    let mut acc = [_mm512_setzero_ps(); MAX_KERNEL_ROWS];
    for k in 0..in_dim {
        let wk = f16x16(w.as_ptr().add(32 * k));
        for (r, acc) in acc.iter_mut().enumerate().take(num_rows) {
            let xk = _mm512_set1_ps(*x.get_unchecked(r * in_dim + k));
            *acc = _mm512_add_ps(*acc, _mm512_mul_ps(wk, xk));
        }
    }
    store_rows(&acc, out, num_rows);
}

#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn f32_impl(w: &[u8], x: &[f32], out: &mut [f32], num_rows: usize, in_dim: usize) {
    let mut acc = [_mm512_setzero_ps(); MAX_KERNEL_ROWS];
    for k in 0..in_dim {
        let wk = _mm512_loadu_ps(w.as_ptr().add(64 * k).cast());
        for (r, acc) in acc.iter_mut().enumerate().take(num_rows) {
            let xk = _mm512_set1_ps(*x.get_unchecked(r * in_dim + k));
            *acc = _mm512_add_ps(*acc, _mm512_mul_ps(wk, xk));
        }
    }
    store_rows(&acc, out, num_rows);
}
