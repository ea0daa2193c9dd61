//! Context n-gram drafting ("prompt lookup"): the longest recent suffix of the sequence that
//! occurred earlier proposes what followed it there. Agents' file rewrites and edits repeat
//! long spans of their context, so this drafter is nearly free and often right. The same lookup
//! over an OpenAI Predicted Output proposes the predicted text.

/// Up to `k` draft tokens for `tokens` (prompt + generated, the last one pending): the longest
/// suffix of `max_ngram` down to `min_ngram` tokens that occurs earlier, and what followed its
/// most recent earlier occurrence. A continuation that runs into the suffix itself repeats the
/// period (`a b a b` → `a b …`). Empty when nothing matches.
pub fn lookup(tokens: &[u32], k: usize, min_ngram: usize, max_ngram: usize) -> Vec<u32> {
    let len = tokens.len();
    if k == 0 {
        return Vec::new();
    }
    for n in (min_ngram.max(1)..=max_ngram).rev() {
        if len <= n {
            continue;
        }
        let suffix = &tokens[len - n..];
        let found = (0..len - n).rev().find(|&i| &tokens[i..i + n] == suffix);
        if let Some(i) = found {
            return continue_from(tokens, i + n, k);
        }
    }
    Vec::new()
}

/// `k` tokens of `tokens ++ draft` starting at `from` (< `tokens.len()`).
fn continue_from(tokens: &[u32], from: usize, k: usize) -> Vec<u32> {
    let mut draft = Vec::with_capacity(k);
    for j in 0..k {
        let at = from + j;
        let t = if at < tokens.len() {
            tokens[at]
        } else {
            draft[at - tokens.len()]
        };
        draft.push(t);
    }
    draft
}

/// Up to `k` draft tokens from a predicted output: its start while nothing is generated, then
/// what follows the longest suffix of `generated` (up to `max_ngram` tokens) found in
/// `prediction`, the occurrence nearest to where the output is now. Empty when nothing matches.
pub fn lookup_prediction(
    prediction: &[u32],
    generated: &[u32],
    k: usize,
    max_ngram: usize,
) -> Vec<u32> {
    if generated.is_empty() {
        return prediction[..k.min(prediction.len())].to_vec();
    }
    let here = generated.len();
    for n in (1..=max_ngram.min(generated.len())).rev() {
        let suffix = &generated[generated.len() - n..];
        let best = (0..prediction.len().saturating_sub(n))
            .filter(|&i| &prediction[i..i + n] == suffix)
            .min_by_key(|&i| (i + n).abs_diff(here));
        if let Some(i) = best {
            let from = i + n;
            return prediction[from..(from + k).min(prediction.len())].to_vec();
        }
    }
    Vec::new()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_suffix_wins_over_a_more_recent_shorter_one() {
        //             0  1  2  3  4  5  6  7  8
        let tokens = [1, 2, 3, 9, 5, 3, 7, 1, 2, 3];
        // suffix [1 2 3] occurred at 0 → followed by 9 5 3; [3] alone last occurred at 5 → 7.
        assert_eq!(lookup(&tokens, 3, 1, 4), vec![9, 5, 3]);
        assert_eq!(lookup(&tokens, 3, 1, 1), vec![7, 1, 2]);
    }

    #[test]
    fn the_most_recent_occurrence_is_used() {
        let tokens = [4, 5, 6, 4, 5, 8, 4, 5];
        assert_eq!(lookup(&tokens, 1, 2, 4), vec![8]);
    }

    #[test]
    fn a_repeating_pattern_continues_past_the_end() {
        let tokens = [1, 2, 1, 2, 1, 2];
        assert_eq!(lookup(&tokens, 5, 1, 4), vec![1, 2, 1, 2, 1]);
    }

    #[test]
    fn no_match_or_too_short_a_match_drafts_nothing() {
        assert!(lookup(&[1, 2, 3, 4], 4, 1, 4).is_empty());
        assert!(
            lookup(&[1, 2, 3, 1], 4, 2, 4).is_empty(),
            "only a 1-gram matches"
        );
        assert!(lookup(&[1, 2, 1], 0, 1, 4).is_empty());
    }

    #[test]
    fn a_prediction_drafts_its_start_then_follows_the_output() {
        let prediction = [10, 11, 12, 13, 11, 14];
        assert_eq!(lookup_prediction(&prediction, &[], 3, 4), vec![10, 11, 12]);
        assert_eq!(
            lookup_prediction(&prediction, &[10, 11], 2, 4),
            vec![12, 13]
        );
        // [11] occurs twice; the occurrence nearest the output's position (5) wins.
        assert_eq!(
            lookup_prediction(&prediction, &[7, 7, 7, 7, 11], 1, 4),
            vec![14]
        );
        assert!(lookup_prediction(&prediction, &[99], 3, 4).is_empty());
        assert!(
            lookup_prediction(&prediction, &[14], 3, 4).is_empty(),
            "at the end"
        );
    }
}
