//! The verifier: given the target's logits for the pending token and each draft token, decides
//! which drafts are accepted and which token comes after them. Pure: no actors, no model.
//!
//! Words used throughout `spec/`: a *draft* token is proposed by a drafter; it is *accepted* when
//! verification keeps it and *rejected* otherwise; after the accepted run one more token is
//! always produced by the target itself: the *bonus* token when every draft was accepted, the
//! *correction* token when a draft was rejected.
//!
//! - Greedy: a draft is accepted iff it equals the target's argmax (after bias and penalties,
//!   with the accepted drafts before it in the history), so the output is plain greedy decoding.
//! - Sampled, [`Verification::Coupled`]: each row is sampled exactly as plain decoding samples
//!   it (same sampler, same RNG draws) and a draft is accepted iff it equals that sample. The
//!   output is then plain sampling's, token for token, for the sequence's seed: drafters, depths,
//!   the draft model's cost guard and batching cannot change it. For a deterministic drafter
//!   (n-gram, predicted outputs: `q` one-hot) this accepts `x` with probability `p(x)` and
//!   otherwise yields a draw from `p` without `x`: the same law as rejection sampling.
//! - Sampled, [`Verification::Rejection`]: rejection sampling (Leviathan et al. 2023, Chen et
//!   al. 2023): accept draft `x` with probability `min(1, p(x)/q(x))`; on rejection draw from
//!   `norm((p − q)+)`. For a drafter with its own distribution `q` this accepts more often than
//!   coupling (`Σ min(p, q)` against `Σ p·q`), but which token comes out depends on whether a
//!   position was drafted. The committed tokens are distributed exactly as `p` either way.

use crate::sampling::{Distribution, SampleOutput, Sampler, SamplingError, TokenHistory};
use rand::Rng;

/// How sampled rows are verified (greedy rows always compare with the argmax).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Verification {
    /// Sample each row as plain decoding does and accept a draft iff it is that sample.
    #[default]
    Coupled,
    /// Rejection sampling against the drafter's distribution.
    Rejection,
}

impl Verification {
    /// A request with a seed is coupled, so the seed reproduces its output whatever the drafters
    /// did; one without (nothing to reproduce) takes rejection sampling's higher acceptance.
    pub fn for_seed(seed: Option<u64>) -> Self {
        match seed {
            Some(_) => Verification::Coupled,
            None => Verification::Rejection,
        }
    }
}

/// What verification decided for one sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct Verdict {
    /// Accepted drafts followed by the bonus or correction token: `num_accepted + 1` tokens.
    pub emitted: Vec<SampleOutput>,
    pub num_accepted: usize,
}

/// Verifies `drafts` against the target's logits. `rows[i]` (`[num_vocab]`) are the logits that
/// follow the pending token (i = 0) or draft `i - 1`: `drafts.len() + 1` rows. `draft_probs[i]`
/// is the drafter's distribution `q` for draft `i`, or `None` for a deterministic drafter
/// (`q` is only read by [`Verification::Rejection`]).
pub fn verify(
    sampler: &mut Sampler,
    history: &TokenHistory,
    drafts: &[u32],
    draft_probs: Option<&[Distribution]>,
    rows: &[&[f32]],
    verification: Verification,
) -> Result<Verdict, SamplingError> {
    assert_eq!(rows.len(), drafts.len() + 1, "one logits row per draft + 1");
    let mut generated = history.generated.to_vec();
    let mut emitted = Vec::with_capacity(rows.len());
    let plain = sampler.params().is_greedy() || verification == Verification::Coupled;
    for (i, row) in rows.iter().enumerate() {
        let h = TokenHistory::new(history.prompt, &generated);
        let draft = drafts.get(i).copied();
        let out = if plain {
            sampler.sample(row, &h)?
        } else {
            let p = sampler.final_distribution(row, &h)?;
            let token = match draft {
                None => sampler.sample_distribution(&p),
                Some(x) => {
                    let q = draft_probs.map(|d| d[i].clone());
                    accept_or_resample(sampler, &p, x, q)
                }
            };
            let out = sampler.output_for(row, &h, token)?;
            sampler.consume(token)?;
            out
        };
        let accepted = draft == Some(out.token);
        generated.push(out.token);
        emitted.push(out);
        if !accepted {
            break;
        }
    }
    let num_accepted = emitted.len() - 1;
    Ok(Verdict {
        emitted,
        num_accepted,
    })
}

/// One rejection-sampling decision for draft `x`: `x` itself, or a draw from the residual.
fn accept_or_resample(
    sampler: &mut Sampler,
    p: &Distribution,
    x: u32,
    q: Option<Distribution>,
) -> u32 {
    let q = q.unwrap_or_else(|| Distribution::greedy(x));
    let q_x = q.prob(x);
    let p_x = p.prob(x);
    let u: f64 = sampler.rng_mut().random();
    if q_x > 0.0 && u < (p_x as f64 / q_x as f64) {
        return x;
    }
    match p.residual(&q) {
        Some(residual) => residual.sample(sampler.rng_mut()),
        // p ≤ q everywhere means p == q: acceptance was certain, so this is float dust.
        None => x,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::SamplingParams;
    use rand::SeedableRng;
    use rand_chacha::ChaCha20Rng;

    fn greedy() -> Sampler {
        Sampler::new(SamplingParams::greedy()).unwrap()
    }

    fn one_hot(vocab: usize, id: usize) -> Vec<f32> {
        let mut row = vec![0.0; vocab];
        row[id] = 5.0;
        row
    }

    #[test]
    fn greedy_accepts_the_matching_prefix_then_corrects() {
        let rows = [one_hot(8, 3), one_hot(8, 4), one_hot(8, 6), one_hot(8, 1)];
        let rows: Vec<&[f32]> = rows.iter().map(|r| r.as_slice()).collect();
        let v = verify(
            &mut greedy(),
            &TokenHistory::EMPTY,
            &[3, 4, 5],
            None,
            &rows,
            Verification::Coupled,
        )
        .unwrap();
        let tokens: Vec<u32> = v.emitted.iter().map(|o| o.token).collect();
        assert_eq!(
            tokens,
            vec![3, 4, 6],
            "drafts 3, 4 accepted; 5 corrected to 6"
        );
        assert_eq!(v.num_accepted, 2);
    }

    #[test]
    fn greedy_all_accepted_takes_the_bonus_token() {
        let rows = [one_hot(8, 3), one_hot(8, 4), one_hot(8, 7)];
        let rows: Vec<&[f32]> = rows.iter().map(|r| r.as_slice()).collect();
        let v = verify(
            &mut greedy(),
            &TokenHistory::EMPTY,
            &[3, 4],
            None,
            &rows,
            Verification::Coupled,
        )
        .unwrap();
        let tokens: Vec<u32> = v.emitted.iter().map(|o| o.token).collect();
        assert_eq!(tokens, vec![3, 4, 7]);
        assert_eq!(v.num_accepted, 2);
    }

    #[test]
    fn greedy_sees_accepted_drafts_in_the_penalty_history() {
        // Token 2 leads everywhere, but a presence penalty makes a repeat lose to token 1.
        let row = vec![0.0, 1.5, 2.0];
        let mut s = Sampler::new(SamplingParams {
            presence_penalty: 1.0,
            ..SamplingParams::greedy()
        })
        .unwrap();
        let rows: Vec<&[f32]> = vec![&row, &row];
        let v = verify(
            &mut s,
            &TokenHistory::EMPTY,
            &[2],
            None,
            &rows,
            Verification::Coupled,
        )
        .unwrap();
        let tokens: Vec<u32> = v.emitted.iter().map(|o| o.token).collect();
        assert_eq!(
            tokens,
            vec![2, 1],
            "the bonus row is penalised for the accepted draft"
        );
    }

    /// Draws `n` first tokens for a sequence whose draft is `x`, with the given acceptance rule.
    fn histogram(
        row: &[f32],
        x: u32,
        params: &SamplingParams,
        n: u64,
        mut rule: impl FnMut(&mut Sampler, &Distribution, u32) -> u32,
    ) -> Vec<f64> {
        let mut counts = vec![0.0; row.len()];
        let mut s = Sampler::new(SamplingParams {
            seed: Some(12345),
            ..params.clone()
        })
        .unwrap();
        for _ in 0..n {
            let p = s.final_distribution(row, &TokenHistory::EMPTY).unwrap();
            counts[rule(&mut s, &p, x) as usize] += 1.0;
        }
        counts
    }

    /// Pearson chi-square of `counts` against the probabilities `p`, over cells with p > 0;
    /// returns (statistic, degrees of freedom). A count in a cell with p = 0 is infinite.
    fn chi_square(counts: &[f64], p: &Distribution) -> (f64, usize) {
        let n: f64 = counts.iter().sum();
        let mut stat = 0.0;
        let mut cells = 0;
        for (id, &c) in counts.iter().enumerate() {
            let e = p.prob(id as u32) as f64 * n;
            if e == 0.0 {
                if c > 0.0 {
                    return (f64::INFINITY, cells);
                }
                continue;
            }
            stat += (c - e) * (c - e) / e;
            cells += 1;
        }
        (stat, cells - 1)
    }

    /// The 0.999 quantile of chi-square with `df` degrees of freedom (Wilson–Hilferty).
    fn critical(df: usize) -> f64 {
        let k = df as f64;
        let z = 3.09;
        k * (1.0 - 2.0 / (9.0 * k) + z * (2.0 / (9.0 * k)).sqrt()).powi(3)
    }

    fn rows_and_params() -> Vec<(Vec<f32>, SamplingParams)> {
        let mut rng = ChaCha20Rng::seed_from_u64(5);
        let row: Vec<f32> = (0..40).map(|_| rng.random_range(-2.0..2.0)).collect();
        vec![
            (row.clone(), SamplingParams::default()),
            (
                row,
                SamplingParams {
                    top_p: 0.9,
                    ..SamplingParams::default()
                },
            ),
        ]
    }

    /// Coupled verification emits what plain sampling draws from the same seed, whatever the
    /// drafts were: the accepted prefix, then plain sampling's own token.
    #[test]
    fn coupled_verification_emits_plain_samplings_tokens() {
        let mut rng = ChaCha20Rng::seed_from_u64(9);
        let rows: Vec<Vec<f32>> = (0..6)
            .map(|_| (0..16).map(|_| rng.random_range(-1.0..1.0)).collect())
            .collect();
        let rows: Vec<&[f32]> = rows.iter().map(|r| r.as_slice()).collect();
        let params = SamplingParams {
            seed: Some(3),
            top_p: 0.95,
            ..SamplingParams::default()
        };
        let mut plain = Sampler::new(params.clone()).unwrap();
        let mut generated = Vec::new();
        for row in &rows {
            let h = TokenHistory::new(&[], &generated);
            generated.push(plain.sample(row, &h).unwrap().token);
        }
        // Drafts that agree with plain sampling for the first `n` tokens, then disagree.
        for n in 0..rows.len() {
            let mut drafts = generated[..n].to_vec();
            if n + 1 < rows.len() {
                drafts.push((generated[n] + 1) % 16);
            }
            let rows = &rows[..drafts.len() + 1];
            let mut s = Sampler::new(params.clone()).unwrap();
            let v = verify(
                &mut s,
                &TokenHistory::EMPTY,
                &drafts,
                None,
                rows,
                Verification::Coupled,
            )
            .unwrap();
            let tokens: Vec<u32> = v.emitted.iter().map(|o| o.token).collect();
            assert_eq!(tokens, generated[..tokens.len()], "{n} agreeing drafts");
            assert_eq!(v.num_accepted, n);
        }
    }

    #[test]
    fn rejection_sampling_keeps_the_target_distribution() {
        for (row, params) in rows_and_params() {
            let p = Sampler::new(params.clone())
                .unwrap()
                .final_distribution(&row, &TokenHistory::EMPTY)
                .unwrap();
            // A likely draft, an unlikely one, and one top-p filtered out.
            let mut by_prob: Vec<(u32, f32)> =
                (0..row.len() as u32).map(|t| (t, p.prob(t))).collect();
            by_prob.sort_by(|a, b| b.1.total_cmp(&a.1));
            for x in [by_prob[0].0, by_prob[10].0, by_prob[39].0] {
                let counts = histogram(&row, x, &params, 200_000, |s, p, x| {
                    accept_or_resample(s, p, x, None)
                });
                let (stat, df) = chi_square(&counts, &p);
                assert!(stat < critical(df), "draft {x}: chi2 {stat:.1} df {df}");
            }
        }
    }

    #[test]
    fn the_chi_square_test_rejects_a_biased_acceptance() {
        // Accepting with probability min(1, 1.1·p(x)) shifts mass toward the draft: with
        // p(x) ≈ 0.2 that is a ~2% shift, which 200,000 draws must detect.
        let (row, params) = rows_and_params().remove(0);
        let p = Sampler::new(params.clone())
            .unwrap()
            .final_distribution(&row, &TokenHistory::EMPTY)
            .unwrap();
        let x = p.argmax().unwrap();
        let biased = |s: &mut Sampler, p: &Distribution, x: u32| {
            let u: f64 = s.rng_mut().random();
            if u < 1.1 * p.prob(x) as f64 {
                x
            } else {
                p.residual(&Distribution::greedy(x))
                    .unwrap()
                    .sample(s.rng_mut())
            }
        };
        let counts = histogram(&row, x, &params, 200_000, biased);
        let (stat, df) = chi_square(&counts, &p);
        assert!(
            stat > critical(df),
            "bias not detected: chi2 {stat:.1} df {df}"
        );
    }

    #[test]
    fn a_drafter_distribution_q_is_respected() {
        let (row, params) = rows_and_params().remove(0);
        let p = Sampler::new(params.clone())
            .unwrap()
            .final_distribution(&row, &TokenHistory::EMPTY)
            .unwrap();
        let q = Distribution::from_weights((0..40u32).map(|t| (t, 1.0 + (t % 3) as f32))).unwrap();
        let mut draw_rng = ChaCha20Rng::seed_from_u64(77);
        let counts = histogram(&row, 0, &params, 200_000, |s, p, _| {
            let x = q.sample(&mut draw_rng);
            accept_or_resample(s, p, x, Some(q.clone()))
        });
        let (stat, df) = chi_square(&counts, &p);
        assert!(stat < critical(df), "chi2 {stat:.1} df {df}");
    }
}
