//! The packed weight layout: GGUF blocks of 16 output rows ("a group") interleaved so that one
//! 64-byte vector holds 4 consecutive weights of each of the 16 rows.
//!
//! A matrix is `[num_groups][num_blocks][group_block_bytes]`. Inside a group-block every
//! quantity is stored column-interleaved: scales as `[16]` (f16 or u8/i8 per sub-block), and
//! quants as `[step][16 columns][4 bytes]`, where byte `b` of step `t` is byte `4t + b` of that
//! column's GGUF quant array. Each "step" is exactly one `vpdpbusd` operand. Rows past
//! `out_dim` in the last group are zero (their scales are zero) and are never written out.
//!
//! | format | k per block | bytes per group-block | contents (byte offsets)                          |
//! | ------ | ----------- | --------------------- | ------------------------------------------------ |
//! | Q8_0   | 32          | 544                   | d f16[16] @0, qs i8 [8][16][4] @32               |
//! | Q4_1   | 32          | 320                   | d @0, m @32, qs nibbles [4][16][4] @64           |
//! | Q5_0   | 32          | 352                   | d @0, qs nibbles [4][16][4] @32, hb [16][4] @288 |
//! | Q4_K   | 256         | 2368                  | d @0, dmin @32, sc u8[8][16] @64, m u8[4][16][2] @192, qs [4 pairs][8][16][4] @320 |
//! | Q6_K   | 256         | 3360                  | d @0, sc i8[16][16] @32, from @288 per half n and step half h: qh [4][16][4], ql part 0 [4][16][4], ql part 1 [4][16][4] (`q6k_qh`, `q6k_ql`) |
//! | F16    | 1           | 32                    | w f16[16]                                        |
//! | F32    | 1           | 64                    | w f32[16]                                        |
//!
//! Q5_0 keeps its 5.5 bits per weight (widening it to Q8_0 would read 55% more bytes per
//! token): the low nibbles as Q4_1's, and the fifth bits re-spread so that byte `b` of column
//! `c` in `hb` holds, at bit `k`, the fifth bit of weight `4k + b` — step `t` of the low nibbles
//! finds its bits at bit `t` and of the high nibbles at bit `t + 4` of the same bytes.

use candle_core::quantized::GgmlDType;

use super::buffer::AlignedBuf;
use super::KernelError;

/// Output rows per group: the lanes of one AVX-512 vector of i32/f32.
pub const GROUP: usize = 16;

/// A packed weight format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Format {
    Q8_0,
    Q4_1,
    Q5_0,
    Q4K,
    Q6K,
    F16,
    F32,
}

impl Format {
    /// Weights along `in_dim` per block.
    pub fn block_len(self) -> usize {
        match self {
            Format::Q8_0 | Format::Q4_1 | Format::Q5_0 => 32,
            Format::Q4K | Format::Q6K => 256,
            Format::F16 | Format::F32 => 1,
        }
    }

    /// Packed bytes of one block for the 16 rows of a group.
    pub fn group_block_bytes(self) -> usize {
        match self {
            Format::Q8_0 => 544,
            Format::Q4_1 => 320,
            Format::Q5_0 => 352,
            Format::Q4K => 2368,
            Format::Q6K => 3360,
            Format::F16 => 32,
            Format::F32 => 64,
        }
    }
}

/// Offset in a packed Q6_K group block of step `t` (0..8; 4 bytes of each of the 16 rows) of
/// the low-bit bytes (`ql`) of part `h` (0, 1) of half `n` (0, 1).
///
/// Steps are laid out in the order the kernels read them: for each half `n` and each run of 4
/// steps, the high bits (`qh`, shared by both parts) and then both parts' low bits, so that a
/// block is read front to back. With all of `ql` first and `qh` after it (two streams 2 KB
/// apart, `qh` read twice), a Q6_K matrix streamed from memory at about 60% of a Q4_K one's rate
/// per byte on a Zen 4.
pub const fn q6k_ql(n: usize, h: usize, t: usize) -> usize {
    q6k_qh(n, t) + 256 + 256 * h
}

/// Offset of step `t` (0..8) of the high-bit bytes (`qh`) of half `n`; see [`q6k_ql`].
pub const fn q6k_qh(n: usize, t: usize) -> usize {
    288 + 1536 * n + 768 * (t / 4) + 64 * (t % 4)
}

/// GGUF bytes of one block, and the packed format it becomes.
fn source_format(dtype: GgmlDType) -> Result<(Format, usize), KernelError> {
    Ok(match dtype {
        GgmlDType::Q8_0 => (Format::Q8_0, 34),
        GgmlDType::Q5_0 => (Format::Q5_0, 22),
        GgmlDType::Q4_1 => (Format::Q4_1, 20),
        GgmlDType::Q4K => (Format::Q4K, 144),
        GgmlDType::Q6K => (Format::Q6K, 210),
        GgmlDType::F16 => (Format::F16, 2),
        GgmlDType::F32 => (Format::F32, 4),
        other => return Err(KernelError::UnsupportedFormat(format!("{other:?}"))),
    })
}

/// Repacks row-major GGUF blocks (`[out_dim][in_dim / block_len]`) into the group layout.
pub fn repack(
    dtype: GgmlDType,
    data: &[u8],
    out_dim: usize,
    in_dim: usize,
) -> Result<(Format, AlignedBuf<u8>), KernelError> {
    let (format, src_block_bytes) = source_format(dtype)?;
    let block_len = format.block_len();
    if out_dim == 0 || in_dim == 0 || !in_dim.is_multiple_of(block_len) {
        return Err(KernelError::Shape(format!(
            "{dtype:?} matrix [{out_dim}, {in_dim}]: in_dim must be a positive multiple of {block_len}"
        )));
    }
    let num_blocks = in_dim / block_len;
    let row_bytes = num_blocks * src_block_bytes;
    if data.len() != out_dim * row_bytes {
        return Err(KernelError::Shape(format!(
            "{dtype:?} matrix [{out_dim}, {in_dim}] needs {} bytes, got {}",
            out_dim * row_bytes,
            data.len()
        )));
    }
    let gbb = format.group_block_bytes();
    let num_groups = out_dim.div_ceil(GROUP);
    let mut packed = AlignedBuf::zeroed(num_groups * num_blocks * gbb);
    for (g, group) in packed.chunks_exact_mut(num_blocks * gbb).enumerate() {
        for (b, dst) in group.chunks_exact_mut(gbb).enumerate() {
            for c in 0..GROUP.min(out_dim - g * GROUP) {
                let start = (g * GROUP + c) * row_bytes + b * src_block_bytes;
                let src = &data[start..start + src_block_bytes];
                match dtype {
                    GgmlDType::Q5_0 => pack_q5_0(src, dst, c),
                    GgmlDType::Q8_0 => pack_q8_0(src, dst, c),
                    GgmlDType::Q4_1 => pack_q4_1(src, dst, c),
                    GgmlDType::Q4K => pack_q4k(src, dst, c),
                    GgmlDType::Q6K => pack_q6k(src, dst, c),
                    _ => dst[c * src.len()..(c + 1) * src.len()].copy_from_slice(src),
                }
            }
        }
    }
    Ok((format, packed))
}

/// Copies `num_steps` 4-byte words of one column: `dst[t][c][..4] = src[4t..4t + 4]`.
fn interleave(src: &[u8], dst: &mut [u8], c: usize) {
    for (t, word) in src.chunks_exact(4).enumerate() {
        let at = t * GROUP * 4 + c * 4;
        dst[at..at + 4].copy_from_slice(word);
    }
}

fn pack_q8_0(src: &[u8], dst: &mut [u8], c: usize) {
    dst[2 * c..2 * c + 2].copy_from_slice(&src[0..2]);
    interleave(&src[2..34], &mut dst[32..], c);
}

fn pack_q4_1(src: &[u8], dst: &mut [u8], c: usize) {
    dst[2 * c..2 * c + 2].copy_from_slice(&src[0..2]);
    dst[32 + 2 * c..32 + 2 * c + 2].copy_from_slice(&src[2..4]);
    interleave(&src[4..20], &mut dst[64..], c);
}

fn pack_q5_0(src: &[u8], dst: &mut [u8], c: usize) {
    dst[2 * c..2 * c + 2].copy_from_slice(&src[0..2]);
    interleave(&src[6..22], &mut dst[32..], c);
    let qh = u32::from_le_bytes([src[2], src[3], src[4], src[5]]);
    for b in 0..4 {
        dst[288 + 4 * c + b] = (0..8).fold(0u8, |byte, k| {
            byte | ((((qh >> (4 * k + b)) & 1) as u8) << k)
        });
    }
}

fn pack_q4k(src: &[u8], dst: &mut [u8], c: usize) {
    dst[2 * c..2 * c + 2].copy_from_slice(&src[0..2]);
    dst[32 + 2 * c..32 + 2 * c + 2].copy_from_slice(&src[2..4]);
    let scales = &src[4..16];
    for s in 0..8 {
        let (sc, m) = scale_min_k4(s, scales);
        dst[64 + s * GROUP + c] = sc;
        dst[192 + (s / 2) * 2 * GROUP + 2 * c + s % 2] = m;
    }
    // Pair p of 64 weights is GGUF qs[32p..32p + 32]: low nibbles are sub-block 2p, high 2p + 1.
    for p in 0..4 {
        interleave(&src[16 + 32 * p..48 + 32 * p], &mut dst[320 + 512 * p..], c);
    }
}

fn pack_q6k(src: &[u8], dst: &mut [u8], c: usize) {
    let (ql, rest) = src.split_at(128);
    let (qh, rest) = rest.split_at(64);
    let (scales, d) = rest.split_at(16);
    dst[2 * c..2 * c + 2].copy_from_slice(d);
    for (s, &sc) in scales.iter().enumerate() {
        dst[32 + s * GROUP + c] = sc;
    }
    // Half n, part h: GGUF ql[64n + 32h..][..32]; low nibbles are weights 128n + 32h + l, high
    // nibbles 128n + 64 + 32h + l. qh[32n + l] holds the top bits of 128n + 32i + l at bit 2i.
    for n in 0..2 {
        for h in 0..2 {
            let words = ql[64 * n + 32 * h..64 * n + 32 * h + 32].chunks_exact(4);
            for (t, word) in words.enumerate() {
                let at = q6k_ql(n, h, t) + 4 * c;
                dst[at..at + 4].copy_from_slice(word);
            }
        }
        for (t, word) in qh[32 * n..32 * n + 32].chunks_exact(4).enumerate() {
            let at = q6k_qh(n, t) + 4 * c;
            dst[at..at + 4].copy_from_slice(word);
        }
    }
}

/// GGUF's 6-bit (scale, min) pair `j` of a Q4_K block's 12 packed scale bytes.
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interleave_puts_word_t_of_column_c_at_step_t() {
        let src: Vec<u8> = (0..32).collect();
        let mut dst = vec![0u8; 512];
        interleave(&src, &mut dst, 3);
        assert_eq!(&dst[12..16], &[0, 1, 2, 3]);
        assert_eq!(&dst[64 + 12..64 + 16], &[4, 5, 6, 7]);
    }

    #[test]
    fn unknown_formats_are_named_in_the_error() {
        let err = repack(GgmlDType::Q2K, &[], 1, 256).unwrap_err();
        assert!(err.to_string().contains("Q2K"), "{err}");
    }

    #[test]
    fn q5_0_fifth_bits_are_spread_by_step() {
        let mut src = [0u8; 22];
        // Fifth bits of weights 0, 5 (step 1, byte 1) and 31 (step 7, byte 3).
        src[2..6].copy_from_slice(&(1u32 | 1 << 5 | 1 << 31).to_le_bytes());
        src[6] = 0xA3; // weight 0: low nibble 3; weight 16: 0xA
        let mut dst = vec![0u8; 352];
        pack_q5_0(&src, &mut dst, 2);
        assert_eq!(&dst[288 + 8..288 + 12], &[0b1, 0b10, 0, 0b1000_0000]);
        assert_eq!(dst[32 + 8], 0xA3);
    }
}
