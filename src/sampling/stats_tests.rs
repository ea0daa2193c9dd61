//! Goodness-of-fit tests: the sampler's draws follow the distribution it claims.
//!
//! Each test draws N = 200,000 tokens from a fixed 10-token row and computes Pearson's
//! chi-square statistic against the exact (f64) probabilities. A correct sampler passes when the
//! p-value is above `ALPHA` = 1e-6, so it fails by chance with probability < 1e-6 (for 9 degrees
//! of freedom the critical value is 44.81). Power: moving 2% of the most likely token's mass
//! (0.0070) to the second one gives a noncentrality λ = N·Σδ²/p = 73.8 and is detected with
//! probability 0.992; moving it to any less likely token, or shifting 2 percentage points, gives
//! λ > 230 and is detected with probability > 1 − 1e-12. `shifted_distribution_is_rejected`
//! shows the statistic does reject such a shift on real draws, so these tests can fail.

use rand::SeedableRng;
use rand_chacha::ChaCha20Rng;

use super::{Distribution, Sampler, SamplingParams, TokenHistory};

const N: usize = 200_000;
const ALPHA: f64 = 1e-6;
const ROW: [f32; 10] = [2.0, 1.5, 1.0, 0.8, 0.5, 0.0, -0.3, -0.7, -1.0, -2.0];

/// Exact softmax of `ROW` at temperature `t`.
fn softmax(t: f64) -> Vec<f64> {
    let exps: Vec<f64> = ROW.iter().map(|&l| (l as f64 / t).exp()).collect();
    let sum: f64 = exps.iter().sum();
    exps.iter().map(|e| e / sum).collect()
}

/// Draw counts per token from `N` calls to `Sampler::sample` on `ROW`.
fn sampled_counts(params: SamplingParams) -> Vec<u64> {
    let mut sampler = Sampler::new(params).unwrap();
    let mut counts = vec![0u64; ROW.len()];
    for _ in 0..N {
        counts[sampler.sample(&ROW, &TokenHistory::EMPTY).unwrap().token as usize] += 1;
    }
    counts
}

/// Pearson's statistic over the tokens with `expected > 0`, and its degrees of freedom. Panics if
/// any draw hit a token with expected probability 0.
fn chi_square(counts: &[u64], expected: &[f64]) -> (f64, usize) {
    let mut stat = 0.0;
    let mut categories = 0;
    for (&c, &p) in counts.iter().zip(expected) {
        if p == 0.0 {
            assert_eq!(c, 0, "drew a token with probability 0");
            continue;
        }
        let e = p * N as f64;
        stat += (c as f64 - e).powi(2) / e;
        categories += 1;
    }
    (stat, categories - 1)
}

/// The chi-square upper tail `P(X ≥ stat)` for `df` degrees of freedom.
fn p_value(stat: f64, df: usize) -> f64 {
    upper_regularized_gamma(df as f64 / 2.0, stat / 2.0)
}

/// `Q(a, x) = Γ(a, x) / Γ(a)` (Numerical Recipes: series below a + 1, continued fraction above).
fn upper_regularized_gamma(a: f64, x: f64) -> f64 {
    let prefactor = (-x + a * x.ln() - ln_gamma(a)).exp();
    if x < a + 1.0 {
        let (mut term, mut sum, mut n) = (1.0 / a, 1.0 / a, a);
        while term.abs() > sum.abs() * 1e-16 {
            n += 1.0;
            term *= x / n;
            sum += term;
        }
        return 1.0 - sum * prefactor;
    }
    let tiny = 1e-300;
    let (mut b, mut c, mut d) = (x + 1.0 - a, 1.0 / tiny, 1.0 / (x + 1.0 - a));
    let mut h = d;
    for i in 1..10_000 {
        let an = -(i as f64) * (i as f64 - a);
        b += 2.0;
        d = an * d + b;
        d = if d.abs() < tiny { tiny } else { d };
        c = b + an / c;
        c = if c.abs() < tiny { tiny } else { c };
        d = 1.0 / d;
        h *= d * c;
        if (d * c - 1.0).abs() < 1e-16 {
            break;
        }
    }
    prefactor * h
}

/// Lanczos approximation (g = 7, n = 9), accurate to ~1e-15 for a > 0.
fn ln_gamma(a: f64) -> f64 {
    const COEF: [f64; 9] = [
        0.999_999_999_999_809_9,
        676.520_368_121_885_1,
        -1_259.139_216_722_402_8,
        771.323_428_777_653_1,
        -176.615_029_162_140_6,
        12.507_343_278_686_905,
        -0.138_571_095_265_720_12,
        9.984_369_578_019_572e-6,
        1.505_632_735_149_311_6e-7,
    ];
    let a = a - 1.0;
    let t = a + 7.5;
    let series: f64 = COEF[0] + (1..9).map(|i| COEF[i] / (a + i as f64)).sum::<f64>();
    0.5 * (2.0 * std::f64::consts::PI).ln() + (a + 0.5) * t.ln() - t + series.ln()
}

/// `p` with `fraction` of token `from`'s mass moved to token `to`.
fn shifted(p: &[f64], from: usize, to: usize, fraction: f64) -> Vec<f64> {
    let mut q = p.to_vec();
    let delta = p[from] * fraction;
    q[from] -= delta;
    q[to] += delta;
    q
}

#[test]
fn p_value_matches_closed_forms() {
    // df = 2: P = exp(-x/2); df = 1: P = erfc(sqrt(x/2)); the 1e-6 critical value for df = 9.
    assert!((p_value(3.0, 2) - (-1.5f64).exp()).abs() < 1e-12);
    assert!((p_value(2.0, 1) - 0.157_299_207_050_285_13).abs() < 1e-12);
    assert!((p_value(44.810_937_870_687_8, 9) / 1e-6 - 1.0).abs() < 1e-6);
    assert!((p_value(0.5, 4) - (-0.25f64).exp() * 1.25).abs() < 1e-12);
}

#[test]
fn temperature_one_draws_match_the_softmax() {
    let counts = sampled_counts(SamplingParams {
        seed: Some(11),
        ..SamplingParams::default()
    });
    let (stat, df) = chi_square(&counts, &softmax(1.0));
    assert_eq!(df, 9);
    assert!(
        p_value(stat, df) > ALPHA,
        "chi2 = {stat:.2}, counts {counts:?}"
    );
}

#[test]
fn shifted_distribution_is_rejected() {
    let counts = sampled_counts(SamplingParams {
        seed: Some(11),
        ..SamplingParams::default()
    });
    let p = softmax(1.0);
    // The hardest 2% shift of token 0's mass: onto the next most likely token (λ = 73.8).
    for to in [1, 5, 9] {
        let (stat, df) = chi_square(&counts, &shifted(&p, 0, to, 0.02));
        assert!(
            p_value(stat, df) < ALPHA,
            "shift to {to} not detected: chi2 = {stat:.2}"
        );
    }
}

#[test]
fn top_p_draws_match_the_renormalised_nucleus() {
    let p = softmax(1.0);
    // Cumulative mass: 0.349, 0.560, 0.688, 0.793, 0.871, 0.918 → the nucleus is tokens 0..6.
    let kept: f64 = p[..6].iter().sum();
    let nucleus: Vec<f64> = (0..10)
        .map(|i| if i < 6 { p[i] / kept } else { 0.0 })
        .collect();
    let params = SamplingParams {
        top_p: 0.9,
        seed: Some(12),
        ..SamplingParams::default()
    };
    let counts = sampled_counts(params);
    let (stat, df) = chi_square(&counts, &nucleus);
    assert_eq!(df, 5);
    assert!(
        p_value(stat, df) > ALPHA,
        "chi2 = {stat:.2}, counts {counts:?}"
    );
    let (stat, df) = chi_square(&counts, &shifted(&nucleus, 0, 1, 0.02));
    assert!(
        p_value(stat, df) < ALPHA,
        "shift not detected: chi2 = {stat:.2}"
    );
}

#[test]
fn distribution_draws_with_the_sampler_rng_match_top_k_at_low_temperature() {
    let params = SamplingParams {
        top_k: 4,
        temperature: 0.7,
        seed: Some(13),
        ..SamplingParams::default()
    };
    let mut sampler = Sampler::new(params).unwrap();
    let dist: Distribution = sampler
        .final_distribution(&ROW, &TokenHistory::EMPTY)
        .unwrap();
    let mut counts = vec![0u64; ROW.len()];
    for _ in 0..N {
        counts[sampler.sample_distribution(&dist) as usize] += 1;
    }
    let p = softmax(0.7);
    let kept: f64 = p[..4].iter().sum();
    let expected: Vec<f64> = (0..10)
        .map(|i| if i < 4 { p[i] / kept } else { 0.0 })
        .collect();
    let (stat, df) = chi_square(&counts, &expected);
    assert!(
        p_value(stat, df) > ALPHA,
        "chi2 = {stat:.2}, counts {counts:?}"
    );
}

#[test]
fn distribution_sampling_is_reproducible_per_seed() {
    let draws = |seed| {
        let mut rng = ChaCha20Rng::seed_from_u64(seed);
        let dist =
            Distribution::from_weights(ROW.iter().enumerate().map(|(i, &l)| (i as u32, l.exp())));
        let dist = dist.unwrap();
        (0..100).map(|_| dist.sample(&mut rng)).collect::<Vec<_>>()
    };
    assert_eq!(draws(1), draws(1));
    assert_ne!(draws(1), draws(2));
}
