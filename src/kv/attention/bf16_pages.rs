//! The bf16 path's two products for a chunk of at most [`MAX_LANES`] lanes (one decode row of a
//! GQA group) with K and V read straight from the pages, instead of being packed into bf16
//! pairs in scratch first.
//!
//! A decode row applies each packed pair to at most 8 lanes, so packing a block into scratch
//! and reading it back cost more than the products: on a Zen 5, one row at 16K context spent
//! about 5 times as long in `key_pairs` and `value_pairs` as in `scores` and `accumulate`
//! (`perf`, criterion `paged_attention`). Here each pair is built in registers by the same
//! functions the packers use ([`key_pair`], [`value_pair`]) and taken by the same
//! `vdpbf16ps` chains in the same order, so a lane's scores and outputs are bit-identical to
//! the scratch path's: a decode row still equals the verify row that stands for it.
//!
//! Used for pages of a multiple of 16 slots and a `head_dim` a multiple of 16 ([`usable`]), so
//! that every vector of 16 keys and every pair of slots lies in one page.

use super::bf16::{
    bcast_pair, key_pair, live, value_pair, with_page_src, F16Page, F32Page, Out, PageSrc, Q8Page,
    INTERLEAVE, MAX_LANES,
};
use crate::kv::storage::HeadRows;
use std::arch::x86_64::*;

/// Pages one block spans at most: `plan::BLOCK_KEYS` / 16.
const MAX_PAGES: usize = 8;

/// Whether blocks of this layout can be read in place.
pub(super) fn usable(page_size: usize, head_dim: usize) -> bool {
    page_size.is_multiple_of(16) && head_dim.is_multiple_of(16)
}

/// A block's K and V pages in order, `page_size` slots each; the block's `nk` keys fill them
/// but for the last, which holds what remains.
pub(super) struct BlockPages<'a> {
    pub(super) keys: [HeadRows<'a>; MAX_PAGES],
    pub(super) values: [HeadRows<'a>; MAX_PAGES],
    pub(super) len: usize,
    pub(super) page_size: usize,
    pub(super) nk: usize,
    /// The K and V bytes of the pages of the task's next block, which the products prefetch as
    /// they read the same places of this block's pages.
    pub(super) next: [(&'a [u8], &'a [u8]); MAX_PAGES],
}

impl<'a> BlockPages<'a> {
    pub(super) fn new(page_size: usize) -> Self {
        BlockPages {
            keys: [HeadRows::F32(&[]); MAX_PAGES],
            values: [HeadRows::F32(&[]); MAX_PAGES],
            len: 0,
            page_size,
            nk: 0,
            next: [(&[], &[]); MAX_PAGES],
        }
    }

    /// Notes the `i`-th page of the task's next block, to be prefetched.
    pub(super) fn push_next(&mut self, i: usize, keys: HeadRows<'a>, values: HeadRows<'a>) {
        self.next[i] = (keys.bytes(), values.bytes());
        // A q8 page's scales lie elsewhere: one line each, asked for now.
        keys.prefetch_scales();
        values.prefetch_scales();
    }

    /// Appends a page holding `n` of the block's keys (`page_size` but for the last page).
    pub(super) fn push(&mut self, keys: HeadRows<'a>, values: HeadRows<'a>, n: usize) {
        assert!(self.len < MAX_PAGES && self.nk.is_multiple_of(self.page_size));
        assert_eq!(keys.len(), values.len());
        (self.keys[self.len], self.values[self.len]) = (keys, values);
        self.len += 1;
        self.nk += n;
    }

    /// The page, and the slot in it, of the block's key `j`.
    pub(super) fn at(&self, j: usize) -> (usize, usize) {
        // Pages of 16 (the default) without a division: the kernels ask once per tile.
        if self.page_size == 16 {
            return (j / 16, j % 16);
        }
        (j / self.page_size, j % self.page_size)
    }

    /// Keys of the block in page `page`.
    pub(super) fn slots_in(&self, page: usize) -> usize {
        self.page_size.min(self.nk - page * self.page_size)
    }
}

/// What [`super::bf16::scores`] computes from the block's K pairs as `key_pairs` packs them
/// against the block's first key `r` (`head_dim` floats), over the pages instead: for each lane
/// `l < lanes` (at most [`MAX_LANES`]), `s[l · s_stride + j]` for `j < keys` (a multiple of 16,
/// at most the block's keys rounded up to 16), and the lane's running maxima of the keys it
/// sees. Scores of keys past the block's are 0 (the scratch path's are stale values): neither
/// path reads them.
///
/// # Safety
/// The CPU must support the bf16 kernels, `usable` must hold for the layout, and every index
/// above must be inside its buffer (`q` rows hold `head_dim` bf16).
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn scores(
    pages: &BlockPages,
    head_dim: usize,
    r: *const f32,
    q: *const u16,
    q_stride: usize,
    lanes: usize,
    keys: usize,
    s: *mut f32,
    s_stride: usize,
    visible: *const usize,
    maxima: *mut f32,
) {
    debug_assert!((1..=MAX_LANES).contains(&lanes) && keys.is_multiple_of(16));
    assert!(pages.len > 0 && keys <= pages.nk.next_multiple_of(16));
    let out = Out {
        s,
        s_stride,
        visible,
        maxima,
    };
    let args = (pages, head_dim, r, q, q_stride, &out);
    with_page_src!(&pages.keys[0], scores_of(lanes, keys, args))
}

type ScoresArgs<'a, 'b> = (
    &'a BlockPages<'b>,
    usize,
    *const f32,
    *const u16,
    usize,
    &'a Out,
);

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,f16c")]
unsafe fn scores_of<S: PageSrc>(_: S, lanes: usize, keys: usize, args: ScoresArgs) {
    by_tiles!(lanes, keys, j => scores_tile::<S>(j, args));
}

/// `L` lanes × `16 · KC` keys from key `j`: `bf16::scores_tile` with each K pair built from
/// the pages as it is needed.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,f16c")]
unsafe fn scores_tile<S: PageSrc, const L: usize, const KC: usize>(
    j: usize,
    (pages, head_dim, r, q, q_stride, out): ScoresArgs,
) {
    let idx = _mm512_loadu_si512(INTERLEAVE.as_ptr().cast());
    // Each vector of 16 keys: its page, first slot, live lanes and q8 scales.
    let mut src = [(S::of(&pages.keys[0]), 0, 0, _mm512_setzero_ps()); KC];
    for (c, src) in src.iter_mut().enumerate() {
        let (page, slot) = pages.at(j + 16 * c);
        let page_src = S::of(&pages.keys[page]);
        let m = live(pages.slots_in(page), slot);
        *src = (page_src, slot, m, page_src.slot_scales(slot, m));
    }
    // Where this tile's vectors lie in the next block's pages.
    let mut next = [std::ptr::null::<u8>(); KC];
    for (c, next) in next.iter_mut().enumerate() {
        let (page, slot) = pages.at(j + 16 * c);
        *next = pages.next[page]
            .0
            .as_ptr()
            .wrapping_add(slot * S::ELEM_BYTES);
    }
    let prefetch = !pages.next[pages.at(j).0].0.is_empty();
    let row_bytes = pages.page_size * S::ELEM_BYTES;
    let mut acc = [[_mm512_setzero_ps(); KC]; L];
    for p in 0..head_dim / 2 {
        let mut x = [_mm512_setzero_si512(); KC];
        for (c, (x, &(page, slot, m, scale))) in x.iter_mut().zip(&src).enumerate() {
            if prefetch {
                // The two rows this reads, in the next block's page.
                prefetch_line(next[c].wrapping_add(2 * p * row_bytes));
                prefetch_line(next[c].wrapping_add((2 * p + 1) * row_bytes));
            }
            *x = key_pair(page, pages.page_size, slot, p, m, scale, r, idx);
        }
        for (l, acc) in acc.iter_mut().enumerate() {
            let y = bcast_pair(q.add(l * q_stride + 2 * p));
            for c in 0..KC {
                acc[c] =
                    _mm512_dpbf16_ps(acc[c], y, std::mem::transmute::<__m512i, __m512bh>(x[c]));
            }
        }
    }
    out.store_tile(j, &acc);
}

/// What [`super::bf16::accumulate`] computes from the block's V pairs as `value_pairs` packs
/// them, over the pages instead: `o[l · o_stride + d] += Σ_{i < pairs} w[l][i] · (v[2i][d],
/// v[2i + 1][d])` for `l < lanes` (at most [`MAX_LANES`]) and `d < o_stride` (= `head_dim`).
///
/// # Safety
/// As [`scores`]; `w` rows (`w_stride` apart) hold `2 · pairs` bf16 weights, `pairs` is at most
/// half the block's keys rounded up.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn accumulate(
    pages: &BlockPages,
    w: *const u16,
    w_stride: usize,
    lanes: usize,
    pairs: usize,
    o: *mut f32,
    o_stride: usize,
) {
    debug_assert!((1..=MAX_LANES).contains(&lanes) && o_stride.is_multiple_of(16));
    assert!(pages.len > 0 && 2 * pairs <= pages.nk.next_multiple_of(2));
    assert_eq!(pages.values[0].len(), pages.page_size * o_stride);
    let args = (pages, w, w_stride, pairs, o, o_stride);
    with_page_src!(&pages.values[0], accumulate_of(lanes, args))
}

type AccumulateArgs<'a, 'b> = (
    &'a BlockPages<'b>,
    *const u16,
    usize,
    usize,
    *mut f32,
    usize,
);

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,f16c")]
unsafe fn accumulate_of<S: PageSrc>(_: S, lanes: usize, args: AccumulateArgs) {
    let o_stride = args.5;
    by_tiles!(lanes, o_stride, d => accumulate_tile::<S>(d, args));
}

/// `L` lanes × `16 · DC` dimensions from `d`: `bf16::accumulate_tile` with each V pair built
/// from the pages as it is needed.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,f16c")]
unsafe fn accumulate_tile<S: PageSrc, const L: usize, const DC: usize>(
    d: usize,
    (pages, w, w_stride, pairs, o, head_dim): AccumulateArgs,
) {
    let idx = _mm512_loadu_si512(INTERLEAVE.as_ptr().cast());
    let mut acc = [[_mm512_setzero_ps(); DC]; L];
    for (l, acc) in acc.iter_mut().enumerate() {
        for (c, acc) in acc.iter_mut().enumerate() {
            *acc = _mm512_loadu_ps(o.add(l * head_dim + d + 16 * c));
        }
    }
    let pairs_per_page = pages.page_size / 2;
    let row_bytes = head_dim * S::ELEM_BYTES;
    let span = 16 * DC * S::ELEM_BYTES;
    for page in 0..pairs.div_ceil(pairs_per_page) {
        let src = S::of(&pages.values[page]);
        // Slots past the block's keys read as 0 (only a last page has them).
        let n = pages.slots_in(page);
        let first = page * pairs_per_page;
        let next = pages.next[page].1;
        let next_at = next.as_ptr().wrapping_add(d * S::ELEM_BYTES);
        for i in first..pairs.min(first + pairs_per_page) {
            let slot = 2 * (i - first);
            if !next.is_empty() {
                // The dimensions of both slots this reads, in the next block's page.
                let at = next_at.wrapping_add(slot * row_bytes);
                prefetch_line(at);
                prefetch_line(at.wrapping_add(span - 1));
                prefetch_line(at.wrapping_add(row_bytes));
                prefetch_line(at.wrapping_add(row_bytes + span - 1));
            }
            let mut x = [_mm512_setzero_si512(); DC];
            for (c, x) in x.iter_mut().enumerate() {
                *x = if n == pages.page_size {
                    value_pair(src, usize::MAX, head_dim, slot, d + 16 * c, 0xffff, idx)
                } else {
                    value_pair(src, n, head_dim, slot, d + 16 * c, 0xffff, idx)
                };
            }
            for (l, acc) in acc.iter_mut().enumerate() {
                let y = bcast_pair(w.add(l * w_stride + 2 * i));
                for c in 0..DC {
                    acc[c] =
                        _mm512_dpbf16_ps(acc[c], y, std::mem::transmute::<__m512i, __m512bh>(x[c]));
                }
            }
        }
    }
    for (l, acc) in acc.iter().enumerate() {
        for (c, acc) in acc.iter().enumerate() {
            _mm512_storeu_ps(o.add(l * head_dim + d + 16 * c), *acc);
        }
    }
}

/// Asks for the cache line holding `p` (an address inside the next block's pages, or, past
/// their ends, one that a prefetch may touch harmlessly: prefetches do not fault), into L2: a
/// whole block ahead is 16 KB of q8 or 32 KB of f16 K and V, as large as a Zen 4's L1, so the
/// T0 hint evicted the block being read. On a Zen 4, one decode row over 16K keys (streamed):
/// int8 315–337 → 255–275 µs, bf16 400–417 → 360–368 µs (BENCHMARKS.md).
#[inline(always)]
pub(super) fn prefetch_line(p: *const u8) {
    // SAFETY: a prefetch has no architectural effect.
    unsafe { _mm_prefetch::<_MM_HINT_T1>(p.cast()) };
}
