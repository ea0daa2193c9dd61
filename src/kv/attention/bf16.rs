//! Both products of a block of attention with AVX-512 BF16 (`vdpbf16ps`): each instruction
//! multiplies 16 pairs of bf16 values and adds both products to 16 f32 sums, twice the
//! multiply-adds of an f32 FMA, at the cost of rounding the operands to bf16 (8 significant
//! bits; the sums stay f32).
//!
//! - Weighted values: the softmax weights lie in [0, 1] and their rounding errors are
//!   independent, so the output moves by about 2^-9 of its size.
//! - Scores: Q and K are rounded after K is centred on the block's first key (the parent
//!   module's `bf16_scores` says why and adds that key's f32 dot product back as an offset).
//!
//! `vdpbf16ps` pairs adjacent bf16 values, so the operands are stored as pairs along the
//! dimension being summed over: V is packed `[key / 2][d]` as (`v[key][d]`, `v[key + 1][d]`)
//! pairs against each lane's bf16 weights, K `[d / 2][key]` as (`k[d][key]`, `k[d + 1][key]`)
//! pairs against each lane's bf16 query; the lane's operand pairs are broadcast.
//!
//! A lane's arithmetic is the same whichever lanes share a call (weights past a lane's visible
//! keys are exact zeros, so the keys another lane adds contribute nothing), which keeps rows
//! bit-identical across batches.

use crate::kernels::math::exp_nonpositive;
use crate::kv::storage::HeadRows;
use std::arch::x86_64::*;

/// Whether this CPU runs the kernels (AVX-512 F/BW/VL and BF16; VL for the masked 256- and
/// 128-bit loads of f16 and q8 pages).
pub fn is_supported() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512bf16")
}

/// Lanes one `accumulate` call handles (as the f32 microkernels).
pub const MAX_LANES: usize = 8;

/// `_mm512_permutexvar_epi16` indices that interleave the two halves of a
/// `_mm512_cvtne2ps_pbh(b, a)` result into (a[i], b[i]) pairs.
pub(super) const INTERLEAVE: [u16; 32] = {
    let mut idx = [0u16; 32];
    let mut i = 0;
    while i < 16 {
        idx[2 * i] = i as u16;
        idx[2 * i + 1] = (i + 16) as u16;
        i += 1;
    }
    idx
};

/// `out[i] = (bf16(a[i]), bf16(b[i]))` for `i < n` (a multiple of 16), as 32-bit pairs.
///
/// # Safety
/// The CPU must support the kernels; `a`, `b` hold `n` floats and `out` `n` pairs.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
pub unsafe fn pack_pairs(a: *const f32, b: *const f32, n: usize, out: *mut u32) {
    let idx = _mm512_loadu_si512(INTERLEAVE.as_ptr().cast());
    for i in (0..n).step_by(16) {
        let pairs = interleave(_mm512_loadu_ps(a.add(i)), _mm512_loadu_ps(b.add(i)), idx);
        _mm512_storeu_si512(out.add(i).cast(), pairs);
    }
}

/// One head's K or V block of a page, as the kernels read it: [`HeadRows`] with its element type
/// made a type parameter, so that the decoding of each vector is not a `match`.
pub(super) trait PageSrc: Copy {
    /// Bytes an element takes.
    const ELEM_BYTES: usize;
    /// The block of `rows`, which must hold this type's elements.
    fn of(rows: &HeadRows) -> Self;
    /// 16 values from element `at` decoded to f32 (lanes outside `m` read as 0), as
    /// [`HeadRows`]' own decoders do; a q8 page's integers are multiplied by `scale`.
    ///
    /// # Safety
    /// The CPU must support the kernels and the lanes of `m` must lie inside the block.
    unsafe fn load16(self, at: usize, m: __mmask16, scale: __m512) -> __m512;
    /// [`PageSrc::load16`] minus `centre`, what the scores' K operand takes (a q8 page's
    /// multiply and subtraction fused into one rounding).
    ///
    /// # Safety
    /// As [`PageSrc::load16`].
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn centred16(self, at: usize, m: __mmask16, scale: __m512, centre: __m512) -> __m512 {
        _mm512_sub_ps(self.load16(at, m, scale), centre)
    }
    /// The scales of the 16 slots from `slot` (lanes outside `m` 0; 0 unless q8): what
    /// [`PageSrc::load16`] takes for a row of K, whose lanes are slots.
    ///
    /// # Safety
    /// As [`PageSrc::load16`].
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn slot_scales(self, _slot: usize, _m: __mmask16) -> __m512 {
        _mm512_setzero_ps()
    }
    /// The scale of `slot` in every lane (0 unless q8): what [`PageSrc::load16`] takes for a
    /// row of V, which is one slot.
    ///
    /// # Safety
    /// `slot` must lie inside the block.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn slot_scale(self, _slot: usize) -> __m512 {
        _mm512_setzero_ps()
    }
}

#[derive(Clone, Copy)]
pub(super) struct F16Page(*const u16);
#[derive(Clone, Copy)]
pub(super) struct F32Page(*const f32);
#[derive(Clone, Copy)]
pub(super) struct Q8Page {
    values: *const i8,
    scales: *const f32,
}

impl PageSrc for F16Page {
    const ELEM_BYTES: usize = 2;
    fn of(rows: &HeadRows) -> Self {
        let HeadRows::F16(src) = rows else {
            unreachable!("pages of one storage share their element type")
        };
        F16Page(src.as_ptr().cast())
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn load16(self, at: usize, m: __mmask16, _: __m512) -> __m512 {
        _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, self.0.add(at).cast()))
    }
}

impl PageSrc for F32Page {
    const ELEM_BYTES: usize = 4;
    fn of(rows: &HeadRows) -> Self {
        let HeadRows::F32(src) = rows else {
            unreachable!("pages of one storage share their element type")
        };
        F32Page(src.as_ptr())
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn load16(self, at: usize, m: __mmask16, _: __m512) -> __m512 {
        _mm512_maskz_loadu_ps(m, self.0.add(at))
    }
}

impl Q8Page {
    /// The 16 integers from element `at` as f32 (lanes outside `m` 0).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn ints16(self, at: usize, m: __mmask16) -> __m512 {
        let q = _mm_maskz_loadu_epi8(m, self.values.add(at).cast());
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q))
    }
}

impl PageSrc for Q8Page {
    const ELEM_BYTES: usize = 1;
    fn of(rows: &HeadRows) -> Self {
        let HeadRows::Q8 { values, scales } = rows else {
            unreachable!("pages of one storage share their element type")
        };
        Q8Page {
            values: values.as_ptr(),
            scales: scales.as_ptr(),
        }
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn load16(self, at: usize, m: __mmask16, scale: __m512) -> __m512 {
        _mm512_mul_ps(self.ints16(at, m), scale)
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn centred16(self, at: usize, m: __mmask16, scale: __m512, centre: __m512) -> __m512 {
        _mm512_fmsub_ps(self.ints16(at, m), scale, centre)
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn slot_scales(self, slot: usize, m: __mmask16) -> __m512 {
        _mm512_maskz_loadu_ps(m, self.scales.add(slot))
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn slot_scale(self, slot: usize) -> __m512 {
        _mm512_set1_ps(*self.scales.add(slot))
    }
}

/// Calls `$f::<S>($rows_as_s, args)` with `S` the [`PageSrc`] of `$rows`' element type.
macro_rules! with_page_src {
    ($rows:expr, $f:ident($($arg:expr),*)) => {
        match $rows {
            rows @ HeadRows::F16(_) => $f(F16Page::of(rows), $($arg),*),
            rows @ HeadRows::F32(_) => $f(F32Page::of(rows), $($arg),*),
            rows @ HeadRows::Q8 { .. } => $f(Q8Page::of(rows), $($arg),*),
        }
    };
}
pub(super) use with_page_src;

/// The scores' K operand for the 16 keys from `j` of a page whose rows (dimensions) are
/// `page_size` apart: the (`k[2p][j..]` − `r[2p]`, `k[2p + 1][j..]` − `r[2p + 1]`) pairs in bf16,
/// `k[d][j]` decoded as [`HeadRows::decode_columns`] decodes it (`scale`: the slots' q8 scales).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,f16c")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn key_pair<S: PageSrc>(
    page: S,
    page_size: usize,
    j: usize,
    p: usize,
    m: __mmask16,
    scale: __m512,
    r: *const f32,
    idx: __m512i,
) -> __m512i {
    let load = |d: usize| page.centred16(d * page_size + j, m, scale, _mm512_set1_ps(*r.add(d)));
    interleave(load(2 * p), load(2 * p + 1), idx)
}

/// The weighted values' V operand for dimensions `d..d + 16` of slots `a` and `a + 1` of a
/// page holding `n` of the block's slots: (`v[a][d..]`, `v[a + 1][d..]`) in bf16, a slot at or
/// past `n` reading as 0, `v` decoded as [`HeadRows::decode_rows`] decodes it.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,f16c")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn value_pair<S: PageSrc>(
    page: S,
    n: usize,
    head_dim: usize,
    a: usize,
    d: usize,
    m: __mmask16,
    idx: __m512i,
) -> __m512i {
    let load = |slot: usize| {
        if slot >= n {
            return _mm512_setzero_ps();
        }
        page.load16(slot * head_dim + d, m, page.slot_scale(slot))
    };
    interleave(load(a), load(a + 1), idx)
}

/// The scores' K operand straight from a page: `out[p * out_stride + j] = (bf16(k[2p][j] -
/// r[2p]), bf16(k[2p + 1][j] - r[2p + 1]))` for `j < num_slots` and `p < head_dim / 2`, where
/// `k[d][j]` is what [`HeadRows::decode_columns`] decodes (no f32 copy of the block is made).
///
/// # Safety
/// The CPU must support the kernels; `head_dim` is even, `r` holds `head_dim` floats and `out`
/// has room for every index above.
pub unsafe fn key_pairs(
    rows: &HeadRows,
    num_slots: usize,
    head_dim: usize,
    r: *const f32,
    out: *mut u32,
    out_stride: usize,
) {
    let page_size = rows.len() / head_dim;
    with_page_src!(
        rows,
        key_pairs_of(page_size, num_slots, head_dim, r, out, out_stride)
    )
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,f16c")]
unsafe fn key_pairs_of<S: PageSrc>(
    page: S,
    page_size: usize,
    num_slots: usize,
    head_dim: usize,
    r: *const f32,
    out: *mut u32,
    out_stride: usize,
) {
    let idx = _mm512_loadu_si512(INTERLEAVE.as_ptr().cast());
    for j in (0..num_slots).step_by(16) {
        let m = live(num_slots, j);
        let scale = page.slot_scales(j, m);
        for p in 0..head_dim / 2 {
            let pairs = key_pair(page, page_size, j, p, m, scale, r, idx);
            _mm512_mask_storeu_epi32(out.add(p * out_stride + j).cast(), m, pairs);
        }
    }
}

/// The weighted values' V operand straight from a page: `out[i * out_stride + d] =
/// (bf16(v[2i][d]), bf16(v[2i + 1][d]))` for `2i < num_slots` and `d < head_dim`, where
/// `v[slot][d]` is what [`HeadRows::decode_rows`] decodes and a last odd slot pairs with 0.
///
/// # Safety
/// The CPU must support the kernels; `out` has room for every index above.
pub unsafe fn value_pairs(
    rows: &HeadRows,
    num_slots: usize,
    head_dim: usize,
    out: *mut u32,
    out_stride: usize,
) {
    with_page_src!(rows, value_pairs_of(num_slots, head_dim, out, out_stride))
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,f16c")]
unsafe fn value_pairs_of<S: PageSrc>(
    page: S,
    num_slots: usize,
    head_dim: usize,
    out: *mut u32,
    out_stride: usize,
) {
    let idx = _mm512_loadu_si512(INTERLEAVE.as_ptr().cast());
    for i in 0..num_slots.div_ceil(2) {
        for d in (0..head_dim).step_by(16) {
            let m = live(head_dim, d);
            let pairs = value_pair(page, num_slots, head_dim, 2 * i, d, m, idx);
            _mm512_mask_storeu_epi32(out.add(i * out_stride + d).cast(), m, pairs);
        }
    }
}

/// `(bf16(a[i]), bf16(b[i]))` as 16 32-bit pairs (`idx`: [`INTERLEAVE`] loaded).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
pub(super) unsafe fn interleave(a: __m512, b: __m512, idx: __m512i) -> __m512i {
    let halves = _mm512_cvtne2ps_pbh(b, a);
    _mm512_permutexvar_epi16(idx, std::mem::transmute::<__m512bh, __m512i>(halves))
}

/// `out[i] = bf16(x[i])` for `i < n` (a multiple of 16): a query row whose adjacent elements
/// are then the pairs the scores broadcast.
///
/// # Safety
/// The CPU must support the kernels; `x` and `out` hold `n` values.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
pub unsafe fn to_bf16(x: *const f32, n: usize, out: *mut u16) {
    for i in (0..n).step_by(16) {
        let h = _mm512_cvtneps_pbh(_mm512_loadu_ps(x.add(i)));
        _mm256_storeu_si256(
            out.add(i).cast(),
            std::mem::transmute::<__m256bh, __m256i>(h),
        );
    }
}

/// `out[l] = Σ_{d < n} qt[d · qt_stride + l] · r[d]` in f32 for `l < lanes`, from queries
/// stored transposed (`qt_stride` a multiple of 16 and at least `lanes`; `out` holds
/// `lanes` rounded up to 16), 16 lanes per vector. Each lane's sum runs in the same order
/// whichever lanes share its vector.
///
/// # Safety
/// The CPU must support the kernels and every index above must be inside its buffer.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
pub unsafe fn offsets(
    qt: *const f32,
    qt_stride: usize,
    lanes: usize,
    r: *const f32,
    n: usize,
    out: *mut f32,
) {
    for l in (0..lanes).step_by(16) {
        // Four partial sums (by d mod 4) so that consecutive multiply-adds do not wait on
        // each other.
        let mut acc = [_mm512_setzero_ps(); 4];
        for d in 0..n {
            let q = _mm512_loadu_ps(qt.add(d * qt_stride + l));
            acc[d % 4] = _mm512_fmadd_ps(q, _mm512_set1_ps(*r.add(d)), acc[d % 4]);
        }
        let sum = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
        _mm512_storeu_ps(out.add(l), sum);
    }
}

/// `s[l · s_stride + j] = Σ_{p < pairs} q[l][p] · k[p][j]` (bf16 pairs, f32 sums) for `lanes`
/// lanes (`q` rows `q_stride` bf16 apart, pairs adjacent) and `j < keys` (a multiple of 16; `k`
/// rows `k_stride` pairs apart). On the way, each lane's 16 running maxima `maxima[l][..16]`
/// take in the scores of the keys it sees (`j < visible[l]`), so that the softmax needs no
/// pass of its own to find them.
///
/// # Safety
/// The CPU must support the kernels and every index above must be inside its buffer.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
pub unsafe fn scores(
    q: *const u16,
    q_stride: usize,
    lanes: usize,
    k: *const u32,
    k_stride: usize,
    pairs: usize,
    keys: usize,
    s: *mut f32,
    s_stride: usize,
    visible: *const usize,
    maxima: *mut f32,
) {
    debug_assert!((1..=MAX_LANES).contains(&lanes) && keys.is_multiple_of(16));
    let out = Out {
        s,
        s_stride,
        visible,
        maxima,
    };
    by_tiles!(lanes, keys, j => scores_tile(
        q, q_stride, k.add(j), k_stride, pairs, j, &out
    ));
}

/// Where [`scores`] (and `bf16_pages::scores`) write: the scores `s` and each lane's 16 running
/// maxima of the keys it sees.
pub(super) struct Out {
    pub(super) s: *mut f32,
    pub(super) s_stride: usize,
    pub(super) visible: *const usize,
    pub(super) maxima: *mut f32,
}

impl Out {
    /// Stores lane `l`'s scores of the 16 keys from key `j` and takes them into its running
    /// maxima ([`Out::store_tile`] for a lane and vector at a time, as the int8 path's AMX tiles
    /// hand them out).
    ///
    /// # Safety
    /// As [`Out::store_tile`].
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn store_row(&self, l: usize, j: usize, f: __m512) {
        _mm512_storeu_ps(self.s.add(l * self.s_stride + j), f);
        let maxima = self.maxima.add(16 * l);
        let mv = _mm512_loadu_ps(maxima);
        let visible = *self.visible.add(l);
        _mm512_storeu_ps(maxima, _mm512_mask_max_ps(mv, live(visible, j), mv, f));
    }

    /// Stores a tile's scores (`L` lanes × `16 · KC` keys from key `j`) and takes them into the
    /// lanes' running maxima.
    ///
    /// # Safety
    /// The CPU must support the kernels and the tile must lie inside the buffers.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn store_tile<const L: usize, const KC: usize>(
        &self,
        j: usize,
        acc: &[[__m512; KC]; L],
    ) {
        for (l, acc) in acc.iter().enumerate() {
            let maxima = self.maxima.add(16 * l);
            let visible = *self.visible.add(l);
            let mut mv = _mm512_loadu_ps(maxima);
            for (c, acc) in acc.iter().enumerate() {
                _mm512_storeu_ps(self.s.add(l * self.s_stride + j + 16 * c), *acc);
                mv = _mm512_mask_max_ps(mv, live(visible, j + 16 * c), mv, *acc);
            }
            _mm512_storeu_ps(maxima, mv);
        }
    }
}

/// `L` lanes × `16 · KC` keys from key `j`, all accumulators in registers.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn scores_tile<const L: usize, const KC: usize>(
    q: *const u16,
    q_stride: usize,
    k: *const u32,
    k_stride: usize,
    pairs: usize,
    j: usize,
    out: &Out,
) {
    let mut acc = [[_mm512_setzero_ps(); KC]; L];
    dot_pairs(&mut acc, q, q_stride, k, k_stride, pairs);
    out.store_tile(j, &acc);
}

/// Each lane's 16 running maxima `maxima[l][..16]` take in the scores `s[l][j]` of the keys it
/// sees (`j < visible[l]`), as [`scores`] does on the way (for the AMX path, whose scores come
/// out of tiles).
///
/// # Safety
/// The CPU must support the kernels and every index above must be inside its buffer.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
pub unsafe fn take_maxima(
    s: *const f32,
    s_stride: usize,
    lanes: usize,
    visible: *const usize,
    maxima: *mut f32,
) {
    for l in 0..lanes {
        let (maxima, visible) = (maxima.add(16 * l), *visible.add(l));
        let mut mv = _mm512_loadu_ps(maxima);
        for j in (0..visible).step_by(16) {
            let x = _mm512_loadu_ps(s.add(l * s_stride + j));
            mv = _mm512_mask_max_ps(mv, live(visible, j), mv, x);
        }
        _mm512_storeu_ps(maxima, mv);
    }
}

/// How softmax weights are rounded for the weighted values' product.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Weights {
    /// For `vdpbf16ps` and AMX (8 significant bits).
    Bf16,
    /// For the fp16 path's `vfmadd231ph` (11 significant bits; weights under 2^-24 are 0).
    F16,
}

/// One lane's online-softmax step over a block, for the bf16 (or fp16) products, with the
/// lane's scores `offset + row[j]` and `row_max = max(row[..visible])`: with
/// `m = max(running_max, offset + row_max)`, writes `exp(offset + row[j] - m)`, rounded as
/// `weights` says, to `out[j]` for `j < visible` and 0 up to `n` (a multiple of 16), and
/// returns `m` and the 16 partial sums of `exp(offset + row[j] - m)` in f32. The exponential is
/// a degree-4 polynomial of 2^f (relative error under 5e-5, far below the rounding of the
/// weights that follows). `visible` must be at least 1.
///
/// # Safety
/// The CPU must support the kernels; `row` holds `n` finite floats and `out` `n` values.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
pub unsafe fn softmax_weights(
    row: *const f32,
    visible: usize,
    n: usize,
    row_max: f32,
    offset: f32,
    running_max: f32,
    out: *mut u16,
    weights: Weights,
) -> (f32, __m512) {
    // Whole vectors of visible keys need no mask; only the last partial one does.
    let full = visible / 16 * 16;
    let m = running_max.max(offset + row_max);
    let m_log2e = _mm512_set1_ps((m - offset) * std::f32::consts::LOG2_E);
    let weight = |j: usize| {
        let e = exp_below(_mm512_loadu_ps(row.add(j)), m_log2e);
        let e = if j >= full {
            _mm512_maskz_mov_ps(live(visible, j), e)
        } else {
            e
        };
        let rounded = match weights {
            Weights::Bf16 => std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(e)),
            Weights::F16 => _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(e),
        };
        _mm256_storeu_si256(out.add(j).cast(), rounded);
        e
    };
    (m, sum_vectors(n, weight))
}

/// `Σ f(j)` over `j` = 0, 16, … below `n` (16 partial sums), each vector computed in turn.
#[inline]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn sum_vectors(n: usize, mut f: impl FnMut(usize) -> __m512) -> __m512 {
    // Two sums (even and odd vectors), so that the additions of consecutive vectors do not
    // wait on each other; two named ones, as an array indexed in the loop lived on the stack.
    let (mut even, mut odd) = (_mm512_setzero_ps(), _mm512_setzero_ps());
    let mut j = 0;
    while j + 32 <= n {
        even = _mm512_add_ps(even, f(j));
        odd = _mm512_add_ps(odd, f(j + 16));
        j += 32;
    }
    if j < n {
        even = _mm512_add_ps(even, f(j));
    }
    _mm512_add_ps(even, odd)
}

/// Moves a lane's online-softmax state (its running `max`, 16 partial sums `sums` and
/// unnormalised output `o` of `hdp` floats) to `new_max` and adds a block's partial sums.
///
/// # Safety
/// The CPU must support AVX-512 F; `sums` holds 16 floats, `o` `hdp` (a multiple of 16).
#[inline]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn advance(
    max: &mut f32,
    new_max: f32,
    sums: *mut f32,
    block_sums: __m512,
    o: *mut f32,
    hdp: usize,
) {
    // Deep in a context the max rarely moves: skip the exponential and the rescaling.
    let mut total = _mm512_loadu_ps(sums);
    if *max != new_max {
        let c = _mm512_set1_ps(exp_nonpositive(*max - new_max));
        total = _mm512_mul_ps(total, c);
        for d in (0..hdp).step_by(16) {
            _mm512_storeu_ps(o.add(d), _mm512_mul_ps(_mm512_loadu_ps(o.add(d)), c));
        }
        *max = new_max;
    }
    _mm512_storeu_ps(sums, _mm512_add_ps(total, block_sums));
}

/// The largest of a lane's 16 running maxima (what [`scores`] kept): the block's row max that
/// [`softmax_lane`] takes. A horizontal reduction is a chain of ~25 cycles; a chunk's lanes take
/// theirs one after another before any softmax, so that the chains overlap instead of each
/// stalling its lane's exponentials.
///
/// # Safety
/// The CPU must support AVX-512 F; `maxima` holds 16 floats.
#[inline]
#[target_feature(enable = "avx512f")]
pub unsafe fn lane_max(maxima: *const f32) -> f32 {
    _mm512_reduce_max_ps(_mm512_loadu_ps(maxima))
}

/// A lane's whole online-softmax step on the bf16 path, from its block row max ([`lane_max`]):
/// [`softmax_weights`], then [`advance`] moves the lane's state (its unnormalised output `o` of
/// `hdp` floats and its running sum, kept as 16 partial sums `sums`, reduced once per segment)
/// to the new max.
///
/// # Safety
/// As [`softmax_weights`]; `o` holds `hdp` floats (a multiple of 16), `sums` 16.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
pub unsafe fn softmax_lane(
    row: *const f32,
    visible: usize,
    n: usize,
    row_max: f32,
    offset: f32,
    max: &mut f32,
    sums: *mut f32,
    o: *mut f32,
    hdp: usize,
    out: *mut u16,
    weights: Weights,
) {
    let (new_max, block_sums) =
        softmax_weights(row, visible, n, row_max, offset, *max, out, weights);
    advance(max, new_max, sums, block_sums, o, hdp);
}

/// The sum of a lane's 16 partial sums.
///
/// # Safety
/// The CPU must support the kernels; `sums` holds 16 floats.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
pub unsafe fn reduce_sums(sums: *const f32) -> f32 {
    _mm512_reduce_add_ps(_mm512_loadu_ps(sums))
}

/// `exp(x - m)` from `m_log2e = m · log2(e)`, for `x` up to `m` (larger `x` give larger
/// values, never NaN; keys past a lane's visible ones may hold any finite score).
#[inline]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn exp_below(x: __m512, m_log2e: __m512) -> __m512 {
    // 2^t with t = x·log2(e) - m·log2(e): 2^round(t) · 2^f, |f| ≤ 1/2.
    let t = _mm512_fmsub_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E), m_log2e);
    let k = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(t);
    let f = _mm512_sub_ps(t, k);
    let mut poly = _mm512_set1_ps(9.618_129e-3);
    for c in [5.550_411e-2, 0.240_226_5, std::f32::consts::LN_2, 1.0] {
        poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(c));
    }
    _mm512_scalef_ps(poly, k)
}

/// Mask of the lanes of the 16 starting at `j` that are below `visible`.
#[inline]
pub(super) fn live(visible: usize, j: usize) -> __mmask16 {
    let n = visible.saturating_sub(j).min(16);
    ((1u32 << n) - 1) as __mmask16
}

/// `o[l * o_stride + d] += Σ_{p < pairs} w[l][p] · v[p][d]` (bf16 pairs) for `lanes` lanes (`w`
/// rows `w_stride` bf16 apart) and `d < o_stride` (a multiple of 16; `v` rows `o_stride` pairs
/// apart).
///
/// # Safety
/// The CPU must support the kernels and every index above must be inside its buffer.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
pub unsafe fn accumulate(
    w: *const u16,
    w_stride: usize,
    lanes: usize,
    v: *const u32,
    o_stride: usize,
    pairs: usize,
    o: *mut f32,
) {
    debug_assert!((1..=MAX_LANES).contains(&lanes) && o_stride.is_multiple_of(16));
    by_tiles!(lanes, o_stride, d => accumulate_tile(
        w, w_stride, v.add(d), o_stride, pairs, o.add(d)
    ));
}

/// `L` lanes × `16 · DC` output dimensions, all accumulators in registers.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn accumulate_tile<const L: usize, const DC: usize>(
    w: *const u16,
    w_stride: usize,
    v: *const u32,
    v_stride: usize,
    pairs: usize,
    o: *mut f32,
) {
    let mut acc = [[_mm512_setzero_ps(); DC]; L];
    for (l, acc) in acc.iter_mut().enumerate() {
        for (c, acc) in acc.iter_mut().enumerate() {
            *acc = _mm512_loadu_ps(o.add(l * v_stride + 16 * c));
        }
    }
    dot_pairs(&mut acc, w, w_stride, v, v_stride, pairs);
    for (l, acc) in acc.iter().enumerate() {
        for (c, acc) in acc.iter().enumerate() {
            _mm512_storeu_ps(o.add(l * v_stride + 16 * c), *acc);
        }
    }
}

/// The register-blocked core of both products:
/// `acc[l][c] += Σ_{p < pairs} a[l][p] · b[p][16c..]`, with lane `l`'s bf16 pairs at
/// `a + l · a_stride` (each broadcast) and row `p` of `b` at `b + p · b_stride` (16 pairs a
/// vector).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn dot_pairs<const L: usize, const C: usize>(
    acc: &mut [[__m512; C]; L],
    a: *const u16,
    a_stride: usize,
    b: *const u32,
    b_stride: usize,
    pairs: usize,
) {
    for p in 0..pairs {
        let row = b.add(p * b_stride);
        let mut x = [_mm512_setzero_si512(); C];
        for (c, x) in x.iter_mut().enumerate() {
            *x = _mm512_loadu_si512(row.add(16 * c).cast());
        }
        for (l, acc) in acc.iter_mut().enumerate() {
            let y = bcast_pair(a.add(l * a_stride + 2 * p));
            for c in 0..C {
                acc[c] =
                    _mm512_dpbf16_ps(acc[c], y, std::mem::transmute::<__m512i, __m512bh>(x[c]));
            }
        }
    }
}

/// The bf16 pair at `p` in all 16 lanes.
#[inline]
#[target_feature(enable = "avx512f,avx512bf16")]
pub(super) unsafe fn bcast_pair(p: *const u16) -> __m512bh {
    std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(p.cast::<i32>().read_unaligned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bf16(x: f32) -> f32 {
        half::bf16::from_f32(x).to_f32()
    }

    fn from_bits(b: u16) -> f32 {
        half::bf16::from_bits(b).to_f32()
    }

    #[test]
    fn softmax_weights_and_weighted_values_match_an_f64_reference() {
        if !is_supported() {
            return;
        }
        let val = |i: usize| ((i * 37 % 101) as f32 - 50.0) / 7.0;
        // Two lanes over 6 keys (the second sees 5), head_dim 16 (one vector).
        let (n, hdp) = (16, 16);
        let scores: Vec<f32> = (0..2 * n).map(val).collect();
        let v: Vec<f32> = (0..6 * hdp).map(|i| val(i + 11)).collect(); // [key][d]
        let mut w = vec![0xffffu16; 2 * n];
        let mut state = Vec::new();
        for (lane, visible) in [(0, 6), (1, 5)] {
            let row = &scores[lane * n..];
            let out = w[lane * n..].as_mut_ptr();
            let row_max = row[..visible]
                .iter()
                .copied()
                .fold(f32::NEG_INFINITY, f32::max);
            let (m, sums) = unsafe {
                softmax_weights(
                    row.as_ptr(),
                    visible,
                    n,
                    row_max,
                    0.0,
                    -1.0,
                    out,
                    Weights::Bf16,
                )
            };
            let sum = unsafe { _mm512_reduce_add_ps(sums) };
            let want_m = row[..visible].iter().fold(-1f32, |a, &b| a.max(b));
            assert_eq!(m, want_m);
            let want: Vec<f64> = row[..visible]
                .iter()
                .map(|&x| ((x - m) as f64).exp())
                .collect();
            let want_sum: f64 = want.iter().sum();
            assert!(
                (sum as f64 - want_sum).abs() < 1e-4 * want_sum,
                "{sum} {want_sum}"
            );
            for (j, &bits) in w[lane * n..(lane + 1) * n].iter().enumerate() {
                let got = from_bits(bits) as f64;
                match want.get(j) {
                    Some(&e) => assert!((got - e).abs() <= e / 128.0, "lane {lane} key {j}"),
                    None => assert_eq!(bits, 0, "lane {lane} key {j} is past what it sees"),
                }
            }
            state.push(sum);
        }
        let mut vp = vec![0u32; 3 * hdp];
        let mut o = vec![1f32; 2 * hdp];
        unsafe {
            for p in 0..3 {
                let (a, b) = (v[2 * p * hdp..].as_ptr(), v[(2 * p + 1) * hdp..].as_ptr());
                pack_pairs(a, b, hdp, vp[p * hdp..].as_mut_ptr());
            }
            accumulate(w.as_ptr(), n, 2, vp.as_ptr(), hdp, 3, o.as_mut_ptr());
        }
        for lane in 0..2 {
            for d in 0..hdp {
                let want: f64 = 1.0
                    + (0..6)
                        .map(|j| from_bits(w[lane * n + j]) as f64 * bf16(v[j * hdp + d]) as f64)
                        .sum::<f64>();
                let got = o[lane * hdp + d] as f64;
                assert!(
                    (got - want).abs() < 1e-5 * want.abs().max(1.0),
                    "{lane} {d}"
                );
            }
        }
    }
}
