//! The scheduler's view of one sequence: which tokens it has, how many of them have K/V in
//! pages, and how many pages its session holds. Prefill, decode and verification are the same
//! thing at different sizes: a step grants a sequence some of its pending tokens.

/// Identifies a sequence (one request's generation) inside the engine.
pub type SeqId = u64;

#[derive(Debug, Clone, PartialEq)]
pub struct Sequence {
    pub id: SeqId,
    /// Higher runs first and is preempted last.
    pub priority: i32,
    /// Admission order (lower is older); ties in priority go to the older sequence.
    pub arrival: u64,
    /// Prompt followed by generated tokens. The last one is pending once decoding starts: it
    /// was sampled but its K/V is not computed yet.
    pub tokens: Vec<u32>,
    pub num_prompt: usize,
    /// Positions whose K/V is in the session's pages.
    pub num_computed: usize,
    /// Pages the sequence's session holds (capacity = pages × page size).
    pub num_pages: usize,
    /// Speculative drafts waiting to be verified after the pending token.
    pub drafts: Vec<u32>,
    /// Most prompt rows one step may compute for it, below `--prefill-chunk` (a scored
    /// prompt's rows each keep a whole row of logits).
    pub max_chunk: Option<usize>,
}

impl Sequence {
    pub fn new(
        id: SeqId,
        arrival: u64,
        tokens: Vec<u32>,
        num_cached: usize,
        num_pages: usize,
    ) -> Self {
        let num_prompt = tokens.len();
        Self {
            id,
            priority: 0,
            arrival,
            tokens,
            num_prompt,
            num_computed: num_cached,
            num_pages,
            drafts: Vec::new(),
            max_chunk: None,
        }
    }

    /// Tokens whose K/V the next steps must compute (not counting drafts).
    pub fn num_pending(&self) -> usize {
        self.tokens.len() - self.num_computed
    }

    /// Still working through its prompt (or a recompute after preemption).
    pub fn is_prefilling(&self) -> bool {
        self.num_pending() > 1
    }

    pub fn num_generated(&self) -> usize {
        self.tokens.len() - self.num_prompt
    }

    /// Pages needed to hold `num_computed + extra` positions beyond those held.
    pub fn pages_needed(&self, extra: usize, page_size: usize) -> usize {
        (self.num_computed + extra)
            .div_ceil(page_size)
            .saturating_sub(self.num_pages)
    }

    /// Sort key: higher priority first, then older first.
    pub fn rank(&self) -> (std::cmp::Reverse<i32>, u64) {
        (std::cmp::Reverse(self.priority), self.arrival)
    }
}
