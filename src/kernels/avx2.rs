//! AVX2 kernels: the AVX-512 scheme (one 64-byte step holds 4 consecutive weights of each of a
//! group's 16 output rows) split over two ymm registers, columns 0–7 and 8–15, both walked in
//! one pass over the group. Each weight block is loaded and unpacked once per chunk of up to
//! [`ROWS`] activation rows and applied to every row of the chunk.
//!
//! Without VNNI a dot product is `vpmaddubsw` (u8 × i8 → i16 pair sums) then `vpmaddwd` (i16
//! pairs → i32). The i16 pair sums of several steps are added in i16 before one `vpmaddwd`
//! (for Q4_K and Q6_K that `vpmaddwd` also applies the sub-block scale) wherever the bound
//! allows it, which halves the multiplies of a 1-row and a 9-row call alike:
//!
//! | weights (u8)           | one pair sum ≤ | pair sums added in i16 |
//! | ---------------------- | -------------- | ---------------------- |
//! | Q4_1, Q4_K (≤ 15)      | 3,810          | 8 (30,480)             |
//! | Q5_0 (≤ 31)            | 7,874          | 4 (31,496)             |
//! | Q6_K (≤ 63)            | 16,002         | 2 (32,004)             |
//! | Q8_0 (\|w\| ≤ 128)     | 32,512         | 1                      |
//!
//! (activations are in −127..=127, so `vpmaddubsw` never saturates and the i16 adds never
//! wrap). Integer sums are exact in any order and the float epilogue mirrors `scalar` op for
//! op, so every result is bit-identical to the portable kernels.

use std::arch::x86_64::*;

use super::act::{ActQ8, ActQ8K};
use super::dispatch::Dispatch;
use super::layout::{q6k_qh, q6k_ql, Format, GROUP};
use super::prefetch::one_row_prefetch;
use super::MAX_KERNEL_ROWS;

/// Activation rows one pass over a group applies each unpacked block to. With 16 ymm registers
/// a row's two i32 sums (and Q4_K/Q6_K's i16 sums) leave room for few rows; further rows take
/// another pass over the group, which by then is in L1/L2.
const ROWS: usize = 4;

/// How far ahead of the block being read the weight stream is prefetched, for one row and for
/// several: a call of several rows spends longer on each byte, so it asks earlier.
const PREFETCH_DISTANCE: usize = 4096;
const PREFETCH_DISTANCE_ROWS: usize = 12288;

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

chunked_kernel!(q8_0, q8_0_impl, Format::Q8_0, ActQ8, ROWS, [1, 2, 3, 4]);
chunked_kernel!(q4_1, q4_1_impl, Format::Q4_1, ActQ8, ROWS, [1, 2, 3, 4]);
chunked_kernel!(q5_0, q5_0_impl, Format::Q5_0, ActQ8, ROWS, [1, 2, 3, 4]);
chunked_kernel!(q4k, q4k_impl, Format::Q4K, ActQ8K, ROWS, [1, 2, 3, 4]);
chunked_kernel!(q6k, q6k_impl, Format::Q6K, ActQ8K, ROWS, [1, 2, 3, 4]);
chunked_kernel!(f16, f16_impl, Format::F16, f32, ROWS, [1, 2, 3, 4]);
chunked_kernel!(f32, f32_impl, Format::F32, f32, ROWS, [1, 2, 3, 4]);

/// A value for each half of a group: columns 0–7, then 8–15.
type Halves<T> = [T; 2];

/// Asks for the lines of the `len` bytes at `p` (a whole group-block), the distance for `R`
/// rows ahead; past the matrix's end the hints touch nothing (prefetches do not fault).
#[inline(always)]
unsafe fn prefetch_block<const R: usize>(p: *const u8, len: usize) {
    if R == 1 && !one_row_prefetch() {
        return;
    }
    let ahead = if R == 1 {
        PREFETCH_DISTANCE
    } else {
        PREFETCH_DISTANCE_ROWS
    };
    for offset in (0..len).step_by(64) {
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(ahead + offset).cast());
    }
}

/// The 64 bytes at `p` as two halves.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn load2(p: *const u8) -> Halves<__m256i> {
    [
        _mm256_loadu_si256(p.cast()),
        _mm256_loadu_si256(p.add(32).cast()),
    ]
}

/// 16 little-endian f16 at `p` as f32, in two halves.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn f16x16(p: *const u8) -> Halves<__m256> {
    [
        _mm256_cvtph_ps(_mm_loadu_si128(p.cast())),
        _mm256_cvtph_ps(_mm_loadu_si128(p.add(16).cast())),
    ]
}

/// The 4 bytes at `p` in every i32 lane.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn bcast4(p: *const i8) -> __m256i {
    _mm256_set1_epi32(p.cast::<i32>().read_unaligned())
}

/// The i16 pair sums `Σ₂ w·x` of `w` (u8) and `x` (i8).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn pairs(w: __m256i, x: __m256i) -> __m256i {
    _mm256_maddubs_epi16(w, x)
}

/// `acc + Σ₂ p16 · scale` per i32 lane (a lane's two i16 against its two scales).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn widen_add(acc: __m256i, p16: __m256i, scale: __m256i) -> __m256i {
    _mm256_add_epi32(acc, _mm256_madd_epi16(p16, scale))
}

/// The 16 scale bytes at `p` (one per column), each repeated in both i16 of its column's i32
/// lane, so that `vpmaddwd` scales a column's two pair sums by it; `signed` for Q6_K's i8.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn column_scales<const SIGNED: bool>(p: *const u8) -> Halves<__m256i> {
    let bytes = _mm_loadu_si128(p.cast());
    let (low, high) = (
        _mm_unpacklo_epi8(bytes, bytes),
        _mm_unpackhi_epi8(bytes, bytes),
    );
    if SIGNED {
        [_mm256_cvtepi8_epi16(low), _mm256_cvtepi8_epi16(high)]
    } else {
        [_mm256_cvtepu8_epi16(low), _mm256_cvtepu8_epi16(high)]
    }
}

/// `acc + (d_w · d_x) · isum` with one rounding for the multiply-add, the epilogue every format
/// shares.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn scaled_add(acc: __m256, dw: __m256, dx: f32, isum: __m256i) -> __m256 {
    _mm256_fmadd_ps(
        _mm256_mul_ps(dw, _mm256_set1_ps(dx)),
        _mm256_cvtepi32_ps(isum),
        acc,
    )
}

/// `(acc + (d · d_x) · isum) ∓ (m · d_x) · msum`: the epilogue of formats with a min term
/// (Q4_1 adds it, Q4_K subtracts it), in `scalar`'s order.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn scaled_add_min<const SUB: bool>(
    acc: __m256,
    (d, m): (__m256, __m256),
    dx: f32,
    isum: __m256i,
    msum: __m256,
) -> __m256 {
    let with_dot = scaled_add(acc, d, dx, isum);
    let min = _mm256_mul_ps(_mm256_mul_ps(m, _mm256_set1_ps(dx)), msum);
    if SUB {
        _mm256_sub_ps(with_dot, min)
    } else {
        _mm256_add_ps(with_dot, min)
    }
}

#[inline]
#[target_feature(enable = "avx2")]
unsafe fn store_rows<const R: usize>(acc: &[Halves<__m256>; R], out: &mut [f32]) {
    for (r, halves) in acc.iter().enumerate() {
        for (h, &v) in halves.iter().enumerate() {
            _mm256_storeu_ps(out.as_mut_ptr().add(r * GROUP + 8 * h), v);
        }
    }
}

/// Block `b` of each of the `R` activation rows (`acts` is `[R, nb]`).
#[inline(always)]
unsafe fn rows_at<A, const R: usize>(acts: &[A], b: usize, nb: usize) -> [&A; R] {
    std::array::from_fn(|r| acts.get_unchecked(r * nb + b))
}

const ZERO_HALVES: Halves<__m256i> = [unsafe { std::mem::zeroed() }; 2];

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_0_impl<const R: usize>(w: &[u8], acts: &[ActQ8], out: &mut [f32], nb: usize) {
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    let ones = _mm256_set1_epi16(1);
    for b in 0..nb {
        let p = w.as_ptr().add(b * Format::Q8_0.group_block_bytes());
        prefetch_block::<R>(p, Format::Q8_0.group_block_bytes());
        let a: [&ActQ8; R] = rows_at(acts, b, nb);
        let mut isum = [ZERO_HALVES; R];
        for t in 0..8 {
            let q = load2(p.add(32 + 64 * t));
            let magnitude = [_mm256_abs_epi8(q[0]), _mm256_abs_epi8(q[1])];
            for (isum, a) in isum.iter_mut().zip(&a) {
                let x = bcast4(a.qs.as_ptr().add(4 * t));
                for h in 0..2 {
                    // Σ w·x as Σ |w| · (x with w's sign): a u8 × i8 product.
                    let p16 = pairs(magnitude[h], _mm256_sign_epi8(x, q[h]));
                    isum[h] = widen_add(isum[h], p16, ones);
                }
            }
        }
        let dw = f16x16(p);
        for r in 0..R {
            for h in 0..2 {
                acc[r][h] = scaled_add(acc[r][h], dw[h], a[r].d, isum[r][h]);
            }
        }
    }
    store_rows(&acc, out);
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_1_impl<const R: usize>(w: &[u8], acts: &[ActQ8], out: &mut [f32], nb: usize) {
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    let (m4, ones) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi16(1));
    for b in 0..nb {
        let p = w.as_ptr().add(b * Format::Q4_1.group_block_bytes());
        prefetch_block::<R>(p, Format::Q4_1.group_block_bytes());
        let a: [&ActQ8; R] = rows_at(acts, b, nb);
        // All 8 pair sums of a block fit in i16 (≤ 15 · 127 · 2 each).
        let mut p16 = [ZERO_HALVES; R];
        for t in 0..4 {
            let v = load2(p.add(64 + 64 * t));
            for (p16, a) in p16.iter_mut().zip(&a) {
                let x = a.qs.as_ptr().add(4 * t);
                let (x_low, x_high) = (bcast4(x), bcast4(x.add(16)));
                for h in 0..2 {
                    let low = pairs(_mm256_and_si256(v[h], m4), x_low);
                    let high_nibbles = _mm256_and_si256(_mm256_srli_epi16::<4>(v[h]), m4);
                    let both = _mm256_add_epi16(low, pairs(high_nibbles, x_high));
                    p16[h] = _mm256_add_epi16(p16[h], both);
                }
            }
        }
        let (dw, mw) = (f16x16(p), f16x16(p.add(32)));
        for r in 0..R {
            let sum = _mm256_set1_ps(a[r].sum as f32);
            for h in 0..2 {
                let isum = _mm256_madd_epi16(p16[r][h], ones);
                acc[r][h] = scaled_add_min::<false>(acc[r][h], (dw[h], mw[h]), a[r].d, isum, sum);
            }
        }
    }
    store_rows(&acc, out);
}

/// Step `t` of a Q5_0 group-block's 5-bit weights (u8, 0..=31), as (low, high) nibbles of each
/// half, each with its fifth bit from `hb` (bit `t`, resp. `t + 4`, moved to bit 4; the 16-bit
/// shifts carry nothing across bytes into bit 4).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn q5_0_weights(p: *const u8, hb: Halves<__m256i>, t: usize) -> Halves<[__m256i; 2]> {
    let (m4, m10) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x10));
    let v = load2(p.add(32 + 64 * t));
    let mut weights = [[_mm256_setzero_si256(); 2]; 2];
    for h in 0..2 {
        let (fifth_low, fifth_high) = match t {
            0 => (_mm256_slli_epi16::<4>(hb[h]), hb[h]),
            1 => (_mm256_slli_epi16::<3>(hb[h]), _mm256_srli_epi16::<1>(hb[h])),
            2 => (_mm256_slli_epi16::<2>(hb[h]), _mm256_srli_epi16::<2>(hb[h])),
            _ => (_mm256_slli_epi16::<1>(hb[h]), _mm256_srli_epi16::<3>(hb[h])),
        };
        let low = _mm256_and_si256(v[h], m4);
        let high = _mm256_and_si256(_mm256_srli_epi16::<4>(v[h]), m4);
        weights[h] = [
            _mm256_or_si256(low, _mm256_and_si256(fifth_low, m10)),
            _mm256_or_si256(high, _mm256_and_si256(fifth_high, m10)),
        ];
    }
    weights
}

/// Q5_0 as `Σ u · x − 16 · Σ x` (`u` the unsigned 5-bit weight): Q8_0's integer sum exactly.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5_0_impl<const R: usize>(w: &[u8], acts: &[ActQ8], out: &mut [f32], nb: usize) {
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    let ones = _mm256_set1_epi16(1);
    for b in 0..nb {
        let p = w.as_ptr().add(b * Format::Q5_0.group_block_bytes());
        prefetch_block::<R>(p, Format::Q5_0.group_block_bytes());
        let a: [&ActQ8; R] = rows_at(acts, b, nb);
        let mut isum = [ZERO_HALVES; R];
        for (isum, a) in isum.iter_mut().zip(&a) {
            *isum = [_mm256_set1_epi32(a.q5_offset); 2];
        }
        let hb = load2(p.add(288));
        // Two steps (4 pair sums of ≤ 31 · 127 · 2) fit in i16.
        for first in [0, 2] {
            let mut p16 = [ZERO_HALVES; R];
            for t in first..first + 2 {
                let q = q5_0_weights(p, hb, t);
                for (p16, a) in p16.iter_mut().zip(&a) {
                    let x = a.qs.as_ptr().add(4 * t);
                    let (x_low, x_high) = (bcast4(x), bcast4(x.add(16)));
                    for h in 0..2 {
                        let both = _mm256_add_epi16(pairs(q[h][0], x_low), pairs(q[h][1], x_high));
                        p16[h] = _mm256_add_epi16(p16[h], both);
                    }
                }
            }
            for r in 0..R {
                for h in 0..2 {
                    isum[r][h] = widen_add(isum[r][h], p16[r][h], ones);
                }
            }
        }
        let dw = f16x16(p);
        for r in 0..R {
            for h in 0..2 {
                acc[r][h] = scaled_add(acc[r][h], dw[h], a[r].d, isum[r][h]);
            }
        }
    }
    store_rows(&acc, out);
}

/// Adds sub-block `s = 2 · pair + part` (32 weights: the low nibbles of the pair's quants for
/// part 0, the high for part 1) to each row's `Σ sc · Σ q · x`: the 8 steps' pair sums in i16,
/// then one `vpmaddwd` by the column scales.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn q4k_sub_block<const R: usize>(
    p: *const u8,
    pair: usize,
    part: usize,
    a: &[&ActQ8K; R],
    sacc: &mut [Halves<__m256i>; R],
) {
    let m4 = _mm256_set1_epi8(0x0F);
    let scales = column_scales::<false>(p.add(64 + 16 * (2 * pair + part)));
    let mut p16 = [ZERO_HALVES; R];
    for t in 0..8 {
        let v = load2(p.add(320 + 512 * pair + 64 * t));
        let q = if part == 0 {
            [_mm256_and_si256(v[0], m4), _mm256_and_si256(v[1], m4)]
        } else {
            [
                _mm256_and_si256(_mm256_srli_epi16::<4>(v[0]), m4),
                _mm256_and_si256(_mm256_srli_epi16::<4>(v[1]), m4),
            ]
        };
        for (p16, a) in p16.iter_mut().zip(a) {
            let x = bcast4(a.qs.as_ptr().add(64 * pair + 32 * part + 4 * t));
            for h in 0..2 {
                p16[h] = _mm256_add_epi16(p16[h], pairs(q[h], x));
            }
        }
    }
    for r in 0..R {
        for h in 0..2 {
            sacc[r][h] = widen_add(sacc[r][h], p16[r][h], scales[h]);
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4k_impl<const R: usize>(w: &[u8], acts: &[ActQ8K], out: &mut [f32], nb: usize) {
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    for b in 0..nb {
        let p = w.as_ptr().add(b * Format::Q4K.group_block_bytes());
        // One row reads a Q4_K block front to back, which the hardware prefetchers follow:
        // asking as well made it slower (a Zen 3, criterion `q4k/1536x8960/mtpx/1`: 12.6 GiB/s
        // without, 11.2–11.6 with the hints 4 KB ahead). Q6_K's walk jumps between `ql` and
        // `qh` and needs them (5.9 GiB/s without, 9.7–10.2 with).
        if R > 1 {
            prefetch_block::<R>(p, Format::Q4K.group_block_bytes());
        }
        let a: [&ActQ8K; R] = rows_at(acts, b, nb);
        let mut sacc = [ZERO_HALVES; R];
        for pair in 0..4 {
            q4k_sub_block(p, pair, 0, &a, &mut sacc);
            q4k_sub_block(p, pair, 1, &a, &mut sacc);
        }
        let (d, dmin) = (f16x16(p), f16x16(p.add(32)));
        for r in 0..R {
            // The mins: `Σ m · Σx` with each column's (m, m') pairs against the row's
            // (Σx, Σx') pairs of sub-blocks 2q and 2q + 1.
            let bsum = a[r].bsum32.as_ptr().cast::<i32>();
            for h in 0..2 {
                let mut macc = _mm256_setzero_si256();
                for q in 0..4 {
                    let m = _mm_loadu_si128(p.add(192 + 32 * q + 16 * h).cast());
                    let sums = _mm256_set1_epi32(bsum.add(q).read_unaligned());
                    macc = widen_add(macc, _mm256_cvtepu8_epi16(m), sums);
                }
                let msum = _mm256_cvtepi32_ps(macc);
                acc[r][h] =
                    scaled_add_min::<true>(acc[r][h], (d[h], dmin[h]), a[r].d, sacc[r][h], msum);
            }
        }
    }
    store_rows(&acc, out);
}

/// Adds sub-blocks `s = 8n + 2H + half` and `s + 4` (16 weights each: the `half`-th halves of
/// parts `H` and `H + 2` of half `n`, which share their `ql` and `qh` bytes: part `H` takes the
/// low nibbles and bits `2H..2H + 2`, part `H + 2` the high nibbles and bits `2H + 4..2H + 6`)
/// to each row's `Σ sc · Σ q · x`, with `q` unsigned (0..=63): the `− 32` is added once per
/// block ([`q6k_offsets`]). Pair sums go to i32 every 2 steps, by the column scales.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn q6k_sub_blocks<const R: usize, const H: usize>(
    p: *const u8,
    n: usize,
    half: usize,
    a: &[&ActQ8K; R],
    sacc: &mut [Halves<__m256i>; R],
) {
    let s = 8 * n + 2 * H + half;
    let (m4, m30) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x30));
    let scales_low = column_scales::<true>(p.add(32 + 16 * s));
    let scales_high = column_scales::<true>(p.add(32 + 16 * (s + 4)));
    let ql = p.add(q6k_ql(n, H, 4 * half));
    let qh = p.add(q6k_qh(n, 4 * half));
    for first in [0, 2] {
        let mut low = [ZERO_HALVES; R];
        let mut high = [ZERO_HALVES; R];
        for t in first..first + 2 {
            let (l, hb) = (load2(ql.add(64 * t)), load2(qh.add(64 * t)));
            let mut q = [[_mm256_setzero_si256(); 2]; 2];
            for h in 0..2 {
                let (h_low, h_high) = if H == 0 {
                    (_mm256_slli_epi16::<4>(hb[h]), hb[h])
                } else {
                    (_mm256_slli_epi16::<2>(hb[h]), _mm256_srli_epi16::<2>(hb[h]))
                };
                let l_high = _mm256_srli_epi16::<4>(l[h]);
                q[h] = [
                    _mm256_or_si256(_mm256_and_si256(l[h], m4), _mm256_and_si256(h_low, m30)),
                    _mm256_or_si256(_mm256_and_si256(l_high, m4), _mm256_and_si256(h_high, m30)),
                ];
            }
            for r in 0..R {
                let x = a[r].qs.as_ptr().add(128 * n + 32 * H + 16 * half + 4 * t);
                let (x_low, x_high) = (bcast4(x), bcast4(x.add(64)));
                for h in 0..2 {
                    low[r][h] = _mm256_add_epi16(low[r][h], pairs(q[h][0], x_low));
                    high[r][h] = _mm256_add_epi16(high[r][h], pairs(q[h][1], x_high));
                }
            }
        }
        for r in 0..R {
            for h in 0..2 {
                let scaled_low = _mm256_madd_epi16(low[r][h], scales_low[h]);
                sacc[r][h] = widen_add(sacc[r][h], high[r][h], scales_high[h]);
                sacc[r][h] = _mm256_add_epi32(sacc[r][h], scaled_low);
            }
        }
    }
}

/// Each column's `Σ_s sc_s · Σx_s` over a block's 16 sub-blocks, for the `− 32` of Q6_K's
/// weights: the column scales of sub-blocks `(s, s + 1)` as i16 pairs against the row's
/// `(Σx_s, Σx_{s+1})` pairs.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn q6k_offsets(scale_pairs: &[Halves<__m256i>; 8], a: &ActQ8K) -> Halves<__m256i> {
    let sums = a.bsum16_i16.as_ptr().cast::<i32>();
    let mut offsets = ZERO_HALVES;
    for (j, pair) in scale_pairs.iter().enumerate() {
        let x = _mm256_set1_epi32(sums.add(j).read_unaligned());
        for h in 0..2 {
            offsets[h] = widen_add(offsets[h], pair[h], x);
        }
    }
    offsets
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6k_impl<const R: usize>(w: &[u8], acts: &[ActQ8K], out: &mut [f32], nb: usize) {
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    for b in 0..nb {
        let p = w.as_ptr().add(b * Format::Q6K.group_block_bytes());
        prefetch_block::<R>(p, Format::Q6K.group_block_bytes());
        let a: [&ActQ8K; R] = rows_at(acts, b, nb);
        let mut sacc = [ZERO_HALVES; R];
        for n in 0..2 {
            // In address order: `ql[0]` with `qh`, then `ql[1]`.
            q6k_sub_blocks::<R, 0>(p, n, 0, &a, &mut sacc);
            q6k_sub_blocks::<R, 1>(p, n, 0, &a, &mut sacc);
            q6k_sub_blocks::<R, 0>(p, n, 1, &a, &mut sacc);
            q6k_sub_blocks::<R, 1>(p, n, 1, &a, &mut sacc);
        }
        let mut scale_pairs = [ZERO_HALVES; 8];
        for (j, pair) in scale_pairs.iter_mut().enumerate() {
            let first = _mm_loadl_epi64(p.add(32 + 32 * j).cast());
            let second = _mm_loadl_epi64(p.add(48 + 32 * j).cast());
            let first_high = _mm_loadl_epi64(p.add(40 + 32 * j).cast());
            let second_high = _mm_loadl_epi64(p.add(56 + 32 * j).cast());
            *pair = [
                _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(first, second)),
                _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(first_high, second_high)),
            ];
        }
        let d = f16x16(p);
        for r in 0..R {
            let offsets = q6k_offsets(&scale_pairs, a[r]);
            for h in 0..2 {
                let isum = _mm256_sub_epi32(sacc[r][h], _mm256_slli_epi32::<5>(offsets[h]));
                acc[r][h] = scaled_add(acc[r][h], d[h], a[r].d, isum);
            }
        }
    }
    store_rows(&acc, out);
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16_impl<const R: usize>(w: &[u8], x: &[f32], out: &mut [f32], in_dim: usize) {
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    for k in 0..in_dim {
        let wk = f16x16(w.as_ptr().add(32 * k));
        for (r, acc) in acc.iter_mut().enumerate() {
            let xk = _mm256_set1_ps(*x.get_unchecked(r * in_dim + k));
            for h in 0..2 {
                acc[h] = _mm256_add_ps(acc[h], _mm256_mul_ps(wk[h], xk));
            }
        }
    }
    store_rows(&acc, out);
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f32_impl<const R: usize>(w: &[u8], x: &[f32], out: &mut [f32], in_dim: usize) {
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    for k in 0..in_dim {
        let p = w.as_ptr().add(64 * k).cast::<f32>();
        let wk = [_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8))];
        for (r, acc) in acc.iter_mut().enumerate() {
            let xk = _mm256_set1_ps(*x.get_unchecked(r * in_dim + k));
            for h in 0..2 {
                acc[h] = _mm256_add_ps(acc[h], _mm256_mul_ps(wk[h], xk));
            }
        }
    }
    store_rows(&acc, out);
}
