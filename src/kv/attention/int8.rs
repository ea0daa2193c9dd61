//! Attention over q8 pages in integers (AVX-512 VNNI and VBMI), K and V read in place.
//!
//! A q8 page holds every key and value row as int8 with one f32 scale per slot (keys also over
//! fixed channel scales, which the queries carry), so both products can be integer dot
//! products, exact in int32, with every rounding in a few f32 multiplies around them. Per key
//! that is a third of the operations of turning the integers into bf16 pairs first, which is
//! what made one decode row over a long q8 context compute-bound.
//!
//! - **Scores.** Each lane's query is quantised once per task in two int8 parts against its
//!   largest component, `q ≈ sq · (hi + lo / 128)`: about 15 bits. (One part, 8 bits, was not
//!   enough: the queries carry the keys' channel scales, whose outlier channels then set the
//!   step of every other component; Qwen2.5-Coder-0.5B's logits moved by up to 1.7 against the
//!   numpy reference, SmolLM2's by 3.6.) `vpdpbusd` multiplies 4 unsigned bytes by 4 signed
//!   ones and adds the products to an int32: the keys are the unsigned side as
//!   `k ^ 0x80 = k + 128`, and the `128 · Σu` this adds is taken off again, so a score is
//!   `(128 Σ k·hi + Σ k·lo) · (sk · sq / 128)`. K rows are `[dim][slot]`; 4 dims × 16 slots (one
//!   64-byte vector on pages of 16) are regrouped by `vpermb` into the 16 groups of a slot's 4
//!   dims that `vpdpbusd` takes, once for both parts.
//! - **Weighted values.** A lane's softmax weights of a block, with V's slot scales folded in
//!   (`e_j · sv_j`), are quantised to int16 against their bound `max e · max sv` (so at most
//!   32767, 15 bits where the bf16 path keeps 8), and `vpdpwssd` multiplies pairs of them by
//!   pairs of V's int8 values (sign-extended). A block's sums (at most 128 · 32767 · 128 <
//!   2^31) join the lane's f32 output once per block, times the quantisation step.
//!
//! A task of one lane chunk (a decode row) reads the operands straight from the pages; a task
//! of more lanes builds them once per block into scratch (`pack`) for all its chunks. Both
//! give the same integers.
//!
//! A lane's arithmetic depends only on its own query, the keys it sees and the absolute block
//! it is in, and the integer sums do not depend on their order: a row is bit-identical alone,
//! in any batch and in any split, as the other paths are.

use super::bf16::{advance, exp_below, lane_max, live, sum_vectors, Out, MAX_LANES};
use super::bf16_pages::{prefetch_line, BlockPages};
use super::int8_tiles;
use super::{seeing_chunks, Scratch};
use crate::kv::storage::HeadRows;
use std::arch::x86_64::*;
use std::sync::OnceLock;

/// Whether this CPU runs the kernels (AVX-512 F/BW, VNNI and VBMI).
pub fn is_supported() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vnni")
        && is_x86_feature_detected!("avx512vbmi")
}

/// Whether pages of this layout can be read by the kernels.
pub(super) fn usable(page_size: usize, head_dim: usize) -> bool {
    page_size.is_multiple_of(16) && head_dim.is_multiple_of(16) && head_dim <= 256
}

/// The path's per-task buffers: the lanes' int8 query parts, 8 lanes' 4 dims of both parts in one
/// cache line (`[lane / 8][dim / 4][lane % 8][hi, lo][4]`: a tile reads one pointer plus
/// constant offsets), each lane's scale
/// (`sq / 128`) and `128 · (128 Σhi + Σlo)`, the block's V slot scales `[bs]` and each lane's
/// weight step of the current block.
#[derive(Default)]
pub(super) struct Int8Scratch {
    queries: Vec<i8>,
    /// One lane's two parts before they are laid out.
    parts: Vec<i8>,
    query_scale: Vec<f32>,
    query_bias: Vec<i32>,
    value_scales: Vec<f32>,
    weight_step: Vec<f32>,
    /// The block's operands for tasks of several lane chunks: K groups `[key / 16][dim / 4][16]`
    /// and V pairs `[key / 2][head_dim]` (dwords, in the kernels' order).
    keys: Vec<i32>,
    values: Vec<i32>,
    /// Whether this task's products run on AMX tiles ([`uses_tiles`]), and their operands: the
    /// query parts `[lane][hdp]`, the weights' byte planes `[lane][keys]` and V `[key / 4][hdp][4]`
    /// (lanes rounded up to a tile).
    tiles: bool,
    query_hi: Vec<i8>,
    query_lo: Vec<i8>,
    weight_low: Vec<u8>,
    weight_high: Vec<u8>,
    tile_values: Vec<u8>,
}

impl Int8Scratch {
    /// Whether the current task's products run on AMX tiles (set by [`prepare`]).
    pub(super) fn tiles(&self) -> bool {
        self.tiles
    }
}

/// Whether a task of `lanes` lanes runs its products on AMX tiles: tasks of several lane chunks
/// (which pack the block's operands anyway), on CPUs with AMX-INT8, for head dimensions
/// the tiles' 64-term products cover. `MTPX_INT8_TILES=0` (read once) keeps them on VNNI.
pub(super) fn uses_tiles(lanes: usize, hd: usize) -> bool {
    static ALLOWED: OnceLock<bool> = OnceLock::new();
    let allowed = *ALLOWED.get_or_init(|| {
        std::env::var("MTPX_INT8_TILES").map_or(true, |v| v.trim() != "0")
            && super::amx::int8_is_supported()
    });
    allowed && lanes > MAX_LANES && hd.is_multiple_of(int8_tiles::DEPTH)
}

/// Keys a tile product covers past `keys` (the B tiles read whole steps).
fn tile_keys(keys: usize) -> usize {
    keys.next_multiple_of(int8_tiles::DEPTH)
}

/// Where a kernel takes its operands from.
trait Source {
    const PACKED: bool;
}
/// From the pages, as it goes.
struct InPlace;
/// From the block's packed operands.
struct Packed;
impl Source for InPlace {
    const PACKED: bool = false;
}
impl Source for Packed {
    const PACKED: bool = true;
}

/// `vpermb` indices taking 4 rows of 16 bytes (`[dim][slot]`) to 16 groups of 4 (`[slot][dim]`).
pub(super) const REGROUP: [u8; 64] = {
    let mut idx = [0u8; 64];
    let mut b = 0;
    while b < 64 {
        idx[b] = ((b % 4) * 16 + b / 4) as u8;
        b += 1;
    }
    idx
};

/// `vpermt2d` indices putting a pair of `unpacklo/hi_epi16` results (dimensions 8k..8k+4 and
/// 8k+4..8k+8 in 128-bit lane k) back in order: dimensions 0..16, then 16..32.
const IN_ORDER: [[u32; 16]; 2] = [
    [0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23],
    [8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31],
];

/// Sizes the buffers for a task of `lanes` lanes and quantises its queries (`s.q`, `[lane][hdp]`).
pub(super) fn prepare(s: &mut Scratch, lanes: usize, hdp: usize, bs: usize) {
    s.p16.resize(lanes * bs, 0);
    let t = &mut s.int8;
    t.tiles = uses_tiles(lanes, hdp);
    if t.tiles {
        let (tile_lanes, keys) = (lanes.next_multiple_of(16), tile_keys(bs));
        t.query_hi.resize(tile_lanes * hdp, 0);
        t.query_lo.resize(tile_lanes * hdp, 0);
        t.weight_low.resize(tile_lanes * keys, 0);
        t.weight_high.resize(tile_lanes * keys, 0);
        t.tile_values.resize(keys * hdp, 0);
    }
    let groups = hdp / 4;
    t.queries.clear();
    t.queries.resize(lanes.div_ceil(MAX_LANES) * groups * 64, 0);
    t.query_scale.resize(lanes, 0.0);
    t.query_bias.resize(lanes, 0);
    t.value_scales.resize(bs, 0.0);
    t.weight_step.resize(lanes, 0.0);
    if lanes > MAX_LANES {
        // (The score tiles read 32 keys at a time.)
        t.keys.resize(bs.next_multiple_of(32) * hdp / 4, 0);
        t.values.resize(bs.div_ceil(2) * hdp, 0);
    }
    t.parts.resize(2 * hdp, 0);
    let (hi, lo) = t.parts.split_at_mut(hdp);
    for lane in 0..lanes {
        let q = &s.q[lane * hdp..(lane + 1) * hdp];
        (t.query_scale[lane], t.query_bias[lane]) = quantize_query(q, hi, lo);
        if t.tiles {
            // The tiles take the parts as they are; the VNNI layout below is not read.
            t.query_hi[lane * hdp..][..hdp].copy_from_slice(hi);
            t.query_lo[lane * hdp..][..hdp].copy_from_slice(lo);
            continue;
        }
        let (chunk, sub) = (lane / MAX_LANES, lane % MAX_LANES);
        for g in 0..groups {
            let at = ((chunk * groups + g) * MAX_LANES + sub) * 8;
            t.queries[at..at + 4].copy_from_slice(&hi[4 * g..4 * g + 4]);
            t.queries[at + 4..at + 8].copy_from_slice(&lo[4 * g..4 * g + 4]);
        }
    }
}

/// `hi = round(q / sq)` with `sq = max |q| / 127`, and `lo = round(128 (q / sq - hi))`; returns
/// `sq / 128` and `128 · (128 Σhi + Σlo)` (what the keys' `+ 128` adds to a score's sums).
fn quantize_query(q: &[f32], hi: &mut [i8], lo: &mut [i8]) -> (f32, i32) {
    let max = q.iter().fold(0f32, |m, x| m.max(x.abs()));
    if max == 0.0 || !max.is_finite() {
        hi.fill(0);
        lo.fill(0);
        return (0.0, 0);
    }
    let inv = 127.0 / max;
    let mut sum = 0i32;
    for ((hi, lo), &x) in hi.iter_mut().zip(lo.iter_mut()).zip(q) {
        let x = x * inv;
        let h = x.round().clamp(-127.0, 127.0);
        *hi = h as i8;
        *lo = ((x - h) * 128.0).round().clamp(-127.0, 127.0) as i8;
        sum += 128 * *hi as i32 + *lo as i32;
    }
    (max / 127.0 / 128.0, 128 * sum)
}

/// A block on this path: every lane's scores, softmax step and weighted values, lane chunk by
/// lane chunk, over the block's pages.
///
/// # Safety
/// The CPU must support the kernels, the pages must be q8 of a usable layout, and the scratch
/// must be sized as `attend_task` sizes it (with [`prepare`] run).
pub(super) unsafe fn block(
    s: &mut Scratch,
    pages: &BlockPages,
    lanes: usize,
    nk: usize,
    hd: usize,
    hdp: usize,
    bs: usize,
) {
    let scales = &mut s.int8.value_scales;
    scales.fill(0.0);
    for (i, rows) in pages.values[..pages.len].iter().enumerate() {
        let HeadRows::Q8 { scales: page, .. } = rows else {
            unreachable!("the int8 path reads q8 pages only")
        };
        let n = pages.slots_in(i);
        scales[i * pages.page_size..][..n].copy_from_slice(&page[..n]);
    }
    s.maxima.clear();
    s.maxima.resize(lanes * 16, f32::NEG_INFINITY);
    // V's largest scale over the block: every lane's bound but for lanes that see part of it.
    let block_sv = visible_max(s.int8.value_scales.as_ptr(), nk);
    if s.int8.tiles {
        tiled_block(s, pages, lanes, nk, hd, bs, block_sv);
        return;
    }
    let packed = lanes > MAX_LANES;
    if packed {
        let t = &mut s.int8;
        pack(pages, hd, t.keys.as_mut_ptr(), t.values.as_mut_ptr());
    }
    let operands = (s.int8.keys.as_ptr(), s.int8.values.as_ptr());
    let mut chunks = std::mem::take(&mut s.chunks);
    chunks.clear();
    chunks.extend(seeing_chunks(&s.visible[..lanes], MAX_LANES));
    for &(l0, l1, keys) in &chunks {
        let n = l1 - l0;
        let t = &s.int8;
        let out = Out {
            s: s.s[l0 * bs..].as_mut_ptr(),
            s_stride: bs,
            visible: s.visible[l0..].as_ptr(),
            maxima: s.maxima[l0 * 16..].as_mut_ptr(),
        };
        // (Chunks start at multiples of MAX_LANES.)
        let queries = (
            t.queries[l0 / MAX_LANES * (hdp / 4) * 64..].as_ptr(),
            t.query_scale[l0..].as_ptr(),
            t.query_bias[l0..].as_ptr(),
        );
        let keys16 = keys.next_multiple_of(16);
        if packed {
            scores::<Packed>(pages, operands, hd, queries, n, keys16, &out);
        } else {
            scores::<InPlace>(pages, operands, hd, queries, n, keys16, &out);
        }
        softmax_lanes(s, (l0, l1), nk, block_sv, bs, hdp);
        let w = (s.p16[l0 * bs..].as_ptr().cast::<i16>(), bs);
        let step = s.int8.weight_step[l0..].as_ptr();
        let (pairs, o) = (keys.div_ceil(2), s.o[l0 * hdp..].as_mut_ptr());
        if packed {
            accumulate::<Packed>(pages, operands, w, n, pairs, step, o, hd);
        } else {
            accumulate::<InPlace>(pages, operands, w, n, pairs, step, o, hd);
        }
    }
    s.chunks = chunks;
}

/// [`block`] with both products on AMX tiles ([`int8_tiles`]): every lane's scores, then every
/// lane's softmax step, then every lane's weighted values; each lane's arithmetic is the one the
/// VNNI kernels do chunk by chunk.
///
/// # Safety
/// As [`block`]; [`prepare`] found the task [`uses_tiles`] and the tiles are configured.
unsafe fn tiled_block(
    s: &mut Scratch,
    pages: &BlockPages,
    lanes: usize,
    nk: usize,
    hd: usize,
    bs: usize,
    block_sv: f32,
) {
    let seen = s.visible[..lanes].iter().copied().max().unwrap_or(0);
    if seen == 0 {
        return;
    }
    let t = &mut s.int8;
    pack_keys(pages, hd, t.keys.as_mut_ptr());
    let keys = tile_keys(seen);
    int8_tiles::pack_values(
        pages,
        hd,
        seen.next_multiple_of(4),
        t.tile_values.as_mut_ptr(),
    );
    let queries = int8_tiles::QueryTiles {
        hi: &t.query_hi,
        lo: &t.query_lo,
        scale: &t.query_scale,
        bias: &t.query_bias,
    };
    let out = Out {
        s: s.s.as_mut_ptr(),
        s_stride: bs,
        visible: s.visible.as_ptr(),
        maxima: s.maxima.as_mut_ptr(),
    };
    let keys16 = seen.next_multiple_of(16);
    int8_tiles::scores(pages, t.keys.as_ptr(), hd, &queries, keys16, lanes, &out);
    for l0 in (0..lanes).step_by(MAX_LANES) {
        softmax_lanes(s, (l0, (l0 + MAX_LANES).min(lanes)), nk, block_sv, bs, hd);
    }
    let t = &mut s.int8;
    let planes = (t.weight_low.as_mut_ptr(), t.weight_high.as_mut_ptr());
    let w = s.p16.as_ptr().cast::<i16>();
    let written = nk.next_multiple_of(16).min(keys);
    int8_tiles::split_weights(w, bs, lanes, written, keys, planes);
    int8_tiles::accumulate(
        (t.weight_low.as_ptr(), t.weight_high.as_ptr()),
        t.tile_values.as_ptr(),
        keys,
        &s.visible[..lanes],
        &t.weight_step,
        s.o.as_mut_ptr(),
        hd,
    );
}

/// Each lane's softmax step over the block, lanes `l0..l1` (at most [`MAX_LANES`]), from the
/// scores and maxima the products left: int16 weights into `s.p16`, their steps into
/// `weight_step`, the lanes' running state moved on.
///
/// # Safety
/// As [`block`].
unsafe fn softmax_lanes(
    s: &mut Scratch,
    (l0, l1): (usize, usize),
    nk: usize,
    block_sv: f32,
    bs: usize,
    hdp: usize,
) {
    let weights = nk.next_multiple_of(16);
    // The lanes' block maxima first: the horizontal reductions' chains then overlap instead
    // of each stalling its lane's exponentials.
    let mut row_max = [0f32; MAX_LANES];
    for (lane, m) in (l0..l1).zip(&mut row_max) {
        *m = lane_max(s.maxima[lane * 16..].as_ptr());
    }
    for (lane, &row_max) in (l0..l1).zip(&row_max) {
        let visible = s.visible[lane];
        let w = s.p16[lane * bs..].as_mut_ptr().cast::<i16>();
        if visible == 0 {
            // Weights of zero: the lane shares the products with lanes that see keys.
            std::ptr::write_bytes(w, 0, weights);
            s.int8.weight_step[lane] = 0.0;
            continue;
        }
        let sv = s.int8.value_scales.as_ptr();
        let sv_max = if visible == nk {
            block_sv
        } else {
            visible_max(sv, visible)
        };
        let lane_state = (
            &mut s.max[lane],
            s.sums[lane * 16..].as_mut_ptr(),
            s.o[lane * hdp..].as_mut_ptr(),
            hdp,
        );
        let row = s.s[lane * bs..].as_ptr();
        s.int8.weight_step[lane] =
            softmax_lane(row, visible, weights, row_max, (sv, sv_max), lane_state, w);
    }
}

/// A chunk's quantised queries from its first lane (laid out as [`Int8Scratch`] says), each
/// lane's scale and bias.
type Queries = (*const i8, *const f32, *const i32);

/// The packed K groups and V pairs ([`Int8Scratch`]; unused in place).
type Operands = (*const i32, *const i32);

/// Builds the block's K groups and V pairs, as the in-place kernels build them, into `keys`
/// and `values`, and prefetches the next block's pages on the way.
///
/// # Safety
/// As [`block`]; the buffers are sized as [`prepare`] sizes them.
unsafe fn pack(pages: &BlockPages, hd: usize, keys: *mut i32, values: *mut i32) {
    pack_keys(pages, hd, keys);
    pack_value_pairs(pages, hd, values);
}

/// The block's K groups, as [`pack`] says.
///
/// # Safety
/// As [`pack`].
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
unsafe fn pack_keys(pages: &BlockPages, hd: usize, keys: *mut i32) {
    let regroup = _mm512_loadu_si512(REGROUP.as_ptr().cast());
    let flip = _mm512_set1_epi8(-128);
    let ps = pages.page_size;
    let groups = hd / 4;
    for v in 0..pages.nk.div_ceil(16) {
        let (page, slot) = pages.at(16 * v);
        let HeadRows::Q8 { values: k, .. } = pages.keys[page] else {
            unreachable!("the int8 path reads q8 pages only")
        };
        let next = pages.next[page].0;
        for g in 0..groups {
            let at = slot + 4 * g * ps;
            if !next.is_empty() {
                for r in (0..4).step_by(if ps == 16 { 4 } else { 1 }) {
                    prefetch_line(next.as_ptr().wrapping_add(at + r * ps));
                }
            }
            let rows = four_rows(k.as_ptr().add(at), ps);
            let x = _mm512_xor_si512(_mm512_permutexvar_epi8(regroup, rows), flip);
            _mm512_storeu_si512(keys.add((v * groups + g) * 16).cast(), x);
        }
    }
}

/// The block's V pairs, as [`pack`] says.
///
/// # Safety
/// As [`pack`].
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn pack_value_pairs(pages: &BlockPages, hd: usize, values: *mut i32) {
    let pairs_per_page = pages.page_size / 2;
    for i in 0..pages.nk.div_ceil(2) {
        let page = i / pairs_per_page;
        let HeadRows::Q8 { values: v, .. } = pages.values[page] else {
            unreachable!("the int8 path reads q8 pages only")
        };
        let at = 2 * (i - page * pairs_per_page) * hd;
        let next = pages.next[page].1;
        if !next.is_empty() {
            for line in (0..2 * hd).step_by(64) {
                prefetch_line(next.as_ptr().wrapping_add(at + line));
            }
        }
        let out = values.add(i * hd);
        let mut d = 0;
        while d + 32 <= hd {
            let x = value_pairs::<2>(v.as_ptr().add(at + d), hd);
            _mm512_storeu_si512(out.add(d).cast(), x[0]);
            _mm512_storeu_si512(out.add(d + 16).cast(), x[1]);
            d += 32;
        }
        if d < hd {
            let x = value_pairs::<1>(v.as_ptr().add(at + d), hd);
            _mm512_storeu_si512(out.add(d).cast(), x[0]);
        }
    }
}

/// Each lane's scores against the block's first `keys` keys (a multiple of 16) and its running
/// maxima, into `out`. Scores of keys past the block's are 0.
///
/// # Safety
/// As [`block`]; `lanes` is at most [`MAX_LANES`].
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vbmi")]
unsafe fn scores<S: Source>(
    pages: &BlockPages,
    operands: Operands,
    hd: usize,
    queries: Queries,
    lanes: usize,
    keys: usize,
    out: &Out,
) {
    debug_assert!((1..=MAX_LANES).contains(&lanes) && keys <= pages.nk.next_multiple_of(16));
    if !S::PACKED {
        // All lanes a tile, 16 keys: each K group is built once for every lane (two parts'
        // accumulators for 8 lanes fill half the registers).
        for j in (0..keys).step_by(16) {
            by_lanes!(lanes, scores_tile::<S; _, 1>(pages, operands, hd, queries, j, out));
        }
        return;
    }
    // Packed groups cost a load: tiles of 4 lanes × 32 keys load 10 vectors for 16 dot
    // products, where 8 lanes × 16 keys load 17.
    let (u, scale, bias) = queries;
    for l0 in (0..lanes).step_by(4) {
        let queries = (u.add(l0 * 8), scale.add(l0), bias.add(l0));
        let out = Out {
            s: out.s.add(l0 * out.s_stride),
            s_stride: out.s_stride,
            visible: out.visible.add(l0),
            maxima: out.maxima.add(16 * l0),
        };
        let (out, n) = (&out, (lanes - l0).min(4));
        let mut j = 0;
        while j + 32 <= keys {
            by_lanes4!(n, scores_tile::<Packed; _, 2>(pages, operands, hd, queries, j, out));
            j += 32;
        }
        if j < keys {
            by_lanes4!(n, scores_tile::<Packed; _, 1>(pages, operands, hd, queries, j, out));
        }
    }
}

/// `L` lanes × `16 · KC` keys from key `j`, both parts' accumulators in registers.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vbmi")]
unsafe fn scores_tile<S: Source, const L: usize, const KC: usize>(
    pages: &BlockPages,
    (packed_keys, _): Operands,
    hd: usize,
    (u, query_scale, query_bias): Queries,
    j: usize,
    out: &Out,
) {
    let regroup = _mm512_loadu_si512(REGROUP.as_ptr().cast());
    let flip = _mm512_set1_epi8(-128);
    let ps = pages.page_size;
    // Each vector of 16 keys: where its slots start in its page, the next block's page, and the
    // slots' scales (0 past the block's keys).
    let mut src = [std::ptr::null::<i8>(); KC];
    let mut next = [std::ptr::null::<u8>(); KC];
    let mut key_scale = [_mm512_setzero_ps(); KC];
    for c in 0..KC {
        let (page, slot) = pages.at(j + 16 * c);
        let HeadRows::Q8 { values, scales } = pages.keys[page] else {
            unreachable!("the int8 path reads q8 pages only")
        };
        src[c] = values.as_ptr().add(slot);
        next[c] = pages.next[page].0.as_ptr().wrapping_add(slot);
        let m = live(pages.slots_in(page), slot);
        key_scale[c] = _mm512_maskz_loadu_ps(m, scales.as_ptr().add(slot));
    }
    let prefetch = !S::PACKED && !pages.next[pages.at(j).0].0.is_empty();
    let groups = hd / 4;
    // The lines a group's 4 rows span in the next block's page: one on pages of 16.
    let line_rows = match ps {
        16 => 4,
        32 => 2,
        _ => 1,
    };
    let mut acc = [[_mm512_setzero_si512(); KC]; L];
    let mut acc_lo = [[_mm512_setzero_si512(); KC]; L];
    for g in 0..hd / 4 {
        let mut x = [_mm512_setzero_si512(); KC];
        for (c, x) in x.iter_mut().enumerate() {
            let at = 4 * g * ps;
            if prefetch {
                let mut r = 0;
                while r < 4 {
                    prefetch_line(next[c].wrapping_add(at + r * ps));
                    r += line_rows;
                }
            }
            *x = if S::PACKED {
                let v = (j + 16 * c) / 16;
                _mm512_loadu_si512(packed_keys.add((v * groups + g) * 16).cast())
            } else {
                let rows = four_rows(src[c].add(at), ps);
                _mm512_xor_si512(_mm512_permutexvar_epi8(regroup, rows), flip)
            };
        }
        for (l, (acc, acc_lo)) in acc.iter_mut().zip(&mut acc_lo).enumerate() {
            let at = u.add(g * 8 * MAX_LANES + l * 8);
            let y = _mm512_set1_epi32(at.cast::<i32>().read_unaligned());
            let y_lo = _mm512_set1_epi32(at.add(4).cast::<i32>().read_unaligned());
            for c in 0..KC {
                acc[c] = _mm512_dpbusd_epi32(acc[c], x[c], y);
                acc_lo[c] = _mm512_dpbusd_epi32(acc_lo[c], x[c], y_lo);
            }
        }
    }
    let mut f = [[_mm512_setzero_ps(); KC]; L];
    for l in 0..L {
        let (qs, bias) = (
            _mm512_set1_ps(*query_scale.add(l)),
            _mm512_set1_epi32(*query_bias.add(l)),
        );
        for c in 0..KC {
            // 128 Σ k·hi + Σ k·lo (k + 128 each), exact: under 2^31 up to 256 dimensions.
            let sum = _mm512_add_epi32(_mm512_slli_epi32::<7>(acc[l][c]), acc_lo[l][c]);
            let dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(sum, bias));
            f[l][c] = _mm512_mul_ps(dot, _mm512_mul_ps(key_scale[c], qs));
        }
    }
    out.store_tile(j, &f);
}

/// 16 bytes from each of the rows at `p`, `p + ps`, `p + 2ps`, `p + 3ps`, in one vector.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn four_rows(p: *const i8, ps: usize) -> __m512i {
    if ps == 16 {
        return _mm512_loadu_si512(p.cast());
    }
    let row = |r: usize| _mm_loadu_si128(p.add(r * ps).cast());
    let low = _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(row(0)), row(1));
    let high = _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(row(2)), row(3));
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(low), high)
}

/// The largest of `x[..n]` (0 for none).
///
/// # Safety
/// The CPU must support AVX-512 F; `x` holds `n` floats rounded up to 16.
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn visible_max(x: *const f32, n: usize) -> f32 {
    let mut max = _mm512_setzero_ps();
    for j in (0..n).step_by(16) {
        max = _mm512_mask_max_ps(max, live(n, j), max, _mm512_loadu_ps(x.add(j)));
    }
    _mm512_reduce_max_ps(max)
}

/// One lane's online-softmax step over a block: with `m = max(running max, row_max)`, writes
/// the int16 weights `round(exp(row[j] - m) · sv[j] / step)` for `j < visible` and 0 up to `n`
/// (a multiple of 16), where `step = exp(row_max - m) · max sv[..visible] / 32767`; moves the
/// lane's state (max, 16 partial sums of `exp(row[j] - m)`, output) to `m`; returns `step`.
///
/// # Safety
/// As [`block`]; `row` and `sv` hold `n` finite floats, `w` room for `n` weights.
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn softmax_lane(
    row: *const f32,
    visible: usize,
    n: usize,
    row_max: f32,
    (sv, sv_max): (*const f32, f32),
    (max, sums, o, hdp): (&mut f32, *mut f32, *mut f32, usize),
    w: *mut i16,
) -> f32 {
    let m = max.max(row_max);
    let m_log2e = _mm512_set1_ps(m * std::f32::consts::LOG2_E);
    // The largest weight, by the same exponential as the weights (a short chain; the scalar
    // one is twice as long).
    let e_max = _mm512_cvtss_f32(exp_below(_mm512_set1_ps(row_max), m_log2e));
    let bound = e_max * sv_max;
    // (All-zero values, or weights below f32's range, give zero weights.)
    let (per_step, step) = if bound > 0.0 && bound.is_finite() {
        (32767.0 / bound, bound / 32767.0)
    } else {
        (0.0, 0.0)
    };
    let per_step = _mm512_set1_ps(per_step);
    let full = visible / 16 * 16;
    let weight = |j: usize| {
        let e = exp_below(_mm512_loadu_ps(row.add(j)), m_log2e);
        let e = if j >= full {
            _mm512_maskz_mov_ps(live(visible, j), e)
        } else {
            e
        };
        let q = _mm512_mul_ps(e, _mm512_mul_ps(_mm512_loadu_ps(sv.add(j)), per_step));
        // Saturating: the products may round to 32768.
        _mm256_storeu_si256(
            w.add(j).cast(),
            _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(q)),
        );
        e
    };
    let block_sums = sum_vectors(n, weight);
    advance(max, m, sums, block_sums, o, hdp);
    step
}

/// A chunk's int16 weights (rows `stride` apart).
type Weights = (*const i16, usize);

/// `o[l · hd + d] += step[l] · Σ_{i < pairs} (w[l][2i] · v[2i][d] + w[l][2i + 1] · v[2i + 1][d])`
/// for `l < lanes` and `d < hd`, `v` the block's V integers; the sums run in int32.
///
/// # Safety
/// As [`block`]; weights past the block's keys are 0 and `pairs` at most half the block's
/// keys rounded up.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[allow(clippy::too_many_arguments)]
unsafe fn accumulate<S: Source>(
    pages: &BlockPages,
    operands: Operands,
    w: Weights,
    lanes: usize,
    pairs: usize,
    step: *const f32,
    o: *mut f32,
    hd: usize,
) {
    debug_assert!((1..=MAX_LANES).contains(&lanes) && hd.is_multiple_of(16));
    by_tiles!(lanes, hd, d => values_tile::<S>(pages, operands, w, pairs, step, o, hd, d));
}

/// `L` lanes × `16 · DC` dimensions from `d`, all accumulators in registers.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[allow(clippy::too_many_arguments)]
unsafe fn values_tile<S: Source, const L: usize, const DC: usize>(
    pages: &BlockPages,
    (_, packed_values): Operands,
    (w, w_stride): Weights,
    pairs: usize,
    step: *const f32,
    o: *mut f32,
    hd: usize,
    d: usize,
) {
    let mut acc = [[_mm512_setzero_si512(); DC]; L];
    let pairs_per_page = pages.page_size / 2;
    for page in 0..pairs.div_ceil(pairs_per_page) {
        let HeadRows::Q8 { values, .. } = pages.values[page] else {
            unreachable!("the int8 path reads q8 pages only")
        };
        let first = page * pairs_per_page;
        let next = pages.next[page].1;
        for i in first..pairs.min(first + pairs_per_page) {
            let at = 2 * (i - first) * hd + d;
            let x = if S::PACKED {
                let mut x = [_mm512_setzero_si512(); DC];
                for (c, x) in x.iter_mut().enumerate() {
                    *x = _mm512_loadu_si512(packed_values.add(i * hd + d + 16 * c).cast());
                }
                x
            } else {
                // Once a line: the tiles of a row's first 64 dimensions read the same one.
                if !next.is_empty() && d.is_multiple_of(64) {
                    prefetch_line(next.as_ptr().wrapping_add(at));
                    prefetch_line(next.as_ptr().wrapping_add(at + hd));
                }
                value_pairs::<DC>(values.as_ptr().add(at), hd)
            };
            for (l, acc) in acc.iter_mut().enumerate() {
                let y =
                    _mm512_set1_epi32(w.add(l * w_stride + 2 * i).cast::<i32>().read_unaligned());
                for c in 0..DC {
                    acc[c] = _mm512_dpwssd_epi32(acc[c], x[c], y);
                }
            }
        }
    }
    for (l, acc) in acc.iter().enumerate() {
        let step = _mm512_set1_ps(*step.add(l));
        let sums = in_order(acc);
        for (c, sum) in sums.iter().enumerate() {
            let at = o.add(l * hd + d + 16 * c);
            _mm512_storeu_ps(
                at,
                _mm512_fmadd_ps(_mm512_cvtepi32_ps(*sum), step, _mm512_loadu_ps(at)),
            );
        }
    }
}

/// The (v[a][d..], v[a + 1][d..]) int16 pairs of `16 · DC` dimensions from `a` (slot `a`'s
/// row; slot `a + 1`'s is `hd` further on). With `DC` = 2 the dimensions come out in the order
/// of `unpacklo/hi_epi16` ([`in_order`] undoes it on the sums).
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn value_pairs<const DC: usize>(a: *const i8, hd: usize) -> [__m512i; DC] {
    let mut x = [_mm512_setzero_si512(); DC];
    if DC == 2 {
        let va = _mm512_cvtepi8_epi16(_mm256_loadu_si256(a.cast()));
        let vb = _mm512_cvtepi8_epi16(_mm256_loadu_si256(a.add(hd).cast()));
        x[0] = _mm512_unpacklo_epi16(va, vb);
        x[1] = _mm512_unpackhi_epi16(va, vb);
    } else {
        let (va, vb) = (_mm_loadu_si128(a.cast()), _mm_loadu_si128(a.add(hd).cast()));
        let bytes = _mm256_inserti128_si256::<1>(
            _mm256_castsi128_si256(_mm_unpacklo_epi8(va, vb)),
            _mm_unpackhi_epi8(va, vb),
        );
        x[0] = _mm512_cvtepi8_epi16(bytes);
    }
    x
}

/// A tile row's sums with its dimensions in order (see [`value_pairs`]).
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn in_order<const DC: usize>(acc: &[__m512i; DC]) -> [__m512i; DC] {
    if DC != 2 {
        return *acc;
    }
    let mut out = *acc;
    for (h, out) in out.iter_mut().enumerate() {
        let idx = _mm512_loadu_si512(IN_ORDER[h].as_ptr().cast());
        *out = _mm512_permutex2var_epi32(acc[0], idx, acc[1]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queries_round_against_their_largest_component() {
        // q / sq = 50, -127, 0, 0.4, 100.3: the fractions go to the second part, in 128ths.
        let q = [0.5f32, -1.27, 0.0, 0.004, 1.003];
        let (mut hi, mut lo) = ([0i8; 5], [0i8; 5]);
        let (scale, bias) = quantize_query(&q, &mut hi, &mut lo);
        assert_eq!(hi, [50, -127, 0, 0, 100]);
        assert_eq!(lo, [0, 0, 0, 51, 38]);
        assert!((scale - 1.27 / 127.0 / 128.0).abs() < 1e-9);
        let sum: i32 = hi
            .iter()
            .zip(&lo)
            .map(|(&h, &l)| 128 * h as i32 + l as i32)
            .sum();
        assert_eq!(bias, 128 * sum);
        let (scale, bias) = quantize_query(&[0.0; 5], &mut hi, &mut lo);
        assert_eq!((scale, bias, hi, lo), (0.0, 0, [0; 5], [0; 5]));
    }

    #[test]
    fn regrouping_takes_a_slots_four_dimensions_together() {
        // Row r (a dimension) holds bytes 16r..16r + 16 (one per slot).
        for (b, &from) in REGROUP.iter().enumerate() {
            let (slot, dim) = (b / 4, b % 4);
            assert_eq!(from as usize, dim * 16 + slot);
        }
    }
}
