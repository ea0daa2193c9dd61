//! Selection over one row of logits: argmax, top-k, softmax, top-p, min-p, and drawing a token.
//!
//! Everything works in a caller-owned candidate buffer and never sorts the whole vocabulary:
//! top-k is one pass with a k-sized heap, top-p sorts growing prefixes found by partial
//! selection, min-p is a filter. Ties are always broken towards the lower token id, so every
//! result is deterministic.

use std::cmp::Ordering;

use rand::Rng;

use super::params::SamplingParams;

/// A token still in the running, with its logit or (after [`softmax`]) its probability.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Candidate {
    pub id: u32,
    pub value: f32,
}

/// The order used everywhere: larger value first, then lower id.
fn better_first(a: &Candidate, b: &Candidate) -> Ordering {
    b.value.total_cmp(&a.value).then(a.id.cmp(&b.id))
}

/// True when `logit` can be chosen at all (`-inf` is a ban; NaN is treated as a ban).
#[inline]
fn is_live(logit: f32) -> bool {
    logit > f32::NEG_INFINITY
}

/// Index of the largest logit, the lowest id among equals; `None` if no logit is live.
pub(crate) fn argmax(logits: &[f32]) -> Option<u32> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &l) in logits.iter().enumerate() {
        if is_live(l) && best.is_none_or(|(_, b)| l > b) {
            best = Some((i, l));
        }
    }
    best.map(|(i, _)| i as u32)
}

/// Fills `out` with the `k` best live logits (fewer if fewer are live), unordered.
///
/// One pass with a min-heap of the k best so far: a token costs one comparison unless it beats
/// the worst kept one, which for a long row is rare (about `k·ln(n/k)` times for random order).
pub(crate) fn top_k_into(logits: &[f32], k: usize, out: &mut Vec<Candidate>) {
    out.clear();
    if k == 0 {
        return;
    }
    let mut iter = logits.iter().enumerate().filter(|(_, &l)| is_live(l));
    out.extend(iter.by_ref().take(k).map(|(i, &l)| Candidate { id: i as u32, value: l }));
    for i in (0..out.len() / 2).rev() {
        sift_down(out, i);
    }
    let Some(mut worst) = out.first().map(|c| c.value) else {
        return;
    };
    // Later ids lose ties, so only a strictly larger logit enters.
    for (i, &l) in iter {
        if l > worst {
            out[0] = Candidate { id: i as u32, value: l };
            sift_down(out, 0);
            worst = out[0].value;
        }
    }
}

/// Restores the heap property below `i`; the root is the worst candidate (see [`better_first`]).
fn sift_down(heap: &mut [Candidate], mut i: usize) {
    loop {
        let (left, right) = (2 * i + 1, 2 * i + 2);
        let mut worst = i;
        for child in [left, right] {
            if child < heap.len() && better_first(&heap[child], &heap[worst]) == Ordering::Greater {
                worst = child;
            }
        }
        if worst == i {
            return;
        }
        heap.swap(i, worst);
        i = worst;
    }
}

/// Fills `out` with every live logit, in id order.
pub(crate) fn all_live_into(logits: &[f32], out: &mut Vec<Candidate>) {
    out.clear();
    out.extend(
        logits
            .iter()
            .enumerate()
            .filter(|(_, &l)| is_live(l))
            .map(|(i, &l)| Candidate { id: i as u32, value: l.min(f32::MAX) }),
    );
}

/// Turns logits into probabilities at `temperature` (> 0), in place. Returns the largest
/// probability. `cands` must be non-empty.
pub(crate) fn softmax(cands: &mut [Candidate], temperature: f32) -> f32 {
    let max = cands.iter().fold(f32::NEG_INFINITY, |m, c| m.max(c.value));
    let inv_t = 1.0 / temperature;
    let mut sum = 0.0f64;
    for c in cands.iter_mut() {
        c.value = ((c.value - max) * inv_t).exp();
        sum += c.value as f64;
    }
    let inv_sum = (1.0 / sum) as f32;
    for c in cands.iter_mut() {
        c.value *= inv_sum;
    }
    inv_sum
}

/// Keeps the smallest most-likely prefix whose probability mass is at least `top_p`, and leaves
/// it sorted most likely first.
///
/// Sorts only what it must: the best 64, then the next 256, 1024, … found by partial selection
/// on what is left, until the running mass reaches `top_p`.
pub(crate) fn top_p(cands: &mut Vec<Candidate>, top_p: f32) {
    let target = top_p as f64;
    let (mut sorted, mut chunk, mut mass) = (0usize, 64usize, 0.0f64);
    while sorted < cands.len() {
        let rest = &mut cands[sorted..];
        let take = chunk.min(rest.len());
        if take < rest.len() {
            rest.select_nth_unstable_by(take - 1, better_first);
        }
        rest[..take].sort_unstable_by(better_first);
        for (i, c) in rest[..take].iter().enumerate() {
            mass += c.value as f64;
            if mass >= target {
                cands.truncate(sorted + i + 1);
                return;
            }
        }
        sorted += take;
        chunk *= 4;
    }
    // Rounding kept the total just under `top_p`: everything stays, fully sorted.
}

/// Drops candidates whose probability is below `min_p * max_prob`. `sorted` says the candidates
/// are in [`better_first`] order, so the survivors are a prefix.
pub(crate) fn min_p(cands: &mut Vec<Candidate>, min_p: f32, max_prob: f32, sorted: bool) {
    let threshold = min_p * max_prob;
    if sorted {
        let keep = cands.partition_point(|c| c.value >= threshold);
        cands.truncate(keep.max(1));
    } else {
        cands.retain(|c| c.value >= threshold);
    }
}

/// Scales the probabilities to sum to 1 and drops any that underflowed to 0, keeping the order.
pub(crate) fn renormalise(cands: &mut Vec<Candidate>) {
    let sum: f64 = cands.iter().map(|c| c.value as f64).sum();
    let inv = (1.0 / sum) as f32;
    let mut kept = 0;
    for i in 0..cands.len() {
        let c = cands[i];
        if c.value > 0.0 {
            cands[kept] = Candidate { id: c.id, value: c.value * inv };
            kept += 1;
        }
    }
    cands.truncate(kept);
}

/// The processed distribution for `params` (not greedy) over `logits` into `cands`: top-k,
/// temperature, softmax, top-p, min-p, renormalise. Leaves `cands` empty when no logit is live.
pub(crate) fn filtered_distribution(
    params: &SamplingParams,
    logits: &[f32],
    cands: &mut Vec<Candidate>,
) {
    let k = params.top_k.max(0) as usize;
    if k > 0 && k < logits.len() {
        top_k_into(logits, k, cands);
    } else {
        all_live_into(logits, cands);
    }
    if cands.is_empty() {
        return;
    }
    let max_prob = softmax(cands, params.temperature);
    let sorted = params.top_p < 1.0;
    if sorted {
        top_p(cands, params.top_p);
    }
    if params.min_p > 0.0 {
        min_p(cands, params.min_p, max_prob, sorted);
    }
    renormalise(cands);
}

/// Draws one candidate with probability proportional to its value. `cands` must be non-empty.
pub(crate) fn draw(cands: &[Candidate], rng: &mut impl Rng) -> u32 {
    let total: f64 = cands.iter().map(|c| c.value as f64).sum();
    let u = rng.random::<f64>() * total;
    let mut cumulative = 0.0f64;
    for c in cands {
        cumulative += c.value as f64;
        if u < cumulative {
            return c.id;
        }
    }
    // u landed in the rounding gap at the very top: the last candidate with any mass.
    cands.iter().rev().find(|c| c.value > 0.0).unwrap_or(&cands[0]).id
}

/// `log Σ exp(logit)` over the live logits (the temperature-1 normaliser); `None` if none live.
pub(crate) fn log_sum_exp(logits: &[f32]) -> Option<f32> {
    let max = logits.iter().copied().filter(|&l| is_live(l)).fold(f32::NEG_INFINITY, f32::max);
    if !is_live(max) {
        return None;
    }
    let sum: f64 = logits.iter().map(|&l| ((l - max).exp()) as f64).sum();
    Some(max + sum.ln() as f32)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn ids(cands: &[Candidate]) -> Vec<u32> {
        let mut ids: Vec<u32> = cands.iter().map(|c| c.id).collect();
        ids.sort_unstable();
        ids
    }

    /// Reference softmax in f64 over `(id, logit)` at temperature `t`.
    fn reference_probs(cands: &[(u32, f32)], t: f32) -> Vec<(u32, f64)> {
        let max = cands.iter().map(|c| c.1 as f64).fold(f64::NEG_INFINITY, f64::max);
        let exps: Vec<f64> = cands.iter().map(|c| ((c.1 as f64 - max) / t as f64).exp()).collect();
        let sum: f64 = exps.iter().sum();
        cands.iter().zip(exps).map(|(c, e)| (c.0, e / sum)).collect()
    }

    #[test]
    fn argmax_breaks_ties_towards_the_lowest_id_and_skips_bans() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), Some(1));
        assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NAN, -5.0]), Some(2));
        assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NAN]), None);
        assert_eq!(argmax(&[]), None);
    }

    #[test]
    fn top_k_keeps_the_lowest_ids_among_tied_boundary_logits() {
        let mut out = Vec::new();
        top_k_into(&[1.0, 5.0, 1.0, 1.0, 0.0], 2, &mut out);
        assert_eq!(ids(&out), vec![0, 1]);
        top_k_into(&[f32::NEG_INFINITY, 2.0, f32::NEG_INFINITY], 2, &mut out);
        assert_eq!(ids(&out), vec![1], "banned tokens never fill the k slots");
    }

    #[test]
    fn top_p_keeps_the_smallest_prefix_reaching_the_mass() {
        // probabilities 0.5, 0.3, 0.2 (given directly as values)
        let mut cands: Vec<Candidate> = [(0, 0.2), (1, 0.5), (2, 0.3)]
            .iter()
            .map(|&(id, value)| Candidate { id, value })
            .collect();
        top_p(&mut cands, 0.8);
        assert_eq!(cands.iter().map(|c| c.id).collect::<Vec<_>>(), vec![1, 2]);
    }

    #[test]
    fn min_p_drops_tokens_below_the_scaled_maximum() {
        let mut cands: Vec<Candidate> = [(0, 0.1), (1, 0.6), (2, 0.3)]
            .iter()
            .map(|&(id, value)| Candidate { id, value })
            .collect();
        min_p(&mut cands, 0.5, 0.6, false);
        assert_eq!(ids(&cands), vec![1, 2]);
    }

    #[test]
    fn log_sum_exp_matches_a_direct_computation() {
        let lse = log_sum_exp(&[0.0, 1.0, f32::NEG_INFINITY, 2.0]).unwrap();
        let direct = (1.0f64 + 1f64.exp() + 2f64.exp()).ln();
        assert!((lse as f64 - direct).abs() < 1e-6);
        assert_eq!(log_sum_exp(&[f32::NEG_INFINITY]), None);
    }

    fn logits_strategy() -> impl Strategy<Value = Vec<f32>> {
        // Coarse values make ties common, which exercises the tie-breaking.
        prop::collection::vec((-40i32..40).prop_map(|v| v as f32 * 0.5), 1..400)
    }

    proptest! {
        #[test]
        fn top_k_keeps_exactly_k_and_only_the_best(logits in logits_strategy(), k in 1usize..64) {
            let mut out = Vec::new();
            top_k_into(&logits, k, &mut out);
            prop_assert_eq!(out.len(), k.min(logits.len()));
            let mut all: Vec<Candidate> = logits.iter().enumerate()
                .map(|(i, &l)| Candidate { id: i as u32, value: l }).collect();
            all.sort_unstable_by(better_first);
            prop_assert_eq!(ids(&out), ids(&all[..out.len()]));
        }

        #[test]
        fn filtered_distribution_has_the_documented_mass_properties(
            logits in logits_strategy(),
            k in 0i32..50,
            p in 0.05f32..=1.0,
            mp in 0.0f32..0.5,
            t in 0.1f32..2.0,
        ) {
            let params = SamplingParams { temperature: t, top_k: k, top_p: p, min_p: mp, ..SamplingParams::default() };
            let mut cands = Vec::new();
            filtered_distribution(&params, &logits, &mut cands);

            // Reference: the top-k set (sorted best first), softmax at t in f64.
            let mut base: Vec<(u32, f32)> = logits.iter().enumerate().map(|(i, &l)| (i as u32, l)).collect();
            base.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            if k > 0 { base.truncate(k as usize); }
            let probs = reference_probs(&base, t);

            // top-p: smallest prefix with mass >= p, give or take f32 rounding at the edge.
            let prefix = |target: f64| {
                let mut mass = 0.0;
                probs.iter().position(|(_, q)| { mass += q; mass >= target }).map_or(probs.len(), |i| i + 1)
            };
            let (n_p_lo, n_p_hi) = (prefix(p as f64 - 1e-5), prefix(p as f64 + 1e-5));
            // min-p on what top-p kept (never empties: the best token always passes).
            let threshold = mp as f64 * probs[0].1;
            let count_above = |n: usize, factor: f64, floor: f64| {
                probs[..n].iter().filter(|(_, q)| *q >= threshold * factor && *q > floor).count().max(1)
            };
            // f32 keeps any probability above 1e-30 and may keep smaller ones down to denormals.
            let (lo, hi) = (count_above(n_p_lo, 1.0 + 1e-5, 1e-30), count_above(n_p_hi, 1.0 - 1e-5, 0.0));
            prop_assert!(cands.len() >= lo && cands.len() <= hi, "kept {} not in {lo}..={hi}", cands.len());
            // the survivors are the best of the top-k set, in order
            prop_assert_eq!(ids(&cands), ids(&base[..cands.len()].iter().map(|&(id, value)| Candidate { id, value }).collect::<Vec<_>>()));
            // renormalised: positive and summing to one
            let total: f64 = cands.iter().map(|c| c.value as f64).sum();
            prop_assert!((total - 1.0).abs() < 1e-5);
            prop_assert!(cands.iter().all(|c| c.value > 0.0));
            // kept mass before renormalising reaches p unless min-p cut it
            let kept: f64 = probs[..cands.len()].iter().map(|(_, q)| q).sum();
            prop_assert!(kept >= p as f64 - 1e-5 || mp > 0.0);
        }
    }
}
