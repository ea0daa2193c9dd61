//! Paged attention on the CPU for a ragged batch of query rows.
//!
//! Every query row belongs to one sequence and sits at one absolute position; it attends to all
//! of that sequence's positions `0..=position`, read in place from the sequence's pages. That
//! one rule covers prefill chunks (causal within the chunk, full attention to earlier pages),
//! decode rows and runs of consecutive speculative verify rows. New K/V must already have been
//! written to the pages before this runs.
//!
//! Work is split into tasks (see `plan`) of (sequence, KV head, up to `ROWS_PER_TASK`
//! consecutive rows — `ROWS_PER_TASK_LONG` deep in a long context —, a range of key positions).
//! A task's *lanes* are its rows × the query heads that share its KV head (GQA). It walks its
//! keys in blocks of about `BLOCK_KEYS` (several pages): each block's K (stored transposed) and
//! V are decoded once into scratch (f32, or bf16 pairs on the bf16 path), the scores of every
//! lane against the block are one small register-blocked matmul (lanes × `head_dim` times
//! `head_dim` × keys), the online softmax rescales once per block, and the weighted values are
//! a second matmul (lanes × keys times keys × `head_dim`). Masked keys are skipped per lane.
//! On CPUs with AVX-512 BF16 both products can take bf16 dot products ([`AttentionPath`]); the
//! scores then use keys centred on the block's first key (see [`bf16_block`]). On CPUs with
//! AMX the same bf16 operands go through tile multiplies (`amx`) instead.
//!
//! Keys are grouped in segments of `SEGMENT_KEYS` absolute positions: the online softmax
//! restarts at each segment, and the segments' states (max, sum, unnormalised output) are
//! folded left to right. When there are fewer tasks than the threads can balance — decode at
//! long context with one sequence and two KV heads — a task's segments are spread over several
//! tasks (split-K, as in flash-decoding) that store each segment's state for a merge pass to
//! fold; otherwise a task folds its segments as it goes, with the same function in the same
//! order. Since block and segment boundaries are absolute positions and the fold order is
//! fixed, a row's output is bit-for-bit the same whatever else is in the batch and however many
//! threads the plan is for: a verify row equals the decode row it replaces.

#[cfg(target_arch = "x86_64")]
#[macro_use]
mod tiles;
#[cfg(target_arch = "x86_64")]
mod amx;
#[cfg(target_arch = "x86_64")]
mod bf16;
#[cfg(target_arch = "x86_64")]
mod bf16_block;
#[cfg(target_arch = "x86_64")]
mod bf16_pages;
#[cfg(target_arch = "x86_64")]
mod fp16;
#[cfg(target_arch = "x86_64")]
mod in_place;
#[cfg(target_arch = "x86_64")]
mod int8;
#[cfg(target_arch = "x86_64")]
mod int8_tiles;
mod micro;
mod path;
mod plan;
mod scratch;

use super::pool::PageId;
#[cfg(target_arch = "x86_64")]
use super::storage::HeadRows;
#[cfg(target_arch = "x86_64")]
use super::storage::KvDtype;
use super::storage::{KvKind, KvStorage};
use crate::kernels::math::exp_nonpositive;
use crate::kernels::Dispatch;
pub use path::{AttentionPath, SimdReport};
use plan::{block_keys, lanes, partial_len, plan_tasks, segment_keys, Multi, Task};
use scratch::{Scratch, ScratchLayout, PARTIALS, SCRATCH};

/// Where one query row attends from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionRow {
    /// Index into the page tables passed alongside.
    pub seq: usize,
    /// Absolute position of the row's token; it sees positions `0..=position`.
    pub position: usize,
}

#[derive(Debug, Clone, Copy)]
pub struct AttentionShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

/// Lanes one microkernel call keeps in registers.
const LANE_CHUNK: usize = micro::MAX_LANES;

/// A raw pointer shared by tasks that write disjoint slices.
#[derive(Clone, Copy)]
struct SharedPtr(*mut f32);
unsafe impl Send for SharedPtr {}
unsafe impl Sync for SharedPtr {}

/// `q`: `[num_rows, num_heads, head_dim]`; `out`: same shape. Rows of one sequence must be
/// consecutive in the batch for page reads to be shared; correctness does not depend on it.
pub fn paged_attention(
    q: &[f32],
    rows: &[AttentionRow],
    page_tables: &[&[PageId]],
    kv: &KvStorage,
    layer: usize,
    shape: AttentionShape,
    out: &mut [f32],
) {
    paged_attention_with(
        AttentionPath::for_kv(kv.dtype()),
        rayon::current_num_threads(),
        q,
        rows,
        page_tables,
        kv,
        layer,
        shape,
        out,
    );
}

/// [`paged_attention`] on a given path (`F32(Scalar)` runs the portable microkernels, the others
/// their own), planned for `threads` threads (which decides how far split-K goes, not the
/// result; the work runs on the current rayon pool).
#[allow(clippy::too_many_arguments)]
pub fn paged_attention_with(
    path: AttentionPath,
    threads: usize,
    q: &[f32],
    rows: &[AttentionRow],
    page_tables: &[&[PageId]],
    kv: &KvStorage,
    layer: usize,
    shape: AttentionShape,
    out: &mut [f32],
) {
    let hd = shape.head_dim;
    assert_eq!(q.len(), rows.len() * shape.num_heads * hd);
    assert_eq!(out.len(), q.len());
    assert_eq!(shape.num_heads % shape.num_kv_heads, 0);
    assert!(path.is_supported(), "{path:?} is not supported by this CPU");
    let page_size = kv.shape().page_size;
    for row in rows {
        assert!(
            row.position < page_tables[row.seq].len() * page_size,
            "row at {} past its pages",
            row.position
        );
    }
    let group = shape.num_heads / shape.num_kv_heads;
    let plan = plan_tasks(rows, shape.num_kv_heads, group, hd, page_size, threads);
    // Buffers kept by the calling thread between calls: allocated per call, the split-K states
    // (1.5 MB for 50 rows after 8K) came as fresh pages from the kernel each time (`perf`: 5% of
    // such a call clearing pages).
    let mut partials = PARTIALS.with(|p| std::mem::take(&mut *p.borrow_mut()));
    partials.clear();
    partials.resize(plan.partials_len, 0.0);
    let out_ptr = SharedPtr(out.as_mut_ptr());
    let partials_ptr = SharedPtr(partials.as_mut_ptr());
    // The integer products need q8 pages; other K/V take the bf16 path instead.
    #[cfg(target_arch = "x86_64")]
    let int8 =
        path == AttentionPath::Int8 && kv.dtype() == KvDtype::Q8 && int8::usable(page_size, hd);
    #[cfg(not(target_arch = "x86_64"))]
    let int8 = false;
    // The fp16 products need f16 pages; other K/V take the f32 path instead.
    #[cfg(target_arch = "x86_64")]
    let fp16 =
        path == AttentionPath::F16 && kv.dtype() == KvDtype::F16 && fp16::usable(page_size, hd);
    #[cfg(not(target_arch = "x86_64"))]
    let fp16 = false;
    let bf16 = matches!(path, AttentionPath::Bf16 | AttentionPath::Amx)
        || (path == AttentionPath::Int8 && !int8)
        || fp16;
    // AMX tiles take 32 terms a product: whole tiles of head dimensions and of a block's keys,
    // or the AVX-512 BF16 kernels (same operands) do the block.
    let amx = path == AttentionPath::Amx
        && hd.is_multiple_of(32)
        && block_keys(page_size)
            .next_multiple_of(16)
            .is_multiple_of(32);
    let path = match path {
        AttentionPath::F32(d) => d,
        AttentionPath::Bf16 | AttentionPath::Amx | AttentionPath::Int8 | AttentionPath::F16 => {
            Dispatch::Avx512
        }
    };
    #[cfg(target_arch = "x86_64")]
    let in_place =
        path == Dispatch::Avx2 && kv.dtype() == KvDtype::F16 && in_place::usable(page_size, hd);
    #[cfg(not(target_arch = "x86_64"))]
    let in_place = false;
    #[cfg(target_arch = "x86_64")]
    let bf16_pages = bf16 && !amx && !fp16 && bf16_pages::usable(page_size, hd);
    #[cfg(not(target_arch = "x86_64"))]
    let bf16_pages = false;
    let ctx = Context {
        path,
        bf16,
        amx,
        bf16_pages,
        in_place,
        int8,
        fp16,
        q,
        rows,
        page_tables,
        kv,
        layer,
        shape,
        group,
    };
    let layout = ScratchLayout::of(&ctx);
    crate::kernels::team::for_each(plan.tasks.len(), |i| {
        let task = &plan.tasks[i];
        SCRATCH.with(|scratch| {
            let scratch = &mut *scratch.borrow_mut();
            if scratch.layout != Some(layout) {
                *scratch = Scratch {
                    layout: Some(layout),
                    ..Scratch::default()
                };
            }
            attend_task(&ctx, task, scratch, out_ptr, partials_ptr);
        })
    });
    let merged = &partials;
    crate::kernels::team::for_each(plan.merges.len(), |i| {
        merge(&ctx, &plan.merges[i], merged, out_ptr);
    });
    PARTIALS.with(|p| *p.borrow_mut() = partials);
}

struct Context<'a> {
    /// The f32 kernels' path (decoding, scores, and the rest unless `bf16`).
    path: Dispatch,
    /// Softmax and weighted values with the bf16 kernels (x86-64 only).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    bf16: bool,
    /// Both bf16 products on AMX tiles (16 lanes a tile).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    amx: bool,
    /// On the bf16 path (not AMX), tasks of one lane chunk (a decode row) read K and V in place
    /// from the pages (`bf16_pages`), with no packed copy of the block.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    bf16_pages: bool,
    /// The f32 products on AVX2 read f16 K and V in place from the pages (`in_place`), with no
    /// f32 scratch copy of the block.
    in_place: bool,
    /// Both products in integers over q8 pages read in place (`int8`; x86-64 only).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    int8: bool,
    /// The bf16 path's steps with fp16 products over f16 pages, V read in place (`fp16`;
    /// x86-64 only). `bf16` is set too.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    fp16: bool,
    q: &'a [f32],
    rows: &'a [AttentionRow],
    page_tables: &'a [&'a [PageId]],
    kv: &'a KvStorage,
    layer: usize,
    shape: AttentionShape,
    group: usize,
}

impl Context<'_> {
    /// Whether V is decoded to f32 scratch: on the f32 path, and on the bf16 path when pages
    /// hold an odd number of slots (pairs of keys straddle pages, so the pairs are packed from
    /// the f32 rows instead of straight from the pages).
    fn values_in_f32(&self) -> bool {
        !self.in_place
            && !self.int8
            && !self.fp16
            && (!self.bf16 || !self.kv.shape().page_size.is_multiple_of(2))
    }
}

fn attend_task(ctx: &Context, task: &Task, s: &mut Scratch, out: SharedPtr, partials: SharedPtr) {
    let shape = ctx.shape;
    let (hd, group) = (shape.head_dim, ctx.group);
    let hdp = hd.next_multiple_of(16);
    let page_size = ctx.kv.shape().page_size;
    let lanes = lanes(task.rows.len(), group);
    let bk = block_keys(page_size);
    let bs = bk.next_multiple_of(16);
    let segment = segment_keys(page_size);
    let scale = 1.0 / (hd as f32).sqrt();
    let task_rows = &ctx.rows[task.rows.clone()];
    let max_pos = task_rows.iter().map(|r| r.position).max().unwrap();
    let key_end = task.keys.end.min(max_pos + 1);

    // (A scratch serves one layout, so `hdp` is fixed and V's padding columns stay zero.) The
    // bf16 path decodes K straight into pairs, and V too unless pairs of keys straddle pages;
    // the int8 path reads both from the pages.
    if !ctx.bf16 && !ctx.in_place && !ctx.int8 && s.kt.len() < hd * bs {
        s.kt.resize(hd * bs, 0.0);
    }
    // Whole pairs of V rows for the bf16 path (rows past the block are finite and weighted 0).
    if ctx.values_in_f32() && s.v.len() < bk.next_multiple_of(2) * hdp {
        s.v.resize(bk.next_multiple_of(2) * hdp, 0.0);
    }
    s.q.clear();
    s.q.resize(lanes * hdp, 0.0);
    // Keys stored divided by channel scales meet queries multiplied by them.
    let channels = ctx.kv.key_channels(ctx.layer, task.kv_head);
    for (r, row_index) in task.rows.clone().enumerate() {
        let src = &ctx.q[(row_index * shape.num_heads + task.kv_head * group) * hd..][..group * hd];
        for g in 0..group {
            let dst = &mut s.q[(r * group + g) * hdp..][..hd];
            let src = &src[g * hd..(g + 1) * hd];
            match channels {
                None => dst.iter_mut().zip(src).for_each(|(d, x)| *d = x * scale),
                Some(c) => {
                    for ((d, x), c) in dst.iter_mut().zip(src).zip(c) {
                        *d = x * scale * c;
                    }
                }
            }
        }
    }
    // AMX tiles always hold 16 lanes: the buffers they read and write have whole tiles of lanes
    // (the padding lanes' values are finite and never read).
    let tile_lanes = if ctx.amx {
        lanes.next_multiple_of(16)
    } else {
        lanes
    };
    s.s.resize(tile_lanes * bs, 0.0);
    s.visible.resize(lanes, 0);
    #[cfg(target_arch = "x86_64")]
    if ctx.bf16 {
        assert!(hd.is_multiple_of(2), "the bf16 path pairs head dimensions");
        s.v2.resize(bs.div_ceil(2) * hdp, 0);
        s.p16.resize(tile_lanes * bs, 0);
        s.kt2.resize(hd / 2 * bs, 0);
        s.q16.resize(tile_lanes * hdp, 0);
        // SAFETY: the path was checked; both buffers hold `lanes * hdp` values.
        unsafe {
            if ctx.fp16 {
                fp16::to_f16(s.q.as_ptr(), lanes * hdp, s.q16.as_mut_ptr());
            } else {
                bf16::to_bf16(s.q.as_ptr(), lanes * hdp, s.q16.as_mut_ptr());
            }
        }
        let lanes16 = lanes.next_multiple_of(16);
        s.qt.clear();
        s.qt.resize(hd * lanes16, 0.0);
        // Column by column: contiguous writes, and no bounds check per element.
        for (d, column) in s.qt.chunks_exact_mut(lanes16).enumerate() {
            for (x, q) in column.iter_mut().zip(s.q.chunks_exact(hdp)) {
                *x = q[d];
            }
        }
        s.kref.resize(hdp, 0.0);
        s.offset.resize(lanes16, 0.0);
    }
    #[cfg(target_arch = "x86_64")]
    if ctx.int8 {
        int8::prepare(s, lanes, hdp, bs);
    }

    // The running fold of this task's segments (unsplit tasks only).
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the path (so AMX) was checked.
    let _tiles =
        (ctx.amx || (ctx.int8 && s.int8.tiles())).then(|| unsafe { amx::Tiles::configure() });
    s.fold_max.clear();
    s.fold_max.resize(lanes, f32::NEG_INFINITY);
    s.fold_sum.clear();
    s.fold_sum.resize(lanes, 0.0);
    s.fold_o.resize(lanes * hdp, 0.0);
    for first in (task.keys.start..key_end).step_by(segment) {
        s.o.clear();
        s.o.resize(tile_lanes * hdp, 0.0);
        s.max.clear();
        s.max.resize(lanes, f32::NEG_INFINITY);
        s.sum.clear();
        s.sum.resize(lanes, 0.0);
        s.sums.clear();
        s.sums.resize(lanes * 16, 0.0);
        let end = (first + segment).min(key_end);
        for kb in (first..end).step_by(bk) {
            attend_block(ctx, task, s, kb, bk.min(end - kb), key_end);
        }
        #[cfg(target_arch = "x86_64")]
        if ctx.bf16 || ctx.int8 {
            for lane in 0..lanes {
                // SAFETY: the path was checked; `sums` holds 16 floats a lane.
                s.sum[lane] = unsafe { bf16::reduce_sums(s.sums[lane * 16..].as_ptr()) };
            }
        }
        match task.partial {
            None => {
                for lane in 0..lanes {
                    let acc = &mut s.fold_o[lane * hdp..lane * hdp + hd];
                    let (max, sum) = (&mut s.fold_max[lane], &mut s.fold_sum[lane]);
                    let o = &s.o[lane * hdp..lane * hdp + hd];
                    fold(max, sum, acc, s.max[lane], s.sum[lane], o);
                }
            }
            Some(at) => {
                let len = partial_len(lanes, hd);
                // SAFETY: the plan gives every (rows, KV head, segment) of a split its own `len`
                // floats, and only the piece holding the segment writes them.
                let dst = unsafe {
                    std::slice::from_raw_parts_mut(partials.0.add(at + first / segment * len), len)
                };
                let (max, rest) = dst.split_at_mut(lanes);
                let (sum, acc) = rest.split_at_mut(lanes);
                max.copy_from_slice(&s.max);
                sum.copy_from_slice(&s.sum);
                for (lane, acc) in acc.chunks_exact_mut(hd).enumerate() {
                    acc.copy_from_slice(&s.o[lane * hdp..lane * hdp + hd]);
                }
            }
        }
    }
    if task.partial.is_none() {
        for lane in 0..lanes {
            let (r, g) = (lane / group, lane % group);
            let head = task.kv_head * group + g;
            let off = ((task.rows.start + r) * shape.num_heads + head) * hd;
            // SAFETY: an unsplit (rows, KV head) is one task, so its (row, head) writes are
            // disjoint from every other task's, and `off + hd <= out.len()` (row < num_rows,
            // head < num_heads).
            let dst = unsafe { std::slice::from_raw_parts_mut(out.0.add(off), hd) };
            let inv = 1.0 / s.fold_sum[lane];
            for (d, a) in dst.iter_mut().zip(&s.fold_o[lane * hdp..]) {
                *d = a * inv;
            }
        }
    }
}

/// Folds one segment's state `(m, l, o)` of a lane into the running `(max, sum, acc)`: the first
/// segment the lane sees is taken as it is, later ones rescale both sides to the larger max. A
/// segment none of whose keys the lane sees (max −inf, sum 0) changes nothing.
#[inline]
fn fold(max: &mut f32, sum: &mut f32, acc: &mut [f32], m: f32, l: f32, o: &[f32]) {
    if m == f32::NEG_INFINITY {
        return;
    }
    if *max == f32::NEG_INFINITY {
        (*max, *sum) = (m, l);
        acc.copy_from_slice(o);
        return;
    }
    let new_max = max.max(m);
    let (a, b) = (
        exp_nonpositive(*max - new_max),
        exp_nonpositive(m - new_max),
    );
    *sum = *sum * a + l * b;
    for (d, x) in acc.iter_mut().zip(o) {
        *d = *d * a + x * b;
    }
    *max = new_max;
}

/// Folds keys `kb..kb + nk` (whole pages from a page boundary) into the lanes' running state;
/// pages up to `prefetch_end` may be prefetched.
fn attend_block(
    ctx: &Context,
    task: &Task,
    s: &mut Scratch,
    kb: usize,
    nk: usize,
    prefetch_end: usize,
) {
    let (hd, group) = (ctx.shape.head_dim, ctx.group);
    let hdp = hd.next_multiple_of(16);
    let page_size = ctx.kv.shape().page_size;
    let lanes = lanes(task.rows.len(), group);
    let bk = block_keys(page_size);
    let bs = bk.next_multiple_of(16);
    let task_rows = &ctx.rows[task.rows.clone()];
    let table = ctx.page_tables[task_rows[0].seq];
    let kv = ctx.kv;

    // The bf16 scores centre K on the block's first key (see `bf16_block`).
    #[cfg(target_arch = "x86_64")]
    if ctx.bf16 {
        kv.head_rows(table[kb / page_size], ctx.layer, KvKind::Key, task.kv_head)
            .column(0, hd, &mut s.kref);
    }
    #[cfg(target_arch = "x86_64")]
    let mut in_place_pages = InPlacePages::default();
    #[cfg(target_arch = "x86_64")]
    let mut block_pages = ((ctx.bf16_pages && lanes <= bf16::MAX_LANES) || ctx.int8)
        .then(|| bf16_pages::BlockPages::new(page_size));
    // Decode the block's pages (or, in place, note where they are).
    let mut j = 0;
    while j < nk {
        let pos = kb + j;
        debug_assert_eq!(pos % page_size, 0);
        let page = table[pos / page_size];
        let n = page_size.min(nk - j);
        let keys = kv.head_rows(page, ctx.layer, KvKind::Key, task.kv_head);
        #[cfg(target_arch = "x86_64")]
        if let Some(pages) = &mut block_pages {
            let values = kv.head_rows(page, ctx.layer, KvKind::Value, task.kv_head);
            pages.push(keys, values, n);
            j += n;
            continue;
        }
        #[cfg(target_arch = "x86_64")]
        if ctx.in_place || ctx.fp16 {
            let values = kv.head_rows(page, ctx.layer, KvKind::Value, task.kv_head);
            if let (true, HeadRows::F16(k)) = (ctx.fp16, keys) {
                let out = s.kt2.as_mut_ptr().cast::<u16>().wrapping_add(j);
                // SAFETY: the path was checked; `kt2` holds `head_dim / 2 * bs` pairs, so
                // `head_dim` rows of `bs >= nk` 16-bit values.
                unsafe { fp16::centred_keys(k, n, hd, s.kref.as_ptr(), out, bs) };
            }
            in_place_pages.push(keys, values);
            j += n;
            continue;
        }
        #[cfg(target_arch = "x86_64")]
        if ctx.bf16 {
            let out = s.kt2[j..].as_mut_ptr();
            // SAFETY: the path was checked; `kt2` holds `head_dim / 2` rows of `bs >= nk` pairs.
            unsafe { bf16::key_pairs(&keys, n, hd, s.kref.as_ptr(), out, bs) };
        } else {
            micro::decode_columns(ctx.path, &keys, n, hd, &mut s.kt[j..], bs);
        }
        #[cfg(not(target_arch = "x86_64"))]
        micro::decode_columns(ctx.path, &keys, n, hd, &mut s.kt[j..], bs);
        let values = kv.head_rows(page, ctx.layer, KvKind::Value, task.kv_head);
        #[cfg(target_arch = "x86_64")]
        if !ctx.values_in_f32() {
            let out = s.v2[j / 2 * hdp..].as_mut_ptr();
            // SAFETY: the path was checked; `v2` holds `bk / 2` rows of `hdp` pairs.
            unsafe { bf16::value_pairs(&values, n, hd, out, hdp) };
            j += n;
            continue;
        }
        values.decode_rows(n, hd, &mut s.v[j * hdp..], hdp);
        j += n;
    }
    // Let the next block's pages stream in while this one is computed: all at once, a share
    // with each lane chunk (bf16), or, read in place, each line as the same place of this block
    // is read.
    #[cfg(target_arch = "x86_64")]
    let mut next_block = bf16_block::NextBlock::default();
    let next = kb + nk;
    if next < prefetch_end {
        let last = (next + bk).min(prefetch_end) - 1;
        let next_pages = &table[next / page_size..=last / page_size];
        #[cfg(target_arch = "x86_64")]
        if let Some(pages) = &mut block_pages {
            for (i, &page) in next_pages.iter().enumerate() {
                let keys = kv.head_rows(page, ctx.layer, KvKind::Key, task.kv_head);
                let values = kv.head_rows(page, ctx.layer, KvKind::Value, task.kv_head);
                pages.push_next(i, keys, values);
            }
        }
        #[cfg(target_arch = "x86_64")]
        if ctx.bf16 && block_pages.is_none() {
            // Spread over the block's lane chunks by `bf16_block`.
            for &page in next_pages {
                for kind in [KvKind::Key, KvKind::Value] {
                    next_block.push(kv.head_rows(page, ctx.layer, kind, task.kv_head).bytes());
                }
            }
        }
        #[cfg(target_arch = "x86_64")]
        let next_pages = if ctx.bf16 || ctx.int8 {
            &[]
        } else {
            next_pages
        };
        for &page in next_pages {
            for kind in [KvKind::Key, KvKind::Value] {
                kv.head_rows(page, ctx.layer, kind, task.kv_head).prefetch();
            }
        }
    }
    for (r, row) in task_rows.iter().enumerate() {
        let visible = (row.position + 1).saturating_sub(kb).min(nk);
        s.visible[r * group..(r + 1) * group].fill(visible);
    }

    #[cfg(target_arch = "x86_64")]
    if let (true, Some(pages)) = (ctx.int8, &block_pages) {
        // SAFETY: the path and the pages' type and layout were checked; `attend_task` sized the
        // scratch for this task.
        unsafe { int8::block(s, pages, lanes, nk, hd, hdp, bs) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if ctx.fp16 {
        let values = in_place_pages.values();
        // SAFETY: the path was checked; `attend_task` sized the scratch for this task and the
        // block's K pairs were packed above.
        unsafe { fp16::block(s, values, page_size, &next_block, lanes, hd, hdp, bs) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if ctx.bf16 {
        // SAFETY: the caller checked the path; `attend_task` sized the scratch for this task.
        unsafe {
            if block_pages.is_none() && ctx.values_in_f32() {
                // Pairs of keys straddle pages: V was decoded to f32 and is packed here.
                bf16_block::pack_values(s, nk, hdp);
            }
            let pages = block_pages.as_ref();
            bf16_block::bf16_block(s, ctx.amx, pages, &next_block, lanes, nk, hd, hdp, bs);
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if ctx.in_place {
        for (l0, l1, keys) in seeing_chunks(&s.visible[..lanes], LANE_CHUNK) {
            let (q, out) = (&s.q[l0 * hdp..l1 * hdp], &mut s.s[l0 * bs..l1 * bs]);
            in_place::scores(q, hdp, hd, in_place_pages.keys(), page_size, keys, out, bs);
        }
    } else {
        scores(ctx.path, s, lanes, hd, hdp, bs);
    }
    #[cfg(not(target_arch = "x86_64"))]
    scores(ctx.path, s, lanes, hd, hdp, bs);

    // Online softmax, once per lane per block.
    for lane in 0..lanes {
        let visible = s.visible[lane];
        let row = &mut s.s[lane * bs..lane * bs + nk];
        row[visible..].fill(0.0);
        if visible == 0 {
            continue;
        }
        let (new_max, block_sum) = micro::softmax(ctx.path, &mut row[..visible], s.max[lane]);
        advance_lane(s, lane, new_max, block_sum, hdp);
    }

    // Weighted values.
    for (l0, l1, keys) in seeing_chunks(&s.visible[..lanes], LANE_CHUNK) {
        #[cfg(target_arch = "x86_64")]
        if ctx.in_place {
            let (p, out) = (&s.s[l0 * bs..l1 * bs], &mut s.o[l0 * hdp..l1 * hdp]);
            let values = in_place_pages.values();
            in_place::accumulate(p, bs, values, page_size, hd, keys, out, hdp);
            continue;
        }
        micro::accumulate(
            ctx.path,
            &s.s[l0 * bs..l1 * bs],
            bs,
            &s.v,
            hdp,
            keys,
            &mut s.o[l0 * hdp..l1 * hdp],
        );
    }
}

/// The f16 K and V pages of one block, for the in-place kernels.
#[cfg(target_arch = "x86_64")]
#[derive(Default)]
struct InPlacePages<'a> {
    keys: [&'a [half::f16]; in_place::MAX_PAGES],
    values: [&'a [half::f16]; in_place::MAX_PAGES],
    len: usize,
}

#[cfg(target_arch = "x86_64")]
impl<'a> InPlacePages<'a> {
    fn push(&mut self, keys: HeadRows<'a>, values: HeadRows<'a>) {
        let (HeadRows::F16(k), HeadRows::F16(v)) = (keys, values) else {
            unreachable!("the in-place kernels read f16 pages only");
        };
        (self.keys[self.len], self.values[self.len]) = (k, v);
        self.len += 1;
    }
    fn keys(&self) -> &[&'a [half::f16]] {
        &self.keys[..self.len]
    }
    fn values(&self) -> &[&'a [half::f16]] {
        &self.values[..self.len]
    }
}

/// Every lane's scores against the block, lane chunk by lane chunk, only as far as the chunk
/// sees.
fn scores(path: Dispatch, s: &mut Scratch, lanes: usize, hd: usize, hdp: usize, bs: usize) {
    for (l0, l1, keys) in seeing_chunks(&s.visible[..lanes], LANE_CHUNK) {
        micro::scores(
            path,
            &s.q[l0 * hdp..l1 * hdp],
            hdp,
            hd,
            &s.kt,
            bs,
            keys.next_multiple_of(16),
            &mut s.s[l0 * bs..l1 * bs],
            bs,
        );
    }
}

/// The chunks `l0..l1` of at most `chunk` lanes in which some lane sees a key of the block,
/// each with the most keys a lane of it sees (`visible` holds each lane's count).
fn seeing_chunks(
    visible: &[usize],
    chunk: usize,
) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
    (0..visible.len()).step_by(chunk).filter_map(move |l0| {
        let l1 = (l0 + chunk).min(visible.len());
        let keys = visible[l0..l1].iter().copied().max().unwrap();
        (keys > 0).then_some((l0, l1, keys))
    })
}

/// Moves a lane's online-softmax state to the block's `new_max`, adding the block's
/// `block_sum` (its weights' sum at `new_max`) and rescaling the lane's output.
#[inline]
fn advance_lane(s: &mut Scratch, lane: usize, new_max: f32, block_sum: f32, hdp: usize) {
    // Deep in a context the max rarely moves: skip the exponential (exp(0) is exactly 1).
    let correction = if s.max[lane] == new_max {
        1.0
    } else {
        exp_nonpositive(s.max[lane] - new_max)
    };
    if correction != 1.0 {
        s.o[lane * hdp..(lane + 1) * hdp]
            .iter_mut()
            .for_each(|a| *a *= correction);
    }
    s.sum[lane] = s.sum[lane] * correction + block_sum;
    s.max[lane] = new_max;
}

/// Folds the segment states of a split (rows, KV head) left to right into its output.
fn merge(ctx: &Context, multi: &Multi, partials: &[f32], out: SharedPtr) {
    let (hd, group, nh) = (ctx.shape.head_dim, ctx.group, ctx.shape.num_heads);
    let lanes = lanes(multi.rows.len(), group);
    let len = partial_len(lanes, hd);
    let states = &partials[multi.at..multi.at + multi.segments * len];
    for lane in 0..lanes {
        let (r, g) = (lane / group, lane % group);
        let off = ((multi.rows.start + r) * nh + multi.kv_head * group + g) * hd;
        // SAFETY: a split (rows, KV head) is merged once and its (row, head) slices belong to
        // no task, so writes are disjoint; `off + hd <= out.len()` as in `attend_task`.
        let dst = unsafe { std::slice::from_raw_parts_mut(out.0.add(off), hd) };
        let (mut max, mut sum) = (f32::NEG_INFINITY, 0f32);
        for state in states.chunks_exact(len) {
            let o = &state[2 * lanes + lane * hd..2 * lanes + (lane + 1) * hd];
            fold(&mut max, &mut sum, dst, state[lane], state[lanes + lane], o);
        }
        let inv = 1.0 / sum;
        dst.iter_mut().for_each(|d| *d *= inv);
    }
}
