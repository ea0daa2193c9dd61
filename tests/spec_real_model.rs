//! Speculative sampling on a real model: Qwen2.5-Coder-0.5B as the target, the context n-gram
//! drafter proposing from a real prompt. The verifier's output must follow the target's own
//! sampling distribution exactly (temperature 1, top-p 1 and 0.9), at every drafted position.
//!
//! Running the whole engine for each of tens of thousands of seeds would take hours on CI's
//! two cores, so the target's logits for the pending token and each draft come from one real
//! forward, and the production verifier (`mtpx::spec::verify`, the code the scheduler calls) is
//! run on them once per seed. The engine path itself is covered by `tests/spec.rs` on the
//! generated test model. Needs the pulled model (`tests/run.sh` pulls it).

mod common;

use common::pulled_model;
use mtpx::kv::KvDtype;
use mtpx::model::ModelBundle;
use mtpx::runner::SingleSequence;
use mtpx::sampling::{Distribution, Sampler, SamplingParams, TokenHistory};
use mtpx::spec::{ngram, verify, Verification};

type Counts = std::collections::HashMap<u32, f64>;

/// A list that repeats with variations: the n-gram drafter proposes " cheese, apples" (what
/// followed the last "apples, bread,"), which the model finds likely but far from certain
/// (p ≈ 0.39, 0.71, 0.47 for the three drafts), so drafts are both accepted and rejected.
const PROMPT: &str = "Shopping list: apples, bread, milk, apples, bread, cheese, apples, bread,";

const NUM_DRAFTS: usize = 3;
const NUM_SEEDS: u64 = 20_000;

/// The real target's logits: `rows[0]` after the prompt, `rows[i]` after draft `i`.
struct Case {
    prompt: Vec<u32>,
    drafts: Vec<u32>,
    rows: Vec<Vec<f32>>,
}

fn real_case() -> Case {
    let bundle = ModelBundle::load(&pulled_model("qwen2.5-coder-0.5b")).unwrap();
    let prompt = bundle.encode(PROMPT).unwrap();
    let m = ngram::lookup(&prompt, NUM_DRAFTS, 2, 16).expect("the prompt repeats itself");
    assert_eq!(m.draft.len(), NUM_DRAFTS, "{m:?}");
    let mut seq = SingleSequence::new(&bundle.transformer, prompt.len() + 8, 16, KvDtype::F16);
    let mut rows = vec![seq.append(&prompt, 512, false).unwrap()];
    let vocab = rows[0].len();
    let after_drafts = seq.append(&m.draft, 512, true).unwrap();
    rows.extend(after_drafts.chunks_exact(vocab).map(<[f32]>::to_vec));
    Case {
        prompt,
        drafts: m.draft,
        rows,
    }
}

fn params(top_p: f32, seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: 1.0,
        top_p,
        seed: Some(seed),
        ..SamplingParams::default()
    }
}

/// The distribution plain sampling draws position `i` from, the drafts before it accepted.
fn target(case: &Case, top_p: f32, i: usize) -> Distribution {
    let history = TokenHistory::new(&case.prompt, &case.drafts[..i]);
    Sampler::new(params(top_p, 0))
        .unwrap()
        .final_distribution(&case.rows[i], &history)
        .unwrap()
}

/// Tokens that get a cell of their own in [`departs`]; the rest of the vocabulary is one cell.
/// Few cells keep the test's power on the likely tokens, where a biased verifier shows first:
/// with all 130 cells of `p` a 2% shift onto the draft would drown in the degrees of freedom.
const NUM_CELLS: usize = 6;

/// Pearson chi-square of `counts` against `p` over cells for the `NUM_CELLS` likeliest tokens
/// (and `also`) plus one for all other tokens. True when the counts depart from `p` at the 0.1%
/// level; a token outside `p`'s support departs outright.
fn departs(counts: &Counts, p: &Distribution, also: Option<u32>) -> (bool, f64, usize) {
    if counts.keys().any(|&t| p.prob(t) == 0.0) {
        return (true, f64::INFINITY, 0);
    }
    let n: f64 = counts.values().sum();
    let mut by_prob = p.entries().to_vec();
    by_prob.sort_by(|a, b| b.1.total_cmp(&a.1));
    let mut cells: Vec<u32> = by_prob.iter().take(NUM_CELLS).map(|e| e.0).collect();
    cells.extend(also.filter(|t| !cells.contains(t)));
    let (mut stat, mut rest_seen, mut rest_expected) = (0.0, n, n);
    for &token in &cells {
        let expected = p.prob(token) as f64 * n;
        let seen = counts.get(&token).copied().unwrap_or(0.0);
        stat += (seen - expected).powi(2) / expected;
        rest_seen -= seen;
        rest_expected -= expected;
    }
    if rest_expected > 1e-9 * n {
        stat += (rest_seen - rest_expected).powi(2) / rest_expected;
    } else {
        cells.pop();
    }
    let df = cells.len() as f64;
    let critical = df * (1.0 - 2.0 / (9.0 * df) + 3.09 * (2.0 / (9.0 * df)).sqrt()).powi(3);
    (stat > critical, stat, cells.len())
}

/// `p` with `shift` of its mass moved onto `token` from everything else, proportionally.
fn shifted(p: &Distribution, token: u32, shift: f32) -> Distribution {
    let rest = 1.0 - p.prob(token);
    Distribution::from_weights(p.entries().iter().map(|&(t, w)| {
        if t == token {
            (t, w + shift)
        } else {
            (t, w * (1.0 - shift / rest))
        }
    }))
    .unwrap()
}

/// For each seed, verifies the drafts; `counts[i]` holds the token emitted at position `i`
/// over the seeds whose earlier drafts were all accepted (so it is a draw from `target(i)`).
fn verify_many(case: &Case, top_p: f32, verification: Verification) -> Vec<Counts> {
    let rows: Vec<&[f32]> = case.rows.iter().map(Vec::as_slice).collect();
    let history = TokenHistory::new(&case.prompt, &[]);
    let mut counts = vec![Counts::new(); NUM_DRAFTS + 1];
    for seed in 0..NUM_SEEDS {
        let mut sampler = Sampler::new(params(top_p, seed)).unwrap();
        let v = verify(
            &mut sampler,
            &history,
            &case.drafts,
            None,
            &rows,
            verification,
        )
        .unwrap();
        for (i, out) in v.emitted.iter().enumerate() {
            *counts[i].entry(out.token).or_insert(0.0) += 1.0;
        }
    }
    counts
}

#[test]
fn rejection_sampling_on_qwen_keeps_the_targets_distribution() {
    assert_verification_keeps_the_distribution(1.0, Verification::Rejection);
}

#[test]
fn rejection_sampling_on_qwen_with_top_p_keeps_the_targets_distribution() {
    assert_verification_keeps_the_distribution(0.9, Verification::Rejection);
}

#[test]
fn coupled_sampling_on_qwen_keeps_the_targets_distribution() {
    assert_verification_keeps_the_distribution(1.0, Verification::Coupled);
}

#[test]
fn coupled_sampling_on_qwen_with_top_p_keeps_the_targets_distribution() {
    assert_verification_keeps_the_distribution(0.9, Verification::Coupled);
}

/// Positions 0 and 1 (and 2, 3 when enough seeds reach them) follow `target`; the counts of
/// position 0 are shown to be enough to notice 2% of the mass moved.
fn assert_verification_keeps_the_distribution(top_p: f32, verification: Verification) {
    let case = real_case();
    {
        {
            let counts = verify_many(&case, top_p, verification);
            for (i, counts) in counts.iter().enumerate() {
                let n: f64 = counts.values().sum();
                let p = target(&case, top_p, i);
                let draft = case.drafts.get(i).copied();
                let accepted = draft.map_or(0.0, |d| counts.get(&d).copied().unwrap_or(0.0));
                println!(
                    "top_p {top_p}, {verification:?}, position {i}: {n} draws, draft {draft:?} \
                     p {:.3} accepted {accepted}",
                    draft.map_or(0.0, |d| p.prob(d)),
                );
                // Positions reached by too few seeds say little; the first two always have
                // thousands (the prompt is chosen so).
                if n < 2_000.0 {
                    assert!(i >= 2, "position {i} reached by only {n} seeds");
                    continue;
                }
                let (d, stat, df) = departs(counts, &p, draft);
                println!("  against the target: chi2 {stat:.1} df {df}");
                assert!(
                    !d,
                    "top_p {top_p}, {verification:?}, position {i}: the emitted tokens \
                     depart from the target's distribution (chi2 {stat:.1}, df {df})"
                );
                if i == 0 {
                    // The same counts are enough to notice 2% of the mass moved onto or off
                    // the draft: the test can fail.
                    let d0 = case.drafts[0];
                    for shift in [0.02, -0.02] {
                        let (d, stat, df) = departs(counts, &shifted(&p, d0, shift), draft);
                        println!("  against a {shift:+} shift: chi2 {stat:.1} df {df}");
                        assert!(
                            d,
                            "a {shift:+} shift went unnoticed: chi2 {stat:.1} df {df}"
                        );
                    }
                    assert!(
                        accepted > 0.1 * n && accepted < 0.9 * n,
                        "the first draft is accepted sometimes, not always ({accepted} of {n})"
                    );
                }
            }
        }
    }
}
