//! Portable kernels for one group of 16 output rows. They define the arithmetic every SIMD path
//! reproduces bit for bit: exact integer block dot products, then per block and per output
//! `acc = fma(d_w · d_x, isum, acc)` (one rounding for the multiply-add; then the format's min
//! term), in block order.
//!
//! Shapes, for every kernel: `w` is one group `[num_blocks][group_block_bytes]` (see `layout`),
//! `acts` is `[num_rows, num_blocks]`, `out` is `[num_rows, 16]`.

use half::f16;

use super::act::{ActQ8, ActQ8K};
use super::layout::{q6k_qh, q6k_ql, Format, GROUP};

/// The f16 at index `i` of a little-endian f16 array.
#[inline(always)]
pub fn f16_at(bytes: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]).to_f32()
}

/// Byte `b` of step `t` of column `c` in an interleaved quant array.
#[inline(always)]
fn byte(q: &[u8], t: usize, c: usize, b: usize) -> u8 {
    q[t * GROUP * 4 + c * 4 + b]
}

fn rows_and_blocks<A>(acts: &[A], out: &[f32]) -> (usize, usize) {
    let num_rows = out.len() / GROUP;
    (num_rows, acts.len() / num_rows)
}

pub fn q8_0(w: &[u8], acts: &[ActQ8], out: &mut [f32]) {
    let (num_rows, num_blocks) = rows_and_blocks(acts, out);
    let gbb = Format::Q8_0.group_block_bytes();
    for (r, out) in out.chunks_exact_mut(GROUP).enumerate() {
        let mut acc = [0f32; GROUP];
        for (b, wb) in w.chunks_exact(gbb).take(num_blocks).enumerate() {
            let a = &acts[r * num_blocks + b];
            let q = &wb[32..];
            for (c, acc) in acc.iter_mut().enumerate() {
                let mut isum = 0i32;
                for k in 0..32 {
                    isum += byte(q, k / 4, c, k % 4) as i8 as i32 * a.qs[k] as i32;
                }
                *acc = (f16_at(wb, c) * a.d).mul_add(isum as f32, *acc);
            }
        }
        out.copy_from_slice(&acc);
    }
    debug_assert_eq!(num_rows * GROUP, out.len());
}

/// Q5_0 as `(u − 16) · x` with `u` the 5-bit weight: the same integer sum as Q8_0's `q · x`.
pub fn q5_0(w: &[u8], acts: &[ActQ8], out: &mut [f32]) {
    let (_, num_blocks) = rows_and_blocks(acts, out);
    let gbb = Format::Q5_0.group_block_bytes();
    for (r, out) in out.chunks_exact_mut(GROUP).enumerate() {
        let mut acc = [0f32; GROUP];
        for (b, wb) in w.chunks_exact(gbb).take(num_blocks).enumerate() {
            let a = &acts[r * num_blocks + b];
            let (q, hb) = (&wb[32..], &wb[288..]);
            for (c, acc) in acc.iter_mut().enumerate() {
                let mut isum = 0i32;
                for k in 0..32 {
                    let (j, high) = (k % 16, k / 16);
                    let (t, bb) = (j / 4, j % 4);
                    let nibble = (byte(q, t, c, bb) >> (4 * high)) & 0x0F;
                    let fifth = (hb[4 * c + bb] >> (t + 4 * high)) & 1;
                    let u = (nibble | (fifth << 4)) as i32;
                    isum += (u - 16) * a.qs[k] as i32;
                }
                *acc = (f16_at(wb, c) * a.d).mul_add(isum as f32, *acc);
            }
        }
        out.copy_from_slice(&acc);
    }
}

pub fn q4_1(w: &[u8], acts: &[ActQ8], out: &mut [f32]) {
    let (_, num_blocks) = rows_and_blocks(acts, out);
    let gbb = Format::Q4_1.group_block_bytes();
    for (r, out) in out.chunks_exact_mut(GROUP).enumerate() {
        let mut acc = [0f32; GROUP];
        for (b, wb) in w.chunks_exact(gbb).take(num_blocks).enumerate() {
            let a = &acts[r * num_blocks + b];
            let q = &wb[64..];
            for (c, acc) in acc.iter_mut().enumerate() {
                let mut isum = 0i32;
                for k in 0..16 {
                    let v = byte(q, k / 4, c, k % 4);
                    isum += (v & 0x0F) as i32 * a.qs[k] as i32;
                    isum += (v >> 4) as i32 * a.qs[k + 16] as i32;
                }
                let with_dot = (f16_at(wb, c) * a.d).mul_add(isum as f32, *acc);
                let min = (f16_at(&wb[32..], c) * a.d) * a.sum as f32;
                *acc = with_dot + min;
            }
        }
        out.copy_from_slice(&acc);
    }
}

pub fn q4k(w: &[u8], acts: &[ActQ8K], out: &mut [f32]) {
    let (_, num_blocks) = rows_and_blocks(acts, out);
    let gbb = Format::Q4K.group_block_bytes();
    for (r, out) in out.chunks_exact_mut(GROUP).enumerate() {
        let mut acc = [0f32; GROUP];
        for (b, wb) in w.chunks_exact(gbb).take(num_blocks).enumerate() {
            let a = &acts[r * num_blocks + b];
            for (c, acc) in acc.iter_mut().enumerate() {
                let (mut sacc, mut macc) = (0i32, 0i32);
                for p in 0..4 {
                    let q = &wb[320 + 512 * p..];
                    let (mut lo, mut hi) = (0i32, 0i32);
                    for k in 0..32 {
                        let v = byte(q, k / 4, c, k % 4);
                        lo += (v & 0x0F) as i32 * a.qs[64 * p + k] as i32;
                        hi += (v >> 4) as i32 * a.qs[64 * p + 32 + k] as i32;
                    }
                    sacc += wb[64 + 2 * p * GROUP + c] as i32 * lo;
                    sacc += wb[64 + (2 * p + 1) * GROUP + c] as i32 * hi;
                    let m = &wb[192 + p * 2 * GROUP + 2 * c..];
                    macc += m[0] as i32 * a.bsum32[2 * p] as i32;
                    macc += m[1] as i32 * a.bsum32[2 * p + 1] as i32;
                }
                let with_dot = (f16_at(wb, c) * a.d).mul_add(sacc as f32, *acc);
                let min = (f16_at(&wb[32..], c) * a.d) * macc as f32;
                *acc = with_dot - min;
            }
        }
        out.copy_from_slice(&acc);
    }
}

pub fn q6k(w: &[u8], acts: &[ActQ8K], out: &mut [f32]) {
    let (_, num_blocks) = rows_and_blocks(acts, out);
    let gbb = Format::Q6K.group_block_bytes();
    for (r, out) in out.chunks_exact_mut(GROUP).enumerate() {
        let mut acc = [0f32; GROUP];
        for (b, wb) in w.chunks_exact(gbb).take(num_blocks).enumerate() {
            let a = &acts[r * num_blocks + b];
            for (c, acc) in acc.iter_mut().enumerate() {
                let mut sacc = 0i32;
                for n in 0..2 {
                    for i in 0..4 {
                        let mut sub = [0i32; 2];
                        for k in 0..32 {
                            let (t, bb) = (k / 4, k % 4);
                            let lo = (wb[q6k_ql(n, i % 2, t) + 4 * c + bb] >> (4 * (i / 2))) & 0x0F;
                            let hi = (wb[q6k_qh(n, t) + 4 * c + bb] >> (2 * i)) & 3;
                            let q = (lo | (hi << 4)) as i32 - 32;
                            sub[k / 16] += q * a.qs[128 * n + 32 * i + k] as i32;
                        }
                        let s = 8 * n + 2 * i;
                        sacc += wb[32 + s * GROUP + c] as i8 as i32 * sub[0];
                        sacc += wb[32 + (s + 1) * GROUP + c] as i8 as i32 * sub[1];
                    }
                }
                *acc = (f16_at(wb, c) * a.d).mul_add(sacc as f32, *acc);
            }
        }
        out.copy_from_slice(&acc);
    }
}

/// `x`: `[num_rows, in_dim]` f32 activations (no quantisation); `acc = acc + w · x` in k order.
pub fn f16(w: &[u8], x: &[f32], out: &mut [f32]) {
    float(w, x, out, f16_at)
}

pub fn f32(w: &[u8], x: &[f32], out: &mut [f32]) {
    float(w, x, out, |wk, c| {
        f32::from_le_bytes([wk[4 * c], wk[4 * c + 1], wk[4 * c + 2], wk[4 * c + 3]])
    })
}

fn float(w: &[u8], x: &[f32], out: &mut [f32], weight: impl Fn(&[u8], usize) -> f32) {
    let num_rows = out.len() / GROUP;
    let in_dim = x.len() / num_rows;
    let step = w.len() / in_dim;
    for (xr, out) in x.chunks_exact(in_dim).zip(out.chunks_exact_mut(GROUP)) {
        let mut acc = [0f32; GROUP];
        for (wk, &xk) in w.chunks_exact(step).zip(xr) {
            for (c, acc) in acc.iter_mut().enumerate() {
                *acc += weight(wk, c) * xk;
            }
        }
        out.copy_from_slice(&acc);
    }
}
