//! One `Sampler::sample` call over a Qwen-sized row of 151,936 logits.
//!
//! Two kinds of row: `peaked` looks like a language model's output (a handful of tokens well
//! above a noisy floor, so top-p 0.9 keeps a few tokens) and `flat` is standard-normal noise (the
//! worst case for top-p: the nucleus holds most of the vocabulary).

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use mtpx::sampling::{Sampler, SamplingParams, TokenHistory};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha20Rng;

const NUM_VOCAB: usize = 151_936;

/// Standard normal draws by Box–Muller.
fn normal_row(rng: &mut ChaCha20Rng, scale: f32) -> Vec<f32> {
    (0..NUM_VOCAB)
        .map(|_| {
            let (u, v): (f32, f32) = (rng.random_range(f32::EPSILON..1.0), rng.random());
            scale * (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos()
        })
        .collect()
}

fn rows() -> [(&'static str, Vec<f32>); 2] {
    let mut rng = ChaCha20Rng::seed_from_u64(0);
    let mut peaked = normal_row(&mut rng, 2.0);
    for (i, boost) in [18.0, 17.0, 16.5, 15.0, 14.0, 13.0, 12.0, 11.0]
        .iter()
        .enumerate()
    {
        peaked[(i * 7919 + 31) % NUM_VOCAB] = *boost;
    }
    let flat = normal_row(&mut rng, 1.0);
    [("peaked", peaked), ("flat", flat)]
}

fn bench_sampling(c: &mut Criterion) {
    let cases = [
        ("greedy", SamplingParams::greedy()),
        (
            "top_k_40",
            SamplingParams {
                top_k: 40,
                temperature: 0.8,
                ..SamplingParams::default()
            },
        ),
        (
            "top_p_0.9",
            SamplingParams {
                top_p: 0.9,
                ..SamplingParams::default()
            },
        ),
        (
            "top_p_0.9_penalties_logprobs",
            SamplingParams {
                top_p: 0.9,
                repetition_penalty: 1.1,
                presence_penalty: 0.5,
                frequency_penalty: 0.2,
                logprobs: true,
                top_logprobs: 5,
                ..SamplingParams::default()
            },
        ),
    ];
    let prompt: Vec<u32> = (0..4096u32).map(|i| i * 37 % NUM_VOCAB as u32).collect();
    let generated: Vec<u32> = (0..512u32).map(|i| i * 101 % NUM_VOCAB as u32).collect();
    let mut group = c.benchmark_group("sample_151936");
    for (row_name, row) in rows() {
        for (name, params) in &cases {
            let mut sampler = Sampler::new(SamplingParams {
                seed: Some(1),
                ..params.clone()
            })
            .expect("valid params");
            let history = TokenHistory::new(&prompt, &generated);
            group.bench_function(BenchmarkId::new(*name, row_name), |b| {
                b.iter(|| {
                    sampler
                        .sample(black_box(&row), &history)
                        .expect("samples")
                        .token
                })
            });
        }
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(20)
        .warm_up_time(std::time::Duration::from_millis(500))
        .measurement_time(std::time::Duration::from_secs(2));
    targets = bench_sampling
}
criterion_main!(benches);
