//! The final distribution a token is drawn from, as the speculative verifier needs it: `p(x)` for
//! any token, a draw with the sampler's RNG, and the residual `norm((p − q)+)` to resample from
//! after a rejected draft token.

use rand::Rng;

use super::select::Candidate;

/// A sparse probability distribution over token ids: only tokens with probability > 0 are stored,
/// sorted by id, summing to 1.
///
/// A greedy distribution holds the argmax alone with probability 1 and says so through
/// [`Distribution::is_greedy`], so a verifier can compare tokens instead of drawing.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Distribution {
    greedy: bool,
    /// `(token_id, probability)`, ascending token id, probability > 0.
    entries: Vec<(u32, f32)>,
}

impl Distribution {
    /// Probability 1 on `token_id`, flagged greedy.
    pub fn greedy(token_id: u32) -> Self {
        let mut dist = Self::default();
        dist.set_greedy(token_id);
        dist
    }

    /// Builds a distribution from `(token_id, weight)` pairs in any order, normalising the
    /// weights; pairs with weight ≤ 0 (or NaN) are dropped, as are repeated ids after the first.
    /// Returns `None` when no weight is positive.
    pub fn from_weights(weights: impl IntoIterator<Item = (u32, f32)>) -> Option<Self> {
        let mut dist = Self::default();
        dist.entries
            .extend(weights.into_iter().filter(|&(_, w)| w > 0.0));
        dist.finish_entries();
        (!dist.entries.is_empty()).then_some(dist)
    }

    /// True when this is greedy decoding's one-hot distribution.
    pub fn is_greedy(&self) -> bool {
        self.greedy
    }

    /// `p(token_id)`; 0 for tokens that were filtered out.
    pub fn prob(&self, token_id: u32) -> f32 {
        self.entries
            .binary_search_by_key(&token_id, |&(id, _)| id)
            .map_or(0.0, |i| self.entries[i].1)
    }

    /// The tokens with probability > 0 and their probabilities, ascending token id.
    pub fn entries(&self) -> &[(u32, f32)] {
        &self.entries
    }

    /// How many tokens have probability > 0.
    pub fn num_candidates(&self) -> usize {
        self.entries.len()
    }

    /// The most likely token, the lowest id among equals. `None` only for an empty (default)
    /// distribution.
    pub fn argmax(&self) -> Option<u32> {
        let mut best: Option<(u32, f32)> = None;
        for &(id, p) in &self.entries {
            if best.is_none_or(|(_, b)| p > b) {
                best = Some((id, p));
            }
        }
        best.map(|(id, _)| id)
    }

    /// Draws a token. A greedy distribution returns its token without touching `rng`, so a
    /// greedy sequence consumes no randomness. Panics on an empty (default) distribution.
    pub fn sample(&self, rng: &mut impl Rng) -> u32 {
        assert!(
            !self.entries.is_empty(),
            "sampling from an empty distribution"
        );
        if self.greedy {
            return self.entries[0].0;
        }
        let u = rng.random::<f64>();
        let mut cumulative = 0.0f64;
        for &(id, p) in &self.entries {
            cumulative += p as f64;
            if u < cumulative {
                return id;
            }
        }
        self.entries[self.entries.len() - 1].0
    }

    /// The residual `norm(max(0, p − q))` where `self` is the target `p` and `q` the draft's
    /// distribution: what a rejected draft token is replaced from. `None` when `p ≤ q` everywhere
    /// (then `p == q` and a draft token is never rejected).
    pub fn residual(&self, q: &Distribution) -> Option<Distribution> {
        let mut out = Distribution::default();
        let mut q_iter = q.entries.iter().peekable();
        for &(id, p) in &self.entries {
            while q_iter.next_if(|&&(qid, _)| qid < id).is_some() {}
            let q_prob = q_iter
                .next_if(|&&(qid, _)| qid == id)
                .map_or(0.0, |&(_, q)| q);
            if p > q_prob {
                out.entries.push((id, p - q_prob));
            }
        }
        out.finish_entries();
        (!out.entries.is_empty()).then_some(out)
    }

    /// Makes this the greedy distribution on `token_id`, reusing the allocation.
    pub(crate) fn set_greedy(&mut self, token_id: u32) {
        self.greedy = true;
        self.entries.clear();
        self.entries.push((token_id, 1.0));
    }

    /// Makes this the distribution proportional to `cands` (distinct ids, values > 0), reusing
    /// the allocation.
    pub(crate) fn set_from_candidates(&mut self, cands: &[Candidate]) {
        let sum: f64 = cands.iter().map(|c| c.value as f64).sum();
        self.greedy = false;
        self.entries.clear();
        self.entries
            .extend(cands.iter().map(|c| (c.id, (c.value as f64 / sum) as f32)));
        self.entries.sort_unstable_by_key(|&(id, _)| id);
    }

    /// Sorts by id, drops repeated ids, and normalises.
    fn finish_entries(&mut self) {
        self.greedy = false;
        self.entries.sort_by_key(|&(id, _)| id);
        self.entries.dedup_by_key(|&mut (id, _)| id);
        let sum: f64 = self.entries.iter().map(|&(_, p)| p as f64).sum();
        for (_, p) in &mut self.entries {
            *p = (*p as f64 / sum) as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;
    use rand_chacha::ChaCha20Rng;

    use super::*;

    fn approx(a: f32, b: f32) -> bool {
        (a - b).abs() < 1e-6
    }

    #[test]
    fn prob_answers_for_any_token() {
        let dist = Distribution::from_weights([(7, 1.0), (2, 3.0), (9, 0.0)]).unwrap();
        assert!(approx(dist.prob(2), 0.75));
        assert!(approx(dist.prob(7), 0.25));
        assert_eq!(dist.prob(9), 0.0);
        assert_eq!(dist.prob(1000), 0.0);
        assert_eq!(dist.num_candidates(), 2);
        assert_eq!(dist.argmax(), Some(2));
        assert!(!dist.is_greedy());
    }

    #[test]
    fn greedy_distribution_is_one_hot_and_uses_no_randomness() {
        let dist = Distribution::greedy(5);
        assert!(dist.is_greedy());
        assert_eq!(dist.prob(5), 1.0);
        let mut rng = ChaCha20Rng::seed_from_u64(1);
        let before = rng.clone();
        assert_eq!(dist.sample(&mut rng), 5);
        assert_eq!(rng, before);
    }

    #[test]
    fn residual_is_the_normalised_positive_part_of_p_minus_q() {
        let p = Distribution::from_weights([(0, 0.5), (1, 0.3), (2, 0.2)]).unwrap();
        let q = Distribution::from_weights([(0, 0.7), (2, 0.1), (3, 0.2)]).unwrap();
        let r = p.residual(&q).unwrap();
        // (p − q)+ = {1: 0.3, 2: 0.1} → normalised {1: 0.75, 2: 0.25}
        assert_eq!(
            r.entries().iter().map(|e| e.0).collect::<Vec<_>>(),
            vec![1, 2]
        );
        assert!(approx(r.prob(1), 0.75) && approx(r.prob(2), 0.25));
        assert_eq!(p.residual(&p), None);
    }

    #[test]
    fn sampling_follows_the_probabilities() {
        let dist = Distribution::from_weights([(0, 1.0), (1, 3.0)]).unwrap();
        let mut rng = ChaCha20Rng::seed_from_u64(3);
        let n = 100_000;
        let ones = (0..n).filter(|_| dist.sample(&mut rng) == 1).count();
        // binomial sd = sqrt(n·0.75·0.25) ≈ 137; allow 6 sd
        assert!(
            (ones as f64 - 0.75 * n as f64).abs() < 6.0 * 137.0,
            "{ones}"
        );
    }
}
