//! CPU matmul kernels against an f64 reference, on every format and every dispatch path.
//!
//! Two references per case, both from candle's own dequantisation of the weights:
//! - `loose`: the activations exactly as given, in f64. The kernels quantise activations to
//!   int8 per 32 (Q8_0, Q4_1) or per 256 (Q4_K, Q6_K) with step d = max|x| / 127, rounding to
//!   nearest, so per output |ours − ref| ≤ Σ_blocks d/2 · Σₖ |wₖ| (plus the f32 rounding below).
//!   Where there are enough outputs for it to be a stable statistic (≥ 64), the relative L2
//!   error ‖ours − ref‖ / ‖ref‖ must also stay below `LOOSE_REL_L2` (1.5e-2; about 6e-3 is
//!   typical). With a handful of outputs a near-zero dot product makes that ratio meaningless.
//! - `tight`: the same int8 activation quantisation applied first, then f64. What is left is
//!   f32 rounding: per output, |ours − ref| ≤ 4e-7 · (num_blocks + 16) · Σₖ |wₖ · xₖ|.
//!
//! Every supported path must give bit-identical outputs, and row r of a batch must equal the
//! row computed alone, to the bit.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use mtpx::kernels::{quantize_block, Dispatch, QuantMatrix, Scratch};
use proptest::prelude::*;
use proptest::test_runner::RngSeed;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const LOOSE_REL_L2: f64 = 1.5e-2;
const FORMATS: [GgmlDType; 7] = [
    GgmlDType::Q8_0,
    GgmlDType::Q5_0,
    GgmlDType::Q4_1,
    GgmlDType::Q4K,
    GgmlDType::Q6K,
    GgmlDType::F16,
    GgmlDType::F32,
];

/// Roughly normal values with a per-row spread, like real weights and hidden states.
fn random_values(n: usize, row_len: usize, seed: u64) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut out = Vec::with_capacity(n);
    for _ in 0..n / row_len {
        let spread: f32 = rng.random_range(0.2..2.0);
        for _ in 0..row_len {
            let v: f32 = (0..4).map(|_| rng.random_range(-1.0f32..1.0)).sum();
            out.push(v * spread);
        }
    }
    out
}

/// Weights quantised to `dtype` by candle and the same weights dequantised by candle.
fn weights(dtype: GgmlDType, out_dim: usize, in_dim: usize, seed: u64) -> (QTensor, Vec<f32>) {
    let values = random_values(out_dim * in_dim, in_dim, seed);
    let t = Tensor::from_vec(values, (out_dim, in_dim), &Device::Cpu).unwrap();
    let q = QTensor::quantize(&t, dtype).unwrap();
    let deq = q.dequantize(&Device::Cpu).unwrap();
    (q, deq.flatten_all().unwrap().to_vec1().unwrap())
}

/// The activations the kernels see after their int8 quantisation.
fn quantized_acts(dtype: GgmlDType, x: &[f32]) -> Vec<f32> {
    let block = match dtype {
        GgmlDType::Q4K | GgmlDType::Q6K => 256,
        GgmlDType::F16 | GgmlDType::F32 => return x.to_vec(),
        _ => 32,
    };
    let mut q = vec![0i8; block];
    let mut out = Vec::with_capacity(x.len());
    for xb in x.chunks(block) {
        let d = quantize_block(xb, &mut q);
        out.extend(q.iter().map(|&q| d * q as f32));
    }
    out
}

/// Per output, the worst case of int8 activation rounding: Σ_blocks (max|x_b| / 254) · Σ_{k∈b} |wₖ|.
fn activation_rounding_bound(dtype: GgmlDType, w: &[f32], x: &[f32], in_dim: usize) -> Vec<f64> {
    let block = match dtype {
        GgmlDType::F16 | GgmlDType::F32 => return vec![0.0; x.len() / in_dim * w.len() / in_dim],
        _ => block_len(dtype),
    };
    let mut out = Vec::new();
    for xr in x.chunks(in_dim) {
        for wr in w.chunks(in_dim) {
            let bound: f64 = xr
                .chunks(block)
                .zip(wr.chunks(block))
                .map(|(xb, wb)| {
                    let half_step = xb.iter().fold(0f64, |m, &v| m.max(v.abs() as f64)) / 254.0;
                    half_step * wb.iter().map(|&v| v.abs() as f64).sum::<f64>()
                })
                .sum();
            out.push(bound);
        }
    }
    out
}

/// `[num_rows, out_dim]` in f64, and per output Σₖ |wₖ · xₖ| (the scale of rounding error).
fn reference(w: &[f32], x: &[f32], in_dim: usize) -> (Vec<f64>, Vec<f64>) {
    let mut out = Vec::new();
    let mut mag = Vec::new();
    for xr in x.chunks(in_dim) {
        for wr in w.chunks(in_dim) {
            let (mut s, mut m) = (0f64, 0f64);
            for (&a, &b) in wr.iter().zip(xr) {
                s += a as f64 * b as f64;
                m += (a as f64 * b as f64).abs();
            }
            out.push(s);
            mag.push(m);
        }
    }
    (out, mag)
}

fn run(m: &QuantMatrix, path: Dispatch, x: &[f32]) -> Vec<f32> {
    let mut out = vec![f32::NAN; x.len() / m.in_dim() * m.out_dim()];
    m.matmul_with(path, x, &mut out, &mut Scratch::new());
    out
}

fn block_len(dtype: GgmlDType) -> usize {
    match dtype {
        GgmlDType::Q4K | GgmlDType::Q6K => 256,
        GgmlDType::F16 | GgmlDType::F32 => 1,
        _ => 32,
    }
}

/// Checks one shape on every supported path against both references.
fn check_case(dtype: GgmlDType, num_rows: usize, out_dim: usize, in_dim: usize, seed: u64) {
    let (q, w) = weights(dtype, out_dim, in_dim, seed);
    let m = QuantMatrix::from_qtensor(&q).unwrap();
    let x = random_values(num_rows * in_dim, in_dim, seed ^ 0x5eed);
    let (loose, _) = reference(&w, &x, in_dim);
    let (tight, mag) = reference(&w, &quantized_acts(dtype, &x), in_dim);
    let num_blocks = in_dim / block_len(dtype);
    let scalar = run(&m, Dispatch::Scalar, &x);
    let case = format!("{dtype:?} rows={num_rows} out={out_dim} in={in_dim}");
    for (i, (&ours, (&t, &mag))) in scalar.iter().zip(tight.iter().zip(&mag)).enumerate() {
        let bound = 4e-7 * (num_blocks + 16) as f64 * mag + 1e-30;
        assert!(
            (ours as f64 - t).abs() <= bound,
            "{case}: out[{i}] = {ours}, tight ref {t}"
        );
    }
    let act_bound = activation_rounding_bound(dtype, &w, &x, in_dim);
    for (i, (&ours, (&r, (&ab, &mag)))) in scalar
        .iter()
        .zip(loose.iter().zip(act_bound.iter().zip(&mag)))
        .enumerate()
    {
        let bound = ab * (1.0 + 1e-5) + 4e-7 * (num_blocks + 16) as f64 * mag + 1e-30;
        assert!(
            (ours as f64 - r).abs() <= bound,
            "{case}: out[{i}] = {ours}, f64 ref {r}, off by more than int8 activations allow ({bound:.3e})"
        );
    }
    if scalar.len() >= 64 {
        let err: f64 = scalar
            .iter()
            .zip(&loose)
            .map(|(&o, &r)| (o as f64 - r).powi(2))
            .sum();
        let norm: f64 = loose.iter().map(|r| r * r).sum();
        let rel = (err / norm).sqrt();
        assert!(
            rel <= LOOSE_REL_L2,
            "{case}: relative L2 error {rel:.2e} vs the f64 reference"
        );
    }
    for path in Dispatch::supported() {
        let got = run(&m, path, &x);
        assert!(
            bitwise_eq(&got, &scalar),
            "{case}: {path:?} differs from Scalar"
        );
    }
}

fn bitwise_eq(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// A typical `in_dim` for the format: 896 (Qwen 0.5B hidden) where blocks allow it.
fn usual_in_dim(dtype: GgmlDType) -> usize {
    match dtype {
        GgmlDType::Q4K | GgmlDType::Q6K => 1536,
        _ => 896,
    }
}

#[test]
fn every_format_matches_the_reference_for_1_to_17_rows() {
    for (f, dtype) in FORMATS.into_iter().enumerate() {
        for num_rows in 1..=17 {
            check_case(
                dtype,
                num_rows,
                37,
                usual_in_dim(dtype),
                (f * 100 + num_rows) as u64,
            );
        }
    }
}

#[test]
fn every_format_matches_the_reference_for_64_and_512_rows() {
    for (f, dtype) in FORMATS.into_iter().enumerate() {
        check_case(dtype, 64, 45, usual_in_dim(dtype), 7000 + f as u64);
        check_case(dtype, 512, 33, usual_in_dim(dtype), 8000 + f as u64);
    }
}

#[test]
fn a_single_block_and_long_rows_match_the_reference() {
    for (f, dtype) in FORMATS.into_iter().enumerate() {
        let single = block_len(dtype).max(32);
        check_case(dtype, 3, 19, single, 9000 + f as u64);
        check_case(dtype, 2, 21, 4864, 9100 + f as u64);
        check_case(dtype, 2, 13, 8960, 9200 + f as u64);
    }
}

#[test]
fn very_narrow_matrices_match_the_reference() {
    for (f, dtype) in FORMATS.into_iter().enumerate() {
        check_case(dtype, 5, 1, usual_in_dim(dtype), 9300 + f as u64);
        check_case(dtype, 9, 3, usual_in_dim(dtype), 9400 + f as u64);
    }
}

#[test]
fn a_row_in_a_batch_equals_the_row_alone() {
    for (f, dtype) in FORMATS.into_iter().enumerate() {
        let in_dim = usual_in_dim(dtype);
        let (q, _) = weights(dtype, 53, in_dim, 9500 + f as u64);
        let m = QuantMatrix::from_qtensor(&q).unwrap();
        for num_rows in [9, 40] {
            let x = random_values(num_rows * in_dim, in_dim, 9600 + f as u64);
            for path in Dispatch::supported() {
                let batch = run(&m, path, &x);
                for (r, xr) in x.chunks(in_dim).enumerate() {
                    let alone = run(&m, path, xr);
                    let in_batch = &batch[r * 53..(r + 1) * 53];
                    assert!(bitwise_eq(&alone, in_batch), "{dtype:?} {path:?} row {r}");
                }
            }
        }
    }
}

/// The 151936 × 896 output projection, as random Q8_0 blocks (built directly: quantising
/// 136 M floats through candle would dominate the test). Reference: the blocks in f64.
#[test]
fn the_wide_output_projection_matches_on_every_path() {
    let (out_dim, in_dim) = (151_936, 896);
    let mut rng = ChaCha8Rng::seed_from_u64(42);
    let num_blocks = out_dim * in_dim / 32;
    let mut bytes = Vec::with_capacity(num_blocks * 34);
    for _ in 0..num_blocks {
        let d = half::f16::from_f32(rng.random_range(0.001f32..0.02));
        bytes.extend_from_slice(&d.to_le_bytes());
        bytes.extend((0..32).map(|_| rng.random_range(-127i8..=127) as u8));
    }
    let m = QuantMatrix::from_gguf_bytes(GgmlDType::Q8_0, &bytes, out_dim, in_dim).unwrap();
    let x = random_values(2 * in_dim, in_dim, 43);
    let xq = quantized_acts(GgmlDType::Q8_0, &x);
    let scalar = run(&m, Dispatch::Scalar, &x);
    for (j, block_row) in bytes.chunks(34 * in_dim / 32).enumerate().step_by(97) {
        for (r, xr) in xq.chunks(in_dim).enumerate() {
            let (mut s, mut mag) = (0f64, 0f64);
            for (blk, xb) in block_row.chunks(34).zip(xr.chunks(32)) {
                let d = half::f16::from_le_bytes([blk[0], blk[1]]).to_f64();
                for (&q, &xv) in blk[2..].iter().zip(xb) {
                    s += d * (q as i8) as f64 * xv as f64;
                    mag += (d * (q as i8) as f64 * xv as f64).abs();
                }
            }
            let ours = scalar[r * out_dim + j] as f64;
            assert!(
                (ours - s).abs() <= 4e-7 * 44.0 * mag,
                "row {r} out {j}: {ours} vs {s}"
            );
        }
    }
    for path in Dispatch::supported() {
        assert!(
            bitwise_eq(&run(&m, path, &x), &scalar),
            "{path:?} differs from Scalar"
        );
    }
}

/// Q4_K blocks whose sub-block sums reach their extremes: every weight 0 or every weight 15
/// (scales and mins all 63) against activations all at ±127 after quantisation, 1 to 10 rows
/// (each kernel width). The AVX-512 kernel sums `Σ (u − 8) · x` in 16 bits (|Σ| ≤ 32 · 8 · 127);
/// were that bound wrong, it would differ from the scalar path here. Reference: the blocks
/// decoded by hand in f64 (`w = d · 63 · u − dmin · 63`).
#[test]
fn q4k_sub_block_sums_at_their_extremes_match_on_every_path() {
    let in_dim = 512;
    let (d, dmin) = (half::f16::from_f32(0.25), half::f16::from_f32(0.5));
    // Weight rows: every nibble 0, every nibble 15, and 0/15 alternating by byte.
    let nibbles = [0x00u8, 0xFF, 0x0F];
    let mut bytes = Vec::new();
    let mut w = Vec::new();
    for &q in &nibbles {
        for _ in 0..in_dim / 256 {
            bytes.extend_from_slice(&d.to_le_bytes());
            bytes.extend_from_slice(&dmin.to_le_bytes());
            bytes.extend_from_slice(&[0xFF; 12]); // every 6-bit scale and min is 63
            bytes.extend_from_slice(&[q; 128]);
            // Byte k of a 32-byte chunk holds weight k (low nibble) and weight k + 32.
            for _chunk in 0..4 {
                for u in [q & 0x0F, q >> 4] {
                    let weight = d.to_f64() * 63.0 * u as f64 - dmin.to_f64() * 63.0;
                    w.extend(std::iter::repeat_n(weight, 32));
                }
            }
        }
    }
    let out_dim = nibbles.len();
    let m = QuantMatrix::from_gguf_bytes(GgmlDType::Q4K, &bytes, out_dim, in_dim).unwrap();
    check_extremes(&m, &w, in_dim);
}

/// Q6_K blocks at their extremes: every weight 0 or every weight 63 (`q − 32` = −32 or 31),
/// sub-block scales alternating 127 and −128, against activations all at ±127, 1 to 10 rows
/// (each kernel width): every path equals the scalar one bit for bit, and the scalar one
/// `w = d · sc · (q − 32)` in f64.
#[test]
fn q6k_weights_and_scales_at_their_extremes_match_on_every_path() {
    let in_dim = 512;
    let d = half::f16::from_f32(0.125);
    let scales: Vec<i8> = (0..16)
        .map(|s| if s % 2 == 0 { 127 } else { -128 })
        .collect();
    let mut bytes = Vec::new();
    let mut w = Vec::new();
    for fill in [0x00u8, 0xFF] {
        let q = if fill == 0 { 0.0 } else { 63.0 };
        for _ in 0..in_dim / 256 {
            bytes.extend_from_slice(&[fill; 128 + 64]); // ql, qh
            bytes.extend(scales.iter().map(|&s| s as u8));
            bytes.extend_from_slice(&d.to_le_bytes());
            for k in 0..256 {
                w.push(d.to_f64() * scales[k / 16] as f64 * (q - 32.0));
            }
        }
    }
    let out_dim = 2;
    let m = QuantMatrix::from_gguf_bytes(GgmlDType::Q6K, &bytes, out_dim, in_dim).unwrap();
    check_extremes(&m, &w, in_dim);
}

/// Activation rows cycling through all −1, all +1 and alternating signs, 1 to 10 rows: the
/// scalar path against `w` (`[out_dim, in_dim]`) in f64, every path bit for bit against scalar.
fn check_extremes(m: &QuantMatrix, w: &[f64], in_dim: usize) {
    let out_dim = w.len() / in_dim;
    let patterns: [fn(usize) -> f32; 3] =
        [|_| -1.0, |_| 1.0, |k| if k % 2 == 0 { 1.0 } else { -1.0 }];
    for num_rows in 1..=10 {
        let x: Vec<f32> = (0..num_rows * in_dim)
            .map(|i| patterns[(i / in_dim) % 3](i % in_dim))
            .collect();
        let scalar = run(m, Dispatch::Scalar, &x);
        for (r, xr) in x.chunks(in_dim).enumerate() {
            for (o, wr) in w.chunks(in_dim).enumerate() {
                let exact: f64 = wr.iter().zip(xr).map(|(&a, &b)| a * b as f64).sum();
                let mag: f64 = wr.iter().zip(xr).map(|(&a, &b)| (a * b as f64).abs()).sum();
                let got = scalar[r * out_dim + o] as f64;
                assert!(
                    (got - exact).abs() <= 1e-5 * mag,
                    "row {r} weights {o}: {got} vs {exact}"
                );
            }
        }
        for path in Dispatch::supported() {
            let got = run(m, path, &x);
            assert!(
                bitwise_eq(&got, &scalar),
                "{num_rows} rows: {path:?} differs from Scalar"
            );
        }
    }
}

/// The comparisons above cover a SIMD path only if it is detected: a detection failure must not
/// pass as "Scalar agrees with itself". `tests/run.sh` names the best path it expects from the
/// (emulated) CPU in `MTPX_EXPECT_BEST_KERNEL`.
#[test]
fn the_expected_paths_are_detected() {
    if let Ok(name) = std::env::var("MTPX_EXPECT_BEST_KERNEL") {
        let expected = Dispatch::parse(&name).expect("MTPX_EXPECT_BEST_KERNEL names a path");
        assert_eq!(Dispatch::best(), expected);
    }
    if cfg!(target_arch = "aarch64") {
        assert!(Dispatch::supported().contains(&Dispatch::Neon));
    }
}

/// Which paths the comparisons above ran on this CPU and which it cannot run, for the CI log
/// (`tests/run.sh` runs this with `--nocapture`): an AVX2-only host must say that it skipped the
/// AVX-512 paths, not pass silently. An AVX-512 host runs the AVX2 path too.
#[test]
fn paths_on_this_cpu() {
    let name = |d: &Dispatch| format!("{d:?}").to_lowercase();
    let (ran, skipped): (Vec<Dispatch>, Vec<Dispatch>) =
        Dispatch::ALL.into_iter().partition(|d| d.is_supported());
    println!(
        "matmul kernel paths tested: {}; not on this CPU: {}",
        ran.iter().map(name).collect::<Vec<_>>().join(" "),
        skipped.iter().map(name).collect::<Vec<_>>().join(" ")
    );
    assert_eq!(ran, Dispatch::supported());
    if Dispatch::supported().contains(&Dispatch::Avx512) {
        assert!(
            ran.contains(&Dispatch::Avx2),
            "an AVX-512 host tests AVX2 as well"
        );
    }
}

#[test]
fn unsupported_formats_are_named() {
    let t = Tensor::zeros((4, 256), candle_core::DType::F32, &Device::Cpu).unwrap();
    let q = QTensor::quantize(&t, GgmlDType::Q3K).unwrap();
    let err = QuantMatrix::from_qtensor(&q).unwrap_err().to_string();
    assert!(err.contains("Q3K"), "{err}");
}

#[test]
fn forcing_a_path_is_refused_only_when_the_cpu_lacks_it() {
    for path in Dispatch::ALL {
        assert_eq!(Dispatch::force(Some(path)).is_ok(), path.is_supported());
    }
    Dispatch::force(None).unwrap();
    assert!(Dispatch::active().is_supported());
}

#[test]
fn zero_rows_is_a_no_op_and_scratch_is_reused_across_shapes() {
    let (q, w) = weights(GgmlDType::Q8_0, 20, 64, 1);
    let m = QuantMatrix::from_qtensor(&q).unwrap();
    let mut scratch = Scratch::new();
    m.matmul(&[], &mut [], &mut scratch);
    for num_rows in [7, 1, 30, 2] {
        let x = random_values(num_rows * 64, 64, num_rows as u64);
        let mut out = vec![0f32; num_rows * 20];
        m.matmul(&x, &mut out, &mut scratch);
        assert!(bitwise_eq(&out, &run(&m, Dispatch::Scalar, &x)));
        let (r, _) = reference(&w, &x, 64);
        assert!((out[0] as f64 - r[0]).abs() < 0.05 * r[0].abs().max(1.0));
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 48,
        rng_seed: RngSeed::Fixed(0x6b65726e),
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn small_random_shapes_agree_on_every_path(
        f in 0usize..FORMATS.len(),
        num_rows in 1usize..20,
        out_dim in 1usize..40,
        num_blocks in 1usize..4,
        seed in 0u64..1000,
    ) {
        let dtype = FORMATS[f];
        let in_dim = num_blocks * block_len(dtype).max(32);
        check_case(dtype, num_rows, out_dim, in_dim, seed);
    }
}
