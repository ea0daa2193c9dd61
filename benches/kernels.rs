//! CPU matmul kernels vs candle's `QMatMul`, per format, on the Qwen2.5-Coder 0.5B/1.5B shapes,
//! at 1 (decode), 9 (a verify step: 1 + 8 drafts) and 512 (prefill) rows; plus the machine's
//! read bandwidth (`bandwidth/sum_512MB`), the bound every decode kernel is measured against.
//!
//! Throughput is weight bytes streamed per call (the packed matrix), so for 1 and 9 rows it
//! reads directly against the measured bandwidth. mtpx cycles through copies of each matrix
//! totalling 128 MB, so its weights come from DRAM as in a real forward pass; candle gets one
//! copy (it is compute-bound, so this flatters it slightly). Groups are named `<format>/<out>x<in>`,
//! functions `mtpx/<rows>` and `candle/<rows>`; matrices of up to 8 MB also run one copy from cache
//! (`mtpx-cached/<rows>`, 1 and 9 rows), which shows how much of a call waits on DRAM.
//!
//! `MTPX_BENCH_FILTER=q4k,bandwidth` (substrings of group names) limits which are built;
//! `MTPX_BENCH_STREAM_MB` sets how much the streamed copies span (default 128).

use std::hint::black_box;
use std::time::Duration;

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use mtpx::kernels::{QuantMatrix, Scratch};
use rayon::prelude::*;

const ROWS: [usize; 3] = [1, 9, 512];

/// Weight bytes cycled through per matrix (4× a 32 MB L3), so timings include DRAM reads.
/// `MTPX_BENCH_STREAM_MB` sets it for machines with a larger L3: on a 2-vCPU Xeon VM reporting
/// 480 MB, 128 MB stayed in cache (one row of Q4_K read at 41 GB/s against 30 GB/s from DRAM);
/// 1536 MB gave DRAM figures.
const STREAM_BYTES: usize = 128 << 20;

/// Copies of a matrix that together span the stream: by default at most 64 (small matrices
/// then stay in a large L3, as the figures in BENCHMARKS.md were taken), as many as it takes
/// when `MTPX_BENCH_STREAM_MB` is set.
fn num_stream_copies(matrix_bytes: usize) -> usize {
    let set = std::env::var("MTPX_BENCH_STREAM_MB")
        .ok()
        .and_then(|mb| mb.parse::<usize>().ok());
    match set {
        Some(mb) => ((mb << 20) / matrix_bytes).max(1),
        None => (STREAM_BYTES / matrix_bytes).clamp(1, 64),
    }
}

/// Matrices up to this size also run from cache (`mtpx-cached/<rows>`): well inside a 32 MB L3.
const CACHED_BYTES: usize = 8 << 20;

/// Qwen2.5-Coder-0.5B: hidden 896, MLP 4864, KV 128, vocab 151936. K-quants need in % 256 == 0,
/// so for them the 0.5B file has only the down projection; the 1.5B (1536/8960/256) fills in.
const SHAPES_0_5B: [(usize, usize); 5] = [
    (4864, 896),
    (896, 4864),
    (896, 896),
    (128, 896),
    (151_936, 896),
];
const SHAPES_K: [(usize, usize); 4] = [(896, 4864), (8960, 1536), (1536, 8960), (256, 1536)];

/// Cheap deterministic pseudo-normal values (an LCG; quality is irrelevant to timing).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let a = ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5;
            let b = (((s >> 16) & 0xFF_FFFF) as f32 / (1u64 << 24) as f32) - 0.5;
            a + b
        })
        .collect()
}

/// Whether `MTPX_BENCH_FILTER` (comma-separated substrings; unset = all) selects `name`.
fn selected(name: &str) -> bool {
    std::env::var("MTPX_BENCH_FILTER").map_or(true, |filter| {
        let filter = filter.to_lowercase();
        filter.split(',').any(|f| name.contains(f.trim()))
    })
}

fn bench_matrix(c: &mut Criterion, dtype: GgmlDType, out_dim: usize, in_dim: usize) {
    let name = format!("{dtype:?}/{out_dim}x{in_dim}").to_lowercase();
    if !selected(&name) {
        return;
    }
    let w = Tensor::from_vec(values(out_dim * in_dim, 1), (out_dim, in_dim), &Device::Cpu).unwrap();
    let q = QTensor::quantize(&w, dtype).unwrap();
    drop(w);
    let started = std::time::Instant::now();
    let ours = QuantMatrix::from_qtensor(&q).unwrap();
    eprintln!(
        "{name}: repacked {} bytes in {:?}",
        ours.packed_bytes(),
        started.elapsed()
    );
    // Copies that together overflow the L3 cache, used in turn: decode streams from DRAM.
    let num_copies = num_stream_copies(ours.packed_bytes());
    let copies: Vec<QuantMatrix> = (0..num_copies).map(|_| ours.clone()).collect();
    let candle = QMatMul::from_qtensor(q).unwrap();

    let mut group = c.benchmark_group(&name);
    group.throughput(Throughput::Bytes(ours.packed_bytes() as u64));
    for num_rows in ROWS {
        if num_rows == 512 && out_dim > 100_000 {
            continue; // prefill computes logits for the last row only
        }
        let x = values(num_rows * in_dim, 2);
        let mut out = vec![0f32; num_rows * out_dim];
        let mut scratch = Scratch::new();
        let mut next = 0;
        group.bench_function(BenchmarkId::new("mtpx", num_rows), |b| {
            b.iter(|| {
                next = (next + 1) % copies.len();
                copies[next].matmul(black_box(&x), &mut out, &mut scratch)
            })
        });
        // The same call on one copy, which stays in the L3 (or L2) from call to call: against
        // `mtpx`, how much of a call is waiting on DRAM rather than computing.
        if num_rows < 512 && ours.packed_bytes() <= CACHED_BYTES {
            group.bench_function(BenchmarkId::new("mtpx-cached", num_rows), |b| {
                b.iter(|| copies[0].matmul(black_box(&x), &mut out, &mut scratch))
            });
        }
        let xt = Tensor::from_vec(x.clone(), (num_rows, in_dim), &Device::Cpu).unwrap();
        group.bench_function(BenchmarkId::new("candle", num_rows), |b| {
            b.iter(|| candle.forward(black_box(&xt)).unwrap())
        });
    }
    group.finish();
}

fn kernels(c: &mut Criterion) {
    // One-row calls prefetch or not as the server decides (`MTPX_PREFETCH=on|off|auto`).
    mtpx::kernels::choose_one_row_prefetch();
    for dtype in [
        GgmlDType::Q8_0,
        GgmlDType::Q5_0,
        GgmlDType::Q4_1,
        GgmlDType::F16,
    ] {
        for (out_dim, in_dim) in SHAPES_0_5B {
            if dtype == GgmlDType::F16 && out_dim > 100_000 {
                continue; // no model here stores its output projection in F16
            }
            bench_matrix(c, dtype, out_dim, in_dim);
        }
    }
    for dtype in [GgmlDType::Q4K, GgmlDType::Q6K] {
        for (out_dim, in_dim) in SHAPES_K {
            bench_matrix(c, dtype, out_dim, in_dim);
        }
    }
}

/// Sums 512 MB of u64 on all of rayon's threads: the read bandwidth decode is bounded by.
fn bandwidth(c: &mut Criterion) {
    if !selected("bandwidth") {
        return;
    }
    let data: Vec<u64> = (0..(512usize << 20) / 8).map(|i| i as u64).collect();
    let mut group = c.benchmark_group("bandwidth");
    group.throughput(Throughput::Bytes((data.len() * 8) as u64));
    group.bench_function("sum_512MB", |b| {
        b.iter(|| {
            data.par_chunks(1 << 16)
                .map(|chunk| chunk.iter().fold(0u64, |s, &v| s.wrapping_add(v)))
                .reduce(|| 0, u64::wrapping_add)
        })
    });
    // The same with a software prefetch 4 KB ahead, as the kernels do: the hardware
    // prefetchers alone do not reach the limit on every machine.
    #[cfg(target_arch = "x86_64")]
    group.bench_function("sum_512MB_prefetched", |b| {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        b.iter(|| {
            data.par_chunks(1 << 16)
                .map(|chunk| {
                    let mut s = 0u64;
                    // 512 bytes (8 lines) at a time: 8 prefetches, then a vectorised sum.
                    for (i, block) in chunk.chunks(64).enumerate() {
                        for line in 0..8 {
                            let ahead = chunk.as_ptr().wrapping_add(64 * i + 8 * line + 512);
                            // SAFETY: a prefetch is a hint; it never faults, even past the end.
                            unsafe { _mm_prefetch::<_MM_HINT_T0>(ahead.cast()) };
                        }
                        s = block.iter().fold(s, |s, &v| s.wrapping_add(v));
                    }
                    s
                })
                .reduce(|| 0, u64::wrapping_add)
        })
    });
    group.finish();
}

fn config() -> Criterion {
    Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
}

criterion_group! {
    name = benches;
    config = config();
    targets = bandwidth, kernels
}
criterion_main!(benches);
