//! [`Sampler`]: one per sequence; turns a row of logits into a token, reproducibly for a seed.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha20Rng;

use super::constraint::TokenConstraint;
use super::distribution::Distribution;
use super::kernels::{self, Softmax};
use super::params::{SamplingParams, SamplingParamsError};
use super::penalties::{self, PenaltyScratch, TokenHistory};
use super::select::{self, Candidate};

/// The chosen token and, when the request asked, its log-probabilities.
#[derive(Debug, Clone, PartialEq)]
pub struct SampleOutput {
    pub token: u32,
    /// `ln p(token)` under the model distribution after bias and penalties, at temperature 1,
    /// before any filter (OpenAI's convention); `Some` only when `params.logprobs`.
    pub logprob: Option<f32>,
    /// The `params.top_logprobs` most likely tokens under that same distribution, most likely
    /// first (lowest id among equals); empty unless asked for.
    pub top_logprobs: Vec<(u32, f32)>,
}

/// Why a row of logits could not be sampled.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SamplingError {
    #[error("the logits row is empty")]
    EmptyLogits,
    /// Every logit is `-inf` or NaN, e.g. every token was banned through `logit_bias`.
    #[error("no token can be sampled: every logit is -inf or NaN")]
    NoCandidates,
    #[error("logit_bias names token {token_id}, but the logits row has {num_vocab} entries")]
    BiasTokenOutOfVocab { token_id: u32, num_vocab: usize },
    /// The output grammar failed (a token it had allowed was refused, or it broke).
    #[error("the output grammar failed: {0}")]
    Constraint(String),
}

/// Samples tokens for one sequence. Owns its RNG and every buffer it needs, so after the first
/// call on a vocabulary it allocates nothing (except the `top_logprobs` list when asked for).
///
/// Not `Sync`-shared: each sequence (owned by one actor) has its own.
#[derive(Debug)]
pub struct Sampler {
    params: SamplingParams,
    seed: u64,
    rng: ChaCha20Rng,
    /// `[num_vocab]` logits after bias and penalties, when those change anything.
    adjusted: Vec<f32>,
    /// The candidates of the distribution being built.
    cands: Vec<Candidate>,
    /// The best `top_logprobs` tokens.
    top: Vec<Candidate>,
    penalty_scratch: PenaltyScratch,
    /// The grammar the output must follow (`response_format`), if any.
    constraint: Option<TokenConstraint>,
}

impl Sampler {
    /// Validates `params` and seeds the RNG from `params.seed`, or from the OS-seeded thread RNG
    /// when there is none (read the choice back with [`Sampler::seed`]).
    pub fn new(params: SamplingParams) -> Result<Self, SamplingParamsError> {
        params.validate()?;
        let seed = params.seed.unwrap_or_else(|| rand::rng().random());
        Ok(Self {
            params,
            seed,
            rng: ChaCha20Rng::seed_from_u64(seed),
            adjusted: Vec::new(),
            cands: Vec::new(),
            top: Vec::new(),
            penalty_scratch: PenaltyScratch::default(),
            constraint: None,
        })
    }

    /// Restricts every token this sampler picks to those `constraint` allows.
    pub fn with_constraint(mut self, constraint: TokenConstraint) -> Self {
        self.constraint = Some(constraint);
        self
    }

    /// Moves the output grammar past `token`, chosen without [`Sampler::sample`] (which does
    /// it itself): the speculative verifier's rejection sampling.
    pub fn consume(&mut self, token: u32) -> Result<(), SamplingError> {
        match &mut self.constraint {
            Some(c) => c.consume(token),
            None => Ok(()),
        }
    }

    /// The seed in use, so a response can report it and a client can replay it.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// The sampler's RNG, for the verifier's acceptance draws; using it advances the stream.
    pub fn rng_mut(&mut self) -> &mut ChaCha20Rng {
        &mut self.rng
    }

    /// Picks the next token from `logits` (`[num_vocab]`) given what the sequence has seen.
    pub fn sample(
        &mut self,
        logits: &[f32],
        history: &TokenHistory,
    ) -> Result<SampleOutput, SamplingError> {
        let Self {
            params,
            rng,
            adjusted,
            cands,
            top,
            penalty_scratch,
            constraint,
            ..
        } = self;
        let logits = adjust(
            params,
            logits,
            history,
            adjusted,
            penalty_scratch,
            constraint,
        )?;
        let token = if params.is_greedy() {
            kernels::argmax(logits).ok_or(SamplingError::NoCandidates)?
        } else {
            select::filtered_distribution(params, logits, cands);
            if cands.is_empty() {
                return Err(SamplingError::NoCandidates);
            }
            select::draw(cands, rng)
        };
        let out = logprobs(params, logits, token, top);
        if let Some(c) = constraint {
            c.consume(token)?;
        }
        Ok(out)
    }

    /// The distribution [`Sampler::sample`] would draw from for these inputs (one-hot when
    /// greedy), without drawing. Allocates the result; see [`Sampler::final_distribution_into`].
    pub fn final_distribution(
        &mut self,
        logits: &[f32],
        history: &TokenHistory,
    ) -> Result<Distribution, SamplingError> {
        let mut dist = Distribution::default();
        self.final_distribution_into(logits, history, &mut dist)?;
        Ok(dist)
    }

    /// Like [`Sampler::final_distribution`], writing into `out` and reusing its allocation.
    pub fn final_distribution_into(
        &mut self,
        logits: &[f32],
        history: &TokenHistory,
        out: &mut Distribution,
    ) -> Result<(), SamplingError> {
        let Self {
            params,
            adjusted,
            cands,
            penalty_scratch,
            constraint,
            ..
        } = self;
        let logits = adjust(
            params,
            logits,
            history,
            adjusted,
            penalty_scratch,
            constraint,
        )?;
        if params.is_greedy() {
            out.set_greedy(kernels::argmax(logits).ok_or(SamplingError::NoCandidates)?);
        } else {
            select::filtered_distribution(params, logits, cands);
            if cands.is_empty() {
                return Err(SamplingError::NoCandidates);
            }
            out.set_from_candidates(cands);
        }
        Ok(())
    }

    /// The output [`Sampler::sample`] would report had it chosen `token` (its log-probabilities
    /// when asked for); the speculative verifier uses it for tokens it chose itself.
    pub fn output_for(
        &mut self,
        logits: &[f32],
        history: &TokenHistory,
        token: u32,
    ) -> Result<SampleOutput, SamplingError> {
        if !self.params.logprobs {
            return Ok(SampleOutput {
                token,
                logprob: None,
                top_logprobs: Vec::new(),
            });
        }
        let Self {
            params,
            adjusted,
            top,
            penalty_scratch,
            constraint,
            ..
        } = self;
        let logits = adjust(
            params,
            logits,
            history,
            adjusted,
            penalty_scratch,
            constraint,
        )?;
        Ok(logprobs(params, logits, token, top))
    }

    /// Draws from `dist` with this sampler's RNG (a greedy one draws nothing).
    pub fn sample_distribution(&mut self, dist: &Distribution) -> u32 {
        dist.sample(&mut self.rng)
    }
}

/// Applies bias, penalties and the output grammar when they change anything; borrows `logits`
/// untouched otherwise.
fn adjust<'a>(
    params: &SamplingParams,
    logits: &'a [f32],
    history: &TokenHistory,
    adjusted: &'a mut Vec<f32>,
    scratch: &mut PenaltyScratch,
    constraint: &mut Option<TokenConstraint>,
) -> Result<&'a [f32], SamplingError> {
    if logits.is_empty() {
        return Err(SamplingError::EmptyLogits);
    }
    if let Some((&token_id, _)) = params.logit_bias.range(logits.len() as u32..).next() {
        return Err(SamplingError::BiasTokenOutOfVocab {
            token_id,
            num_vocab: logits.len(),
        });
    }
    let penalised = penalties::has_effect(params, history);
    let constrained = constraint.as_ref().is_some_and(TokenConstraint::is_active);
    if !penalised && !constrained {
        return Ok(logits);
    }
    adjusted.clear();
    adjusted.extend_from_slice(logits);
    if penalised {
        penalties::apply(params, history, adjusted, scratch);
    }
    if let Some(c) = constraint {
        c.mask(adjusted)?;
    }
    Ok(adjusted)
}

/// The output for `token`, with the temperature-1 log-probabilities when asked for.
fn logprobs(
    params: &SamplingParams,
    logits: &[f32],
    token: u32,
    top: &mut Vec<Candidate>,
) -> SampleOutput {
    let mut out = SampleOutput {
        token,
        logprob: None,
        top_logprobs: Vec::new(),
    };
    if params.logprobs {
        (out.logprob, out.top_logprobs) =
            token_logprobs(logits, token, params.top_logprobs as usize, top);
    }
    out
}

/// `ln p(token)` under the softmax of `logits` (temperature 1), and the `num_top` most likely
/// tokens with theirs, most likely first; `None` when no token is live (every logit `-inf`).
/// `top` is scratch space.
pub(crate) fn token_logprobs(
    logits: &[f32],
    token: u32,
    num_top: usize,
    top: &mut Vec<Candidate>,
) -> (Option<f32>, Vec<(u32, f32)>) {
    let Some(softmax) = Softmax::over_row(logits, 1.0) else {
        return (None, Vec::new());
    };
    let logprob = softmax.log_prob(logits[token as usize]);
    let mut best = Vec::new();
    if num_top > 0 {
        select::top_k_into(logits, num_top, top);
        top.sort_unstable_by(select::better_first);
        best.extend(top.iter().map(|c| (c.id, softmax.log_prob(c.value))));
    }
    (Some(logprob), best)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn sampler(params: SamplingParams) -> Sampler {
        Sampler::new(params).unwrap()
    }

    fn seeded(seed: u64) -> SamplingParams {
        SamplingParams {
            seed: Some(seed),
            ..SamplingParams::default()
        }
    }

    /// A fixed pseudo-random sequence of logit rows.
    fn rows(num_rows: usize, num_vocab: usize) -> Vec<Vec<f32>> {
        let mut rng = ChaCha20Rng::seed_from_u64(99);
        (0..num_rows)
            .map(|_| {
                (0..num_vocab)
                    .map(|_| rng.random_range(-3.0..3.0))
                    .collect()
            })
            .collect()
    }

    fn run(params: SamplingParams, rows: &[Vec<f32>]) -> Vec<u32> {
        let mut s = sampler(params);
        let mut generated = Vec::new();
        for row in rows {
            let token = s
                .sample(row, &TokenHistory::new(&[], &generated))
                .unwrap()
                .token;
            generated.push(token);
        }
        generated
    }

    #[test]
    fn same_seed_same_tokens_different_seed_different_tokens() {
        let rows = rows(64, 500);
        let params = |seed| SamplingParams {
            top_p: 0.95,
            presence_penalty: 0.3,
            ..seeded(seed)
        };
        assert_eq!(run(params(7), &rows), run(params(7), &rows));
        assert_ne!(run(params(7), &rows), run(params(8), &rows));
    }

    #[test]
    fn unseeded_samplers_report_the_seed_they_picked() {
        let a = sampler(SamplingParams::default());
        let b = sampler(SamplingParams::default());
        assert_ne!(a.seed(), b.seed());
        assert_eq!(sampler(seeded(5)).seed(), 5);
        // Replaying with the reported seed reproduces an unseeded sampler's tokens.
        let rows = rows(32, 100);
        let mut unseeded = a;
        let mut generated = Vec::new();
        for row in &rows {
            let history = TokenHistory::new(&[], &generated);
            generated.push(unseeded.sample(row, &history).unwrap().token);
        }
        assert_eq!(generated, run(seeded(unseeded.seed()), &rows));
    }

    #[test]
    fn greedy_is_argmax_with_lowest_id_on_ties() {
        let mut s = sampler(SamplingParams::greedy());
        let out = s
            .sample(&[0.5, 2.0, 2.0, 1.0], &TokenHistory::EMPTY)
            .unwrap();
        assert_eq!(out.token, 1);
        let dist = s
            .final_distribution(&[0.5, 2.0, 2.0, 1.0], &TokenHistory::EMPTY)
            .unwrap();
        assert!(dist.is_greedy());
        assert_eq!(dist.entries(), &[(1, 1.0)]);
    }

    #[test]
    fn bias_minus_100_bans_and_plus_100_forces() {
        let row = vec![5.0, 4.0, 3.0, -2.0];
        let banned = BTreeMap::from([(0, -100.0)]);
        let forced = BTreeMap::from([(3, 100.0)]);
        for seed in 0..200 {
            let mut s = sampler(SamplingParams {
                temperature: 2.0,
                logit_bias: banned.clone(),
                ..seeded(seed)
            });
            assert_ne!(s.sample(&row, &TokenHistory::EMPTY).unwrap().token, 0);
            let mut s = sampler(SamplingParams {
                temperature: 2.0,
                logit_bias: forced.clone(),
                ..seeded(seed)
            });
            assert_eq!(s.sample(&row, &TokenHistory::EMPTY).unwrap().token, 3);
        }
        let mut greedy = sampler(SamplingParams {
            logit_bias: banned,
            ..SamplingParams::greedy()
        });
        assert_eq!(greedy.sample(&row, &TokenHistory::EMPTY).unwrap().token, 1);
        let dist = sampler(SamplingParams {
            logit_bias: BTreeMap::from([(0, -100.0)]),
            ..seeded(1)
        })
        .final_distribution(&row, &TokenHistory::EMPTY)
        .unwrap();
        assert_eq!(
            dist.prob(0),
            0.0,
            "a banned token has probability exactly 0"
        );
    }

    #[test]
    fn banning_everything_is_an_error_not_a_panic() {
        let bias = BTreeMap::from([(0, -100.0), (1, -100.0)]);
        for params in [SamplingParams::greedy(), SamplingParams::default()] {
            let mut s = sampler(SamplingParams {
                logit_bias: bias.clone(),
                ..params
            });
            assert_eq!(
                s.sample(&[1.0, 2.0], &TokenHistory::EMPTY),
                Err(SamplingError::NoCandidates)
            );
        }
        let mut s = sampler(SamplingParams::default());
        assert_eq!(
            s.sample(&[], &TokenHistory::EMPTY),
            Err(SamplingError::EmptyLogits)
        );
        let mut s = sampler(SamplingParams {
            logit_bias: BTreeMap::from([(2, 1.0)]),
            ..SamplingParams::default()
        });
        assert_eq!(
            s.sample(&[1.0, 2.0], &TokenHistory::EMPTY),
            Err(SamplingError::BiasTokenOutOfVocab {
                token_id: 2,
                num_vocab: 2
            })
        );
    }

    #[test]
    fn logprobs_are_temperature_one_after_penalties() {
        let row = vec![1.0f32, 2.0, 3.0];
        let params = SamplingParams {
            temperature: 0.0,
            presence_penalty: 1.0,
            logprobs: true,
            top_logprobs: 2,
            ..SamplingParams::default()
        };
        let out = sampler(params)
            .sample(&row, &TokenHistory::new(&[], &[2]))
            .unwrap();
        // after the penalty the logits are [1, 2, 2]: argmax 1 (lowest id among equals)
        let log_z = (1f64.exp() + 2.0 * 2f64.exp()).ln() as f32;
        assert_eq!(out.token, 1);
        assert!((out.logprob.unwrap() - (2.0 - log_z)).abs() < 1e-6);
        assert_eq!(
            out.top_logprobs.iter().map(|t| t.0).collect::<Vec<_>>(),
            vec![1, 2]
        );
        assert!((out.top_logprobs[0].1 - (2.0 - log_z)).abs() < 1e-6);
        let plain = sampler(SamplingParams::greedy())
            .sample(&row, &TokenHistory::EMPTY)
            .unwrap();
        assert_eq!((plain.logprob, plain.top_logprobs.len()), (None, 0));
    }

    #[test]
    fn final_distribution_matches_what_sample_draws_from() {
        let row: Vec<f32> = (0..50).map(|i| (i % 7) as f32 * 0.4).collect();
        let params = SamplingParams {
            top_k: 20,
            top_p: 0.8,
            temperature: 0.7,
            ..seeded(4)
        };
        let mut s = sampler(params);
        let dist = s.final_distribution(&row, &TokenHistory::EMPTY).unwrap();
        let total: f32 = dist.entries().iter().map(|e| e.1).sum();
        assert!((total - 1.0).abs() < 1e-5);
        for _ in 0..500 {
            let token = s.sample(&row, &TokenHistory::EMPTY).unwrap().token;
            assert!(
                dist.prob(token) > 0.0,
                "drew {token}, outside the final distribution"
            );
        }
    }

    #[test]
    fn buffers_are_reused_across_calls() {
        let rows = rows(3, 2000);
        let params = SamplingParams {
            top_p: 0.9,
            frequency_penalty: 0.5,
            ..seeded(1)
        };
        let mut s = sampler(params);
        let history = [1u32, 2, 3, 2];
        s.sample(&rows[0], &TokenHistory::new(&[], &history))
            .unwrap();
        let pointers = (s.adjusted.as_ptr(), s.cands.as_ptr());
        for row in &rows[1..] {
            s.sample(row, &TokenHistory::new(&[], &history)).unwrap();
        }
        assert_eq!(pointers, (s.adjusted.as_ptr(), s.cands.as_ptr()));
    }
}
