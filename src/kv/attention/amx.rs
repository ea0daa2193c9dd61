//! Both bf16 products of a block of attention on AMX tiles (Intel Sapphire Rapids and later):
//! one `tdpbf16ps` multiplies a 16 × 32 bf16 tile by a 32 × 16 one into 16 × 16 f32 sums, 8,192
//! multiply-adds, where an AVX-512 `vdpbf16ps` does 32 (measured here: ~1 T multiply-adds a
//! second on one core against ~0.1 T for f32 FMAs).
//!
//! The operands are the ones the AVX-512 BF16 kernels (`bf16`) take, in the same layouts, so
//! the two paths share the page decoding and the softmax and round the same values to bf16:
//! tiles of 16 lanes, the scores' K as `[d / 2][key]` pairs and V as `[key / 2][d]` pairs (AMX's
//! "VNNI" layout of B). Each row of a result tile is computed from its own row of A alone, so a
//! lane's arithmetic does not depend on the lanes beside it (rows stay bit-identical in any
//! batch); padding lanes compute finite values nobody reads.
//!
//! Tiles live in 8 registers the compiler knows nothing about, so they are only touched by the
//! `asm!` here, between [`Tiles::configure`] and its drop on the same thread: `tmm0`/`tmm1` hold
//! A (16 lanes each), `tmm2`/`tmm3` B and `tmm4`..`tmm7` the 2 × 2 result tiles, so each tile
//! loaded serves two products. Every tile is configured as 16 rows of 64 bytes.
//!
//! Unlike the other SIMD kernels, these functions cannot enable their own instruction set:
//! Rust's `amx-tile`/`amx-bf16`/`amx-int8` target features are unstable (1.95). Their `asm!`
//! names no register class that needs a feature, so they compile for any x86-64 target, and
//! they are reached only through [`is_supported`] (which also asks Linux for the tile state).

use std::arch::asm;
use std::sync::OnceLock;

/// Whether this CPU and kernel run AMX-BF16: CPUID reports AMX-TILE and AMX-BF16, and Linux
/// grants the process the tile state (`ARCH_REQ_XCOMP_PERM`, asked once; without it the first
/// tile instruction would fault).
pub fn is_supported() -> bool {
    static SUPPORTED: OnceLock<bool> = OnceLock::new();
    // CPUID leaf 7 exists on every x86-64 CPU that reports AVX-512 (checked first).
    *SUPPORTED.get_or_init(|| super::bf16::is_supported() && tiles_with(AMX_BF16))
}

/// Whether this CPU and kernel run AMX-INT8 (`tdpbsud`, `tdpbusd`; the int8 path's tiles).
pub fn int8_is_supported() -> bool {
    static SUPPORTED: OnceLock<bool> = OnceLock::new();
    *SUPPORTED.get_or_init(|| super::int8::is_supported() && tiles_with(AMX_INT8))
}

/// CPUID.(7, 0):EDX bits of AMX-BF16 and AMX-INT8 (AMX-TILE is bit 24).
const AMX_BF16: u32 = 1 << 22;
const AMX_INT8: u32 = 1 << 25;

/// Whether CPUID reports AMX-TILE and `feature`, and Linux grants the tile state.
fn tiles_with(feature: u32) -> bool {
    let leaf = std::arch::x86_64::__cpuid_count(7, 0);
    leaf.edx & (1 << 24) != 0 && leaf.edx & feature != 0 && tile_state_granted()
}

/// Asks Linux once for the tile state.
fn tile_state_granted() -> bool {
    static GRANTED: OnceLock<bool> = OnceLock::new();
    *GRANTED.get_or_init(request_tile_state)
}

#[cfg(target_os = "linux")]
fn request_tile_state() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: a plain system call with integer arguments.
    unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        ) == 0
    }
}

#[cfg(not(target_os = "linux"))]
fn request_tile_state() -> bool {
    false
}

/// The tile configuration (palette 1): every tile 16 rows of 64 bytes.
#[repr(C, align(64))]
struct Config([u8; 64]);

const CONFIG: Config = {
    let mut c = [0u8; 64];
    c[0] = 1;
    let mut t = 0;
    while t < 8 {
        c[16 + 2 * t] = 64; // bytes per row (little-endian u16)
        c[48 + t] = 16; // rows
        t += 1;
    }
    Config(c)
};

/// The tile registers configured on this thread until dropped (which releases them, so that
/// the kernel need not save 8 KB of tile state on every context switch).
pub struct Tiles(());

impl Tiles {
    /// # Safety
    /// [`is_supported`] must hold.
    pub unsafe fn configure() -> Tiles {
        asm!("ldtilecfg [{}]", in(reg) CONFIG.0.as_ptr(), options(nostack, readonly));
        Tiles(())
    }
}

impl Drop for Tiles {
    fn drop(&mut self) {
        // SAFETY: the tiles were configured by `configure`, so the CPU has AMX.
        unsafe { asm!("tilerelease", options(nostack, nomem)) };
    }
}

/// `asm!` with result tile `$i` (0..4, i.e. `tmm4`..`tmm7`) between the template's two halves:
/// tile registers cannot be operands, so each one is its own literal.
macro_rules! on_result_tile {
    ($i:expr, $pre:literal, $post:literal $($rest:tt)*) => {
        match $i {
            0 => asm!(concat!($pre, "tmm4", $post) $($rest)*),
            1 => asm!(concat!($pre, "tmm5", $post) $($rest)*),
            2 => asm!(concat!($pre, "tmm6", $post) $($rest)*),
            _ => asm!(concat!($pre, "tmm7", $post) $($rest)*),
        }
    };
}

#[inline(always)]
unsafe fn zero_result(i: usize) {
    on_result_tile!(i, "tilezero ", "", options(nostack, nomem));
}

/// Loads result tile `i` from 16 rows of 16 floats `stride` bytes apart.
#[inline(always)]
unsafe fn load_result(i: usize, p: *const f32, stride: usize) {
    on_result_tile!(i, "tileloadd ", ", [{p} + {s}*1]",
        p = in(reg) p, s = in(reg) stride, options(nostack, readonly));
}

#[inline(always)]
unsafe fn store_result(i: usize, p: *mut f32, stride: usize) {
    on_result_tile!(i, "tilestored [{p} + {s}*1], ", "",
        p = in(reg) p, s = in(reg) stride, options(nostack));
}

/// One step of 32 terms for up to 2 × 2 result tiles: A tiles (16 rows of 32 bf16, `a_stride`
/// bytes apart) from `a` and `a + a_next` bytes (the second only when `lane_tiles` is 2), B
/// tiles (16 rows of 16 bf16 pairs, `b_stride` bytes apart) from `b` and `b + b_next` bytes,
/// and result tile `2i + j` += A_i · B_j. Every tile is loaded before the products: a product
/// right behind the load of its operand waits for it (measured: 1 A against 4 B tiles loaded
/// one by one ran at a third of the rate of 2 × 2 with loads first).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn step(
    lane_tiles: usize,
    a: *const u8,
    a_next: usize,
    a_stride: usize,
    b: *const u8,
    b_next: usize,
    b_stride: usize,
) {
    if lane_tiles == 2 {
        asm!(
            "tileloadd tmm0, [{a} + {sa}*1]",
            "tileloadd tmm1, [{a1} + {sa}*1]",
            "tileloadd tmm2, [{b} + {sb}*1]",
            "tileloadd tmm3, [{b1} + {sb}*1]",
            "tdpbf16ps tmm4, tmm0, tmm2",
            "tdpbf16ps tmm5, tmm0, tmm3",
            "tdpbf16ps tmm6, tmm1, tmm2",
            "tdpbf16ps tmm7, tmm1, tmm3",
            a = in(reg) a, a1 = in(reg) a.add(a_next), sa = in(reg) a_stride,
            b = in(reg) b, b1 = in(reg) b.add(b_next), sb = in(reg) b_stride,
            options(nostack, readonly),
        );
    } else {
        asm!(
            "tileloadd tmm0, [{a} + {sa}*1]",
            "tileloadd tmm2, [{b} + {sb}*1]",
            "tileloadd tmm3, [{b1} + {sb}*1]",
            "tdpbf16ps tmm4, tmm0, tmm2",
            "tdpbf16ps tmm5, tmm0, tmm3",
            a = in(reg) a, sa = in(reg) a_stride,
            b = in(reg) b, b1 = in(reg) b.add(b_next), sb = in(reg) b_stride,
            options(nostack, readonly),
        );
    }
}

/// `s[l · s_stride + j] = Σ_{p < pairs} q[l][p] · k[p][j]` for `16 · lane_tiles` lanes (1 or 2
/// tiles; `q` rows `q_stride` bf16 apart, pairs adjacent) and `j < keys` (a multiple of 32; `k`
/// rows `k_stride` pairs apart); `pairs` is a multiple of 16.
///
/// # Safety
/// The tiles must be configured on this thread and every index above inside its buffer.
#[allow(clippy::too_many_arguments)]
pub unsafe fn scores(
    lane_tiles: usize,
    q: *const u16,
    q_stride: usize,
    k: *const u32,
    k_stride: usize,
    pairs: usize,
    keys: usize,
    s: *mut f32,
    s_stride: usize,
) {
    let (a, b, c) = ((q, q_stride), (k, k_stride), (s, s_stride));
    product(lane_tiles, a, b, pairs, keys, c, false);
}

/// `o[l · o_stride + d] += Σ_{p < pairs} w[l][p] · v[p][d]` (bf16 pairs) for `16 · lane_tiles`
/// lanes (`w` rows `w_stride` bf16 apart) and `d < o_stride` (a multiple of 32; `v` rows
/// `o_stride` pairs apart); `pairs` is a multiple of 16.
///
/// # Safety
/// The tiles must be configured on this thread and every index above inside its buffer.
pub unsafe fn accumulate(
    lane_tiles: usize,
    w: *const u16,
    w_stride: usize,
    v: *const u32,
    o_stride: usize,
    pairs: usize,
    o: *mut f32,
) {
    let (a, b, c) = ((w, w_stride), (v, o_stride), (o, o_stride));
    product(lane_tiles, a, b, pairs, o_stride, c, true);
}

/// Both products: `c[l][j] (+)= Σ_{p < pairs} a[l][p] · b[p][j]` for `16 · lane_tiles` lanes
/// and `j < cols`, each operand given as (pointer, row stride in elements): `a` rows of bf16
/// with pairs adjacent, `b` rows of bf16 pairs, `c` rows of f32; `add` keeps what `c` holds.
///
/// # Safety
/// As [`scores`].
unsafe fn product(
    lane_tiles: usize,
    (a, a_stride): (*const u16, usize),
    (b, b_stride): (*const u32, usize),
    pairs: usize,
    cols: usize,
    (c, c_stride): (*mut f32, usize),
    add: bool,
) {
    debug_assert!(cols.is_multiple_of(32) && pairs.is_multiple_of(16));
    debug_assert!((1..=2).contains(&lane_tiles));
    let results = 2 * lane_tiles;
    // Result tile `i`: lanes `16 · (i / 2)..`, columns `j + 16 · (i % 2)..`.
    let tile = |i: usize, j: usize| c.add(16 * (i / 2) * c_stride + j + 16 * (i % 2));
    for j in (0..cols).step_by(32) {
        for i in 0..results {
            if add {
                load_result(i, tile(i, j), 4 * c_stride);
            } else {
                zero_result(i);
            }
        }
        for p in (0..pairs).step_by(16) {
            step(
                lane_tiles,
                a.add(2 * p).cast(),
                32 * a_stride,
                2 * a_stride,
                b.add(p * b_stride + j).cast(),
                64,
                4 * b_stride,
            );
        }
        for i in 0..results {
            store_result(i, tile(i, j), 4 * c_stride);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bf16(x: f32) -> u16 {
        half::bf16::from_f32(x).to_bits()
    }

    fn val(i: usize) -> f32 {
        ((i * 37 % 101) as f32 - 50.0) / 16.0
    }

    /// Both products against f64 sums of the same bf16 operands, with 16 padding-free lanes
    /// and strides wider than the rows (the layouts the attention scratch uses).
    #[test]
    fn tile_products_match_f64_sums_of_the_bf16_operands() {
        if !is_supported() {
            return;
        }
        let (lanes, pairs, keys, q_stride, k_stride) = (32, 32, 96, 72, 96);
        let q: Vec<u16> = (0..lanes * q_stride).map(|i| bf16(val(i))).collect();
        let k: Vec<u32> = (0..pairs * k_stride)
            .map(|i| bf16(val(i + 5)) as u32 | (bf16(val(i + 9)) as u32) << 16)
            .collect();
        let f = |b: u16| half::bf16::from_bits(b).to_f32() as f64;
        let mut s = vec![f32::NAN; lanes * k_stride];
        let o_stride = 96;
        let mut o: Vec<f32> = (0..lanes * o_stride).map(|i| val(i + 3)).collect();
        let o0 = o.clone();
        unsafe {
            let _tiles = Tiles::configure();
            let (q, k) = (q.as_ptr(), k.as_ptr());
            scores(
                2,
                q,
                q_stride,
                k,
                k_stride,
                pairs,
                keys,
                s.as_mut_ptr(),
                k_stride,
            );
            // One lane tile: the second tile's lanes must stay as they were.
            accumulate(1, q, q_stride, k, o_stride, pairs, o.as_mut_ptr());
            let upper = o_stride * 16;
            let (q, o) = (q.add(16 * q_stride), o[upper..].as_mut_ptr());
            accumulate(1, q, q_stride, k, o_stride, pairs, o);
        }
        for l in 0..lanes {
            for j in 0..keys {
                let want: f64 = (0..pairs)
                    .map(|p| {
                        let pair = k[p * k_stride + j];
                        f(q[l * q_stride + 2 * p]) * f(pair as u16)
                            + f(q[l * q_stride + 2 * p + 1]) * f((pair >> 16) as u16)
                    })
                    .sum();
                let got = s[l * k_stride + j] as f64;
                assert!(
                    (got - want).abs() < 1e-4 * want.abs().max(1.0),
                    "score {l} {j}"
                );
            }
            for d in 0..o_stride {
                let want: f64 = o0[l * o_stride + d] as f64
                    + (0..pairs)
                        .map(|p| {
                            let pair = k[p * o_stride + d];
                            f(q[l * q_stride + 2 * p]) * f(pair as u16)
                                + f(q[l * q_stride + 2 * p + 1]) * f((pair >> 16) as u16)
                        })
                        .sum::<f64>();
                let got = o[l * o_stride + d] as f64;
                assert!(
                    (got - want).abs() < 1e-4 * want.abs().max(1.0),
                    "value {l} {d}"
                );
            }
        }
    }
}
