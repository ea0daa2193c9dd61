//! The bytes behind the pages: K and V for every layer, head and slot of every page, in one of
//! three element types. Storage grows in chunks the first time a page in a new chunk is written,
//! never past the pool's page count, so an idle server holds almost no KV memory.
//!
//! Layout inside a page, per layer and per K/V: `[kv_head][slot][head_dim]`, so that the rows of
//! one head within a page are contiguous and attention reads them in place.

use half::f16;
use half::slice::HalfFloatSliceExt;
use serde::{Deserialize, Serialize};
use std::str::FromStr;

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
    fn block_index(&self, page_in_chunk: usize, layer: usize, kind: KvKind, head: usize) -> usize {
        ((page_in_chunk * self.num_layers + layer) * 2 + kind as usize) * self.num_kv_heads + head
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvKind {
    Key = 0,
    Value = 1,
}

/// One head's rows of K or V inside one page, `[slot][head_dim]`, read in place.
#[derive(Clone, Copy)]
pub enum HeadRows<'a> {
    F16(&'a [f16]),
    F32(&'a [f32]),
    Q8 { values: &'a [i8], scales: &'a [f32] },
}

impl HeadRows<'_> {
    /// Decodes the first `num_slots` rows into `out` (`[num_slots][head_dim]`).
    pub fn decode_into(&self, num_slots: usize, head_dim: usize, out: &mut [f32]) {
        let n = num_slots * head_dim;
        match self {
            HeadRows::F16(src) => src[..n].convert_to_f32_slice(&mut out[..n]),
            HeadRows::F32(src) => out[..n].copy_from_slice(&src[..n]),
            HeadRows::Q8 { values, scales } => {
                for slot in 0..num_slots {
                    let scale = scales[slot];
                    let row = &values[slot * head_dim..(slot + 1) * head_dim];
                    let dst = &mut out[slot * head_dim..(slot + 1) * head_dim];
                    for (d, &v) in dst.iter_mut().zip(row) {
                        *d = v as f32 * scale;
                    }
                }
            }
        }
    }
}

struct Chunks<T> {
    chunks: Vec<Vec<T>>,
}

impl<T: Copy + Default> Chunks<T> {
    fn new() -> Self {
        Self { chunks: Vec::new() }
    }
    fn ensure(&mut self, chunk: usize, elems: usize) {
        while self.chunks.len() <= chunk {
            self.chunks.push(vec![T::default(); elems]);
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
    max_pages: usize,
    pages_per_chunk: usize,
    data: KvData,
}

/// Chunks are sized to about this many bytes: large enough that growth is rare, small enough
/// that an idle or small server holds little.
const TARGET_CHUNK_BYTES: usize = 8 << 20;

impl KvStorage {
    pub fn new(shape: KvShape, dtype: KvDtype, max_pages: usize) -> Self {
        let pages_per_chunk = (TARGET_CHUNK_BYTES / shape.page_bytes(dtype)).clamp(1, 4096);
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
            max_pages,
            pages_per_chunk,
            data,
        }
    }

    pub fn shape(&self) -> KvShape {
        self.shape
    }

    pub fn dtype(&self) -> KvDtype {
        self.dtype
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

    fn ensure_page(&mut self, page_id: usize) {
        assert!(page_id < self.max_pages, "page {page_id} beyond the pool");
        let chunk = page_id / self.pages_per_chunk;
        let pages_in_chunk = self
            .pages_per_chunk
            .min(self.max_pages - chunk * self.pages_per_chunk);
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
        let chunk = page / self.pages_per_chunk;
        let page_in_chunk = page % self.pages_per_chunk;
        let hd = shape.head_dim;
        for (kind, src) in [(KvKind::Key, k), (KvKind::Value, v)] {
            for head in 0..shape.num_kv_heads {
                let block = shape.block_index(page_in_chunk, layer, kind, head);
                let at = block * shape.head_block() + slot * hd;
                let row = &src[head * hd..(head + 1) * hd];
                match &mut self.data {
                    KvData::F16(c) => c.chunks[chunk][at..at + hd].convert_from_f32_slice(row),
                    KvData::F32(c) => c.chunks[chunk][at..at + hd].copy_from_slice(row),
                    KvData::Q8 { values, scales } => {
                        let amax = row.iter().fold(0f32, |m, x| m.max(x.abs()));
                        let scale = if amax > 0.0 { amax / 127.0 } else { 1.0 };
                        let inv = 1.0 / scale;
                        for (d, &x) in values.chunks[chunk][at..at + hd].iter_mut().zip(row) {
                            *d = (x * inv).round().clamp(-127.0, 127.0) as i8;
                        }
                        scales.chunks[chunk][block * shape.page_size + slot] = scale;
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
        let ppc = self.pages_per_chunk;
        let (src_chunk, dst_chunk) = (src / ppc, dst / ppc);
        let n = copy.num_slots.min(shape.page_size);
        for layer in 0..shape.num_layers {
            for kind in [KvKind::Key, KvKind::Value] {
                for head in 0..shape.num_kv_heads {
                    let sb = shape.block_index(src % ppc, layer, kind, head);
                    let db = shape.block_index(dst % ppc, layer, kind, head);
                    let (s, d) = (sb * shape.head_block(), db * shape.head_block());
                    let len = n * shape.head_dim;
                    match &mut self.data {
                        KvData::F16(c) => c.copy((src_chunk, s), (dst_chunk, d), len),
                        KvData::F32(c) => c.copy((src_chunk, s), (dst_chunk, d), len),
                        KvData::Q8 { values, scales } => {
                            values.copy((src_chunk, s), (dst_chunk, d), len);
                            let (s, d) = (sb * shape.page_size, db * shape.page_size);
                            scales.copy((src_chunk, s), (dst_chunk, d), n);
                        }
                    }
                }
            }
        }
    }

    /// The rows of one head of K or V in one page, read in place.
    pub fn head_rows(&self, page_id: u32, layer: usize, kind: KvKind, head: usize) -> HeadRows<'_> {
        let page = page_id as usize;
        let shape = self.shape;
        let chunk = page / self.pages_per_chunk;
        let block = shape.block_index(page % self.pages_per_chunk, layer, kind, head);
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
    fn rows_round_trip_for_every_dtype() {
        for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Q8] {
            let mut kv = KvStorage::new(shape(), dtype, 4);
            let k: Vec<f32> = (0..8).map(|i| i as f32 * 0.25 - 1.0).collect();
            let v: Vec<f32> = (0..8).map(|i| 2.0 - i as f32 * 0.5).collect();
            kv.write_token(3, 2, 1, &k, &v);
            let mut out = vec![0.0; 12];
            kv.head_rows(3, 1, KvKind::Value, 1)
                .decode_into(3, 4, &mut out);
            let tol = if dtype == KvDtype::Q8 { 0.02 } else { 1e-3 };
            for d in 0..4 {
                assert!((out[8 + d] - v[4 + d]).abs() < tol, "{dtype:?}");
            }
            kv.head_rows(3, 1, KvKind::Key, 0)
                .decode_into(3, 4, &mut out);
            for d in 0..4 {
                assert!((out[8 + d] - k[d]).abs() < tol, "{dtype:?}");
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
                            kv.head_rows(src, layer, kind, head)
                                .decode_into(3, 4, &mut a);
                            kv.head_rows(dst, layer, kind, head)
                                .decode_into(3, 4, &mut b);
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
