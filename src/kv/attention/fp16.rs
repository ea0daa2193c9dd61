//! The fp16 path: both products of a block with AVX-512 FP16 multiply-adds, for f16 K/V.
//!
//! Intel cores with AVX-512 FP16 (Sapphire Rapids and later) run `vfmadd231ph` at the rate of
//! `vfmadd231ps`, 32 multiply-adds an instruction instead of 16, while their `vdpbf16ps` is
//! slower than either (measured on a Xeon of family 6 model 207: 2 `vfmadd231ph` a cycle,
//! one `vdpbf16ps` every 3.4). Where AMX is not exposed, the f32 path was the best these cores
//! had for a continuation's attention, and it also widens every f16 K/V element to f32 first.
//!
//! The operands are the bf16 path's (`bf16_block`) with fp16 in place of bf16:
//! - scores: the scaled queries in fp16 against K centred on the block's first key
//!   (`centred_keys`, in the pages' own layout: a row of keys per dimension), 32 keys a
//!   vector, each query element broadcast; the fp16 sums over the head's dimensions are widened
//!   to f32 and `offsets` (an f32 dot product with the first key) completes each score.
//!   Centring keeps the fp16 sums small: Qwen2.5's keys carry large components that vary
//!   slowly with position.
//! - softmax: `bf16::softmax_lane`, writing fp16 weights.
//! - weighted values: V rows read in place from the f16 pages (no packing), each key's weight
//!   broadcast; a lane's fp16 sums over the block (at most `plan::BLOCK_KEYS` keys, weights at
//!   most 1) are added to its f32 output once per block.
//!
//! Every sum runs in a fixed order per lane, whichever lanes share a tile, so a row's output
//! does not depend on the batch.
//!
//! Range: fp16 holds magnitudes up to 65504. The scores' sums are of scaled queries against
//! centred keys, so they are the scaled attention logits less the f32 offset; real models keep
//! those within a few hundred (a softmax saturates far below), and V's sums within a block are
//! weighted averages of V's f16 values times at most the block's keys. A model whose scaled
//! logits reached tens of thousands would overflow here: `MTPX_ATTENTION=f32` is the way out.

use super::bf16::{live, Out, MAX_LANES};
use super::bf16_block::{self, NextBlock};
use super::{bf16, seeing_chunks, Scratch};
use std::arch::x86_64::*;

/// Whether this CPU runs the kernels (AVX-512 FP16 and VL, and the bf16 path's AVX-512 BF16
/// helpers).
pub fn is_supported() -> bool {
    is_x86_feature_detected!("avx512fp16")
        && is_x86_feature_detected!("avx512vl")
        && bf16::is_supported()
}

/// Whether blocks of this layout can take the path (with f16 pages): whole vectors of 32
/// dimensions for the weighted values, pages of a multiple of 16 slots, so that a block spans
/// at most `in_place::MAX_PAGES` of them, and blocks of a multiple of 32 keys, so that the
/// scores' vectors of 32 keys stay inside a block's rows.
pub(super) fn usable(page_size: usize, head_dim: usize) -> bool {
    page_size.is_multiple_of(16)
        && head_dim.is_multiple_of(32)
        && super::plan::block_keys(page_size).is_multiple_of(32)
}

/// Largest finite fp16: centred keys are clamped to it, so that two f16 keys of opposite signs
/// cannot round to infinity.
const F16_MAX: f32 = 65504.0;

/// `out[i] = f16(x[i])` for `i < n` (a multiple of 16).
///
/// # Safety
/// The CPU must support the kernels; `x` and `out` hold `n` values.
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn to_f16(x: *const f32, n: usize, out: *mut u16) {
    for i in (0..n).step_by(16) {
        let h = _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_loadu_ps(x.add(i)),
        );
        _mm256_storeu_si256(out.add(i).cast(), h);
    }
}

/// The scores' K operand from an f16 page whose rows (dimensions) are `page_size` apart, in
/// the page's own layout: `out[d * out_stride + j] = f16(k[d][j] - r[d])` for `j < num_slots`
/// and `d < head_dim`, each difference taken in f32 and rounded once.
///
/// # Safety
/// The CPU must support the kernels; `rows` are f16, `r` holds `head_dim` floats and `out` has
/// room for every index above.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
pub(super) unsafe fn centred_keys(
    rows: &[half::f16],
    num_slots: usize,
    head_dim: usize,
    r: *const f32,
    out: *mut u16,
    out_stride: usize,
) {
    let page_size = rows.len() / head_dim;
    let k = rows.as_ptr().cast::<u16>();
    let (lo, hi) = (_mm512_set1_ps(-F16_MAX), _mm512_set1_ps(F16_MAX));
    for j in (0..num_slots).step_by(16) {
        let m = live(num_slots, j);
        for d in 0..head_dim {
            let x = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, k.add(d * page_size + j).cast()));
            let x = _mm512_sub_ps(x, _mm512_set1_ps(*r.add(d)));
            let x = _mm512_min_ps(_mm512_max_ps(x, lo), hi);
            let h = _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x);
            _mm256_mask_storeu_epi16(out.add(d * out_stride + j).cast(), m, h);
        }
    }
}

/// A block on the fp16 path: every lane's scores, softmax step and weighted values, lane chunk
/// by lane chunk, with the block's centred keys in `s.kt2` (as `u16`, rows of `bs`) and its V
/// pages `values`
/// (`page_size` slots a page).
///
/// # Safety
/// The CPU must support the kernels, and the scratch must be sized as `attend_task` sizes it
/// for `lanes` lanes on the bf16 path, with the block's centred keys in place.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn block(
    s: &mut Scratch,
    values: &[&[half::f16]],
    page_size: usize,
    next: &NextBlock,
    lanes: usize,
    hd: usize,
    hdp: usize,
    bs: usize,
) {
    bf16_block::start_block(s, lanes, hd);
    let mut rows = [std::ptr::null::<u16>(); super::in_place::MAX_PAGES];
    for (row, page) in rows.iter_mut().zip(values) {
        *row = page.as_ptr().cast();
    }
    let v = Values {
        rows,
        page_size,
        head_dim: hd,
    };
    let mut chunks = std::mem::take(&mut s.chunks);
    chunks.clear();
    chunks.extend(seeing_chunks(&s.visible[..lanes], MAX_LANES));
    for (i, &(l0, l1, keys)) in chunks.iter().enumerate() {
        next.prefetch_share(i, chunks.len());
        let n = l1 - l0;
        let keys16 = keys.next_multiple_of(16);
        let out = Out {
            s: s.s[l0 * bs..].as_mut_ptr(),
            s_stride: bs,
            visible: s.visible[l0..].as_ptr(),
            maxima: s.maxima[l0 * 16..].as_mut_ptr(),
        };
        let (q16, k) = (s.q16[l0 * hdp..].as_ptr(), s.kt2.as_ptr().cast::<u16>());
        let keys32 = keys.next_multiple_of(32);
        let mut j = 0;
        while j + 64 <= keys32 {
            by_lanes!(
                n,
                scores_tile::<_, 2>(q16, hdp, k.add(j), bs, hd, j, keys16, &out)
            );
            j += 64;
        }
        if j < keys32 {
            by_lanes!(
                n,
                scores_tile::<_, 1>(q16, hdp, k.add(j), bs, hd, j, keys16, &out)
            );
        }
        bf16_block::chunk_softmax(s, l0..l1, keys16, hdp, bs, bf16::Weights::F16);
        let (w, o) = (s.p16[l0 * bs..].as_ptr(), s.o[l0 * hdp..].as_mut_ptr());
        accumulate(&v, w, bs, n, keys, o, hdp);
    }
    s.chunks = chunks;
}

/// `L` lanes × `32 · KC` keys from key `j`: the fp16 sums over `head_dim` dimensions of each
/// lane's query (`q` rows `q_stride` apart, each element broadcast) times the centred keys (`k`
/// rows, one a dimension, `k_stride` apart), in f32, stored with the lanes' running maxima for
/// the keys below `keys16` (the keys of the chunk rounded up to 16).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512fp16")]
#[allow(clippy::too_many_arguments)]
unsafe fn scores_tile<const L: usize, const KC: usize>(
    q: *const u16,
    q_stride: usize,
    k: *const u16,
    k_stride: usize,
    head_dim: usize,
    j: usize,
    keys16: usize,
    out: &Out,
) {
    let mut acc = [[_mm512_setzero_ph(); KC]; L];
    for d in 0..head_dim {
        let row = k.add(d * k_stride);
        let mut x = [_mm512_setzero_ph(); KC];
        for (c, x) in x.iter_mut().enumerate() {
            *x = _mm512_castsi512_ph(_mm512_loadu_si512(row.add(32 * c).cast()));
        }
        for (l, acc) in acc.iter_mut().enumerate() {
            let y = q.add(l * q_stride + d);
            for c in 0..KC {
                acc[c] = fmadd_broadcast(acc[c], x[c], y);
            }
        }
    }
    for c in 0..KC {
        let at = j + 32 * c;
        let mut sums = [[_mm512_setzero_ps(); 2]; L];
        for (sums, acc) in sums.iter_mut().zip(&acc) {
            let x = _mm512_castph_si512(acc[c]);
            sums[0] = _mm512_cvtph_ps(_mm512_castsi512_si256(x));
            sums[1] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64::<1>(x));
        }
        if at + 32 <= keys16 {
            out.store_tile(at, &sums);
        } else {
            // The chunk's keys end in this vector's first half: the second lies past the
            // scores' row.
            let first = sums.map(|s| [s[0]]);
            out.store_tile(at, &first);
        }
    }
}

/// A block's V pages: row `slot` of page `i` (`head_dim` f16) at `rows[i] + slot · head_dim`.
struct Values {
    rows: [*const u16; super::in_place::MAX_PAGES],
    page_size: usize,
    head_dim: usize,
}

/// `o[l · o_stride + d] += Σ_{j < keys} w[l][j] · v[j][d]` for `lanes` lanes (fp16 weights,
/// `w` rows `w_stride` apart) and `d < head_dim`, summed in fp16 over the block and added to
/// the f32 `o` once.
///
/// # Safety
/// The CPU must support the kernels; `keys` lie in the pages and every index above must be
/// inside its buffer.
#[target_feature(enable = "avx512f,avx512bw,avx512fp16")]
unsafe fn accumulate(
    v: &Values,
    w: *const u16,
    w_stride: usize,
    lanes: usize,
    keys: usize,
    o: *mut f32,
    o_stride: usize,
) {
    debug_assert!((1..=MAX_LANES).contains(&lanes));
    let mut d = 0;
    while d + 64 <= v.head_dim {
        by_lanes!(
            lanes,
            values_tile::<_, 2>(v, d, w, w_stride, keys, o, o_stride)
        );
        d += 64;
    }
    if d < v.head_dim {
        by_lanes!(
            lanes,
            values_tile::<_, 1>(v, d, w, w_stride, keys, o, o_stride)
        );
    }
}

/// `L` lanes × `32 · DC` dimensions from `d` of [`accumulate`], all sums in registers.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512fp16")]
unsafe fn values_tile<const L: usize, const DC: usize>(
    v: &Values,
    d: usize,
    w: *const u16,
    w_stride: usize,
    keys: usize,
    o: *mut f32,
    o_stride: usize,
) {
    let mut acc = [[_mm512_setzero_ph(); DC]; L];
    let mut j = 0;
    for &page in &v.rows[..keys.div_ceil(v.page_size)] {
        let slots = v.page_size.min(keys - j);
        for slot in 0..slots {
            let row = page.add(slot * v.head_dim + d);
            let mut x = [_mm512_setzero_ph(); DC];
            for (c, x) in x.iter_mut().enumerate() {
                *x = _mm512_castsi512_ph(_mm512_loadu_si512(row.add(32 * c).cast()));
            }
            for (l, acc) in acc.iter_mut().enumerate() {
                let y = w.add(l * w_stride + j);
                for c in 0..DC {
                    acc[c] = fmadd_broadcast(acc[c], x[c], y);
                }
            }
            j += 1;
        }
    }
    for (l, acc) in acc.iter().enumerate() {
        for (c, acc) in acc.iter().enumerate() {
            let x = _mm512_castph_si512(*acc);
            let at = o.add(l * o_stride + d + 32 * c);
            for (h, half) in [_mm512_castsi512_si256(x), _mm512_extracti64x4_epi64::<1>(x)]
                .into_iter()
                .enumerate()
            {
                let dst = at.add(16 * h);
                _mm512_storeu_ps(
                    dst,
                    _mm512_add_ps(_mm512_loadu_ps(dst), _mm512_cvtph_ps(half)),
                );
            }
        }
    }
}

/// `acc + x · w` with the fp16 weight at `w` broadcast to every element by the multiply-add's
/// own memory operand (`{1to32}`). Broadcasting a 16-bit value into a register takes a shuffle
/// on port 5, one of the two ports that run the multiply-adds; the embedded broadcast is a load
/// only. (The compiler folds it only where a broadcast feeds one multiply-add.)
///
/// # Safety
/// The CPU must support AVX-512 FP16; `w` must be readable. The function carries its own target
/// features (a `zmm` operand needs `avx512f` on the function itself, whatever `-C target-cpu`
/// says); its callers have the same ones, so it still inlines into their loops.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512fp16")]
unsafe fn fmadd_broadcast(acc: __m512h, x: __m512h, w: *const u16) -> __m512h {
    let mut acc = _mm512_castph_ps(acc);
    std::arch::asm!(
        "vfmadd231ph {acc}, {x}, word ptr [{w}]{{1to32}}",
        acc = inout(zmm_reg) acc,
        x = in(zmm_reg) _mm512_castph_ps(x),
        w = in(reg) w,
        options(pure, readonly, nostack, preserves_flags),
    );
    _mm512_castps_ph(acc)
}
