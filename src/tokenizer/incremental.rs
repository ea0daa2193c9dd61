//! Incremental detokenisation: turns a stream of generated token ids into text deltas.
//!
//! A character can span several byte-level tokens (emoji, CJK, ZWJ sequences), and some decoders
//! change a token's text depending on its neighbours. So each step decodes a small window — the
//! tokens of the last emitted delta (`prefix`) plus the ones not yet emitted — and emits only what
//! the new tokens added, once that text no longer ends in an incomplete character (U+FFFD).
//! Concatenating every delta and the final flush gives exactly `decode(all_ids)`.

use tokenizers::Tokenizer;

/// Replacement character the decoder produces for an incomplete UTF-8 sequence.
const REPLACEMENT: char = '\u{FFFD}';

/// How many prompt tokens [`IncrementalDecoder::with_context`] keeps as decoding context.
const MAX_CONTEXT_TOKENS: usize = 6;

/// Per-stream detokeniser state. One per generated sequence; not shared.
#[derive(Debug, Clone)]
pub struct IncrementalDecoder {
    /// Decoding window: `[prefix | pending]`. The prefix is the tokens of the last emitted delta
    /// (or the prompt context); older ids are dropped.
    ids: Vec<u32>,
    /// Length of the prefix: tokens before it have been emitted (or are never emitted).
    read_offset: usize,
    /// Whether special (control) tokens such as `<|im_end|>` are left out of the text.
    /// Non-special added tokens such as `<tool_call>` are always kept.
    skip_special_tokens: bool,
}

impl Default for IncrementalDecoder {
    /// Skips control tokens, keeps user-defined ones.
    fn default() -> Self {
        Self::new(true)
    }
}

impl IncrementalDecoder {
    /// A decoder for a fresh stream. `skip_special_tokens` drops control tokens from the text.
    pub fn new(skip_special_tokens: bool) -> Self {
        Self {
            ids: Vec::new(),
            read_offset: 0,
            skip_special_tokens,
        }
    }

    /// Seeds the window with the last few prompt tokens so that decoders whose output depends
    /// on the previous token (e.g. SentencePiece leading spaces) render the first delta right.
    /// The context itself is never emitted.
    pub fn with_context(mut self, prompt_ids: &[u32]) -> Self {
        let start = prompt_ids.len().saturating_sub(MAX_CONTEXT_TOKENS);
        self.ids = prompt_ids[start..].to_vec();
        self.read_offset = self.ids.len();
        self
    }

    /// Adds one generated token; returns the text it completes, or `None` while the text is
    /// still an incomplete character (or the token renders as nothing, e.g. a skipped control
    /// token). Never returns text ending in a partial UTF-8 sequence.
    pub fn push(&mut self, tok: &Tokenizer, token_id: u32) -> Option<String> {
        self.ids.push(token_id);
        let prefix = self.decode(tok, self.read_offset);
        let full = self.decode(tok, self.ids.len());
        if full.len() <= prefix.len() || full.ends_with(REPLACEMENT) {
            return None;
        }
        let delta = new_text(&prefix, &full)?.to_string();
        self.advance();
        Some(delta)
    }

    /// Flushes whatever is still held back at the end of the stream (a trailing incomplete
    /// character is emitted as U+FFFD, as a full decode would show it).
    pub fn finish(&mut self, tok: &Tokenizer) -> Option<String> {
        if self.read_offset >= self.ids.len() {
            return None;
        }
        let prefix = self.decode(tok, self.read_offset);
        let full = self.decode(tok, self.ids.len());
        self.advance();
        new_text(&prefix, &full)
            .filter(|delta| !delta.is_empty())
            .map(str::to_string)
    }

    /// Number of pushed tokens whose text has not been emitted yet.
    pub fn num_pending(&self) -> usize {
        self.ids.len() - self.read_offset
    }

    /// Marks everything pushed so far as emitted. The tokens of the delta just emitted become
    /// the next window's prefix; older ids are dropped.
    fn advance(&mut self) {
        self.ids.drain(..self.read_offset);
        self.read_offset = self.ids.len();
    }

    /// Decodes the first `end` ids of the window.
    fn decode(&self, tok: &Tokenizer, end: usize) -> String {
        // Decoding known ids with a byte-level decoder cannot fail; unknown ids decode to
        // nothing, which holds the text back rather than corrupting it.
        tok.decode(&self.ids[..end], self.skip_special_tokens)
            .unwrap_or_default()
    }
}

/// The part of `full` after `prefix`, when `full` really extends it at a char boundary.
fn new_text<'a>(prefix: &str, full: &'a str) -> Option<&'a str> {
    // When a decoder rewrote the prefix (rare), emit from the same byte offset if that is valid.
    full.strip_prefix(prefix)
        .or_else(|| full.get(prefix.len()..))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
    use tokenizers::models::bpe::BPE;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;

    /// A byte-level BPE without merges: one token per byte, so every non-ASCII character
    /// spans several tokens.
    fn bytes_tokenizer() -> Tokenizer {
        let vocab = ByteLevel::alphabet()
            .into_iter()
            .enumerate()
            .map(|(id, c)| (c.to_string(), id as u32))
            .collect::<tokenizers::models::bpe::Vocab>();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, vec![])
            .build()
            .unwrap();
        let mut tok = Tokenizer::new(bpe);
        tok.with_pre_tokenizer(Some(ByteLevel::new(false, false, false)));
        tok.with_decoder(Some(ByteLevelDecoder::default()));
        tok
    }

    #[test]
    fn multibyte_characters_are_emitted_whole() {
        let tok = bytes_tokenizer();
        let ids = tok.encode("a€😀", false).unwrap().get_ids().to_vec();
        assert_eq!(ids.len(), 8);
        let mut decoder = IncrementalDecoder::new(false);
        let deltas: Vec<Option<String>> = ids.iter().map(|&id| decoder.push(&tok, id)).collect();
        let some = |s: &str| Some(s.to_string());
        assert_eq!(
            deltas,
            [
                some("a"),
                None,
                None,
                some("€"),
                None,
                None,
                None,
                some("😀")
            ]
        );
        assert_eq!(decoder.finish(&tok), None);
    }

    #[test]
    fn finish_flushes_an_incomplete_character_as_replacement() {
        let tok = bytes_tokenizer();
        let ids = tok.encode("x😀", false).unwrap().get_ids().to_vec();
        let mut decoder = IncrementalDecoder::new(false);
        let text: String = ids[..3]
            .iter()
            .filter_map(|&id| decoder.push(&tok, id))
            .collect();
        assert_eq!(text, "x");
        assert_eq!(decoder.num_pending(), 2);
        assert_eq!(decoder.finish(&tok).as_deref(), Some("\u{FFFD}"));
        assert_eq!(decoder.num_pending(), 0);
    }
}
