//! Whether one-row calls (decode steps) ask for the weight stream ahead in software.
//!
//! The x86 kernels prefetch the weights a few KB ahead of the line they read. On the quiet Zen 4
//! and Zen 5 hosts this took one-row matmuls from ~70% to ~87% of the read bandwidth; on a busy
//! Zen 4 host (2026-12-02) the same hints made 1.5B decode ~25% slower than the hardware
//! prefetchers alone (BENCHMARKS.md, "The Zen 4 again"). Which way a machine goes is measured
//! once per process, when the first model loads ([`choose_one_row_prefetch_for`]): one-row calls
//! over the model's own weight matrices in forward order (a decode step's weight reads), with and
//! without the hints, alternating. The formats differ: on one Zen 4 host the hints sped a
//! streamed Q5_0 matrix up by ~10% and slowed Q4_K and Q6_K ones by 15–25%, so a calibration
//! over one format (Q8_0, as this first did) could keep the hints for a model they slowed.
//! Calls of several rows keep their hints: they spend several times longer per byte and need
//! the line earlier.
//!
//! The choice changes only timing, never results. `MTPX_PREFETCH=on|off|auto` (default `auto`)
//! overrides it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use super::{AlignedBuf, Format, QuantMatrix, Scratch};

/// Read by the kernels on every hint of a one-row call; a relaxed load of a line that stays in
/// L1, so the check costs nothing measurable.
static ONE_ROW: AtomicBool = AtomicBool::new(true);

/// Whether one-row calls prefetch now.
#[inline(always)]
pub fn one_row_prefetch() -> bool {
    ONE_ROW.load(Ordering::Relaxed)
}

/// Sets whether one-row calls prefetch (tests, benchmarks).
pub fn set_one_row_prefetch(on: bool) {
    ONE_ROW.store(on, Ordering::Relaxed);
}

/// What [`choose_one_row_prefetch_for`] decided, and from what.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrefetchChoice {
    pub one_row: bool,
    /// The fastest one-row sweep over the calibration matrices with and without the hints (zero
    /// when `MTPX_PREFETCH` decided).
    pub with_hints: Duration,
    pub without_hints: Duration,
    /// Packed bytes one sweep read, and whether they were the model's own matrices (or, for
    /// models smaller than [`CALIBRATION_BYTES`], a synthetic Q8_0 one).
    pub swept_bytes: usize,
    pub model_weights: bool,
}

/// Bytes a calibration sweep reads at least: above a 32 MB L3 by enough that the calls stream
/// from DRAM, as a decode step does.
const CALIBRATION_BYTES: usize = 64 << 20;

/// Sweeps timed each way, alternating; fewer over models above 1 GB (a 7B's 4 GB sweep takes
/// ~150 ms on two cores).
const CALIBRATION_ROUNDS: usize = 7;
const CALIBRATION_ROUNDS_LARGE: usize = 3;

/// Hints stay on unless the sweeps without them were at least this much faster: the hints are
/// the default that most earlier measurements were taken with. (With a Q8_0 matrix standing in
/// for the model this was 0.93; on a Zen 4 host that kept the hints for a 4.5% difference while
/// decode ran 5–12% faster without them, 0.5B and 1.5B alike.)
const SWITCH_OFF_BELOW: f64 = 0.97;

/// [`choose_one_row_prefetch_for`] without a model: a synthetic Q8_0 matrix.
pub fn choose_one_row_prefetch() -> PrefetchChoice {
    choose_one_row_prefetch_for(&[])
}

/// Decides, once per process, whether one-row calls prefetch (see the module comment), by
/// one-row sweeps over `matrices` (a model's weights in forward order) when they hold at least
/// [`CALIBRATION_BYTES`], else over a synthetic matrix; later calls return the first decision.
pub fn choose_one_row_prefetch_for(matrices: &[&QuantMatrix]) -> PrefetchChoice {
    static CHOICE: OnceLock<PrefetchChoice> = OnceLock::new();
    *CHOICE.get_or_init(|| {
        let fixed = |one_row| PrefetchChoice {
            one_row,
            with_hints: Duration::ZERO,
            without_hints: Duration::ZERO,
            swept_bytes: 0,
            model_weights: false,
        };
        let choice = match std::env::var("MTPX_PREFETCH").as_deref().map(str::trim) {
            Ok("on") => fixed(true),
            Ok("off") => fixed(false),
            // Only the x86 kernels prefetch in software.
            _ if !cfg!(target_arch = "x86_64") => fixed(false),
            Ok("auto") | Err(_) => calibrate(matrices),
            Ok(other) => {
                tracing::warn!("MTPX_PREFETCH={other}: expected on, off or auto; measuring");
                calibrate(matrices)
            }
        };
        set_one_row_prefetch(choice.one_row);
        tracing::info!(
            one_row = choice.one_row,
            with_hints_us = choice.with_hints.as_micros() as u64,
            without_hints_us = choice.without_hints.as_micros() as u64,
            "weight prefetch for one-row matmuls"
        );
        choice
    })
}

/// Times one-row sweeps over `matrices` (or a synthetic Q8_0 matrix of [`CALIBRATION_BYTES`]
/// when they are smaller) with and without the hints.
fn calibrate(matrices: &[&QuantMatrix]) -> PrefetchChoice {
    let model_bytes: usize = matrices.iter().map(|m| m.packed_bytes()).sum();
    if model_bytes >= CALIBRATION_BYTES {
        return time_sweeps(matrices, model_bytes, true);
    }
    let in_dim = 4096;
    let group_bytes = in_dim / Format::Q8_0.block_len() * Format::Q8_0.group_block_bytes();
    let synthetic = filled_matrix(
        Format::Q8_0,
        CALIBRATION_BYTES.div_ceil(group_bytes),
        in_dim,
    );
    time_sweeps(&[&synthetic], synthetic.packed_bytes(), false)
}

/// A matrix of `num_groups` groups of `format` over `in_dim` whose packed bytes are all 1: the
/// scales are small normal numbers once widened, the sums integers; the values do not matter,
/// only that the pages are really there (written, not the zero page).
fn filled_matrix(format: Format, num_groups: usize, in_dim: usize) -> QuantMatrix {
    let group_bytes = in_dim / format.block_len() * format.group_block_bytes();
    let mut packed = AlignedBuf::zeroed(num_groups * group_bytes);
    packed.fill(1);
    QuantMatrix {
        format,
        out_dim: num_groups * super::GROUP,
        in_dim,
        packed,
    }
}

/// The fastest of [`CALIBRATION_ROUNDS`] (or [`CALIBRATION_ROUNDS_LARGE`]) one-row sweeps over
/// `matrices` (`swept_bytes` in all) each way, alternating.
fn time_sweeps(
    matrices: &[&QuantMatrix],
    swept_bytes: usize,
    model_weights: bool,
) -> PrefetchChoice {
    let widest_in = matrices.iter().map(|m| m.in_dim).max().unwrap_or(0);
    let widest_out = matrices.iter().map(|m| m.out_dim).max().unwrap_or(0);
    let x = vec![0.5f32; widest_in];
    let mut out = vec![0f32; widest_out];
    let mut scratch = Scratch::new();
    let mut time = |on: bool| {
        set_one_row_prefetch(on);
        let start = Instant::now();
        for m in matrices {
            m.matmul(&x[..m.in_dim], &mut out[..m.out_dim], &mut scratch);
        }
        start.elapsed()
    };
    // One untimed sweep each way warms the pool (the pages are already in memory).
    time(true);
    time(false);
    let rounds = if swept_bytes > 1 << 30 {
        CALIBRATION_ROUNDS_LARGE
    } else {
        CALIBRATION_ROUNDS
    };
    let (mut with_hints, mut without_hints) = (Duration::MAX, Duration::MAX);
    for _ in 0..rounds {
        with_hints = with_hints.min(time(true));
        without_hints = without_hints.min(time(false));
    }
    let one_row = without_hints.as_secs_f64() >= SWITCH_OFF_BELOW * with_hints.as_secs_f64();
    PrefetchChoice {
        one_row,
        with_hints,
        without_hints,
        swept_bytes,
        model_weights,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_model_of_enough_bytes_is_swept_itself_and_a_small_one_is_not() {
        let before = one_row_prefetch();
        // 4096 × 4096 Q4_K: 9.25 MB a matrix; eight of them are above CALIBRATION_BYTES.
        let big: Vec<QuantMatrix> = (0..8)
            .map(|_| filled_matrix(Format::Q4K, 256, 4096))
            .collect();
        let refs: Vec<&QuantMatrix> = big.iter().collect();
        let swept: usize = big.iter().map(QuantMatrix::packed_bytes).sum();
        assert!(swept >= CALIBRATION_BYTES);
        let choice = calibrate(&refs);
        assert!(choice.model_weights);
        assert_eq!(choice.swept_bytes, swept);
        assert!(!choice.with_hints.is_zero() && !choice.without_hints.is_zero());

        let small = calibrate(&refs[..1]);
        assert!(!small.model_weights);
        assert!(small.swept_bytes >= CALIBRATION_BYTES);
        set_one_row_prefetch(before);
    }

    #[test]
    fn the_hints_change_no_result() {
        let (out_dim, in_dim) = (64, 512);
        let data: Vec<u8> = (0..out_dim * in_dim / 32)
            .flat_map(|b| {
                let mut block = vec![0u8; 34];
                block[..2].copy_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
                for (i, q) in block[2..].iter_mut().enumerate() {
                    *q = ((b * 31 + i * 7) % 255) as u8;
                }
                block
            })
            .collect();
        let m = QuantMatrix::from_gguf_bytes(
            candle_core::quantized::GgmlDType::Q8_0,
            &data,
            out_dim,
            in_dim,
        )
        .unwrap();
        let x: Vec<f32> = (0..in_dim).map(|i| (i as f32 * 0.37).sin()).collect();
        let (mut a, mut b) = (vec![0f32; out_dim], vec![0f32; out_dim]);
        let mut scratch = Scratch::new();
        let before = one_row_prefetch();
        set_one_row_prefetch(true);
        m.matmul(&x, &mut a, &mut scratch);
        set_one_row_prefetch(false);
        m.matmul(&x, &mut b, &mut scratch);
        set_one_row_prefetch(before);
        assert_eq!(a, b);
        assert!(a.iter().any(|&v| v != 0.0));
    }
}
