//! Selection over one row of logits: top-k, softmax, top-p, min-p, and drawing a token.
//!
//! Everything works in a caller-owned candidate buffer and never sorts the whole vocabulary:
//! top-k is one pass with a k-sized heap; top-p first tries the best 64 tokens, and otherwise
//! buckets the probabilities by their top bits and resolves only the bucket where the mass
//! crosses `top_p` (by partial selection); min-p is a filter on the pass that computes the
//! probabilities. Ties are always broken towards the lower token id.

use std::cmp::Ordering;

use rand::Rng;

use super::kernels::{is_live, keeps, Softmax};
use super::params::SamplingParams;

/// A token still in the running, with its logit or its probability.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Candidate {
    pub id: u32,
    pub value: f32,
}

/// How many of the best tokens top-p looks at first; also the size below which it just sorts.
const NUCLEUS_FIRST_TRY: usize = 64;

/// The order used everywhere: larger value first, then lower id.
pub(crate) fn better_first(a: &Candidate, b: &Candidate) -> Ordering {
    b.value.total_cmp(&a.value).then(a.id.cmp(&b.id))
}

/// Fills `out` with the `k` best live logits (fewer if fewer are live), unordered.
///
/// One pass with a min-heap of the k best so far. The row is read 16 logits at a time and a
/// block is only looked into when its maximum beats the worst kept logit, which for a long row
/// is rare (about `k·ln(n/k)` entries for random order).
pub(crate) fn top_k_into(logits: &[f32], k: usize, out: &mut Vec<Candidate>) {
    const BLOCK: usize = 16;
    out.clear();
    let mut start = 0;
    while out.len() < k && start < logits.len() {
        if is_live(logits[start]) {
            out.push(Candidate {
                id: start as u32,
                value: logits[start],
            });
        }
        start += 1;
    }
    if out.len() < k {
        return;
    }
    for i in (0..k / 2).rev() {
        sift_down(out, i);
    }
    let mut worst = out[0].value;
    for (b, block) in logits[start..].chunks(BLOCK).enumerate() {
        let block_max = block
            .iter()
            .fold(f32::NEG_INFINITY, |m, &l| if l > m { l } else { m });
        if block_max <= worst {
            continue;
        }
        // Later ids lose ties, so only a strictly larger logit enters.
        for (j, &l) in block.iter().enumerate() {
            if l > worst {
                out[0] = Candidate {
                    id: (start + b * BLOCK + j) as u32,
                    value: l,
                };
                sift_down(out, 0);
                worst = out[0].value;
            }
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

/// Keeps the smallest set of most likely candidates whose probability mass reaches `target`
/// (ties by lower id), in no particular order; keeps all when rounding leaves it just short.
///
/// A long list is first bucketed by the top bits of each probability (for positive floats the
/// bit pattern orders like the value): the buckets above the one where the running mass crosses
/// `target` are kept whole, those below dropped, and only the crossing bucket is resolved by
/// [`nucleus_after`].
pub(crate) fn nucleus(cands: &mut Vec<Candidate>, target: f64) {
    const SHIFT: u32 = 19; // 8 exponent bits and 4 mantissa bits: 1/16-octave buckets
    const NUM_BUCKETS: usize = 1 << (31 - SHIFT);
    if cands.len() <= 8 * NUCLEUS_FIRST_TRY {
        return nucleus_after(cands, 0, 0.0, target);
    }
    let bucket = |c: &Candidate| (c.value.to_bits() >> SHIFT) as usize;
    let mut mass = [0.0f64; NUM_BUCKETS];
    for c in cands.iter() {
        mass[bucket(c)] += c.value as f64;
    }
    let mut mass_above = 0.0;
    let Some(boundary) = (0..NUM_BUCKETS).rev().find(|&b| {
        mass_above += mass[b];
        mass_above >= target
    }) else {
        return; // rounding left the total just short of `target`: keep everything
    };
    mass_above -= mass[boundary];
    // Drop the buckets below (branch-free compaction), then move the few entries of the crossing
    // bucket behind the ones above it (two pointers, swapping only crossing-bucket entries).
    let mut num_kept = 0;
    for i in 0..cands.len() {
        let c = cands[i];
        cands[num_kept] = c;
        num_kept += (bucket(&c) >= boundary) as usize;
    }
    cands.truncate(num_kept);
    let (mut num_above, mut end) = (0, cands.len());
    loop {
        while num_above < end && bucket(&cands[num_above]) > boundary {
            num_above += 1;
        }
        while num_above < end && bucket(&cands[end - 1]) == boundary {
            end -= 1;
        }
        if num_above >= end {
            break;
        }
        cands.swap(num_above, end - 1);
    }
    nucleus_after(cands, num_above, mass_above, target);
}

/// [`nucleus`] when `cands[..lo]` are known to beat the rest and to hold `mass_above < target`.
///
/// Bisects on mass: partial selection splits the undecided range at its middle, and the half
/// that holds the boundary stays undecided, so the cost is about two partial selections.
fn nucleus_after(cands: &mut Vec<Candidate>, mut lo: usize, mut mass_above: f64, target: f64) {
    let mut hi = cands.len();
    // Invariant: cands[..lo] beat everything after them and hold mass_above < target;
    // cands[..hi] beat cands[hi..] and, unless hi == len, hold at least target.
    while hi - lo > NUCLEUS_FIRST_TRY {
        let mid = lo + (hi - lo) / 2;
        cands[lo..hi].select_nth_unstable_by(mid - lo, better_first);
        let upper: f64 = cands[lo..=mid].iter().map(|c| c.value as f64).sum();
        if mass_above + upper >= target {
            hi = mid + 1;
        } else {
            mass_above += upper;
            lo = mid + 1;
        }
    }
    cands[lo..hi].sort_unstable_by(better_first);
    let mut mass = mass_above;
    for i in lo..hi {
        mass += cands[i].value as f64;
        if mass >= target {
            cands.truncate(i + 1);
            return;
        }
    }
    cands.truncate(hi);
}

/// Keeps the candidates with probability at least `min_prob` and above 0 (see [`keeps`]).
pub(crate) fn drop_below(cands: &mut Vec<Candidate>, min_prob: f32) {
    cands.retain(|c| keeps(c.value, min_prob));
}

/// The processed distribution for `params` (not greedy) over `logits` into `cands`: top-k,
/// temperature, softmax, top-p, min-p. The values are the softmax probabilities of the
/// survivors, all > 0, *not* renormalised: [`draw`] does not need it and
/// [`super::Distribution`] does it itself. Leaves `cands` empty when no logit is live.
pub(crate) fn filtered_distribution(
    params: &SamplingParams,
    logits: &[f32],
    cands: &mut Vec<Candidate>,
) {
    let k = params.top_k.max(0) as usize;
    let whole_row = k == 0 || k >= logits.len();
    let softmax = if whole_row {
        Softmax::over_row(logits, params.temperature)
    } else {
        top_k_into(logits, k, cands);
        let softmax = Softmax::over(cands.iter().map(|c| c.value), params.temperature);
        for c in cands.iter_mut() {
            c.value = softmax.map_or(0.0, |s| s.prob(c.value));
        }
        softmax
    };
    let Some(softmax) = softmax else {
        cands.clear();
        return;
    };
    // min-p's floor. Applying it before top-p gives the same set as after: nothing is
    // renormalised in between and the nucleus is a most-likely prefix.
    let min_prob = params.min_p * softmax.max_prob();
    let top_p = params.top_p as f64;
    if whole_row && !(top_p < 1.0 && try_small_nucleus(logits, &softmax, top_p, cands)) {
        cands.clear();
        cands.reserve(logits.len());
        softmax.collect_kept(logits, min_prob, cands);
    } else {
        // At most max(k, 64) candidates, already turned into probabilities.
        drop_below(cands, min_prob);
    }
    if top_p < 1.0 {
        nucleus(cands, top_p);
    }
}

/// Top-p for the common peaked case: when the best [`NUCLEUS_FIRST_TRY`] tokens already hold
/// `top_p` of the mass, the nucleus is among them. Leaves them in `cands` as probabilities and
/// returns true in that case.
fn try_small_nucleus(
    logits: &[f32],
    softmax: &Softmax,
    top_p: f64,
    cands: &mut Vec<Candidate>,
) -> bool {
    if logits.len() <= 4 * NUCLEUS_FIRST_TRY {
        return false;
    }
    top_k_into(logits, NUCLEUS_FIRST_TRY, cands);
    for c in cands.iter_mut() {
        c.value = softmax.prob(c.value);
    }
    cands.iter().map(|c| c.value as f64).sum::<f64>() >= top_p
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
    cands
        .iter()
        .rev()
        .find(|c| c.value > 0.0)
        .unwrap_or(&cands[0])
        .id
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
        let max = cands
            .iter()
            .map(|c| c.1 as f64)
            .fold(f64::NEG_INFINITY, f64::max);
        let exps: Vec<f64> = cands
            .iter()
            .map(|c| ((c.1 as f64 - max) / t as f64).exp())
            .collect();
        let sum: f64 = exps.iter().sum();
        cands
            .iter()
            .zip(exps)
            .map(|(c, e)| (c.0, e / sum))
            .collect()
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
        nucleus(&mut cands, 0.8);
        assert_eq!(ids(&cands), vec![1, 2]);
        nucleus(&mut cands, 0.5);
        assert_eq!(ids(&cands), vec![1]);
    }

    #[test]
    fn min_p_drops_tokens_below_the_scaled_maximum() {
        let mut cands: Vec<Candidate> = [(0, 0.1), (1, 0.6), (2, 0.3)]
            .iter()
            .map(|&(id, value)| Candidate { id, value })
            .collect();
        drop_below(&mut cands, 0.5 * 0.6);
        assert_eq!(ids(&cands), vec![1, 2]);
        drop_below(&mut cands, 0.6);
        assert_eq!(
            ids(&cands),
            vec![1],
            "the most likely token survives min_p = 1"
        );
    }

    fn logits_strategy() -> impl Strategy<Value = Vec<f32>> {
        // Coarse values make ties common, which exercises the tie-breaking.
        prop::collection::vec((-40i32..40).prop_map(|v| v as f32 * 0.5), 1..1200)
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
        fn nucleus_is_the_most_likely_prefix_reaching_the_mass(
            weights in prop::collection::vec(0u32..40, 1..5000),
            p in 0.01f64..=1.0,
        ) {
            // Coarse exponentially spaced values: many ties and many buckets.
            let values: Vec<f32> = weights.iter().map(|&w| 0.8f32.powi(w as i32)).collect();
            let sum: f64 = values.iter().map(|&v| v as f64).sum();
            let mut cands: Vec<Candidate> = values.iter().enumerate()
                .map(|(i, &v)| Candidate { id: i as u32, value: (v as f64 / sum) as f32 }).collect();
            let mut sorted = cands.clone();
            sorted.sort_unstable_by(better_first);
            let prefix = |target: f64| {
                let mut mass = 0.0;
                sorted.iter().position(|c| { mass += c.value as f64; mass >= target })
                    .map_or(sorted.len(), |i| i + 1)
            };
            nucleus(&mut cands, p);
            let (lo, hi) = (prefix(p - 1e-9), prefix(p + 1e-9));
            prop_assert!(cands.len() >= lo && cands.len() <= hi, "{} not in {lo}..={hi}", cands.len());
            prop_assert_eq!(ids(&cands), ids(&sorted[..cands.len()]));
        }

        #[test]
        fn filtered_distribution_has_the_documented_mass_properties(
            logits in logits_strategy(),
            k in prop_oneof![Just(0i32), 1i32..50],
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
            // values are the softmax probabilities (not renormalised), all positive
            let mut q_by_id = vec![0.0; logits.len()];
            for &(id, q) in &probs {
                q_by_id[id as usize] = q;
            }
            for c in &cands {
                let q = q_by_id[c.id as usize];
                prop_assert!(c.value > 0.0);
                prop_assert!(q < 1e-30 || (c.value as f64 / q - 1.0).abs() < 1e-4, "{} vs {q}", c.value);
            }
            // the kept mass reaches p unless min-p cut it
            let kept: f64 = probs[..cands.len()].iter().map(|(_, q)| q).sum();
            prop_assert!(kept >= p as f64 - 1e-5 || mp > 0.0);
        }
    }
}
