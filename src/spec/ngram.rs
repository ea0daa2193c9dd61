//! Context n-gram drafting ("prompt lookup"): the longest recent suffix of the sequence that
//! occurred earlier proposes what followed it there. Agents' file rewrites and edits repeat
//! long spans of their context, so this drafter is nearly free and often right. The same lookup
//! over an OpenAI Predicted Output proposes the predicted text.

/// A draft and how long a context match it rests on (longer is more trustworthy).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Match {
    pub len: usize,
    pub draft: Vec<u32>,
}

/// Up to `k` draft tokens for `tokens` (prompt + generated, the last one pending): the earlier
/// position whose preceding tokens match the longest suffix of the sequence (at least
/// `min_ngram`, at most `max_ngram` tokens; the most recent among equally long matches), and what
/// followed it there. A long match pins the draft to the right copy of a repeated span (an
/// edited file, not a similar line nearby). A continuation that runs into the suffix itself
/// repeats the period (`a b a b` → `a b …`).
pub fn lookup(tokens: &[u32], k: usize, min_ngram: usize, max_ngram: usize) -> Option<Match> {
    let len = tokens.len();
    if k == 0 || len < 2 {
        return None;
    }
    let (n, i) = longest_match(tokens, len - 1, tokens, max_ngram, |i| i as i64)?;
    (n >= min_ngram.max(1)).then(|| Match {
        len: n,
        draft: continue_from(tokens, i + 1, k),
    })
}

/// The position `i < search_end` in `corpus` whose tokens up to `i` match the longest suffix
/// of `tail` (at most `max_ngram`), as `(match length, i)`; ties go to the highest `rank(i)`.
fn longest_match(
    corpus: &[u32],
    search_end: usize,
    tail: &[u32],
    max_ngram: usize,
    rank: impl Fn(usize) -> i64,
) -> Option<(usize, usize)> {
    let &last = tail.last()?;
    let mut best: Option<(usize, i64, usize)> = None;
    for i in 0..search_end {
        if corpus[i] != last {
            continue;
        }
        let limit = max_ngram.min(i + 1).min(tail.len());
        let n = (0..limit)
            .take_while(|&j| corpus[i - j] == tail[tail.len() - 1 - j])
            .count();
        let r = rank(i);
        if best.is_none_or(|(bn, br, _)| (n, r) > (bn, br)) {
            best = Some((n, r, i));
        }
    }
    best.map(|(n, _, i)| (n, i))
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
/// what follows the longest suffix of the output (up to `max_ngram`) found in `prediction`, the
/// occurrence nearest to where the output is now (`num_generated`).
pub fn lookup_prediction(
    prediction: &[u32],
    tokens: &[u32],
    num_generated: usize,
    k: usize,
    max_ngram: usize,
) -> Option<Match> {
    if num_generated == 0 {
        let draft = prediction[..k.min(prediction.len())].to_vec();
        return (!draft.is_empty()).then_some(Match { len: 0, draft });
    }
    let tail = &tokens[tokens.len() - num_generated..];
    let end = prediction.len().saturating_sub(1);
    let rank = |i: usize| -((i + 1).abs_diff(num_generated) as i64);
    let (n, i) = longest_match(prediction, end, tail, max_ngram, rank)?;
    let from = i + 1;
    let draft = prediction[from..(from + k).min(prediction.len())].to_vec();
    (n > 0 && !draft.is_empty()).then_some(Match { len: n, draft })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn draft(m: Option<Match>) -> Vec<u32> {
        m.map(|m| m.draft).unwrap_or_default()
    }

    #[test]
    fn the_longest_suffix_wins_over_a_more_recent_shorter_one() {
        //             0  1  2  3  4  5  6  7  8
        let tokens = [1, 2, 3, 9, 5, 3, 7, 1, 2, 3];
        // suffix [1 2 3] occurred at 0 → followed by 9 5 3; [3] alone last occurred at 5 → 7.
        assert_eq!(draft(lookup(&tokens, 3, 1, 4)), vec![9, 5, 3]);
        assert_eq!(lookup(&tokens, 3, 1, 4).unwrap().len, 3);
        assert_eq!(draft(lookup(&tokens, 3, 1, 1)), vec![7, 1, 2]);
    }

    #[test]
    fn the_most_recent_occurrence_is_used() {
        let tokens = [4, 5, 6, 4, 5, 8, 4, 5];
        assert_eq!(draft(lookup(&tokens, 1, 2, 4)), vec![8]);
    }

    #[test]
    fn a_repeating_pattern_continues_past_the_end() {
        let tokens = [1, 2, 1, 2, 1, 2];
        assert_eq!(draft(lookup(&tokens, 5, 1, 4)), vec![1, 2, 1, 2, 1]);
    }

    #[test]
    fn no_match_or_too_short_a_match_drafts_nothing() {
        assert!(lookup(&[1, 2, 3, 4], 4, 1, 4).is_none());
        assert!(
            lookup(&[1, 2, 3, 1], 4, 2, 4).is_none(),
            "only a 1-gram matches"
        );
        assert!(lookup(&[1, 2, 1], 0, 1, 4).is_none());
    }

    #[test]
    fn a_prediction_drafts_its_start_then_follows_the_output() {
        let prediction = [10, 11, 12, 13, 11, 14];
        let p = |tokens: &[u32], n, k| draft(lookup_prediction(&prediction, tokens, n, k, 4));
        assert_eq!(p(&[1], 0, 3), vec![10, 11, 12]);
        assert_eq!(p(&[1, 10, 11], 2, 2), vec![12, 13]);
        // [11] occurs twice; the occurrence nearest the output's position (5) wins.
        assert_eq!(p(&[7, 7, 7, 7, 11], 5, 1), vec![14]);
        assert!(p(&[99], 1, 3).is_empty());
        assert!(p(&[14], 1, 3).is_empty(), "at the end");
    }
}
