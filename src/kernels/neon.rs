//! AArch64 NEON kernels: baseline Advanced SIMD (`Dispatch::Neon`, every aarch64 CPU) and the
//! same kernels with the dotprod extension's `sdot` (`Dispatch::NeonDot`, ARMv8.4 and many
//! v8.2 cores).
//!
//! A 128-bit register holds one step of a "quad": 4 bytes of each of 4 consecutive output rows
//! (`layout`'s `[step][16 columns][4 bytes]` seen as 4 registers per step). Each of a quad's
//! 4 i32 lanes needs the 4-byte dot product of its bytes with the same 4 activations. `sdot` by
//! element does exactly that in one instruction ([`SDot`]). Baseline NEON multiplies the step
//! by the 4 activations repeated 4 times with `smull`/`smlal` (i8 × i8 → i16) and reduces the
//! i16 lanes with pairwise adds ([`Mull`]); each format's weight range decides how many steps
//! the i16 lanes can take before a reduction.
//!
//! For each weight block the kernels go quad by quad: a quad's weights (a block's, or a K-quant
//! sub-block's: 4 to 8 registers) are unpacked once and applied to up to [`ROWS`] activation
//! rows before the next are loaded, which keeps the live registers within NEON's 32 whatever
//! the format. No software prefetch (unlike the x86 kernels): there is no ARM hardware here to
//! tune a distance on.
//! The float epilogue mirrors `scalar` op for op (`fmul`/`fadd`, never fused), so results are
//! bit-identical to it. Only correctness is tested (under qemu-aarch64 in `tests/run.sh`);
//! the speed of these kernels has not been measured on ARM hardware.

use std::arch::aarch64::*;
use std::arch::asm;

use super::act::{ActQ8, ActQ8K};
use super::dispatch::Dispatch;
use super::layout::{q6k_qh, q6k_ql, Format, GROUP};
use super::MAX_KERNEL_ROWS;

/// Activation rows one kernel call applies each quad of weights to. Per row the integer kernels
/// keep at most two i16 chains, a broadcast of the activations and an i32 sum live (4
/// registers), next to 8 or so registers of weights, so 4 rows fit NEON's 32 registers.
const ROWS: usize = 4;

/// Rows per chunk when `num_rows` are split into as few chunks of at most [`ROWS`] as possible,
/// evenly (so no chunk re-reads the weights for a single row when it can be avoided).
fn chunk_rows(num_rows: usize) -> usize {
    num_rows.div_ceil(num_rows.div_ceil(ROWS))
}

/// Checks what the `unsafe` kernels rely on: the CPU has `path` and the slices hold
/// `num_rows ≤ 16` rows of `num_blocks` blocks. Returns `num_blocks`.
fn check<A>(path: Dispatch, format: Format, w: &[u8], acts: &[A], out: &[f32]) -> usize {
    assert!(path.is_supported(), "{path:?} is not supported by this CPU");
    let num_rows = out.len() / GROUP;
    assert!(num_rows > 0 && num_rows <= MAX_KERNEL_ROWS && out.len() == num_rows * GROUP);
    assert!(acts.len().is_multiple_of(num_rows));
    let num_blocks = acts.len() / num_rows;
    assert!(w.len() >= num_blocks * format.group_block_bytes());
    num_blocks
}

/// The activation rows and output rows of each chunk of [`chunk_rows`] rows, and its row count.
fn row_chunks<'a, A>(
    acts: &'a [A],
    out: &'a mut [f32],
    nb: usize,
) -> impl Iterator<Item = (&'a [A], &'a mut [f32], usize)> {
    let rows = chunk_rows(out.len() / GROUP);
    acts.chunks(rows * nb)
        .zip(out.chunks_mut(rows * GROUP))
        .map(|(a, o)| {
            let r = o.len() / GROUP;
            (a, o, r)
        })
}

/// `$imp::<$g.., R>(w, acts, out, nb)` for each chunk of rows, with `R` the chunk's row count.
macro_rules! by_rows {
    ($imp:ident, [$($g:ty),*], $w:expr, $acts:expr, $out:expr, $nb:expr) => {
        for (a, o, rows) in row_chunks($acts, $out, $nb) {
            match rows {
                1 => $imp::<$($g,)* 1>($w, a, o, $nb),
                2 => $imp::<$($g,)* 2>($w, a, o, $nb),
                3 => $imp::<$($g,)* 3>($w, a, o, $nb),
                _ => $imp::<$($g,)* 4>($w, a, o, $nb),
            }
        }
    };
}

/// The safe entry points: `$name` on baseline NEON and, for integer formats, `$dot` with
/// `sdot`. The `sdot` kernels are inlined into a function compiled with the dotprod feature,
/// which is what lets the assembler accept the instruction.
macro_rules! safe_kernel {
    ($name:ident, $imp:ident, $format:expr, $act:ty) => {
        pub fn $name(w: &[u8], acts: &[$act], out: &mut [f32]) {
            let nb = check(Dispatch::Neon, $format, w, acts, out);
            // SAFETY: `check` proved NEON is present and that `w` holds `nb` blocks; each chunk
            // holds the same number (1..=ROWS) of activation and output rows.
            unsafe { by_rows!($imp, [], w, acts, out, nb) }
        }
    };
    ($name:ident, $dot:ident, $imp:ident, $format:expr, $act:ty) => {
        pub fn $name(w: &[u8], acts: &[$act], out: &mut [f32]) {
            let nb = check(Dispatch::Neon, $format, w, acts, out);
            // SAFETY: as for the float kernels above.
            unsafe { by_rows!($imp, [Mull], w, acts, out, nb) }
        }

        pub fn $dot(w: &[u8], acts: &[$act], out: &mut [f32]) {
            #[target_feature(enable = "dotprod")]
            unsafe fn with_dotprod(w: &[u8], acts: &[$act], out: &mut [f32], nb: usize) {
                by_rows!($imp, [SDot], w, acts, out, nb)
            }
            let nb = check(Dispatch::NeonDot, $format, w, acts, out);
            // SAFETY: `check` proved the CPU has NEON and dotprod, and the sizes as above.
            unsafe { with_dotprod(w, acts, out, nb) }
        }
    };
}

safe_kernel!(f16, f16_impl, Format::F16, f32);
safe_kernel!(f32, f32_impl, Format::F32, f32);
safe_kernel!(q8_0, q8_0_dot, q8_0_impl, Format::Q8_0, ActQ8);
safe_kernel!(q4_1, q4_1_dot, q4_1_impl, Format::Q4_1, ActQ8);
safe_kernel!(q5_0, q5_0_dot, q5_0_impl, Format::Q5_0, ActQ8);
safe_kernel!(q4k, q4k_dot, q4k_impl, Format::Q4K, ActQ8K);
safe_kernel!(q6k, q6k_dot, q6k_impl, Format::Q6K, ActQ8K);

/// Float accumulators of `R` rows: `[quad][row]`, 4 output rows each.
type Acc<const R: usize> = [[float32x4_t; R]; 4];

/// 4 little-endian f16 at `p` as f32. `fcvtl` (half → single) is baseline AArch64, but Rust's
/// `vcvt_f32_f16` takes the unstable `float16x4_t`, hence the one-instruction `asm!`. The
/// conversion is exact, as `half`'s in `scalar` is.
#[inline(always)]
unsafe fn f16x4(p: *const u8) -> float32x4_t {
    let h = vreinterpret_u16_u8(vld1_u8(p));
    let out: float32x4_t;
    asm!(
        "fcvtl {out:v}.4s, {h:v}.4h",
        out = lateout(vreg) out,
        h = in(vreg) h,
        options(pure, nomem, nostack, preserves_flags)
    );
    out
}

/// 8 little-endian f16 at `p` as two f32 vectors.
#[inline(always)]
unsafe fn f16x8(p: *const u8) -> (float32x4_t, float32x4_t) {
    let h = vld1q_u8(p);
    let (lo, hi): (float32x4_t, float32x4_t);
    asm!(
        "fcvtl {lo:v}.4s, {h:v}.4h",
        "fcvtl2 {hi:v}.4s, {h:v}.8h",
        lo = out(vreg) lo,
        hi = lateout(vreg) hi,
        h = in(vreg) h,
        options(pure, nomem, nostack, preserves_flags)
    );
    (lo, hi)
}

#[inline(always)]
unsafe fn load(p: *const u8) -> uint8x16_t {
    vld1q_u8(p)
}

/// The 4 bytes at `p` repeated 4 times: one activation step for every row of a quad.
#[inline(always)]
unsafe fn bcast4(p: *const i8) -> int8x16_t {
    vreinterpretq_s8_s32(vdupq_n_s32(p.cast::<i32>().read_unaligned()))
}

/// The 4 bytes at `p` as i32 lanes, unsigned or signed (a quad's sub-block scales).
#[inline(always)]
unsafe fn u8x4(p: *const u8) -> int32x4_t {
    let bytes = vreinterpret_u8_u32(vdup_n_u32(p.cast::<u32>().read_unaligned()));
    vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(vmovl_u8(bytes))))
}

#[inline(always)]
unsafe fn i8x4(p: *const u8) -> int32x4_t {
    let bytes = vreinterpret_s8_u32(vdup_n_u32(p.cast::<u32>().read_unaligned()));
    vmovl_s16(vget_low_s16(vmovl_s8(bytes)))
}

/// How a quad's integer dot products are formed: `Σₛ q[s] · x[4s..4s + 4]` per output row of
/// the quad (an i32 lane each), exactly, for `N` steps of weights `q` and activations `x`.
trait Dot {
    /// For weights with `2 · N · max|w| · 127 ≤ 32767`: `N ≤ 8` for |w| ≤ 16 (Q4_1, Q5_0,
    /// Q4_K) and `N ≤ 4` for |w| ≤ 32 (Q6_K).
    unsafe fn small<const N: usize>(q: &[int8x16_t; N], x: *const i8) -> int32x4_t;

    /// For Q8_0's 8 steps of full-range weights (|w| ≤ 128).
    unsafe fn full(q: &[int8x16_t; 8], x: *const i8) -> int32x4_t;
}

/// Baseline NEON: `smull`/`smlal` into i16 lanes, reduced with pairwise adds.
struct Mull;

impl Dot for Mull {
    /// Each i16 lane sums `N` products and the first reduction adds two lanes, hence the bound.
    #[inline(always)]
    unsafe fn small<const N: usize>(q: &[int8x16_t; N], x: *const i8) -> int32x4_t {
        let x0 = bcast4(x);
        // Low halves hold rows 0 and 1 of the quad (4 lanes each), high halves rows 2 and 3.
        let mut lo = vmull_s8(vget_low_s8(q[0]), vget_low_s8(x0));
        let mut hi = vmull_high_s8(q[0], x0);
        for (s, &q) in q.iter().enumerate().skip(1) {
            let xs = bcast4(x.add(4 * s));
            lo = vmlal_s8(lo, vget_low_s8(q), vget_low_s8(xs));
            hi = vmlal_high_s8(hi, q, xs);
        }
        vpaddlq_s16(vpaddq_s16(lo, hi))
    }

    /// |w · x| ≤ 128 · 127, so an i16 lane holds the sum of two products, not more: every two
    /// steps are widened into i32 pairs (`sadalp`), which are reduced at the end.
    #[inline(always)]
    unsafe fn full(q: &[int8x16_t; 8], x: *const i8) -> int32x4_t {
        let (mut lo, mut hi) = (vdupq_n_s32(0), vdupq_n_s32(0));
        for t in (0..8).step_by(2) {
            let (x0, x1) = (bcast4(x.add(4 * t)), bcast4(x.add(4 * t + 4)));
            let l = vmull_s8(vget_low_s8(q[t]), vget_low_s8(x0));
            let l = vmlal_s8(l, vget_low_s8(q[t + 1]), vget_low_s8(x1));
            let h = vmlal_high_s8(vmull_high_s8(q[t], x0), q[t + 1], x1);
            lo = vpadalq_s16(lo, l);
            hi = vpadalq_s16(hi, h);
        }
        vpaddq_s32(lo, hi)
    }
}

/// The dotprod extension: one `sdot` by element per step, i32 sums throughout (no bound).
/// Its methods may only run inside a function compiled with the dotprod feature.
struct SDot;

impl Dot for SDot {
    #[inline(always)]
    unsafe fn small<const N: usize>(q: &[int8x16_t; N], x: *const i8) -> int32x4_t {
        sdot_steps(q, x)
    }

    #[inline(always)]
    unsafe fn full(q: &[int8x16_t; 8], x: *const i8) -> int32x4_t {
        sdot_steps(q, x)
    }
}

#[inline(always)]
unsafe fn sdot_steps<const N: usize>(q: &[int8x16_t; N], x: *const i8) -> int32x4_t {
    let mut acc = vdupq_n_s32(0);
    for (s, &q) in q.iter().enumerate() {
        // Activations `16 · (s / 4)..` in one register; step `s` takes its 4-byte element s % 4.
        let xs = vld1q_s8(x.add(16 * (s / 4)));
        acc = match s % 4 {
            0 => sdot_lane::<0>(acc, q, xs),
            1 => sdot_lane::<1>(acc, q, xs),
            2 => sdot_lane::<2>(acc, q, xs),
            _ => sdot_lane::<3>(acc, q, xs),
        };
    }
    acc
}

/// `acc + Σ₄ w · x[4L..4L + 4]` per i32 lane. The `vdotq_laneq_s32` intrinsic is not stable
/// Rust; the instruction is, through `asm!`.
#[inline(always)]
unsafe fn sdot_lane<const L: i32>(acc: int32x4_t, w: int8x16_t, x: int8x16_t) -> int32x4_t {
    let mut acc = acc;
    asm!(
        "sdot {acc:v}.4s, {w:v}.16b, {x:v}.4b[{lane}]",
        acc = inout(vreg) acc,
        w = in(vreg) w,
        x = in(vreg) x,
        lane = const L,
        options(pure, nomem, nostack, preserves_flags)
    );
    acc
}

/// `acc + (d_w · d_x) · isum` with one rounding for the multiply-add (`fmla`), the epilogue
/// every format shares.
#[inline(always)]
unsafe fn scaled_add(acc: float32x4_t, dw: float32x4_t, dx: f32, isum: int32x4_t) -> float32x4_t {
    vfmaq_f32(acc, vmulq_n_f32(dw, dx), vcvtq_f32_s32(isum))
}

#[inline(always)]
unsafe fn store_rows<const R: usize>(acc: &Acc<R>, out: &mut [f32]) {
    for (j, acc) in acc.iter().enumerate() {
        for (i, &v) in acc.iter().enumerate() {
            vst1q_f32(out.as_mut_ptr().add(i * GROUP + 4 * j), v);
        }
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

#[inline(always)]
unsafe fn zero_acc<const R: usize>() -> Acc<R> {
    [[vdupq_n_f32(0.0); R]; 4]
}

#[inline(always)]
unsafe fn q8_0_impl<D: Dot, const R: usize>(w: &[u8], acts: &[ActQ8], out: &mut [f32], nb: usize) {
    let mut acc = zero_acc::<R>();
    for b in 0..nb {
        let p = w.as_ptr().add(b * Format::Q8_0.group_block_bytes());
        let a: [*const ActQ8; R] = rows_at(acts, b, nb);
        for (j, acc) in acc.iter_mut().enumerate() {
            let mut q = [vdupq_n_s8(0); 8];
            for (t, q) in q.iter_mut().enumerate() {
                *q = vreinterpretq_s8_u8(load(p.add(32 + 64 * t + 16 * j)));
            }
            let dw = f16x4(p.add(8 * j));
            for i in 0..R {
                let isum = D::full(&q, (*a[i]).qs.as_ptr());
                acc[i] = scaled_add(acc[i], dw, (*a[i]).d, isum);
            }
        }
    }
    store_rows(&acc, out);
}

/// A quad's 8 nibble steps of a Q4_1 or Q5_0 block: the low nibbles of the 4 packed steps (the
/// block's weights 0..16) then the high nibbles (16..32), so step `s` meets activations `4s`.
#[inline(always)]
unsafe fn nibble_steps(p: *const u8) -> ([uint8x16_t; 4], [uint8x16_t; 4]) {
    let m4 = vdupq_n_u8(0x0F);
    let mut low = [vdupq_n_u8(0); 4];
    let mut high = [vdupq_n_u8(0); 4];
    for t in 0..4 {
        let v = load(p.add(64 * t));
        low[t] = vandq_u8(v, m4);
        high[t] = vshrq_n_u8::<4>(v);
    }
    (low, high)
}

#[inline(always)]
unsafe fn q4_1_impl<D: Dot, const R: usize>(w: &[u8], acts: &[ActQ8], out: &mut [f32], nb: usize) {
    let mut acc = zero_acc::<R>();
    for b in 0..nb {
        let p = w.as_ptr().add(b * Format::Q4_1.group_block_bytes());
        let a: [*const ActQ8; R] = rows_at(acts, b, nb);
        for (j, acc) in acc.iter_mut().enumerate() {
            let (low, high) = nibble_steps(p.add(64 + 16 * j));
            let mut q = [vdupq_n_s8(0); 8];
            for t in 0..4 {
                q[t] = vreinterpretq_s8_u8(low[t]);
                q[t + 4] = vreinterpretq_s8_u8(high[t]);
            }
            let (dw, mw) = (f16x4(p.add(8 * j)), f16x4(p.add(32 + 8 * j)));
            for i in 0..R {
                let a = &*a[i];
                let isum = D::small(&q, a.qs.as_ptr());
                let with_dot = scaled_add(acc[i], dw, a.d, isum);
                let min = vmulq_n_f32(vmulq_n_f32(mw, a.d), a.sum as f32);
                acc[i] = vaddq_f32(with_dot, min);
            }
        }
    }
    store_rows(&acc, out);
}

/// Q5_0 weights as signed `u − 16` (the integer sum `scalar` forms): a nibble whose fifth bit
/// is clear is `nibble − 16`, i.e. the nibble with bits 4..8 set, read as i8.
#[inline(always)]
unsafe fn q5_signed(nibble: uint8x16_t, hb: uint8x16_t, bit: u8) -> int8x16_t {
    let set = vtstq_u8(hb, vdupq_n_u8(bit));
    vreinterpretq_s8_u8(vorrq_u8(nibble, vbicq_u8(vdupq_n_u8(0xF0), set)))
}

#[inline(always)]
unsafe fn q5_0_impl<D: Dot, const R: usize>(w: &[u8], acts: &[ActQ8], out: &mut [f32], nb: usize) {
    let mut acc = zero_acc::<R>();
    for b in 0..nb {
        let p = w.as_ptr().add(b * Format::Q5_0.group_block_bytes());
        let a: [*const ActQ8; R] = rows_at(acts, b, nb);
        for (j, acc) in acc.iter_mut().enumerate() {
            let (low, high) = nibble_steps(p.add(32 + 16 * j));
            // Byte `b` of a row in `hb` holds the fifth bit of step `t`'s low nibble at bit `t`
            // and of its high nibble at bit `t + 4` (see `layout`).
            let hb = load(p.add(288 + 16 * j));
            let mut q = [vdupq_n_s8(0); 8];
            for t in 0..4 {
                q[t] = q5_signed(low[t], hb, 1 << t);
                q[t + 4] = q5_signed(high[t], hb, 1 << (t + 4));
            }
            let dw = f16x4(p.add(8 * j));
            for i in 0..R {
                let isum = D::small(&q, (*a[i]).qs.as_ptr());
                acc[i] = scaled_add(acc[i], dw, (*a[i]).d, isum);
            }
        }
    }
    store_rows(&acc, out);
}

#[inline(always)]
unsafe fn q4k_impl<D: Dot, const R: usize>(w: &[u8], acts: &[ActQ8K], out: &mut [f32], nb: usize) {
    let mut acc = zero_acc::<R>();
    let m4 = vdupq_n_u8(0x0F);
    for b in 0..nb {
        let p = w.as_ptr().add(b * Format::Q4K.group_block_bytes());
        let a: [*const ActQ8K; R] = rows_at(acts, b, nb);
        for (j, acc) in acc.iter_mut().enumerate() {
            let mut sacc = [vdupq_n_s32(0); R];
            // Sub-block `s = 2 · pair + half`: the low (half 0) or high nibbles of pair `pair`.
            // Each half re-reads the pair's 8 steps from L1 rather than holding 16 registers.
            for s in 0..8 {
                let (pair, half) = (s / 2, s % 2);
                let mut q = [vdupq_n_s8(0); 8];
                for (t, q) in q.iter_mut().enumerate() {
                    let v = load(p.add(320 + 512 * pair + 64 * t + 16 * j));
                    let v = if half == 0 {
                        vandq_u8(v, m4)
                    } else {
                        vshrq_n_u8::<4>(v)
                    };
                    *q = vreinterpretq_s8_u8(v);
                }
                let sc = u8x4(p.add(64 + 16 * s + 4 * j));
                for (i, sacc) in sacc.iter_mut().enumerate() {
                    let x = (*a[i]).qs.as_ptr().add(32 * s);
                    *sacc = vmlaq_s32(*sacc, D::small(&q, x), sc);
                }
            }
            // Mins: bytes (row, sub-block 2·pair + 0/1) pairs for the quad's 4 rows, against
            // the activations' (bsum32[2·pair], bsum32[2·pair + 1]) repeated.
            let mut mins = [vdupq_n_s16(0); 4];
            for (pair, m) in mins.iter_mut().enumerate() {
                *m = vreinterpretq_s16_u16(vmovl_u8(vld1_u8(p.add(192 + 32 * pair + 8 * j))));
            }
            let (d, dmin) = (f16x4(p.add(8 * j)), f16x4(p.add(32 + 8 * j)));
            for i in 0..R {
                let a = &*a[i];
                let bsum = a.bsum32.as_ptr().cast::<i32>();
                let mut macc = vdupq_n_s32(0);
                for (pair, &m) in mins.iter().enumerate() {
                    let sums = vreinterpretq_s16_s32(vdupq_n_s32(bsum.add(pair).read_unaligned()));
                    let lo = vmull_s16(vget_low_s16(m), vget_low_s16(sums));
                    let hi = vmull_high_s16(m, sums);
                    macc = vaddq_s32(macc, vpaddq_s32(lo, hi));
                }
                let with_dot = scaled_add(acc[i], d, a.d, sacc[i]);
                let min = vmulq_f32(vmulq_n_f32(dmin, a.d), vcvtq_f32_s32(macc));
                acc[i] = vsubq_f32(with_dot, min);
            }
        }
    }
    store_rows(&acc, out);
}

/// Q6_K's weights of part `i` as signed `q − 32`: the low (`i < 2`) or high nibbles of `ql`
/// with bits `2i..2i + 2` of `qh` on top (moved to bits 4–5).
#[inline(always)]
unsafe fn q6_signed(ql: uint8x16_t, qh: uint8x16_t, i: usize) -> int8x16_t {
    let low = if i < 2 {
        vandq_u8(ql, vdupq_n_u8(0x0F))
    } else {
        vshrq_n_u8::<4>(ql)
    };
    let high = match i {
        0 => vshlq_n_u8::<4>(qh),
        1 => vshlq_n_u8::<2>(qh),
        2 => qh,
        _ => vshrq_n_u8::<2>(qh),
    };
    let q = vorrq_u8(low, vandq_u8(high, vdupq_n_u8(0x30)));
    vsubq_s8(vreinterpretq_s8_u8(q), vdupq_n_s8(32))
}

#[inline(always)]
unsafe fn q6k_impl<D: Dot, const R: usize>(w: &[u8], acts: &[ActQ8K], out: &mut [f32], nb: usize) {
    let mut acc = zero_acc::<R>();
    for b in 0..nb {
        let p = w.as_ptr().add(b * Format::Q6K.group_block_bytes());
        let a: [*const ActQ8K; R] = rows_at(acts, b, nb);
        for (j, acc) in acc.iter_mut().enumerate() {
            let mut sacc = [vdupq_n_s32(0); R];
            // Half `n`, part `i`, 16-weight sub-block `s = 8n + 2i + sub` (steps 4·sub..+4).
            for n in 0..2 {
                for i in 0..4 {
                    for sub in 0..2 {
                        let mut q = [vdupq_n_s8(0); 4];
                        for (k, q) in q.iter_mut().enumerate() {
                            let t = 4 * sub + k;
                            let ql = load(p.add(q6k_ql(n, i % 2, t) + 16 * j));
                            let qh = load(p.add(q6k_qh(n, t) + 16 * j));
                            *q = q6_signed(ql, qh, i);
                        }
                        let s = 8 * n + 2 * i + sub;
                        let sc = i8x4(p.add(32 + 16 * s + 4 * j));
                        for (r, sacc) in sacc.iter_mut().enumerate() {
                            let x = (*a[r]).qs.as_ptr().add(128 * n + 32 * i + 16 * sub);
                            *sacc = vmlaq_s32(*sacc, D::small(&q, x), sc);
                        }
                    }
                }
            }
            let d = f16x4(p.add(8 * j));
            for r in 0..R {
                acc[r] = scaled_add(acc[r], d, (*a[r]).d, sacc[r]);
            }
        }
    }
    store_rows(&acc, out);
}

/// `acc = acc + w · x` per input `k` in order, as `scalar::float` does.
#[inline(always)]
unsafe fn float_step<const R: usize>(acc: &mut Acc<R>, wk: [float32x4_t; 4], x: &[f32], k: usize) {
    let in_dim = x.len() / R;
    for i in 0..R {
        let xk = *x.get_unchecked(i * in_dim + k);
        for (acc, &wk) in acc.iter_mut().zip(&wk) {
            acc[i] = vaddq_f32(acc[i], vmulq_n_f32(wk, xk));
        }
    }
}

#[inline(always)]
unsafe fn f16_impl<const R: usize>(w: &[u8], x: &[f32], out: &mut [f32], in_dim: usize) {
    let mut acc = zero_acc::<R>();
    for k in 0..in_dim {
        let p = w.as_ptr().add(32 * k);
        let ((w0, w1), (w2, w3)) = (f16x8(p), f16x8(p.add(16)));
        float_step(&mut acc, [w0, w1, w2, w3], x, k);
    }
    store_rows(&acc, out);
}

#[inline(always)]
unsafe fn f32_impl<const R: usize>(w: &[u8], x: &[f32], out: &mut [f32], in_dim: usize) {
    let mut acc = zero_acc::<R>();
    for k in 0..in_dim {
        // Byte loads: the kernel takes the group as a `&[u8]`, with no f32 alignment promised.
        let p = w.as_ptr().add(64 * k);
        let wk = [0, 16, 32, 48].map(|at| vreinterpretq_f32_u8(load(p.add(at))));
        float_step(&mut acc, wk, x, k);
    }
    store_rows(&acc, out);
}
