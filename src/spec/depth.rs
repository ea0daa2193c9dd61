//! Adaptive draft depth: per sequence and drafter, the acceptance rate at each depth position
//! (given every earlier draft was accepted), and the depth that maximises the expected
//! committed tokens per unit of step time.

/// The deepest draft any drafter proposes.
pub const MAX_DEPTH: usize = 16;

/// Conditional acceptance counts by depth position.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Acceptance {
    /// Drafts at position `d` that were verified with every earlier draft accepted.
    pub tried: [u32; MAX_DEPTH],
    pub accepted: [u32; MAX_DEPTH],
}

impl Acceptance {
    /// Records a round that verified `num_drafted` drafts and accepted the first `num_accepted`.
    pub fn record(&mut self, num_drafted: usize, num_accepted: usize) {
        let reached = (num_accepted + 1).min(num_drafted).min(MAX_DEPTH);
        for d in 0..reached {
            self.tried[d] += 1;
            if d < num_accepted {
                self.accepted[d] += 1;
            }
        }
    }

    /// Estimated probability that the draft at each position `0..n` is accepted given all
    /// earlier ones were: the counts with two pseudo-observations at the previous position's
    /// rate (`first_prior` for the first), so a position never tried yet is expected to do as
    /// well as the one before it — which lets the depth grow while drafts keep being accepted.
    pub fn rates(&self, n: usize, first_prior: f64) -> Vec<f64> {
        let mut rates = Vec::with_capacity(n);
        let mut prior = first_prior;
        for d in 0..n.min(MAX_DEPTH) {
            let r = (self.accepted[d] as f64 + 2.0 * prior) / (self.tried[d] as f64 + 2.0);
            rates.push(r);
            prior = r;
        }
        rates
    }

    /// The depth in `0..=max_depth` that maximises expected tokens committed per step
    /// (`1 + Σ_d Π_{j≤d} rate(j)`) over the step's relative cost (`1 + row_cost · depth`);
    /// 0 means plain decoding pays more than it gains. `row_cost` is everything one more draft
    /// costs relative to a decode step: its verify row, and for a model drafter its forward.
    pub fn best_depth(&self, max_depth: usize, row_cost: f64, first_prior: f64) -> usize {
        let mut best = (0, 1.0);
        let mut expected = 1.0;
        let mut reach = 1.0;
        for (d, rate) in self.rates(max_depth, first_prior).into_iter().enumerate() {
            reach *= rate;
            expected += reach;
            let per_cost = expected / (1.0 + row_cost * (d + 1) as f64);
            if per_cost > best.1 {
                best = (d + 1, per_cost);
            }
        }
        best.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_drafter_that_is_always_right_drafts_deep() {
        let mut a = Acceptance::default();
        for _ in 0..50 {
            a.record(8, 8);
        }
        assert_eq!(a.best_depth(8, 0.05, 0.5), 8);
    }

    #[test]
    fn a_drafter_that_is_always_wrong_is_switched_off() {
        let mut a = Acceptance::default();
        for _ in 0..20 {
            a.record(4, 0);
        }
        assert_eq!(a.tried[1], 0, "position 1 is never reached");
        assert_eq!(a.best_depth(8, 0.1, 0.5), 0);
    }

    #[test]
    fn costly_rows_make_the_depth_shallower() {
        let mut a = Acceptance::default();
        for i in 0..40 {
            a.record(4, if i % 3 == 0 { 0 } else { 4 });
        }
        let (cheap, costly) = (a.best_depth(8, 0.02, 0.5), a.best_depth(8, 0.9, 0.5));
        assert!(cheap > costly, "{cheap} vs {costly}: {:?}", a.rates(8, 0.5));
    }

    #[test]
    fn a_drafter_with_a_hopeful_prior_is_tried_at_a_cost_a_coin_toss_is_not() {
        let a = Acceptance::default();
        // A draft model costs about half a decode step per draft (its forward + a verify row).
        assert_eq!(a.best_depth(8, 0.6, 0.5), 0);
        assert!(a.best_depth(8, 0.6, 0.8) > 0);
    }
}
