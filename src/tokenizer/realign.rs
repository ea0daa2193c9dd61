//! A session's next prompt spelled with the tokens the session already holds.
//!
//! A client sends each turn as text, and the server tokenizes it afresh. Where the model
//! sampled a token split that is not the tokenizer's own (`"Hel" + "lo"` where the tokenizer
//! writes `"Hello"`), the fresh tokens differ from the session's from that point on, and the
//! K/V of everything after it would be computed again: after a sampled reply of 300 tokens,
//! measured reuse fell to 58–97 prompt tokens in some turns instead of 336. So where the
//! session's tokens spell the same bytes as the start of the new prompt, the prompt takes them
//! in place of its own, up to a point where both tokenizations have a token boundary; from
//! there on it is the fresh tokenization. The result decodes to exactly the prompt's bytes; it
//! differs from the fresh tokens only where the model itself chose the split.
//!
//! Special tokens are matched one for one: a history that spells `<|im_end|>` with plain-text
//! pieces never stands in for the control token, nor the other way round.

/// One token's bytes, and whether it is a special (added) token.
pub struct Piece {
    pub bytes: Vec<u8>,
    pub special: bool,
}

/// `canonical` (the new prompt, tokenized afresh) with the longest stretch of `history` that
/// spells the same bytes in place of its own tokens, or `None` when that would reuse no more of
/// the history than `canonical` already does.
pub fn realign(
    history: &[u32],
    canonical: &[u32],
    piece: impl Fn(u32) -> Piece,
) -> Option<Vec<u32>> {
    let shared = super::common_prefix(history, canonical);
    if shared == history.len() || shared == canonical.len() {
        return None;
    }
    // The fresh tokens past the shared ones: their bytes, where each starts, which are special.
    let rest = &canonical[shared..];
    let mut text = Vec::new();
    let mut starts = Vec::with_capacity(rest.len());
    let mut special = Vec::with_capacity(rest.len());
    for &id in rest {
        let p = piece(id);
        starts.push(text.len());
        special.push(p.special);
        text.extend_from_slice(&p.bytes);
    }
    // Walk the history over those bytes; `best` = (history tokens kept, fresh tokens skipped).
    let mut best = None;
    let (mut offset, mut next) = (0, 0);
    for (k, &id) in history[shared..].iter().enumerate() {
        let p = piece(id);
        let end = offset + p.bytes.len();
        if text.get(offset..end) != Some(&p.bytes[..]) {
            break;
        }
        let first = next;
        while next < starts.len() && starts[next] < end {
            next += 1;
        }
        let same_token = next == first + 1 && starts[first] == offset && rest[first] == id;
        if (p.special || special[first..next].iter().any(|&s| s)) && !same_token {
            break;
        }
        offset = end;
        if starts
            .get(next)
            .map_or(offset == text.len(), |&s| s == offset)
        {
            best = Some((shared + k + 1, shared + next));
        }
    }
    let (kept, skipped) = best?;
    let mut out = history[..kept].to_vec();
    out.extend_from_slice(&canonical[skipped..]);
    Some(out)
}

/// [`realign`] with a real tokenizer's pieces.
pub fn realign_with(
    tokenizer: &tokenizers::Tokenizer,
    history: &[u32],
    canonical: &[u32],
) -> Option<Vec<u32>> {
    let byte_level = super::is_byte_level(tokenizer);
    let added = tokenizer.get_added_vocabulary();
    realign(history, canonical, |id| Piece {
        bytes: super::token_bytes(tokenizer, byte_level, id),
        special: added.simple_id_to_token(id).is_some(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A made-up vocabulary: ids 0..=4 text pieces, 9 a special token.
    fn piece(id: u32) -> Piece {
        let (text, special) = match id {
            0 => ("Hel", false),
            1 => ("lo", false),
            2 => ("Hello", false),
            3 => (" world", false),
            4 => ("<e>", false),
            9 => ("<e>", true),
            _ => ("?", false),
        };
        Piece {
            bytes: text.as_bytes().to_vec(),
            special,
        }
    }

    fn spell(ids: &[u32]) -> Vec<u8> {
        ids.iter().flat_map(|&id| piece(id).bytes).collect()
    }

    #[test]
    fn the_sessions_own_split_is_kept_and_the_rest_is_fresh() {
        // History: "Hel" "lo" " world" as sampled; the fresh prompt writes "Hello" " world" <e> ...
        let history = [0, 1, 3];
        let fresh = [2, 3, 9, 3];
        let out = realign(&history, &fresh, piece).unwrap();
        assert_eq!(out, vec![0, 1, 3, 9, 3]);
        assert_eq!(spell(&out), spell(&fresh), "the same bytes");
    }

    #[test]
    fn nothing_changes_when_the_fresh_tokens_already_reuse_the_history() {
        assert_eq!(realign(&[2, 3], &[2, 3, 9], piece), None);
        // Or when the history spells something else.
        assert_eq!(realign(&[3, 3], &[2, 3, 9], piece), None);
    }

    #[test]
    fn it_stops_where_the_texts_part() {
        // History "Hel" "lo" "Hello": the prompt has "Hello" " world" after "Hello".
        let out = realign(&[0, 1, 2], &[2, 3], piece).unwrap();
        assert_eq!(out, vec![0, 1, 3]);
    }

    #[test]
    fn a_special_token_is_matched_only_by_itself() {
        // Plain "<e>" in the history where the prompt has the control token: kept up to it.
        let out = realign(&[0, 1, 4, 3], &[2, 9, 3], piece).unwrap();
        assert_eq!(out, vec![0, 1, 9, 3]);
        // The control token in the history where the prompt spells it as text.
        let out = realign(&[0, 1, 9, 3], &[2, 4, 3], piece).unwrap();
        assert_eq!(out, vec![0, 1, 4, 3]);
        // The same control token on both sides is kept.
        let out = realign(&[0, 1, 9, 3], &[2, 9, 3, 3], piece).unwrap();
        assert_eq!(out, vec![0, 1, 9, 3, 3]);
    }

    #[test]
    fn the_history_may_only_end_on_a_boundary_of_the_fresh_tokens() {
        // History "Hel" alone: "Hello" has no boundary after "Hel", so nothing is gained.
        assert_eq!(realign(&[0], &[2, 3], piece), None);
    }
}
