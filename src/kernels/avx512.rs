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
use super::layout::{q6k_qh, q6k_ql, Format, GROUP};
use super::prefetch::one_row_prefetch;
use super::MAX_KERNEL_ROWS;

/// Checks what the `unsafe` kernels rely on: the CPU has the features and the slices hold
/// `num_rows ≤ 16` rows of `num_blocks` blocks. Returns `(num_rows, num_blocks)`.
fn check<A>(format: Format, w: &[u8], acts: &[A], out: &[f32]) -> (usize, usize) {
    assert!(
        Dispatch::Avx512.is_supported(),
        "AVX-512 VNNI is not supported by this CPU"
    );
    let num_rows = out.len() / GROUP;
    assert!(num_rows > 0 && num_rows <= MAX_KERNEL_ROWS && out.len() == num_rows * GROUP);
    assert!(acts.len().is_multiple_of(num_rows));
    let num_blocks = acts.len() / num_rows;
    assert!(w.len() >= num_blocks * format.group_block_bytes());
    (num_rows, num_blocks)
}

/// Activation rows one kernel call keeps in registers (its accumulators and `vpdpbusd`
/// chains: 4 per row, so 5 rows use 20 of the 32 zmm registers); a group's weights are re-read
/// from L1/L2 and unpacked again for each further chunk of rows.
const ROWS: usize = 5;

/// Rows per pass for Q8_0, Q4_1, Q5_0, Q4_K and Q6_K, so that a 9-row verify step unpacks each
/// block once instead of twice (5 + 4). Each row keeps two `vpdpbusd` chains and an f32 sum:
/// 27 of the 32 registers at 9 rows (the activations are embedded broadcasts; 10 rows spill a
/// little, Q8_0 measured 100 against 9 rows' 122 G multiply-adds/s in cache). (One chain a row
/// above 5 rows, as these kernels first did, left each row a chain of 8 dependent `vpdpbusd`
/// a block: on a Xeon with AMX, in cache, 9 rows of Q8_0 and Q5_0 ran at 85–89 G
/// multiply-adds/s a thread with it and 122 without.) Q4_K keeps its per-row sums (partly in
/// memory then) and measured faster anyway (a 9-row step of the 1.5B 126 → 119 ms, prefill
/// +15%). Q6_K, whose rows each kept four registers, measured slower at 10 rows until it
/// unpacked each sub-block pair once and applied it row by row (see `q6k_sub_blocks`).
const ROWS_WIDE: usize = 10;

/// From this many rows a kernel keeps one `vpdpbusd` chain a row: the rows' chains alone keep
/// both ports busy, and merging two chains was one more instruction per row and block. Below it
/// a row's two chains hide the instruction's latency. (In cache on one thread of a Xeon with
/// AMX, 9 rows: Q8_0 220 → 224, Q5_0 194 → 205 G multiply-adds/s.)
const ONE_CHAIN_ROWS: usize = 6;

/// `first += w0 · x0` and `second += w1 · x1` for a kernel of `R` rows: two independent chains
/// a row, so that `vpdpbusd`'s latency does not bound a block, or from [`ONE_CHAIN_ROWS`] both
/// into `first` (`second` stays as it started). Integer sums are exact in any order.
#[inline]
#[target_feature(enable = "avx512f,avx512vnni")]
unsafe fn dot2<const R: usize>(
    first: &mut __m512i,
    second: &mut __m512i,
    (w0, x0): (__m512i, __m512i),
    (w1, x1): (__m512i, __m512i),
) {
    *first = _mm512_dpbusd_epi32(*first, w0, x0);
    if R >= ONE_CHAIN_ROWS {
        *first = _mm512_dpbusd_epi32(*first, w1, x1);
    } else {
        *second = _mm512_dpbusd_epi32(*second, w1, x1);
    }
}

/// The sum of a row's chains (see [`dot2`]).
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn join2<const R: usize>(first: __m512i, second: __m512i) -> __m512i {
    if R >= ONE_CHAIN_ROWS {
        first
    } else {
        _mm512_add_epi32(first, second)
    }
}

chunked_kernel!(
    q8_0,
    q8_0_impl,
    Format::Q8_0,
    ActQ8,
    ROWS_WIDE,
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
);
chunked_kernel!(
    q4_1,
    q4_1_impl,
    Format::Q4_1,
    ActQ8,
    ROWS_WIDE,
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
);
chunked_kernel!(
    q5_0,
    q5_0_impl,
    Format::Q5_0,
    ActQ8,
    ROWS_WIDE,
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
);
chunked_kernel!(
    q4k,
    q4k_impl,
    Format::Q4K,
    ActQ8K,
    ROWS_WIDE,
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
);
chunked_kernel!(
    q6k,
    q6k_impl,
    Format::Q6K,
    ActQ8K,
    ROWS_WIDE,
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
);
chunked_kernel!(f16, f16_impl, Format::F16, f32, ROWS, [1, 2, 3, 4, 5]);
chunked_kernel!(f32, f32_impl, Format::F32, f32, ROWS, [1, 2, 3, 4, 5]);

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

/// How far ahead of the bytes being read the weight stream is prefetched. The hardware
/// prefetchers alone left one-row matmuls at ~70% of the read bandwidth; 4 KB ahead reached
/// ~87% (Zen 5, `cargo bench --bench kernels`).
pub(super) const PREFETCH_DISTANCE: usize = 4096;

/// Calls of several rows spend several times longer on each byte and take each line in two
/// hops: into L2 from [`FAR_ROWS`] ahead, into L1 from [`NEAR_ROWS`] ahead. (One `prefetcht0`
/// 12 KB ahead, as these calls had before, holds an L1 fill buffer for a line's whole trip from
/// DRAM, and a core has few: streamed from DRAM, a 9-row Q8_0 4864×896 matmul on one thread ran
/// at 11 GB/s against 16 GB/s for one row. On a 2-vCPU Xeon, two threads, 9 rows: Q8_0 211 →
/// 190 µs, Q5_0 157 → 154 µs; the L2 hint alone 205 µs, the L1 one alone 210 µs; 16 or 64 KB
/// far, 1 or 4 KB near, or T2 for T1 within 2%. A 9-row verify step of the 0.5B 22.1–22.3 →
/// 20.9–21.4 ms, the 1.5B's unchanged.)
const FAR_ROWS: usize = 32768;
const NEAR_ROWS: usize = 2048;

/// Asks for the cache line `p` will reach [`PREFETCH_DISTANCE`] bytes on (one row) or, for
/// calls of several rows, as [`FAR_ROWS`] says (past the matrix's end a prefetch is a hint that
/// touches nothing: prefetches do not fault).
#[inline(always)]
unsafe fn prefetch_ahead<const R: usize>(p: *const u8) {
    if R == 1 {
        if one_row_prefetch() {
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(PREFETCH_DISTANCE).cast());
        }
    } else {
        _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(FAR_ROWS).cast());
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(NEAR_ROWS).cast());
    }
}

/// [`prefetch_ahead`] for the first `len` bytes at `p` (a block's scales, which the quant loop
/// does not read).
#[inline(always)]
unsafe fn prefetch_header<const R: usize>(p: *const u8, len: usize) {
    for offset in (0..len).step_by(64) {
        prefetch_ahead::<R>(p.add(offset));
    }
}

/// The 4 bytes at `p` in every i32 lane.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn bcast4(p: *const i8) -> __m512i {
    _mm512_set1_epi32(p.cast::<i32>().read_unaligned())
}

/// `acc + (d_w · d_x) · isum` with one rounding for the multiply-add (`vfmadd`), the epilogue
/// every format shares.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn scaled_add(acc: __m512, dw: __m512, dx: f32, isum: __m512i) -> __m512 {
    _mm512_fmadd_ps(
        _mm512_mul_ps(dw, _mm512_set1_ps(dx)),
        _mm512_cvtepi32_ps(isum),
        acc,
    )
}

#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn store_rows<const R: usize>(acc: &[__m512; R], out: &mut [f32]) {
    for (i, acc) in acc.iter().enumerate() {
        _mm512_storeu_ps(out.as_mut_ptr().add(i * GROUP), *acc);
    }
}

/// Pointers to block `b` of each of the `R` activation rows (`acts` is `[R, nb]`).
#[inline(always)]
unsafe fn rows_at<A, const R: usize>(acts: &[A], b: usize, nb: usize) -> [*const A; R] {
    let mut rows = [std::ptr::null(); R];
    for (i, row) in rows.iter_mut().enumerate() {
        *row = acts.as_ptr().add(i * nb + b);
    }
    rows
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q8_0_impl<const R: usize>(w: &[u8], acts: &[ActQ8], out: &mut [f32], nb: usize) {
    let mut acc = [_mm512_setzero_ps(); R];
    let flip = _mm512_set1_epi8(-128);
    for b in 0..nb {
        let p = w.as_ptr().add(b * Format::Q8_0.group_block_bytes());
        let a: [*const ActQ8; R] = rows_at(acts, b, nb);
        // Two chains per row, so `vpdpbusd` latency does not bound a single row.
        let mut even = [_mm512_setzero_si512(); R];
        let mut odd = [_mm512_setzero_si512(); R];
        for (even, &a) in even.iter_mut().zip(&a) {
            *even = _mm512_set1_epi32((*a).q8_offset);
        }
        for t in (0..8).step_by(2) {
            prefetch_ahead::<R>(p.add(32 + 64 * t));
            prefetch_ahead::<R>(p.add(96 + 64 * t));
            let q0 = _mm512_xor_si512(load(p.add(32 + 64 * t)), flip);
            let q1 = _mm512_xor_si512(load(p.add(96 + 64 * t)), flip);
            for i in 0..R {
                let x = (*a[i]).qs.as_ptr().add(4 * t);
                let (x0, x1) = (bcast4(x), bcast4(x.add(4)));
                dot2::<R>(&mut even[i], &mut odd[i], (q0, x0), (q1, x1));
            }
        }
        let dw = f16x16(p);
        for i in 0..R {
            let isum = join2::<R>(even[i], odd[i]);
            acc[i] = scaled_add(acc[i], dw, (*a[i]).d, isum);
        }
    }
    store_rows(&acc, out);
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q4_1_impl<const R: usize>(w: &[u8], acts: &[ActQ8], out: &mut [f32], nb: usize) {
    let mut acc = [_mm512_setzero_ps(); R];
    let m4 = _mm512_set1_epi8(0x0F);
    for b in 0..nb {
        let p = w.as_ptr().add(b * Format::Q4_1.group_block_bytes());
        prefetch_ahead::<R>(p.add(256));
        let a: [*const ActQ8; R] = rows_at(acts, b, nb);
        let mut lo_sum = [_mm512_setzero_si512(); R];
        let mut hi_sum = [_mm512_setzero_si512(); R];
        for t in 0..4 {
            prefetch_ahead::<R>(p.add(64 * t));
            let v = load(p.add(64 + 64 * t));
            let lo = _mm512_and_si512(v, m4);
            let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), m4);
            for i in 0..R {
                let x = (*a[i]).qs.as_ptr().add(4 * t);
                let (x0, x1) = (bcast4(x), bcast4(x.add(16)));
                dot2::<R>(&mut lo_sum[i], &mut hi_sum[i], (lo, x0), (hi, x1));
            }
        }
        let (dw, mw) = (f16x16(p), f16x16(p.add(32)));
        for i in 0..R {
            let a = &*a[i];
            let isum = join2::<R>(lo_sum[i], hi_sum[i]);
            let with_dot = scaled_add(acc[i], dw, a.d, isum);
            let min = _mm512_mul_ps(
                _mm512_mul_ps(mw, _mm512_set1_ps(a.d)),
                _mm512_set1_ps(a.sum as f32),
            );
            acc[i] = _mm512_add_ps(with_dot, min);
        }
    }
    store_rows(&acc, out);
}

/// Step `t` of a Q5_0 group-block's 5-bit weights (u8, 0..=31): the low and high nibbles of the
/// quants, each with its fifth bit from `hb` (bit `t`, resp. `t + 4`, moved to bit 4; the
/// 16-bit shifts carry nothing across bytes into bit 4).
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn q5_0_weights(p: *const u8, hb: __m512i, t: usize) -> (__m512i, __m512i) {
    let m4 = _mm512_set1_epi8(0x0F);
    let m10 = _mm512_set1_epi8(0x10);
    let v = load(p.add(32 + 64 * t));
    let (fifth_low, fifth_high) = match t {
        0 => (_mm512_slli_epi16::<4>(hb), hb),
        1 => (_mm512_slli_epi16::<3>(hb), _mm512_srli_epi16::<1>(hb)),
        2 => (_mm512_slli_epi16::<2>(hb), _mm512_srli_epi16::<2>(hb)),
        _ => (_mm512_slli_epi16::<1>(hb), _mm512_srli_epi16::<3>(hb)),
    };
    // `nibble | (fifth & 0x10)` in one instruction (truth table A | (B & C)).
    let low = _mm512_ternarylogic_epi32::<0xF8>(_mm512_and_si512(v, m4), fifth_low, m10);
    let high_nibble = _mm512_and_si512(_mm512_srli_epi16::<4>(v), m4);
    let high = _mm512_ternarylogic_epi32::<0xF8>(high_nibble, fifth_high, m10);
    (low, high)
}

/// Q5_0 as `Σ u · x − 16 · Σ x` (`u` the unsigned 5-bit weight): Q8_0's integer sum exactly.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q5_0_impl<const R: usize>(w: &[u8], acts: &[ActQ8], out: &mut [f32], nb: usize) {
    let mut acc = [_mm512_setzero_ps(); R];
    for b in 0..nb {
        let p = w.as_ptr().add(b * Format::Q5_0.group_block_bytes());
        prefetch_header::<R>(p, Format::Q5_0.group_block_bytes());
        let a: [*const ActQ8; R] = rows_at(acts, b, nb);
        let mut low_sum = [_mm512_setzero_si512(); R];
        let mut high_sum = [_mm512_setzero_si512(); R];
        for (sum, &a) in low_sum.iter_mut().zip(&a) {
            *sum = _mm512_set1_epi32((*a).q5_offset);
        }
        let hb = load(p.add(288));
        for t in 0..4 {
            let (low, high) = q5_0_weights(p, hb, t);
            for i in 0..R {
                let x = (*a[i]).qs.as_ptr().add(4 * t);
                let (x0, x1) = (bcast4(x), bcast4(x.add(16)));
                dot2::<R>(&mut low_sum[i], &mut high_sum[i], (low, x0), (high, x1));
            }
        }
        let dw = f16x16(p);
        for i in 0..R {
            let isum = join2::<R>(low_sum[i], high_sum[i]);
            acc[i] = scaled_add(acc[i], dw, (*a[i]).d, isum);
        }
    }
    store_rows(&acc, out);
}

/// Q4_K: `Σ_j sc_j · Σ u · x` over the block's 8 sub-blocks `j` (`u` the 4-bit weights) as an
/// exact integer, then `d` and `dmin · Σ_j m_j · Σ x` in floats. Each sub-block's sum starts at
/// `−8 · Σ x` (`q4k_offset32`), so it is `Σ (u − 8) · x`, which fits in 16 bits, and one
/// `vpdpwssd` multiplies it by the lanes' scales and adds it to the block's sum, where `vpmulld`
/// (two micro-ops, 10 cycles of latency) and `vpaddd` did it before; the centring's
/// `8 · Σ_j sc_j · Σ x` is added back per block with the mins' operands. The integer is the one
/// the other paths compute, so the result is bit-identical. Measured small: a 9-row 8960×1536
/// call in the 1.5B's forward 451–455 → 444–447 µs (the loop of `vpdpbusd` with broadcast
/// activations dominates: ~1.35 a cycle at best on a Xeon with AMX, against ~1.86 from registers).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q4k_impl<const R: usize>(w: &[u8], acts: &[ActQ8K], out: &mut [f32], nb: usize) {
    let mut acc = [_mm512_setzero_ps(); R];
    let m4 = _mm512_set1_epi8(0x0F);
    for b in 0..nb {
        let p = w.as_ptr().add(b * Format::Q4K.group_block_bytes());
        prefetch_header::<R>(p, 320);
        let a: [*const ActQ8K; R] = rows_at(acts, b, nb);
        let mut sacc = [_mm512_setzero_si512(); R];
        let mut centring = [_mm512_setzero_si512(); 4];
        for (pair, centring) in centring.iter_mut().enumerate() {
            let mut lo_sum = [_mm512_setzero_si512(); R];
            let mut hi_sum = [_mm512_setzero_si512(); R];
            for i in 0..R {
                let offset = (*a[i]).q4k_offset32.as_ptr().add(2 * pair);
                lo_sum[i] = _mm512_set1_epi32(*offset);
                hi_sum[i] = _mm512_set1_epi32(*offset.add(1));
            }
            for t in 0..8 {
                prefetch_ahead::<R>(p.add(320 + 512 * pair + 64 * t));
                let v = load(p.add(320 + 512 * pair + 64 * t));
                let lo = _mm512_and_si512(v, m4);
                let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), m4);
                for i in 0..R {
                    let x = (*a[i]).qs.as_ptr().add(64 * pair + 4 * t);
                    lo_sum[i] = _mm512_dpbusd_epi32(lo_sum[i], lo, bcast4(x));
                    hi_sum[i] = _mm512_dpbusd_epi32(hi_sum[i], hi, bcast4(x.add(32)));
                }
            }
            // The scales in the low 16 bits of each lane, 0 above: `vpdpwssd` then multiplies
            // the sums' low halves (the whole sums, which fit) by them.
            let sc_lo = _mm512_cvtepu8_epi32(_mm_loadu_si128(p.add(64 + 32 * pair).cast()));
            let sc_hi = _mm512_cvtepu8_epi32(_mm_loadu_si128(p.add(80 + 32 * pair).cast()));
            // (8 · sc_lo, 8 · sc_hi) as the i16 pairs the activations' sums pair with below.
            let both = _mm512_or_si512(sc_lo, _mm512_slli_epi32::<16>(sc_hi));
            *centring = _mm512_slli_epi16::<3>(both);
            for i in 0..R {
                sacc[i] = _mm512_dpwssd_epi32(sacc[i], lo_sum[i], sc_lo);
                sacc[i] = _mm512_dpwssd_epi32(sacc[i], hi_sum[i], sc_hi);
            }
        }
        let (d, dmin) = (f16x16(p), f16x16(p.add(32)));
        let mut mins = [_mm512_setzero_si512(); 4];
        for (q, m) in mins.iter_mut().enumerate() {
            *m = _mm512_cvtepu8_epi16(_mm256_loadu_si256(p.add(192 + 32 * q).cast()));
        }
        for i in 0..R {
            let a = &*a[i];
            let bsum = a.bsum32.as_ptr().cast::<i32>();
            let mut macc = _mm512_setzero_si512();
            for q in 0..4 {
                let pair = _mm512_set1_epi32(bsum.add(q).read_unaligned());
                macc = _mm512_dpwssd_epi32(macc, mins[q], pair);
                sacc[i] = _mm512_dpwssd_epi32(sacc[i], centring[q], pair);
            }
            let with_dot = scaled_add(acc[i], d, a.d, sacc[i]);
            let min = _mm512_mul_ps(
                _mm512_mul_ps(dmin, _mm512_set1_ps(a.d)),
                _mm512_cvtepi32_ps(macc),
            );
            acc[i] = _mm512_sub_ps(with_dot, min);
        }
    }
    store_rows(&acc, out);
}

/// The 128 weights of Q6_K sub-blocks `s = 8n + 2H + half` and `s + 4` (16 weights of each of
/// a group's 16 output rows: the `half`-th halves of parts `H` and `H + 2` of half `n`) as four
/// `(part H, part H + 2)` pairs of `vpdpbusd` operands, `q` in 0..64. The two parts share their
/// bytes: part `H` takes the low nibbles of `ql[H]` and bits `2H..2H + 2` of `qh`, part `H + 2`
/// the high nibbles and bits `2H + 4..2H + 6`, so each 64-byte load of `ql` and `qh` is
/// unpacked into two weight vectors (a shift, an `and` and a `vpternlogd` merge each).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q6k_unpack<const R: usize, const H: usize>(
    p: *const u8,
    n: usize,
    half: usize,
) -> [(__m512i, __m512i); 4] {
    let m4 = _mm512_set1_epi8(0x0F);
    let m30 = _mm512_set1_epi8(0x30);
    let ql = p.add(q6k_ql(n, H, 4 * half));
    let qh = p.add(q6k_qh(n, 4 * half));
    let mut q = [(_mm512_setzero_si512(), _mm512_setzero_si512()); 4];
    for (t, q) in q.iter_mut().enumerate() {
        prefetch_ahead::<R>(ql.add(64 * t));
        if H == 0 {
            prefetch_ahead::<R>(qh.add(64 * t));
        }
        let l = load(ql.add(64 * t));
        let h = load(qh.add(64 * t));
        let (h_low, h_high) = if H == 0 {
            (_mm512_slli_epi16::<4>(h), h)
        } else {
            (_mm512_slli_epi16::<2>(h), _mm512_srli_epi16::<2>(h))
        };
        // `l_bits | (h_bits & 0x30)` in one instruction (truth table A | (B & C)).
        let q_low = _mm512_ternarylogic_epi32::<0xF8>(_mm512_and_si512(l, m4), h_low, m30);
        let l_high = _mm512_and_si512(_mm512_srli_epi16::<4>(l), m4);
        *q = (
            q_low,
            _mm512_ternarylogic_epi32::<0xF8>(l_high, h_high, m30),
        );
    }
    q
}

/// Adds sub-blocks `s = 8n + 2H + half` and `s + 4` ([`q6k_unpack`]) to each row's integer sum
/// `Σ sc · Σ (q − 32) · x`; the `− 32` enters as the starting value (`q6k_offset16`). The
/// weights are unpacked once into 8 registers and then applied row by row, so a row holds only
/// its two chains while it runs and its sum across them: up to 10 rows take one pass (the
/// unpacking is not repeated per chunk of rows, and different rows' sums are independent for
/// out-of-order issue).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q6k_sub_blocks<const R: usize, const H: usize>(
    p: *const u8,
    n: usize,
    half: usize,
    a: &[*const ActQ8K; R],
    sacc: &mut [__m512i; R],
) {
    let s = 8 * n + 2 * H + half;
    let q = q6k_unpack::<R, H>(p, n, half);
    let sc_low = _mm512_cvtepi8_epi32(_mm_loadu_si128(p.add(32 + 16 * s).cast()));
    let sc_high = _mm512_cvtepi8_epi32(_mm_loadu_si128(p.add(32 + 16 * (s + 4)).cast()));
    for i in 0..R {
        let x = (*a[i]).qs.as_ptr().add(128 * n + 32 * H + 16 * half);
        let mut low = _mm512_set1_epi32((*a[i]).q6k_offset16[s]);
        let mut high = _mm512_set1_epi32((*a[i]).q6k_offset16[s + 4]);
        for (t, &(q_low, q_high)) in q.iter().enumerate() {
            low = _mm512_dpbusd_epi32(low, q_low, bcast4(x.add(4 * t)));
            high = _mm512_dpbusd_epi32(high, q_high, bcast4(x.add(64 + 4 * t)));
        }
        let scaled = _mm512_add_epi32(
            _mm512_mullo_epi32(low, sc_low),
            _mm512_mullo_epi32(high, sc_high),
        );
        sacc[i] = _mm512_add_epi32(sacc[i], scaled);
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q6k_impl<const R: usize>(w: &[u8], acts: &[ActQ8K], out: &mut [f32], nb: usize) {
    let mut acc = [_mm512_setzero_ps(); R];
    for b in 0..nb {
        let p = w.as_ptr().add(b * Format::Q6K.group_block_bytes());
        prefetch_header::<R>(p, 288);
        let a: [*const ActQ8K; R] = rows_at(acts, b, nb);
        let mut sacc = [_mm512_setzero_si512(); R];
        for n in 0..2 {
            // In address order: `ql[0]` with `qh`, then `ql[1]`.
            q6k_sub_blocks::<R, 0>(p, n, 0, &a, &mut sacc);
            q6k_sub_blocks::<R, 1>(p, n, 0, &a, &mut sacc);
            q6k_sub_blocks::<R, 0>(p, n, 1, &a, &mut sacc);
            q6k_sub_blocks::<R, 1>(p, n, 1, &a, &mut sacc);
        }
        let d = f16x16(p);
        for i in 0..R {
            acc[i] = scaled_add(acc[i], d, (*a[i]).d, sacc[i]);
        }
    }
    store_rows(&acc, out);
}

#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn f16_impl<const R: usize>(w: &[u8], x: &[f32], out: &mut [f32], in_dim: usize) {
    let mut acc = [_mm512_setzero_ps(); R];
    for k in 0..in_dim {
        let wk = f16x16(w.as_ptr().add(32 * k));
        for (i, acc) in acc.iter_mut().enumerate() {
            let xk = _mm512_set1_ps(*x.get_unchecked(i * in_dim + k));
            *acc = _mm512_add_ps(*acc, _mm512_mul_ps(wk, xk));
        }
    }
    store_rows(&acc, out);
}

#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn f32_impl<const R: usize>(w: &[u8], x: &[f32], out: &mut [f32], in_dim: usize) {
    let mut acc = [_mm512_setzero_ps(); R];
    for k in 0..in_dim {
        let wk = _mm512_loadu_ps(w.as_ptr().add(64 * k).cast());
        for (i, acc) in acc.iter_mut().enumerate() {
            let xk = _mm512_set1_ps(*x.get_unchecked(i * in_dim + k));
            *acc = _mm512_add_ps(*acc, _mm512_mul_ps(wk, xk));
        }
    }
    store_rows(&acc, out);
}
