//! The scheduling decision, as a pure function: given the sequences and the free pages, which
//! tokens of which sequences run in the next step, and who is preempted to make room. No
//! actors, tensors or models here, so every rule is unit-tested directly.
//!
//! Rules, in order:
//! 1. Running sequences that are decoding (one pending token, plus any drafts to verify) go
//!    first, highest rank first: a long prompt never stalls a running stream.
//! 2. Then prefill chunks (at most `prefill_chunk` tokens each): running sequences still in
//!    their prompt, then waiting sequences by rank, while the token budget and sequence limit
//!    allow.
//! 3. A decode that needs a page when none is free preempts the lowest-ranked running
//!    sequence not yet granted (its pages are released; it resumes later by recompute). A
//!    prefill that does not fit waits instead of preempting.
//! 4. Unless nothing at all can run: running prompts part-way through their prefill can hold
//!    every page between them, each waiting for pages another holds. Once no idle session is
//!    left to give pages up, [`unblock_prefill`] lets the highest-ranked of them go on by
//!    preempting the lowest-ranked others.

use super::sequence::{SeqId, Sequence};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Most tokens (rows) in one step.
    pub max_batch_tokens: usize,
    /// Most sequences in one step.
    pub max_seqs: usize,
    /// Most prompt tokens one sequence prefills per step.
    pub prefill_chunk: usize,
    pub page_size: usize,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            max_batch_tokens: 2048,
            max_seqs: 64,
            prefill_chunk: 512,
            page_size: 16,
        }
    }
}

/// One sequence's share of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grant {
    pub seq_id: SeqId,
    /// Tokens from `num_computed` on whose K/V this step computes (pending + drafts).
    pub num_tokens: usize,
    /// Of those, drafts being verified (the last `num_drafts` rows).
    pub num_drafts: usize,
    /// Pages the session must add before the step.
    pub num_new_pages: usize,
    /// The grant reaches the end of the sequence's tokens, so its last row(s) need logits.
    pub wants_logits: bool,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepPlan {
    pub grants: Vec<Grant>,
    /// Running sequences to preempt before the step (release all pages, recompute later).
    pub preempted: Vec<SeqId>,
}

impl StepPlan {
    pub fn num_tokens(&self) -> usize {
        self.grants.iter().map(|g| g.num_tokens).sum()
    }
    pub fn is_empty(&self) -> bool {
        self.grants.is_empty()
    }
}

/// Decides the next step. `running` are sequences that have been admitted (they may hold
/// pages); `waiting` are queued ones. `free_pages` is what the pool can hand out now.
pub fn plan_step(
    running: &[&Sequence],
    waiting: &[&Sequence],
    free_pages: usize,
    cfg: &SchedulerConfig,
) -> StepPlan {
    let mut plan = StepPlan::default();
    let mut budget = cfg.max_batch_tokens;
    let mut free = free_pages;
    let mut by_rank: Vec<&Sequence> = running.to_vec();
    by_rank.sort_by_key(|s| s.rank());

    // 1. Decode and verify rows.
    for i in 0..by_rank.len() {
        let seq = by_rank[i];
        if seq.is_prefilling() || plan.preempted.contains(&seq.id) {
            continue;
        }
        if plan.grants.len() == cfg.max_seqs {
            break;
        }
        let mut num_drafts = seq.drafts.len();
        let mut num_tokens = seq.num_pending() + num_drafts;
        let mut need = seq.pages_needed(num_tokens, cfg.page_size);
        if num_drafts > 0 && (num_tokens > budget || need > free) {
            // Drafts are optional: they never preempt anyone or crowd out a decode.
            num_drafts = 0;
            num_tokens = seq.num_pending();
            need = seq.pages_needed(num_tokens, cfg.page_size);
        }
        if num_tokens > budget || num_tokens == 0 {
            continue;
        }
        while need > free {
            // Preempt the lowest-ranked running sequence that has no grant and holds pages.
            let victim = by_rank[i + 1..]
                .iter()
                .rev()
                .find(|s| !plan.preempted.contains(&s.id) && s.num_pages > 0);
            match victim {
                Some(v) => {
                    plan.preempted.push(v.id);
                    free += v.num_pages;
                }
                None => break,
            }
        }
        if need > free {
            // Nobody left to preempt: this one yields its own pages and recomputes later.
            plan.preempted.push(seq.id);
            free += seq.num_pages;
            continue;
        }
        free -= need;
        budget -= num_tokens;
        plan.grants.push(Grant {
            seq_id: seq.id,
            num_tokens,
            num_drafts,
            num_new_pages: need,
            wants_logits: true,
        });
    }

    // 2. Prefill chunks: running sequences first, then waiting ones by rank.
    let mut queued: Vec<&Sequence> = waiting.to_vec();
    queued.sort_by_key(|s| s.rank());
    let prefilling = by_rank
        .iter()
        .filter(|s| s.is_prefilling() && !plan.preempted.contains(&s.id))
        .chain(queued.iter());
    for seq in prefilling {
        if budget == 0 || plan.grants.len() == cfg.max_seqs {
            break;
        }
        let grant = next_chunk(seq, budget, cfg);
        if grant.num_new_pages > free {
            // Prefill waits for pages rather than preempting; later arrivals wait behind it so
            // a large prompt is not starved by small ones.
            break;
        }
        free -= grant.num_new_pages;
        budget -= grant.num_tokens;
        plan.grants.push(grant);
    }
    plan
}

/// The grant of `seq`'s next prompt chunk within `budget` rows (with the pages it needs).
fn next_chunk(seq: &Sequence, budget: usize, cfg: &SchedulerConfig) -> Grant {
    let chunk = seq
        .max_chunk
        .map_or(cfg.prefill_chunk, |c| c.min(cfg.prefill_chunk));
    let num_tokens = seq.num_pending().min(chunk).min(budget);
    Grant {
        seq_id: seq.id,
        num_tokens,
        num_drafts: 0,
        num_new_pages: seq.pages_needed(num_tokens, cfg.page_size),
        wants_logits: num_tokens == seq.num_pending(),
    }
}

/// The step that breaks a stall among prompts being prefilled (rule 4): the highest-ranked
/// running sequence still in its prompt gets its next chunk, and the lowest-ranked other
/// running sequences holding pages are preempted until it fits. Empty when there is no such
/// sequence or when even preempting all the others would not free enough (the pages are held
/// elsewhere: the scheduler then waits for them).
pub fn unblock_prefill(
    running: &[&Sequence],
    free_pages: usize,
    cfg: &SchedulerConfig,
) -> StepPlan {
    let mut by_rank: Vec<&Sequence> = running.to_vec();
    by_rank.sort_by_key(|s| s.rank());
    let Some(head) = by_rank.iter().copied().find(|s| s.is_prefilling()) else {
        return StepPlan::default();
    };
    let grant = next_chunk(head, cfg.max_batch_tokens, cfg);
    let need = grant.num_new_pages;
    let mut plan = StepPlan::default();
    let mut free = free_pages;
    for victim in by_rank.iter().rev() {
        if free >= need {
            break;
        }
        if victim.id != head.id && victim.num_pages > 0 {
            plan.preempted.push(victim.id);
            free += victim.num_pages;
        }
    }
    if need > free {
        return StepPlan::default();
    }
    plan.grants.push(grant);
    plan
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> SchedulerConfig {
        SchedulerConfig {
            max_batch_tokens: 64,
            max_seqs: 8,
            prefill_chunk: 32,
            page_size: 4,
        }
    }

    /// A sequence with `prompt` tokens, `computed` of them done, holding the pages it needs.
    fn seq(id: SeqId, prompt: usize, computed: usize) -> Sequence {
        let mut s = Sequence::new(id, id, vec![1; prompt], computed, computed.div_ceil(4));
        s.num_computed = computed;
        s
    }

    fn decoding(id: SeqId, len: usize) -> Sequence {
        seq(id, len, len - 1)
    }

    #[test]
    fn a_sequence_with_a_smaller_chunk_gets_no_more_rows_a_step() {
        let mut scored = seq(1, 200, 0);
        scored.max_chunk = Some(8);
        let plain = seq(2, 200, 0);
        let plan = plan_step(&[], &[&scored, &plain], 100, &cfg());
        assert_eq!(plan.grants[0].num_tokens, 8);
        assert_eq!(plan.grants[1].num_tokens, 32);
    }

    #[test]
    fn active_decodes_are_scheduled_before_new_prompts() {
        let a = decoding(1, 10);
        let b = decoding(2, 20);
        let newcomer = seq(3, 200, 0);
        let plan = plan_step(&[&a, &b], &[&newcomer], 100, &cfg());
        assert_eq!(plan.grants[0].seq_id, 1);
        assert_eq!(plan.grants[1].seq_id, 2);
        assert_eq!(plan.grants[2].seq_id, 3);
        assert_eq!(plan.grants[2].num_tokens, 32, "prefill is chunked");
        assert!(
            !plan.grants[2].wants_logits,
            "mid-prompt chunk needs no logits"
        );
    }

    #[test]
    fn the_token_budget_is_never_exceeded() {
        let running: Vec<Sequence> = (0..5).map(|i| decoding(i, 9)).collect();
        let waiting: Vec<Sequence> = (10..14).map(|i| seq(i, 100, 0)).collect();
        let r: Vec<&Sequence> = running.iter().collect();
        let w: Vec<&Sequence> = waiting.iter().collect();
        let plan = plan_step(&r, &w, 1000, &cfg());
        assert_eq!(plan.num_tokens(), 64);
        assert_eq!(
            plan.grants.len(),
            5 + 2,
            "5 decodes + 32 + 27 prefill tokens"
        );
        assert_eq!(plan.grants[6].num_tokens, 64 - 5 - 32);
    }

    #[test]
    fn decode_is_never_starved_by_a_long_prefill() {
        let long = seq(1, 10_000, 512);
        let d = decoding(2, 40);
        for _ in 0..3 {
            let plan = plan_step(&[&long, &d], &[], 10_000, &cfg());
            assert_eq!(plan.grants[0].seq_id, 2);
            assert_eq!(plan.grants[0].num_tokens, 1);
        }
    }

    #[test]
    fn the_sequence_limit_is_respected() {
        let running: Vec<Sequence> = (0..12).map(|i| decoding(i, 9)).collect();
        let r: Vec<&Sequence> = running.iter().collect();
        let plan = plan_step(&r, &[], 1000, &cfg());
        assert_eq!(plan.grants.len(), 8);
    }

    #[test]
    fn a_decode_without_pages_preempts_the_lowest_ranked_sequence() {
        // Sequence 1 needs a new page (8 computed, page size 4); no page is free.
        let a = decoding(1, 9);
        let mut b = decoding(2, 6);
        b.priority = -1;
        let c = decoding(3, 6);
        let plan = plan_step(&[&a, &b, &c], &[], 0, &cfg());
        assert_eq!(plan.preempted, vec![2], "lowest priority goes first");
        assert_eq!(plan.grants[0].seq_id, 1);
        assert_eq!(plan.grants[0].num_new_pages, 1);
        assert!(!plan.grants.iter().any(|g| g.seq_id == 2));
    }

    #[test]
    fn a_lone_sequence_without_pages_yields_instead_of_failing() {
        let a = decoding(1, 9);
        let plan = plan_step(&[&a], &[], 0, &cfg());
        assert!(plan.grants.is_empty());
        assert_eq!(plan.preempted, vec![1]);
    }

    #[test]
    fn prompts_that_hold_every_page_between_them_unblock_by_preempting_the_lowest_ranked() {
        // Three prompts of 100 tokens, 40 computed each: 10 pages each, none free. The
        // ordinary plan runs nothing (each waits for pages another holds).
        let a = seq(1, 100, 40);
        let b = seq(2, 100, 40);
        let c = seq(3, 100, 40);
        let stuck = plan_step(&[&c, &a, &b], &[], 0, &cfg());
        assert!(stuck.is_empty() && stuck.preempted.is_empty());
        let plan = unblock_prefill(&[&c, &a, &b], 0, &cfg());
        // The oldest goes on with a whole chunk (32 tokens: 8 pages); the youngest yields.
        assert_eq!(plan.preempted, vec![3]);
        assert_eq!(plan.grants.len(), 1);
        assert_eq!(plan.grants[0].seq_id, 1);
        assert_eq!(plan.grants[0].num_tokens, 32);
        assert_eq!(plan.grants[0].num_new_pages, 8);
        // A higher priority outranks age.
        let mut urgent = seq(4, 100, 40);
        urgent.priority = 5;
        let plan = unblock_prefill(&[&a, &urgent], 0, &cfg());
        assert_eq!(
            (plan.grants[0].seq_id, plan.preempted.clone()),
            (4, vec![1])
        );
    }

    #[test]
    fn unblocking_preempts_nobody_when_that_would_not_free_enough() {
        // The only other running sequence holds 1 page; the chunk needs 8.
        let head = seq(1, 100, 40);
        let small = seq(2, 3, 2);
        assert!(unblock_prefill(&[&head, &small], 0, &cfg()).is_empty());
        assert!(unblock_prefill(&[&head, &small], 0, &cfg())
            .preempted
            .is_empty());
        // Nobody is in a prompt: nothing to unblock.
        let d = decoding(3, 20);
        assert!(unblock_prefill(&[&d], 0, &cfg()).is_empty());
    }

    #[test]
    fn prefill_waits_for_pages_instead_of_preempting() {
        let a = decoding(1, 8);
        let newcomer = seq(2, 40, 0);
        let plan = plan_step(&[&a], &[&newcomer], 3, &cfg());
        assert!(plan.preempted.is_empty());
        assert_eq!(
            plan.grants.len(),
            1,
            "only the decode (which needs no page)"
        );
    }

    #[test]
    fn waiting_prompts_are_admitted_oldest_first_within_a_priority() {
        let w: Vec<Sequence> = [5u64, 3, 4].iter().map(|&i| seq(i, 20, 0)).collect();
        let refs: Vec<&Sequence> = w.iter().collect();
        let plan = plan_step(&[], &refs, 100, &cfg());
        let order: Vec<SeqId> = plan.grants.iter().map(|g| g.seq_id).collect();
        assert_eq!(order, vec![3, 4, 5]);
    }

    #[test]
    fn verify_rows_are_granted_with_the_pending_token() {
        let mut a = decoding(1, 10);
        a.drafts = vec![7, 8, 9];
        let plan = plan_step(&[&a], &[], 10, &cfg());
        assert_eq!(plan.grants[0].num_tokens, 4);
        assert_eq!(plan.grants[0].num_drafts, 3);
        assert_eq!(
            plan.grants[0].num_new_pages, 1,
            "positions 9..13 cross into page 3"
        );
    }

    #[test]
    fn drafts_that_do_not_fit_are_dropped_instead_of_preempting() {
        // Sequence 1 has 8 computed (2 full pages); its pending token + 3 drafts need a page.
        let mut a = decoding(1, 9);
        a.num_pages = 3;
        a.drafts = vec![7, 8, 9, 10, 11, 12];
        let b = decoding(2, 6);
        let plan = plan_step(&[&a, &b], &[], 0, &cfg());
        assert!(plan.preempted.is_empty());
        assert_eq!(plan.grants[0].num_drafts, 0);
        assert_eq!(plan.grants[0].num_tokens, 1);
    }

    #[test]
    fn a_finished_prompt_chunk_asks_for_logits() {
        let s = seq(1, 40, 20);
        let plan = plan_step(&[&s], &[], 100, &cfg());
        assert_eq!(plan.grants[0].num_tokens, 20);
        assert!(plan.grants[0].wants_logits);
    }
}
