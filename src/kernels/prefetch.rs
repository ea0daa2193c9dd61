//! Whether one-row calls (decode steps) ask for the weight stream ahead in software.
//!
//! The x86 kernels prefetch the weights a few KB ahead of the line they read. On the quiet Zen 4
//! and Zen 5 hosts this took one-row matmuls from ~70% to ~87% of the read bandwidth; on a busy
//! Zen 4 host (2026-12-02) the same hints made 1.5B decode ~25% slower than the hardware
//! prefetchers alone (BENCHMARKS.md, "The Zen 4 again"). Which way a machine goes is measured
//! once per process, when the first model loads ([`choose_one_row_prefetch`]): a one-row matmul
//! over a matrix larger than the L3, with and without the hints, alternating. Calls of several
//! rows keep their hints: they spend several times longer per byte and need the line earlier.
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

/// What [`choose_one_row_prefetch`] decided, and from what.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrefetchChoice {
    pub one_row: bool,
    /// The fastest one-row call over the calibration matrix with and without the hints (zero
    /// when `MTPX_PREFETCH` decided).
    pub with_hints: Duration,
    pub without_hints: Duration,
}

/// Bytes of the calibration matrix: above a 32 MB L3 by enough that the calls stream from DRAM,
/// as a decode step does.
const CALIBRATION_BYTES: usize = 64 << 20;

/// Calls timed each way, alternating.
const CALIBRATION_ROUNDS: usize = 7;

/// Hints stay on unless the calls without them were at least this much faster: the hints are the
/// default that every earlier measurement was taken with, and a noisy calibration should not
/// flip it on a small difference.
const SWITCH_OFF_BELOW: f64 = 0.93;

/// Decides, once per process, whether one-row calls prefetch (see the module comment); later
/// calls return the first decision.
pub fn choose_one_row_prefetch() -> PrefetchChoice {
    static CHOICE: OnceLock<PrefetchChoice> = OnceLock::new();
    *CHOICE.get_or_init(|| {
        let fixed = |one_row| PrefetchChoice {
            one_row,
            with_hints: Duration::ZERO,
            without_hints: Duration::ZERO,
        };
        let choice = match std::env::var("MTPX_PREFETCH").as_deref().map(str::trim) {
            Ok("on") => fixed(true),
            Ok("off") => fixed(false),
            // Only the x86 kernels prefetch in software.
            _ if !cfg!(target_arch = "x86_64") => fixed(false),
            Ok("auto") | Err(_) => calibrate(),
            Ok(other) => {
                tracing::warn!("MTPX_PREFETCH={other}: expected on, off or auto; measuring");
                calibrate()
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

/// Times one-row calls over a Q8_0 matrix of [`CALIBRATION_BYTES`] with and without the hints.
fn calibrate() -> PrefetchChoice {
    let in_dim = 4096;
    let group_bytes = in_dim / Format::Q8_0.block_len() * Format::Q8_0.group_block_bytes();
    let num_groups = CALIBRATION_BYTES / group_bytes;
    // Every byte 1: the scales are small normal numbers once widened, the sums integers; the
    // values do not matter, only that the pages are really there (written, not the zero page).
    let mut packed = AlignedBuf::zeroed(num_groups * group_bytes);
    packed.fill(1);
    let matrix = QuantMatrix {
        format: Format::Q8_0,
        out_dim: num_groups * super::GROUP,
        in_dim,
        packed,
    };
    let x = vec![0.5f32; in_dim];
    let mut out = vec![0f32; matrix.out_dim];
    let mut scratch = Scratch::new();
    let mut time = |on: bool| {
        set_one_row_prefetch(on);
        let start = Instant::now();
        matrix.matmul(&x, &mut out, &mut scratch);
        start.elapsed()
    };
    // One untimed call each way faults nothing in (the buffer is written) but warms the pool.
    time(true);
    time(false);
    let (mut with_hints, mut without_hints) = (Duration::MAX, Duration::MAX);
    for _ in 0..CALIBRATION_ROUNDS {
        with_hints = with_hints.min(time(true));
        without_hints = without_hints.min(time(false));
    }
    let one_row = without_hints.as_secs_f64() >= SWITCH_OFF_BELOW * with_hints.as_secs_f64();
    PrefetchChoice {
        one_row,
        with_hints,
        without_hints,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
