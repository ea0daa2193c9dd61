//! A block on the bf16 path (AVX-512 BF16 or AMX): scores against centred keys, the softmax
//! step and the weighted values, lane chunk by lane chunk, over the task's scratch.

use super::bf16_pages::{self, BlockPages};
use super::{amx, bf16, seeing_chunks, Scratch};
use std::ops::Range;

/// A block on the bf16 path: every lane's scores, softmax step and weighted values. The scores
/// are `offset[lane] + s[lane][j]`:
/// `offset` is the lane's f32 dot product with the block's first key `r` (which every lane that
/// sees the block sees), `s` the bf16 dot product with `k - r`. Softmax does not change when a
/// lane's scores shift together, but rounding does: Qwen2.5's keys carry large components that
/// vary slowly with position, and rounding Q and raw K to bf16 moved Qwen2.5-Coder-0.5B's logits
/// by up to 0.76 and flipped 3 of 256 greedy tokens; centred, the keys are small and the same
/// test moves logits by 0.15, with one top-1 token of 256 different, where the reference's top
/// two are 0.007 apart (f16 K/V with f32 scores: 0.08, none). `r` is a fixed key of the block,
/// so a row's arithmetic does not depend on the batch.
///
/// # Safety
/// The CPU must support the bf16 kernels, and the scratch must be sized as `attend_task` sizes
/// it for `lanes` lanes, with the block's K and V pairs in place.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn bf16_block(
    s: &mut Scratch,
    amx: bool,
    pages: Option<&BlockPages>,
    next: &NextBlock,
    lanes: usize,
    nk: usize,
    hd: usize,
    hdp: usize,
    bs: usize,
) {
    start_block(s, lanes, hd);
    // Weights written per lane: AMX's weighted values take keys 32 at a time (those past a
    // lane's visible ones weigh exactly 0).
    let weights = if amx {
        nk.next_multiple_of(32)
    } else {
        nk.next_multiple_of(16)
    };
    // AMX takes two tiles of 16 lanes at a time.
    let chunk = if amx { 32 } else { bf16::MAX_LANES };
    let mut chunks = std::mem::take(&mut s.chunks);
    chunks.clear();
    chunks.extend(seeing_chunks(&s.visible[..lanes], chunk));
    // Scores, softmax and weighted values chunk by chunk, so that a chunk's scores and weights
    // are still in L1 when the next step reads them. (For AMX, each step over every chunk
    // before the next measured the same.)
    for (i, &(l0, l1, keys)) in chunks.iter().enumerate() {
        next.prefetch_share(i, chunks.len());
        chunk_scores(s, amx, pages, l0..l1, keys, hd, hdp, bs);
        chunk_softmax(s, l0..l1, weights, hdp, bs, bf16::Weights::Bf16);
        chunk_values(s, amx, pages, l0..l1, keys, hdp, bs);
    }
    s.chunks = chunks;
}

/// What every block of the bf16 and fp16 paths starts with: each lane's f32 dot product with
/// the block's first key (`offset`), and its 16 running maxima reset.
///
/// # Safety
/// As [`bf16_block`].
pub(super) unsafe fn start_block(s: &mut Scratch, lanes: usize, hd: usize) {
    let lanes16 = lanes.next_multiple_of(16);
    let (qt, kref) = (s.qt.as_ptr(), s.kref.as_ptr());
    bf16::offsets(qt, lanes16, lanes, kref, hd, s.offset.as_mut_ptr());
    s.maxima.clear();
    s.maxima.resize(lanes * 16, f32::NEG_INFINITY);
}

/// The scores of lanes `lanes` against the block's first `keys` keys, and their maxima.
///
/// # Safety
/// As [`bf16_block`].
#[allow(clippy::too_many_arguments)]
unsafe fn chunk_scores(
    s: &mut Scratch,
    amx: bool,
    pages: Option<&BlockPages>,
    lanes: Range<usize>,
    keys: usize,
    hd: usize,
    hdp: usize,
    bs: usize,
) {
    let (l0, n) = (lanes.start, lanes.len());
    let (q16, sc) = (s.q16[l0 * hdp..].as_ptr(), s.s[l0 * bs..].as_mut_ptr());
    let (visible, maxima) = (s.visible[l0..].as_ptr(), s.maxima[l0 * 16..].as_mut_ptr());
    let k = s.kt2.as_ptr();
    if let Some(pages) = pages {
        let keys16 = keys.next_multiple_of(16);
        let r = s.kref.as_ptr();
        bf16_pages::scores(pages, hd, r, q16, hdp, n, keys16, sc, bs, visible, maxima);
    } else if amx {
        let keys32 = keys.next_multiple_of(32);
        amx::scores(n.div_ceil(16), q16, hdp, k, bs, hd / 2, keys32, sc, bs);
        bf16::take_maxima(sc, bs, n, visible, maxima);
    } else {
        let keys16 = keys.next_multiple_of(16);
        bf16::scores(q16, hdp, n, k, bs, hd / 2, keys16, sc, bs, visible, maxima);
    }
}

/// The softmax step of lanes `lanes`, writing `weights` weights a lane, rounded as `kind`
/// says (bf16, or fp16 for the fp16 path).
///
/// # Safety
/// As [`bf16_block`], after [`chunk_scores`] (or the fp16 path's scores).
pub(super) unsafe fn chunk_softmax(
    s: &mut Scratch,
    lanes: Range<usize>,
    weights: usize,
    hdp: usize,
    bs: usize,
    kind: bf16::Weights,
) {
    debug_assert!(lanes.len() <= 32, "a lane chunk holds at most 32 lanes");
    let mut row_max = [0f32; 32];
    for (lane, m) in lanes.clone().zip(&mut row_max) {
        *m = bf16::lane_max(s.maxima[lane * 16..].as_ptr());
    }
    for (lane, &row_max) in lanes.zip(&row_max) {
        let visible = s.visible[lane];
        if visible == 0 {
            // Weights of zero: the lane shares the products with lanes that see keys.
            s.p16[lane * bs..lane * bs + weights].fill(0);
            continue;
        }
        let (row, out) = (s.s[lane * bs..].as_ptr(), s.p16[lane * bs..].as_mut_ptr());
        let (sums, o) = (
            s.sums[lane * 16..].as_mut_ptr(),
            s.o[lane * hdp..].as_mut_ptr(),
        );
        let (max, offset) = (&mut s.max[lane], s.offset[lane]);
        bf16::softmax_lane(
            row, visible, weights, row_max, offset, max, sums, o, hdp, out, kind,
        );
    }
}

/// The weighted values of lanes `lanes` over the block's first `keys` keys.
///
/// # Safety
/// As [`bf16_block`], after [`chunk_softmax`].
unsafe fn chunk_values(
    s: &mut Scratch,
    amx: bool,
    pages: Option<&BlockPages>,
    lanes: Range<usize>,
    keys: usize,
    hdp: usize,
    bs: usize,
) {
    let (l0, n) = (lanes.start, lanes.len());
    let (p16, v2) = (s.p16[l0 * bs..].as_ptr(), s.v2.as_ptr());
    let o = s.o[l0 * hdp..].as_mut_ptr();
    if let Some(pages) = pages {
        bf16_pages::accumulate(pages, p16, bs, n, keys.div_ceil(2), o, hdp);
    } else if amx {
        let pairs = keys.next_multiple_of(32) / 2;
        amx::accumulate(n.div_ceil(16), p16, bs, v2, hdp, pairs, o);
    } else {
        bf16::accumulate(p16, bs, n, v2, hdp, keys.div_ceil(2), o);
    }
}

/// The K and V bytes of the task's next block, prefetched a share with each lane chunk of
/// this one: issued all at once, the prefetches of a whole block overran the miss buffers.
#[derive(Default)]
pub(super) struct NextBlock<'a> {
    parts: [&'a [u8]; 16],
    len: usize,
    /// Cache lines of all parts together.
    lines: usize,
}

impl<'a> NextBlock<'a> {
    pub(super) fn push(&mut self, bytes: &'a [u8]) {
        if self.len < self.parts.len() {
            self.parts[self.len] = bytes;
            self.len += 1;
            self.lines += bytes.len().div_ceil(64);
        }
    }

    /// Prefetches share `i` of `n` of the parts' cache lines, the parts taken as one run of
    /// lines, with [`bf16_pages::prefetch_line`] (its hint and why). (Splitting each part into
    /// `n` shares cost two divisions per part and chunk: with 50 lane chunks and 16 parts, the
    /// largest item of a block's bookkeeping.)
    pub(super) fn prefetch_share(&self, i: usize, n: usize) {
        let (mut line, end) = (i * self.lines / n, (i + 1) * self.lines / n);
        let mut part_start = 0;
        for part in &self.parts[..self.len] {
            let part_end = part_start + part.len().div_ceil(64);
            while line < end.min(part_end) {
                bf16_pages::prefetch_line(part.as_ptr().wrapping_add((line - part_start) * 64));
                line += 1;
            }
            if line >= end {
                break;
            }
            part_start = part_end;
        }
    }
}

/// Packs the block's f32 V rows into the bf16 pairs of keys the weighted values take.
///
/// # Safety
/// As [`bf16_block`].
pub(super) unsafe fn pack_values(s: &mut Scratch, nk: usize, hdp: usize) {
    for p in 0..nk.div_ceil(2) {
        let (a, b) = (
            s.v[2 * p * hdp..].as_ptr(),
            s.v[(2 * p + 1) * hdp..].as_ptr(),
        );
        bf16::pack_pairs(a, b, hdp, s.v2[p * hdp..].as_mut_ptr());
    }
}
