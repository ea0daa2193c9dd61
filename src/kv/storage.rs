//! The bytes behind the pages: K and V for every layer, head and slot of every page, in one of
//! three element types. Storage grows in chunks the first time a page in a new chunk is written,
//! never past the pool's page count, so an idle server holds almost no KV memory.
//!
//! Layout inside a page, per layer: V is `[kv_head][slot][head_dim]` and K is transposed,
//! `[kv_head][head_dim][slot]`, so that one head's keys or values within a page are contiguous
//! and attention reads them in place in the shapes its two products want: the scores of a block
//! of keys are query lanes × `head_dim` times `head_dim` × keys (a row of K^T is consecutive
//! keys, one SIMD vector at page size 16), and the weighted sum is lanes × keys times keys ×
//! `head_dim` (a row of V is one key's values). Q8 keeps one scale per (token, head) either way.

use half::f16;
use half::slice::HalfFloatSliceExt;
use serde::{Deserialize, Serialize};
use std::str::FromStr;
use std::sync::Arc;

use crate::kernels::{AlignedBuf, Zeroable};

/// Element type of the KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum KvDtype {
    #[default]
    F16,
    F32,
    /// int8 with one f32 scale per (token, head): a quarter of f32's bytes.
    Q8,
}

impl KvDtype {
    fn elem_bytes(self) -> usize {
        match self {
            KvDtype::F16 => 2,
            KvDtype::F32 => 4,
            KvDtype::Q8 => 1,
        }
    }
}

impl FromStr for KvDtype {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "f16" => Ok(KvDtype::F16),
            "f32" => Ok(KvDtype::F32),
            "q8" | "q8_0" | "int8" => Ok(KvDtype::Q8),
            other => Err(format!(
                "unknown KV dtype `{other}` (expected f16, f32 or q8)"
            )),
        }
    }
}

/// The dimensions of the cache, fixed by the model and the page size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvShape {
    pub num_layers: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub page_size: usize,
}

impl KvShape {
    /// Elements of one head's rows in one page: `[slot][head_dim]`.
    fn head_block(&self) -> usize {
        self.page_size * self.head_dim
    }
    fn page_elems(&self) -> usize {
        self.num_layers * 2 * self.num_kv_heads * self.head_block()
    }
    fn page_scales(&self) -> usize {
        self.num_layers * 2 * self.num_kv_heads * self.page_size
    }
    /// Bytes one page occupies in storage of `dtype`.
    pub fn page_bytes(&self, dtype: KvDtype) -> usize {
        let scales = if dtype == KvDtype::Q8 {
            self.page_scales() * 4
        } else {
            0
        };
        self.page_elems() * dtype.elem_bytes() + scales
    }
    /// Bytes per token of context.
    pub fn token_bytes(&self, dtype: KvDtype) -> f64 {
        self.page_bytes(dtype) as f64 / self.page_size as f64
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvKind {
    Key = 0,
    Value = 1,
}

/// One head's K or V inside one page, read in place: `[head_dim][page_size]` for K (transposed),
/// `[page_size][head_dim]` for V. Q8 scales are per slot either way.
#[derive(Clone, Copy)]
pub enum HeadRows<'a> {
    F16(&'a [f16]),
    F32(&'a [f32]),
    Q8 { values: &'a [i8], scales: &'a [f32] },
}

impl<'a> HeadRows<'a> {
    /// V: decodes the first `num_slots` rows (`[slot][head_dim]`) into `out`, one row every
    /// `out_stride` elements (`out_stride >= head_dim`).
    pub fn decode_rows(
        &self,
        num_slots: usize,
        head_dim: usize,
        out: &mut [f32],
        out_stride: usize,
    ) {
        if out_stride == head_dim {
            let n = num_slots * head_dim;
            match self {
                HeadRows::F16(src) => return src[..n].convert_to_f32_slice(&mut out[..n]),
                HeadRows::F32(src) => return out[..n].copy_from_slice(&src[..n]),
                HeadRows::Q8 { .. } => {}
            }
        }
        for slot in 0..num_slots {
            let dst = &mut out[slot * out_stride..slot * out_stride + head_dim];
            let at = slot * head_dim;
            match self {
                HeadRows::F16(src) => src[at..at + head_dim].convert_to_f32_slice(dst),
                HeadRows::F32(src) => dst.copy_from_slice(&src[at..at + head_dim]),
                HeadRows::Q8 { values, scales } => {
                    let scale = scales[slot];
                    for (d, &v) in dst.iter_mut().zip(&values[at..at + head_dim]) {
                        *d = v as f32 * scale;
                    }
                }
            }
        }
    }

    /// K: decodes the first `num_slots` slots of every row of the transposed block
    /// (`[head_dim][page_size]`) into `out[d * out_stride..][..num_slots]`.
    pub fn decode_columns(
        &self,
        num_slots: usize,
        head_dim: usize,
        out: &mut [f32],
        out_stride: usize,
    ) {
        let page_size = self.len() / head_dim;
        for d in 0..head_dim {
            let dst = &mut out[d * out_stride..d * out_stride + num_slots];
            let at = d * page_size;
            match self {
                HeadRows::F16(src) => src[at..at + num_slots].convert_to_f32_slice(dst),
                HeadRows::F32(src) => dst.copy_from_slice(&src[at..at + num_slots]),
                HeadRows::Q8 { values, scales } => {
                    for ((o, &v), &s) in dst.iter_mut().zip(&values[at..]).zip(scales.iter()) {
                        *o = v as f32 * s;
                    }
                }
            }
        }
    }

    /// K: one slot's vector of the transposed block, `out[d]` for `d < head_dim`, decoded as
    /// [`HeadRows::decode_columns`] decodes it.
    pub fn column(&self, slot: usize, head_dim: usize, out: &mut [f32]) {
        let page_size = self.len() / head_dim;
        let out = &mut out[..head_dim];
        // (One `match` outside the loop: attention decodes a column for every block it reads.)
        match self {
            HeadRows::F16(src) => {
                for (o, x) in out.iter_mut().zip(src[slot..].iter().step_by(page_size)) {
                    *o = x.to_f32();
                }
            }
            HeadRows::F32(src) => {
                for (o, x) in out.iter_mut().zip(src[slot..].iter().step_by(page_size)) {
                    *o = *x;
                }
            }
            HeadRows::Q8 { values, scales } => {
                let scale = scales[slot];
                for (o, x) in out.iter_mut().zip(values[slot..].iter().step_by(page_size)) {
                    *o = *x as f32 * scale;
                }
            }
        }
    }

    /// The block's elements as bytes (a q8 block's integers, not its scales).
    pub fn bytes(&self) -> &'a [u8] {
        match *self {
            HeadRows::F16(s) => bytes_of(s),
            HeadRows::F32(s) => bytes_of(s),
            HeadRows::Q8 { values, .. } => bytes_of(values),
        }
    }

    /// Asks the CPU to start loading a q8 block's scales (one line) into cache (no-op for other
    /// element types, and off x86-64).
    #[inline]
    pub fn prefetch_scales(&self) {
        #[cfg(target_arch = "x86_64")]
        if let HeadRows::Q8 { scales, .. } = self {
            prefetch_lines::<{ std::arch::x86_64::_MM_HINT_T0 }>(bytes_of(scales));
        }
    }

    /// Asks the CPU to start loading the block into cache (no-op off x86-64).
    #[inline]
    pub fn prefetch(&self) {
        let bytes = self.bytes();
        // The hint measured best differs: non-temporal on AMD Zen 4 (the block is read once,
        // soon); on an Intel Xeon it made decode at 16K context 1.6x slower than the T1 hint
        // (L2) or none at all, which measured alike.
        #[cfg(target_arch = "x86_64")]
        if crate::kernels::cpu_is_amd() {
            prefetch_lines::<{ std::arch::x86_64::_MM_HINT_NTA }>(bytes);
        } else {
            prefetch_lines::<{ std::arch::x86_64::_MM_HINT_T1 }>(bytes);
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = bytes;
    }

    /// Elements in the block (`page_size * head_dim`).
    pub fn len(&self) -> usize {
        match self {
            HeadRows::F16(s) => s.len(),
            HeadRows::F32(s) => s.len(),
            HeadRows::Q8 { values, .. } => values.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn bytes_of<T: Copy>(s: &[T]) -> &[u8] {
    // SAFETY: any initialised `Copy` plain-old-data slice (f16, f32, i8) is readable as bytes.
    unsafe { std::slice::from_raw_parts(s.as_ptr().cast(), std::mem::size_of_val(s)) }
}

fn bytes_of_mut<T: Copy>(s: &mut [T]) -> &mut [u8] {
    // SAFETY: as `bytes_of`; every bit pattern is a valid f16, f32 or i8, so any bytes written
    // leave the slice valid.
    unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr().cast(), std::mem::size_of_val(s)) }
}

struct Chunks<T: Zeroable> {
    chunks: Vec<AlignedBuf<T>>,
}

impl<T: Zeroable> Chunks<T> {
    fn new() -> Self {
        Self { chunks: Vec::new() }
    }
    fn ensure(&mut self, chunk: usize, elems: usize) {
        while self.chunks.len() <= chunk {
            self.chunks.push(AlignedBuf::zeroed(elems));
        }
    }
    fn bytes(&self) -> usize {
        self.chunks.iter().map(|c| c.len()).sum::<usize>() * std::mem::size_of::<T>()
    }
    /// Copies `len` elements from (chunk, offset) `from` to `to`.
    fn copy(&mut self, from: (usize, usize), to: (usize, usize), len: usize) {
        if from.0 == to.0 {
            self.chunks[from.0].copy_within(from.1..from.1 + len, to.1);
        } else {
            let (a, b) = if from.0 < to.0 {
                let (lo, hi) = self.chunks.split_at_mut(to.0);
                (&lo[from.0], &mut hi[0])
            } else {
                let (lo, hi) = self.chunks.split_at_mut(from.0);
                (&hi[0], &mut lo[to.0])
            };
            b[to.1..to.1 + len].copy_from_slice(&a[from.1..from.1 + len]);
        }
    }
}

/// Copy the first `num_slots` positions of page `src` into page `dst` (all layers and heads).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageCopy {
    pub src: u32,
    pub dst: u32,
    pub num_slots: usize,
}

enum KvData {
    F16(Chunks<f16>),
    F32(Chunks<f32>),
    Q8 {
        values: Chunks<i8>,
        scales: Chunks<f32>,
    },
}

pub struct KvStorage {
    shape: KvShape,
    dtype: KvDtype,
    /// q8 only: each key channel's scale, `[layer][kv_head][head_dim]` (see
    /// [`KvStorage::set_key_channels`]).
    key_channels: Option<Arc<[f32]>>,
    max_pages: usize,
    /// Pages a chunk holds: `1 << chunk_shift`.
    pages_per_chunk: usize,
    chunk_shift: u32,
    data: KvData,
}

/// Chunks are sized to about this many bytes: large enough that growth is rare, small enough
/// that an idle or small server holds little.
const TARGET_CHUNK_BYTES: usize = 8 << 20;

impl KvStorage {
    pub fn new(shape: KvShape, dtype: KvDtype, max_pages: usize) -> Self {
        // A power of two, so that finding a page's chunk (for every page of every block that
        // attention reads) is a shift, not a division.
        let chunk_shift = (TARGET_CHUNK_BYTES / shape.page_bytes(dtype))
            .clamp(1, 4096)
            .ilog2();
        let pages_per_chunk = 1 << chunk_shift;
        let data = match dtype {
            KvDtype::F16 => KvData::F16(Chunks::new()),
            KvDtype::F32 => KvData::F32(Chunks::new()),
            KvDtype::Q8 => KvData::Q8 {
                values: Chunks::new(),
                scales: Chunks::new(),
            },
        };
        Self {
            shape,
            dtype,
            key_channels: None,
            max_pages,
            pages_per_chunk,
            chunk_shift,
            data,
        }
    }

    pub fn shape(&self) -> KvShape {
        self.shape
    }

    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }

    /// q8 keys are stored divided by a fixed scale per channel (`[layer][kv_head][head_dim]`,
    /// from the model: `runner::calibrate`) before their per-token int8 quantisation. Some
    /// models' keys carry a few channels tens of times larger than the rest (Qwen2.5's, from its
    /// K bias): one scale per token then leaves the others a handful of levels, and measured
    /// against the numpy reference Qwen2.5-Coder-0.5B's top-1 agreement fell to 0.90. The
    /// stored keys stay divided: attention multiplies the queries by the same scales instead
    /// ([`KvStorage::key_channels`]), since `q · k = (q ⊙ σ) · (k / σ)`. No effect on f16/f32.
    pub fn set_key_channels(&mut self, scales: Arc<[f32]>) {
        let s = self.shape;
        assert_eq!(scales.len(), s.num_layers * s.num_kv_heads * s.head_dim);
        assert!(scales.iter().all(|x| x.is_finite() && *x > 0.0));
        if self.dtype == KvDtype::Q8 {
            self.key_channels = Some(scales);
        }
    }

    /// The channel scales the keys of `(layer, head)` are stored divided by (q8 with
    /// [`KvStorage::set_key_channels`] only).
    pub fn key_channels(&self, layer: usize, head: usize) -> Option<&[f32]> {
        let hd = self.shape.head_dim;
        let at = (layer * self.shape.num_kv_heads + head) * hd;
        self.key_channels.as_deref().map(|c| &c[at..at + hd])
    }

    /// Every key channel scale (`[layer][kv_head][head_dim]`), q8 only.
    pub fn all_key_channels(&self) -> Option<&[f32]> {
        self.key_channels.as_deref()
    }

    /// Bytes currently allocated (grows with the highest page ever written).
    pub fn bytes_allocated(&self) -> usize {
        match &self.data {
            KvData::F16(c) => c.bytes(),
            KvData::F32(c) => c.bytes(),
            KvData::Q8 { values, scales } => values.bytes() + scales.bytes(),
        }
    }

    /// Bytes the storage would hold with every page allocated: the budget it never exceeds.
    pub fn budget_bytes(&self) -> usize {
        self.max_pages * self.shape.page_bytes(self.dtype)
    }

    /// The chunk holding `page` and the index of its (layer, kind, head) block in the chunk.
    /// A chunk is laid out `[layer][head][page][kind]`, so that one head's K and V of
    /// consecutive pages sit side by side and attention streams through them.
    #[inline]
    fn locate(&self, page: usize, layer: usize, kind: KvKind, head: usize) -> (usize, usize) {
        let chunk = page >> self.chunk_shift;
        let pages_in_chunk = self.pages_in_chunk(chunk);
        let page_in_chunk = page & (self.pages_per_chunk - 1);
        let block = ((layer * self.shape.num_kv_heads + head) * pages_in_chunk + page_in_chunk) * 2
            + kind as usize;
        (chunk, block)
    }

    #[inline]
    fn pages_in_chunk(&self, chunk: usize) -> usize {
        self.pages_per_chunk
            .min(self.max_pages - chunk * self.pages_per_chunk)
    }

    fn ensure_page(&mut self, page_id: usize) {
        assert!(page_id < self.max_pages, "page {page_id} beyond the pool");
        let chunk = page_id >> self.chunk_shift;
        let pages_in_chunk = self.pages_in_chunk(chunk);
        let elems = pages_in_chunk * self.shape.page_elems();
        let scales = pages_in_chunk * self.shape.page_scales();
        match &mut self.data {
            KvData::F16(c) => c.ensure(chunk, elems),
            KvData::F32(c) => c.ensure(chunk, elems),
            KvData::Q8 { values, scales: s } => {
                values.ensure(chunk, elems);
                s.ensure(chunk, scales);
            }
        }
    }

    /// Writes the K and V rows (`[num_kv_heads * head_dim]` each) of one token into `slot` of
    /// `page_id` for `layer`.
    pub fn write_token(&mut self, page_id: u32, slot: usize, layer: usize, k: &[f32], v: &[f32]) {
        let page = page_id as usize;
        self.ensure_page(page);
        let shape = self.shape;
        let hd = shape.head_dim;
        let page_size = shape.page_size;
        for (kind, src) in [(KvKind::Key, k), (KvKind::Value, v)] {
            // V rows are contiguous; K is transposed, one element every `page_size`.
            let (first, step) = match kind {
                KvKind::Key => (slot, page_size),
                KvKind::Value => (slot * hd, 1),
            };
            for head in 0..shape.num_kv_heads {
                let (chunk, block) = self.locate(page, layer, kind, head);
                let at = block * shape.head_block() + first;
                let mut row = &src[head * hd..(head + 1) * hd];
                let mut divided = [0f32; 256];
                let divided_long: Vec<f32>;
                if let (KvKind::Key, Some(channels)) = (kind, self.key_channels(layer, head)) {
                    let quotients = row.iter().zip(channels).map(|(x, c)| x / c);
                    if hd <= divided.len() {
                        divided.iter_mut().zip(quotients).for_each(|(d, x)| *d = x);
                        row = &divided[..hd];
                    } else {
                        divided_long = quotients.collect();
                        row = &divided_long;
                    }
                }
                let span = at..at + (hd - 1) * step + 1;
                match &mut self.data {
                    KvData::F16(c) if step == 1 => {
                        c.chunks[chunk][span].convert_from_f32_slice(row)
                    }
                    KvData::F16(c) => {
                        for (d, &x) in c.chunks[chunk][span].iter_mut().step_by(step).zip(row) {
                            *d = f16::from_f32(x);
                        }
                    }
                    KvData::F32(c) => {
                        for (d, &x) in c.chunks[chunk][span].iter_mut().step_by(step).zip(row) {
                            *d = x;
                        }
                    }
                    KvData::Q8 { values, scales } => {
                        let amax = row.iter().fold(0f32, |m, x| m.max(x.abs()));
                        let scale = if amax > 0.0 { amax / 127.0 } else { 1.0 };
                        let inv = 1.0 / scale;
                        let dst = values.chunks[chunk][span].iter_mut().step_by(step);
                        for (d, &x) in dst.zip(row) {
                            *d = (x * inv).round().clamp(-127.0, 127.0) as i8;
                        }
                        scales.chunks[chunk][block * page_size + slot] = scale;
                    }
                }
            }
        }
    }

    /// Copies the first `copy.num_slots` positions of page `copy.src` (every layer, K and V,
    /// every head) into page `copy.dst`: the copy-on-write of a shared, partly reused page.
    pub fn copy_slots(&mut self, copy: PageCopy) {
        let (src, dst) = (copy.src as usize, copy.dst as usize);
        self.ensure_page(src);
        self.ensure_page(dst);
        let shape = self.shape;
        let (ps, hd) = (shape.page_size, shape.head_dim);
        let n = copy.num_slots.min(ps);
        for layer in 0..shape.num_layers {
            for kind in [KvKind::Key, KvKind::Value] {
                for head in 0..shape.num_kv_heads {
                    let (sc, sb) = self.locate(src, layer, kind, head);
                    let (dc, db) = self.locate(dst, layer, kind, head);
                    let (s, d) = (sb * shape.head_block(), db * shape.head_block());
                    // V rows are `[slot][head_dim]`: one run. K is `[head_dim][slot]`: a run of
                    // `n` per dimension.
                    let runs: Vec<(usize, usize, usize)> = match kind {
                        KvKind::Value => vec![(s, d, n * hd)],
                        KvKind::Key => (0..hd).map(|i| (s + i * ps, d + i * ps, n)).collect(),
                    };
                    for (s, d, len) in runs {
                        match &mut self.data {
                            KvData::F16(c) => c.copy((sc, s), (dc, d), len),
                            KvData::F32(c) => c.copy((sc, s), (dc, d), len),
                            KvData::Q8 { values, .. } => values.copy((sc, s), (dc, d), len),
                        }
                    }
                    if let KvData::Q8 { scales, .. } = &mut self.data {
                        scales.copy((sc, sb * ps), (dc, db * ps), n);
                    }
                }
            }
        }
    }

    /// The bytes of whole pages, one after another ([`KvShape::page_bytes`] each), as stored:
    /// per layer, K then V, per head the block's elements and, for q8, its slots' scales (the
    /// session store's page format; [`KvStorage::import_pages`] reads it back).
    pub fn export_pages(&mut self, page_ids: &[u32]) -> Vec<u8> {
        let mut out = Vec::with_capacity(page_ids.len() * self.shape.page_bytes(self.dtype));
        for &page in page_ids {
            self.ensure_page(page as usize);
            self.for_each_block(page, |data, elems, scales| match data {
                KvData::F16(c) => out.extend_from_slice(bytes_of(&c.chunks[elems.0][elems.1])),
                KvData::F32(c) => out.extend_from_slice(bytes_of(&c.chunks[elems.0][elems.1])),
                KvData::Q8 { values, scales: s } => {
                    out.extend_from_slice(bytes_of(&values.chunks[elems.0][elems.1]));
                    out.extend_from_slice(bytes_of(&s.chunks[scales.0][scales.1.clone()]));
                }
            });
        }
        out
    }

    /// Writes pages exported by [`KvStorage::export_pages`] (of the same shape and dtype) into
    /// `page_ids`. `bytes` must hold exactly one page per id.
    pub fn import_pages(&mut self, page_ids: &[u32], bytes: &[u8]) {
        let page_bytes = self.shape.page_bytes(self.dtype);
        assert_eq!(bytes.len(), page_ids.len() * page_bytes, "page bytes");
        let mut at = 0;
        for &page in page_ids {
            self.ensure_page(page as usize);
            self.for_each_block(page, |data, elems, scales| {
                let mut take = |dst: &mut [u8]| {
                    dst.copy_from_slice(&bytes[at..at + dst.len()]);
                    at += dst.len();
                };
                match data {
                    KvData::F16(c) => take(bytes_of_mut(&mut c.chunks[elems.0][elems.1])),
                    KvData::F32(c) => take(bytes_of_mut(&mut c.chunks[elems.0][elems.1])),
                    KvData::Q8 { values, scales: s } => {
                        take(bytes_of_mut(&mut values.chunks[elems.0][elems.1]));
                        take(bytes_of_mut(&mut s.chunks[scales.0][scales.1.clone()]));
                    }
                }
            });
        }
    }

    /// Calls `f` with every (layer, K/V, head) block of `page` in export order: the storage,
    /// the block's (chunk, element range) and its (chunk, scale range).
    fn for_each_block(
        &mut self,
        page: u32,
        mut f: impl FnMut(&mut KvData, (usize, std::ops::Range<usize>), (usize, std::ops::Range<usize>)),
    ) {
        let shape = self.shape;
        for layer in 0..shape.num_layers {
            for kind in [KvKind::Key, KvKind::Value] {
                for head in 0..shape.num_kv_heads {
                    let (chunk, block) = self.locate(page as usize, layer, kind, head);
                    let elems = block * shape.head_block()..(block + 1) * shape.head_block();
                    let scales = block * shape.page_size..(block + 1) * shape.page_size;
                    f(&mut self.data, (chunk, elems), (chunk, scales));
                }
            }
        }
    }

    /// One head of K (transposed) or V in one page, read in place. (Always inlined: attention
    /// looks up four of these a page of every block; as a call, which `#[inline]` alone left it
    /// in `attend_block`, it was 5% of a decode row's attention at 16K.)
    #[inline(always)]
    pub fn head_rows(&self, page_id: u32, layer: usize, kind: KvKind, head: usize) -> HeadRows<'_> {
        let page = page_id as usize;
        let shape = self.shape;
        let (chunk, block) = self.locate(page, layer, kind, head);
        let range = block * shape.head_block()..(block + 1) * shape.head_block();
        match &self.data {
            KvData::F16(c) => HeadRows::F16(&c.chunks[chunk][range]),
            KvData::F32(c) => HeadRows::F32(&c.chunks[chunk][range]),
            KvData::Q8 { values, scales } => {
                let s = block * shape.page_size;
                HeadRows::Q8 {
                    values: &values.chunks[chunk][range],
                    scales: &scales.chunks[chunk][s..s + shape.page_size],
                }
            }
        }
    }
}

/// Prefetches every cache line of `bytes` with hint `HINT`.
#[cfg(target_arch = "x86_64")]
#[inline]
fn prefetch_lines<const HINT: i32>(bytes: &[u8]) {
    for at in (0..bytes.len()).step_by(64) {
        // SAFETY: prefetching an address inside a live slice has no side effects.
        unsafe { std::arch::x86_64::_mm_prefetch::<HINT>(bytes.as_ptr().add(at).cast()) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> KvShape {
        KvShape {
            num_layers: 2,
            num_kv_heads: 2,
            head_dim: 4,
            page_size: 3,
        }
    }

    #[test]
    fn storage_grows_only_when_written() {
        let mut kv = KvStorage::new(shape(), KvDtype::F32, 100_000);
        assert_eq!(kv.bytes_allocated(), 0);
        kv.write_token(0, 0, 0, &[1.0; 8], &[2.0; 8]);
        let one_chunk = kv.bytes_allocated();
        assert!(one_chunk > 0 && one_chunk <= TARGET_CHUNK_BYTES);
        assert!(kv.bytes_allocated() <= kv.budget_bytes());
    }

    #[test]
    fn q8_keys_are_stored_over_their_channel_scales() {
        // shape(): 2 layers, 2 heads of 4 dims. Head 0 of layer 1 has a channel 100x the rest.
        let k = [100.0, 0.5, -0.25, 0.125, 1.0, 2.0, 3.0, 4.0];
        let mut scales = vec![1f32; 2 * 2 * 4];
        scales[2 * 4] = 100.0; // layer 1, head 0, channel 0: index (1 * 2 + 0) * 4
        for dtype in [KvDtype::Q8, KvDtype::F16] {
            let mut kv = KvStorage::new(shape(), dtype, 4);
            kv.set_key_channels(scales.clone().into());
            kv.write_token(0, 1, 1, &k, &k);
            let mut column = vec![0.0; 4];
            kv.head_rows(0, 1, KvKind::Key, 0).column(1, 4, &mut column);
            let channels = kv.key_channels(1, 0);
            let want: Vec<f32> = match channels {
                Some(c) => k[..4].iter().zip(c).map(|(x, c)| x / c).collect(),
                None => k[..4].to_vec(),
            };
            assert_eq!(channels.is_some(), dtype == KvDtype::Q8);
            for (got, want) in column.iter().zip(&want) {
                // Over the scales the q8 step is 1/127 of the largest quotient (1.0), not of 100.
                assert!(
                    (got - want).abs() < 0.005,
                    "{dtype:?}: {column:?} vs {want:?}"
                );
            }
            assert_eq!(kv.key_channels(0, 1).is_some(), dtype == KvDtype::Q8);
        }
    }

    #[test]
    fn exported_pages_import_into_other_pages_bit_for_bit() {
        for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Q8] {
            let mut kv = KvStorage::new(shape(), dtype, 600);
            let mut x = 0.37f32;
            for page in [3u32, 513] {
                for slot in 0..3 {
                    for layer in 0..2 {
                        let k: Vec<f32> = (0..8).map(|i| (x + i as f32).sin()).collect();
                        let v: Vec<f32> = (0..8).map(|i| (x * 3.0 - i as f32).cos()).collect();
                        kv.write_token(page, slot, layer, &k, &v);
                        x += 0.71;
                    }
                }
            }
            let bytes = kv.export_pages(&[3, 513]);
            assert_eq!(bytes.len(), 2 * shape().page_bytes(dtype));
            kv.import_pages(&[7, 2], &bytes);
            for (from, to) in [(3u32, 7u32), (513, 2)] {
                for layer in 0..2 {
                    for kind in [KvKind::Key, KvKind::Value] {
                        for head in 0..2 {
                            let a = kv.head_rows(from, layer, kind, head);
                            let b = kv.head_rows(to, layer, kind, head);
                            assert_eq!(a.bytes(), b.bytes(), "{dtype:?}");
                            if let (
                                HeadRows::Q8 { scales: sa, .. },
                                HeadRows::Q8 { scales: sb, .. },
                            ) = (a, b)
                            {
                                assert_eq!(sa, sb);
                            }
                        }
                    }
                }
            }
            assert_eq!(kv.export_pages(&[7, 2]), bytes, "{dtype:?}");
        }
    }

    #[test]
    fn rows_round_trip_for_every_dtype() {
        for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Q8] {
            let mut kv = KvStorage::new(shape(), dtype, 4);
            let k: Vec<f32> = (0..8).map(|i| i as f32 * 0.25 - 1.0).collect();
            let v: Vec<f32> = (0..8).map(|i| 2.0 - i as f32 * 0.5).collect();
            kv.write_token(3, 2, 1, &k, &v);
            let tol = if dtype == KvDtype::Q8 { 0.02 } else { 1e-3 };
            // V rows, at a padded stride.
            let mut out = vec![0.0; 3 * 6];
            kv.head_rows(3, 1, KvKind::Value, 1)
                .decode_rows(3, 4, &mut out, 6);
            for d in 0..4 {
                assert!((out[2 * 6 + d] - v[4 + d]).abs() < tol, "{dtype:?}");
            }
            // K columns: slot 2 of every row, at a stride of 5.
            let mut out = vec![0.0; 4 * 5];
            kv.head_rows(3, 1, KvKind::Key, 0)
                .decode_columns(3, 4, &mut out, 5);
            for d in 0..4 {
                assert!((out[d * 5 + 2] - k[d]).abs() < tol, "{dtype:?}");
            }
        }
    }

    #[test]
    fn copied_slots_read_back_equal_in_every_dtype_and_across_chunks() {
        for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Q8] {
            let mut kv = KvStorage::new(shape(), dtype, 100_000);
            let far = (kv.pages_per_chunk * 2 + 1) as u32; // another chunk
            for (src, dst) in [(3u32, 5u32), (3, far), (far, 4)] {
                for slot in 0..3 {
                    for layer in 0..2 {
                        let k: Vec<f32> = (0..8)
                            .map(|i| (i + slot * 8 + layer) as f32 * 0.1)
                            .collect();
                        let v: Vec<f32> = k.iter().map(|x| -x).collect();
                        kv.write_token(src, slot, layer, &k, &v);
                        kv.write_token(dst, slot, layer, &[9.0; 8], &[9.0; 8]);
                    }
                }
                kv.copy_slots(PageCopy {
                    src,
                    dst,
                    num_slots: 2,
                });
                let (mut a, mut b) = (vec![0.0; 12], vec![0.0; 12]);
                for layer in 0..2 {
                    for kind in [KvKind::Key, KvKind::Value] {
                        for head in 0..2 {
                            // As `[slot][head_dim]` for both kinds.
                            for (page, out) in [(src, &mut a), (dst, &mut b)] {
                                let rows = kv.head_rows(page, layer, kind, head);
                                match kind {
                                    KvKind::Value => rows.decode_rows(3, 4, out, 4),
                                    KvKind::Key => {
                                        let mut t = vec![0.0; 12];
                                        rows.decode_columns(3, 4, &mut t, 3);
                                        for slot in 0..3 {
                                            for d in 0..4 {
                                                out[slot * 4 + d] = t[d * 3 + slot];
                                            }
                                        }
                                    }
                                }
                            }
                            assert_eq!(a[..8], b[..8], "{dtype:?} copied slots");
                            assert!(
                                b[8..].iter().all(|&x| x == 9.0),
                                "{dtype:?} slot 2 untouched"
                            );
                        }
                    }
                }
            }
        }
    }
}
