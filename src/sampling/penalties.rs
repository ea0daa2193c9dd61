//! Logit processors that run before selection: `logit_bias`, then the repetition penalty, then
//! the presence and frequency penalties.
//!
//! They touch only the logits of tokens that are biased or appear in the history, so their cost
//! is the history length plus one copy of the row, never a pass per token of history over the
//! vocabulary. Their scratch (a count per token, a bit per token) is zero between calls.

use super::params::{SamplingParams, BAN_BIAS};

/// The tokens a sequence has seen so far, for penalties.
#[derive(Debug, Clone, Copy, Default)]
pub struct TokenHistory<'a> {
    /// The prompt's token ids (the repetition penalty looks at these).
    pub prompt: &'a [u32],
    /// The token ids generated so far in this response (every penalty looks at these).
    pub generated: &'a [u32],
}

impl<'a> TokenHistory<'a> {
    /// No history: penalties have nothing to act on.
    pub const EMPTY: TokenHistory<'static> = TokenHistory {
        prompt: &[],
        generated: &[],
    };

    pub fn new(prompt: &'a [u32], generated: &'a [u32]) -> Self {
        Self { prompt, generated }
    }

    /// The prompt tokens the penalties of `params` read at this step: the repetition penalty's
    /// window of them (presence and frequency penalties read only the generated tokens).
    pub fn prompt_read_by(&self, params: &SamplingParams) -> &'a [u32] {
        if params.repetition_penalty == 1.0 {
            &[]
        } else {
            self.recent(params.repetition_window).0
        }
    }

    /// The last `window` tokens of prompt followed by generated (all of them when 0), as the
    /// part from the prompt and the part from the generated tokens.
    fn recent(&self, window: u32) -> (&'a [u32], &'a [u32]) {
        let total = self.prompt.len() + self.generated.len();
        let skip = match window {
            0 => 0,
            w => total.saturating_sub(w as usize),
        };
        if skip >= self.prompt.len() {
            (&[], &self.generated[skip - self.prompt.len()..])
        } else {
            (&self.prompt[skip..], self.generated)
        }
    }
}

/// Reusable scratch for the penalties; sized to the vocabulary on first use, all zero between
/// calls.
#[derive(Debug, Default)]
pub(crate) struct PenaltyScratch {
    /// Occurrences of each token in the generated tokens (frequency / presence penalties).
    counts: Vec<u32>,
    /// One bit per token: already penalised by the repetition penalty in this call.
    seen: Vec<u64>,
}

/// True when `apply` would change some logit for this history.
pub(crate) fn has_effect(params: &SamplingParams, history: &TokenHistory) -> bool {
    if !params.modifies_logits() {
        return false;
    }
    let any_history = !(history.prompt.is_empty() && history.generated.is_empty());
    !params.logit_bias.is_empty()
        || (params.repetition_penalty != 1.0 && any_history)
        || !history.generated.is_empty()
}

/// Applies bias and penalties in place to `logits` (`[num_vocab]`). History tokens outside the
/// vocabulary have no logit to change and are skipped; bias keys must have been validated.
pub(crate) fn apply(
    params: &SamplingParams,
    history: &TokenHistory,
    logits: &mut [f32],
    scratch: &mut PenaltyScratch,
) {
    apply_logit_bias(params, logits);
    if params.repetition_penalty != 1.0 {
        let (prompt, generated) = history.recent(params.repetition_window);
        apply_repetition_penalty(
            params.repetition_penalty,
            prompt,
            generated,
            logits,
            scratch,
        );
    }
    if params.presence_penalty != 0.0 || params.frequency_penalty != 0.0 {
        apply_openai_penalties(params, history.generated, logits, scratch);
    }
}

fn apply_logit_bias(params: &SamplingParams, logits: &mut [f32]) {
    for (&token_id, &bias) in &params.logit_bias {
        if let Some(logit) = logits.get_mut(token_id as usize) {
            *logit = if bias <= BAN_BIAS {
                f32::NEG_INFINITY
            } else {
                *logit + bias
            };
        }
    }
}

/// HF `RepetitionPenaltyLogitsProcessor` / llama.cpp `penalty_repeat`: once per distinct token.
fn apply_repetition_penalty(
    penalty: f32,
    prompt: &[u32],
    generated: &[u32],
    logits: &mut [f32],
    scratch: &mut PenaltyScratch,
) {
    let num_vocab = logits.len();
    if scratch.seen.len() < num_vocab.div_ceil(64) {
        scratch.seen.resize(num_vocab.div_ceil(64), 0);
    }
    let tokens = || prompt.iter().chain(generated).map(|&t| t as usize);
    for t in tokens().filter(|&t| t < num_vocab) {
        let (word, bit) = (t / 64, 1u64 << (t % 64));
        if scratch.seen[word] & bit == 0 {
            scratch.seen[word] |= bit;
            let logit = &mut logits[t];
            *logit = if *logit > 0.0 {
                *logit / penalty
            } else {
                *logit * penalty
            };
        }
    }
    for t in tokens().filter(|&t| t < num_vocab) {
        scratch.seen[t / 64] = 0;
    }
}

/// OpenAI: `logit -= count * frequency_penalty + (count > 0) * presence_penalty`, counting only
/// generated tokens.
fn apply_openai_penalties(
    params: &SamplingParams,
    generated: &[u32],
    logits: &mut [f32],
    scratch: &mut PenaltyScratch,
) {
    let num_vocab = logits.len();
    if scratch.counts.len() < num_vocab {
        scratch.counts.resize(num_vocab, 0);
    }
    let tokens = || {
        generated
            .iter()
            .map(|&t| t as usize)
            .filter(|&t| t < num_vocab)
    };
    for t in tokens() {
        scratch.counts[t] += 1;
    }
    // The second pass applies each distinct token once and resets its count to zero.
    for t in tokens() {
        let count = std::mem::take(&mut scratch.counts[t]);
        if count > 0 {
            logits[t] -= count as f32 * params.frequency_penalty + params.presence_penalty;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn run(params: &SamplingParams, prompt: &[u32], generated: &[u32], logits: &[f32]) -> Vec<f32> {
        let mut out = logits.to_vec();
        let mut scratch = PenaltyScratch::default();
        apply(
            params,
            &TokenHistory::new(prompt, generated),
            &mut out,
            &mut scratch,
        );
        assert!(
            scratch.counts.iter().all(|&c| c == 0),
            "counts must be reset"
        );
        assert!(scratch.seen.iter().all(|&w| w == 0), "bits must be reset");
        out
    }

    #[test]
    fn presence_penalty_subtracts_once_per_generated_token() {
        let params = SamplingParams {
            presence_penalty: 0.5,
            ..SamplingParams::default()
        };
        let out = run(&params, &[0], &[1, 1, 3], &[1.0, 1.0, 1.0, -1.0]);
        assert_eq!(
            out,
            vec![1.0, 0.5, 1.0, -1.5],
            "prompt token 0 is not penalised"
        );
    }

    #[test]
    fn frequency_penalty_scales_with_count() {
        let params = SamplingParams {
            frequency_penalty: 0.25,
            ..SamplingParams::default()
        };
        let out = run(&params, &[], &[2, 1, 2, 2], &[0.0, 2.0, 2.0]);
        assert_eq!(out, vec![0.0, 1.75, 1.25]);
    }

    #[test]
    fn presence_and_frequency_combine() {
        let params = SamplingParams {
            presence_penalty: 1.0,
            frequency_penalty: -0.5,
            ..SamplingParams::default()
        };
        let out = run(&params, &[], &[0, 0], &[3.0, 3.0]);
        assert_eq!(out, vec![3.0 - (2.0 * -0.5 + 1.0), 3.0]);
    }

    #[test]
    fn repetition_penalty_divides_positive_and_multiplies_negative_once() {
        let params = SamplingParams {
            repetition_penalty: 2.0,
            ..SamplingParams::default()
        };
        let out = run(&params, &[0, 1, 1], &[2, 0], &[4.0, -3.0, 0.0, 4.0]);
        assert_eq!(out, vec![2.0, -6.0, 0.0, 4.0]);
    }

    #[test]
    fn repetition_window_counts_from_the_end_of_prompt_plus_generated() {
        let params = SamplingParams {
            repetition_penalty: 2.0,
            repetition_window: 2,
            ..SamplingParams::default()
        };
        // prompt [0, 1] + generated [2] → the last two are 1 and 2.
        let out = run(&params, &[0, 1], &[2], &[4.0, 4.0, 4.0]);
        assert_eq!(out, vec![4.0, 2.0, 2.0]);
        // window inside the generated tokens only
        let out = run(&params, &[0, 1], &[2, 2, 2], &[4.0, 4.0, 4.0]);
        assert_eq!(out, vec![4.0, 4.0, 2.0]);
    }

    #[test]
    fn bias_adds_and_minus_100_bans() {
        let params = SamplingParams {
            logit_bias: BTreeMap::from([(0, 1.5), (1, -100.0), (2, 100.0)]),
            ..SamplingParams::default()
        };
        let out = run(&params, &[], &[], &[1.0, 50.0, -3.0]);
        assert_eq!(out, vec![2.5, f32::NEG_INFINITY, 97.0]);
    }

    #[test]
    fn out_of_vocab_history_is_ignored() {
        let params = SamplingParams {
            repetition_penalty: 2.0,
            frequency_penalty: 1.0,
            ..SamplingParams::default()
        };
        let out = run(&params, &[99], &[1, 1000], &[1.0, 1.0]);
        assert_eq!(out, vec![1.0, 1.0 / 2.0 - 1.0]);
    }

    #[test]
    fn has_effect_only_when_something_would_change() {
        let rep = SamplingParams {
            repetition_penalty: 1.2,
            ..SamplingParams::default()
        };
        let pres = SamplingParams {
            presence_penalty: 0.5,
            ..SamplingParams::default()
        };
        let prompt_only = TokenHistory::new(&[1, 2], &[]);
        assert!(!has_effect(&SamplingParams::default(), &prompt_only));
        assert!(has_effect(&rep, &prompt_only));
        assert!(!has_effect(&pres, &prompt_only));
        assert!(has_effect(&pres, &TokenHistory::new(&[], &[3])));
    }
}
