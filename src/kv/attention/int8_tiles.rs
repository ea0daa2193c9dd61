//! The int8 path's two products on AMX tiles, for tasks of several lane chunks (a verify step, a
//! prefill chunk). They compute the integers the VNNI kernels in `int8` compute and round them
//! with the same float operations, so a row is bit-identical whichever computed it: a decode
//! row alone (VNNI, in place) equals the same row in a verify step (tiles).
//!
//! - **Scores.** `tdpbsud` multiplies 16 lanes' query parts (signed, `[lane][dim]`) by 16 keys
//!   as `k + 128` (unsigned; the packed K groups `[key / 16][dim / 4][16]` already are a B tile:
//!   a row holds 4 dimensions of each of 16 keys) into int32 sums over 64 dimensions, one
//!   product for each part.
//! - **Weighted values.** The int16 softmax weights are `w = 256 · wh + wl` with both bytes
//!   unsigned (weights are never negative), and `tdpbusd` multiplies each byte plane by V's int8
//!   values laid out as AMX wants them (`[key / 4][dim][4]`): `Σ w · v = 256 · Σ wh · v + Σ wl ·
//!   v`, exact in int32.
//!
//! Each product covers 64 terms, so these kernels need head dimensions that are a multiple of
//! 64; other heads stay on VNNI. Tiles are the 16 × 64-byte ones [`Tiles`](super::amx::Tiles)
//! configures: `tmm0`/`tmm1` two A tiles, `tmm2`/`tmm3` two B tiles, `tmm4`..`tmm7` the four
//! products `A0·B0, A1·B0, A0·B1, A1·B1`.

use super::bf16::{live, Out};
use super::bf16_pages::{prefetch_line, BlockPages};
use super::int8::REGROUP;
use crate::kv::storage::HeadRows;
use std::arch::asm;
use std::arch::x86_64::*;

/// Dimensions (scores) or keys (weighted values) one product sums.
pub(super) const DEPTH: usize = 64;

/// Four result tiles, 16 rows of 16 int32 each, where `store` puts them.
#[repr(C, align(64))]
struct Results([[[i32; 16]; 16]; 4]);

/// Whether the product is of signed A and unsigned B (`tdpbsud`: queries by keys) or of unsigned
/// A and signed B (`tdpbusd`: weights by values).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Signs {
    SignedByUnsigned,
    UnsignedBySigned,
}

/// The four products summed over `steps` steps of [`DEPTH`] terms: A tiles at `a0`, `a1` (rows
/// `a_stride` bytes apart, step `s` at `+ DEPTH · s`), B tiles at `b0` and `b0 + b_next` (rows
/// `b_stride` bytes apart, step `s` at `+ b_step · s`), stored into `out`.
///
/// # Safety
/// The tiles must be configured on this thread, the CPU must run AMX-INT8, and every tile read
/// must lie inside its buffer.
#[allow(clippy::too_many_arguments)]
unsafe fn products(
    signs: Signs,
    (a0, a1, a_stride): (*const u8, *const u8, usize),
    (b0, b_next, b_stride, b_step): (*const u8, usize, usize, usize),
    steps: usize,
    out: &mut Results,
) {
    asm!(
        "tilezero tmm4",
        "tilezero tmm5",
        "tilezero tmm6",
        "tilezero tmm7",
        options(nostack, nomem)
    );
    for s in 0..steps {
        let (a0, a1) = (a0.add(DEPTH * s), a1.add(DEPTH * s));
        let b0 = b0.add(b_step * s);
        let b1 = b0.add(b_next);
        // Every tile is loaded before the products (see `amx::step`).
        asm!(
            "tileloadd tmm0, [{a0} + {sa}*1]",
            "tileloadd tmm1, [{a1} + {sa}*1]",
            "tileloadd tmm2, [{b0} + {sb}*1]",
            "tileloadd tmm3, [{b1} + {sb}*1]",
            a0 = in(reg) a0, a1 = in(reg) a1, sa = in(reg) a_stride,
            b0 = in(reg) b0, b1 = in(reg) b1, sb = in(reg) b_stride,
            options(nostack, readonly),
        );
        if signs == Signs::SignedByUnsigned {
            asm!(
                "tdpbsud tmm4, tmm0, tmm2",
                "tdpbsud tmm5, tmm1, tmm2",
                "tdpbsud tmm6, tmm0, tmm3",
                "tdpbsud tmm7, tmm1, tmm3",
                options(nostack, nomem)
            );
        } else {
            asm!(
                "tdpbusd tmm4, tmm0, tmm2",
                "tdpbusd tmm5, tmm1, tmm2",
                "tdpbusd tmm6, tmm0, tmm3",
                "tdpbusd tmm7, tmm1, tmm3",
                options(nostack, nomem)
            );
        }
    }
    let p = out.0.as_mut_ptr().cast::<u8>();
    asm!(
        "tilestored [{p0} + {s}*1], tmm4",
        "tilestored [{p1} + {s}*1], tmm5",
        "tilestored [{p2} + {s}*1], tmm6",
        "tilestored [{p3} + {s}*1], tmm7",
        p0 = in(reg) p, p1 = in(reg) p.add(1024), p2 = in(reg) p.add(2048),
        p3 = in(reg) p.add(3072), s = in(reg) 64usize,
        options(nostack),
    );
}

/// The lanes' query parts as A tiles: `hi` and `lo` `[lane][hdp]`, lanes rounded up to 16.
pub(super) struct QueryTiles<'a> {
    pub(super) hi: &'a [i8],
    pub(super) lo: &'a [i8],
    pub(super) scale: &'a [f32],
    pub(super) bias: &'a [i32],
}

/// Every lane's scores against the block's first `keys` keys (a multiple of 16), as
/// `int8::scores_tile` computes them, and its running maxima.
///
/// A tile of 16 lanes keeps its two query parts in `tmm0`/`tmm1` (for heads of [`DEPTH`]
/// dimensions) and takes 16 keys at a time in two alternating sets (B in `tmm2`, products in
/// `tmm4`/`tmm5`; B in `tmm3`, products in `tmm6`/`tmm7`): tile registers are not renamed, so a
/// load into a tile the previous products still read waits for them, and with one set every
/// step waited for the last (a 50-row continuation's attention spent a quarter of its time in
/// tile loads that way).
///
/// # Safety
/// As `int8::block`; the CPU runs AMX-INT8 with the tiles configured; `packed_keys` holds the
/// block's K groups for `keys` rounded up to 32 keys; `hd` is a multiple of [`DEPTH`]; the query
/// buffers hold whole tiles of lanes.
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn scores(
    pages: &BlockPages,
    packed_keys: *const i32,
    hd: usize,
    q: &QueryTiles,
    keys: usize,
    lanes: usize,
    out: &Out,
) {
    let groups = hd / 4;
    // The slots' scales of 16-key vector `v` (0 past the block's keys).
    let key_scale = |v: usize| {
        let (page, slot) = pages.at(16 * v);
        let HeadRows::Q8 { scales, .. } = pages.keys[page] else {
            unreachable!("the int8 path reads q8 pages only")
        };
        let m = live(pages.slots_in(page), slot);
        _mm512_maskz_loadu_ps(m, scales.as_ptr().add(slot))
    };
    let mut results = Results([[[0; 16]; 16]; 4]);
    for l0 in (0..lanes).step_by(16) {
        let a = (
            q.hi.as_ptr().add(l0 * hd).cast::<u8>(),
            q.lo.as_ptr().add(l0 * hd).cast::<u8>(),
            hd,
        );
        let tile_lanes = l0..lanes.min(l0 + 16);
        if hd != DEPTH {
            for j in (0..keys).step_by(32) {
                let b = (
                    packed_keys.add(j / 16 * groups * 16).cast(),
                    groups * 64,
                    64,
                    16 * 64,
                );
                products(Signs::SignedByUnsigned, a, b, hd / DEPTH, &mut results);
                for c in 0..2 {
                    if j + 16 * c < keys {
                        let (hi, lo) = (&results.0[2 * c], &results.0[2 * c + 1]);
                        let vector = (j + 16 * c, key_scale(j / 16 + c));
                        score_rows(q, tile_lanes.clone(), (hi, lo), vector, out);
                    }
                }
            }
            continue;
        }
        asm!(
            "tileloadd tmm0, [{hi} + {s}*1]",
            "tileloadd tmm1, [{lo} + {s}*1]",
            hi = in(reg) a.0, lo = in(reg) a.1, s = in(reg) hd,
            options(nostack, readonly),
        );
        // Vector `v`'s products go to set `v % 2` and are stored into results `2 (v % 2)` and
        // `2 (v % 2) + 1`; the rows of vector `v − 1` are scored while `v`'s products run.
        for v in 0..keys / 16 {
            let b = packed_keys.add(v * groups * 16);
            let stored = results.0[2 * (v % 2)..].as_mut_ptr().cast::<u8>();
            if v % 2 == 0 {
                asm!(
                    "tileloadd tmm2, [{b} + {s}*1]",
                    "tilezero tmm4",
                    "tilezero tmm5",
                    "tdpbsud tmm4, tmm0, tmm2",
                    "tdpbsud tmm5, tmm1, tmm2",
                    b = in(reg) b, s = in(reg) 64usize,
                    options(nostack, readonly),
                );
            } else {
                asm!(
                    "tileloadd tmm3, [{b} + {s}*1]",
                    "tilezero tmm6",
                    "tilezero tmm7",
                    "tdpbsud tmm6, tmm0, tmm3",
                    "tdpbsud tmm7, tmm1, tmm3",
                    b = in(reg) b, s = in(reg) 64usize,
                    options(nostack, readonly),
                );
            }
            if v > 0 {
                let p = (v - 1) % 2;
                let (hi, lo) = (&results.0[2 * p], &results.0[2 * p + 1]);
                let vector = (16 * (v - 1), key_scale(v - 1));
                score_rows(q, tile_lanes.clone(), (hi, lo), vector, out);
            }
            if v % 2 == 0 {
                asm!(
                    "tilestored [{p} + {s}*1], tmm4",
                    "tilestored [{p1} + {s}*1], tmm5",
                    p = in(reg) stored, p1 = in(reg) stored.add(1024), s = in(reg) 64usize,
                    options(nostack),
                );
            } else {
                asm!(
                    "tilestored [{p} + {s}*1], tmm6",
                    "tilestored [{p1} + {s}*1], tmm7",
                    p = in(reg) stored, p1 = in(reg) stored.add(1024), s = in(reg) 64usize,
                    options(nostack),
                );
            }
        }
        if keys > 0 {
            let (v, p) = (keys / 16 - 1, (keys / 16 - 1) % 2);
            let (hi, lo) = (&results.0[2 * p], &results.0[2 * p + 1]);
            score_rows(q, tile_lanes.clone(), (hi, lo), (16 * v, key_scale(v)), out);
        }
    }
}

/// The scores of lanes `lanes` (one tile's, from `lanes.start`) against the 16 keys from `j`
/// whose scales are `key_scale`, from the parts' integer sums `hi` and `lo` (a row a lane).
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn score_rows(
    q: &QueryTiles,
    lanes: std::ops::Range<usize>,
    (hi, lo): (&[[i32; 16]; 16], &[[i32; 16]; 16]),
    (j, key_scale): (usize, __m512),
    out: &Out,
) {
    let l0 = lanes.start;
    for l in lanes {
        let (qs, bias) = (_mm512_set1_ps(q.scale[l]), _mm512_set1_epi32(q.bias[l]));
        let hi = _mm512_load_si512(hi[l - l0].as_ptr().cast());
        let lo = _mm512_load_si512(lo[l - l0].as_ptr().cast());
        // As `int8::scores_tile`, operation for operation.
        let sum = _mm512_add_epi32(_mm512_slli_epi32::<7>(hi), lo);
        let dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(sum, bias));
        let f = _mm512_mul_ps(dot, _mm512_mul_ps(key_scale, qs));
        out.store_row(l, j, f);
    }
}

/// V's first `keys` rows (a multiple of 4) of the block in AMX's B layout, `[key / 4][hd][4]`:
/// row `r` of a tile holds 4 keys of each of 16 dimensions. Prefetches the next block's pages on
/// the way.
///
/// # Safety
/// As `int8::block`; `out` holds `keys · hd` bytes; pages hold whole groups of 4 slots.
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
pub(super) unsafe fn pack_values(pages: &BlockPages, hd: usize, keys: usize, out: *mut u8) {
    let regroup = _mm512_loadu_si512(REGROUP.as_ptr().cast());
    let ps = pages.page_size;
    for r in 0..keys / 4 {
        let (page, slot) = pages.at(4 * r);
        let HeadRows::Q8 { values, .. } = pages.values[page] else {
            unreachable!("the int8 path reads q8 pages only")
        };
        let next = pages.next[page].1;
        let rows = values.as_ptr().add(slot * hd);
        if !next.is_empty() {
            for line in (0..4 * hd).step_by(64) {
                prefetch_line(next.as_ptr().wrapping_add(slot * hd + line));
            }
        }
        debug_assert!(slot + 4 <= ps);
        for d in (0..hd).step_by(16) {
            let row = |i: usize| _mm_loadu_si128(rows.add(i * hd + d).cast());
            let low = _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(row(0)), row(1));
            let high = _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(row(2)), row(3));
            let x = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(low), high);
            // Byte `4c + i` from byte `16i + c`: dimension `d + c` of key `4r + i`.
            let x = _mm512_permutexvar_epi8(regroup, x);
            _mm512_storeu_si512(out.add(r * 4 * hd + 4 * d).cast(), x);
        }
    }
}

/// Splits each lane's int16 weights `w[lane][..n]` (`w_stride` apart; 0 from `n` on, up to
/// `keys`, a multiple of [`DEPTH`]) into their low and high bytes, `[lane][keys]`.
///
/// # Safety
/// The CPU must support AVX-512 BW/VL; every index above inside its buffer.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
pub(super) unsafe fn split_weights(
    w: *const i16,
    w_stride: usize,
    lanes: usize,
    n: usize,
    keys: usize,
    (low, high): (*mut u8, *mut u8),
) {
    debug_assert!(n.is_multiple_of(16) && keys.is_multiple_of(DEPTH) && n <= keys);
    for l in 0..lanes {
        let (w, low, high) = (w.add(l * w_stride), low.add(l * keys), high.add(l * keys));
        for j in (0..keys).step_by(16) {
            let x = if j < n {
                _mm256_loadu_si256(w.add(j).cast())
            } else {
                _mm256_setzero_si256()
            };
            _mm_storeu_si128(low.add(j).cast(), _mm256_cvtepi16_epi8(x));
            let x = _mm256_srli_epi16::<8>(x);
            _mm_storeu_si128(high.add(j).cast(), _mm256_cvtepi16_epi8(x));
        }
    }
}

/// `o[l · hd + d] += step[l] · Σ_{k < keys} w[l][k] · v[k][d]` for every lane that sees keys
/// (`visible[l] > 0`), as `int8::values_tile` adds a block's sum: `w` as [`split_weights`] left
/// it, `v` as [`pack_values`] did.
///
/// # Safety
/// As [`scores`]; `keys` is a multiple of [`DEPTH`], the weight planes and packed values hold
/// that many keys for whole tiles of lanes.
#[target_feature(enable = "avx512f,avx512bw")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn accumulate(
    (low, high): (*const u8, *const u8),
    values: *const u8,
    keys: usize,
    visible: &[usize],
    step: &[f32],
    o: *mut f32,
    hd: usize,
) {
    let mut results = Results([[[0; 16]; 16]; 4]);
    for l0 in (0..visible.len()).step_by(16) {
        let a = (low.add(l0 * keys), high.add(l0 * keys), keys);
        for d in (0..hd).step_by(32) {
            // B tiles: 16 rows of 4 keys × 16 dimensions, `4 · hd` bytes apart; the second
            // tile's dimensions 16 further on; each step 64 keys on.
            let b = (values.add(4 * d), 64, 4 * hd, DEPTH * hd);
            products(Signs::UnsignedBySigned, a, b, keys / DEPTH, &mut results);
            for l in l0..visible.len().min(l0 + 16) {
                if visible[l] == 0 {
                    continue;
                }
                let row = l - l0;
                let step = _mm512_set1_ps(step[l]);
                for c in 0..2 {
                    let low = _mm512_load_si512(results.0[2 * c][row].as_ptr().cast());
                    let high = _mm512_load_si512(results.0[2 * c + 1][row].as_ptr().cast());
                    let sum = _mm512_add_epi32(_mm512_slli_epi32::<8>(high), low);
                    let at = o.add(l * hd + d + 16 * c);
                    _mm512_storeu_ps(
                        at,
                        _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), step, _mm512_loadu_ps(at)),
                    );
                }
            }
        }
    }
}
