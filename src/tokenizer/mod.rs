//! Text ⇄ tokens at the edge of the engine.
//!
//! Owns: building the model's tokenizer (from GGUF `tokenizer.ggml.*` metadata, or a
//! `tokenizer.json` beside the weights), rendering chat templates (minijinja configured as
//! transformers configures Jinja2), and incremental detokenisation of generated tokens into
//! UTF-8-safe text deltas.
//!
//! Never touches: sessions, KV pages, scheduling or sampling. Everything here is plain data in,
//! plain data out (no actors, no shared state), so the tokenizer actor and tests can call it
//! directly. Depends only on external crates.
//!
//! Special tokens: GGUF control tokens (e.g. `<|im_start|>`, `<|im_end|>`) are *special*: never
//! split when encoding and skipped by `decode(.., skip_special_tokens = true)`. User-defined
//! tokens (e.g. Qwen's `<tool_call>`) are never split either but are always decoded, because
//! tool-call parsing downstream needs to see them.

pub mod actor;
mod gguf;
mod incremental;
mod pyjson;
pub mod realign;
pub(crate) mod template;

pub use gguf::{load_tokenizer, tokenizer_from_gguf};
pub use incremental::IncrementalDecoder;
pub use template::ChatTemplate;

/// How many leading tokens `a` and `b` share.
pub fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Whether the tokenizer decodes byte-level (GPT-2-style) vocabulary entries, as every GGUF
/// tokenizer mtpx builds does; a `tokenizer.json` beside the weights may be SentencePiece.
pub fn is_byte_level(tokenizer: &tokenizers::Tokenizer) -> bool {
    use tokenizers::decoders::DecoderWrapper;
    fn byte_level(d: &DecoderWrapper) -> bool {
        match d {
            DecoderWrapper::ByteLevel(_) => true,
            DecoderWrapper::Sequence(seq) => seq.get_decoders().iter().any(byte_level),
            _ => false,
        }
    }
    tokenizer.get_decoder().is_some_and(byte_level)
}

/// One token's raw bytes. A token may hold part of a UTF-8 character (an emoji's joiner split in
/// two), so its decoded text alone ("\u{FFFD}") cannot say them, and OpenAI's logprobs `bytes`
/// exist to put such tokens back together. Byte-level vocabulary entries (`byte_level`, see
/// [`is_byte_level`]) map back through GPT-2's byte alphabet; SentencePiece ones write a space
/// as `▁` and a lone byte as `<0xNN>`; added tokens (`<|im_end|>`) are their text.
pub fn token_bytes(tokenizer: &tokenizers::Tokenizer, byte_level: bool, id: u32) -> Vec<u8> {
    let Some(piece) = tokenizer.id_to_token(id) else {
        return Vec::new();
    };
    if tokenizer
        .get_added_vocabulary()
        .simple_id_to_token(id)
        .is_some()
    {
        return piece.into_bytes();
    }
    if !byte_level {
        let hex = piece
            .strip_prefix("<0x")
            .and_then(|h| h.strip_suffix('>'))
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        return match hex {
            Some(b) => vec![b],
            None => piece.replace('\u{2581}', " ").into_bytes(),
        };
    }
    let mut out = Vec::with_capacity(piece.len());
    for c in piece.chars() {
        match byte_of(c) {
            Some(b) => out.push(b),
            None => out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
        }
    }
    out
}

/// The byte GPT-2's byte-level alphabet writes as `c`: printable Latin-1 bytes stand for
/// themselves, the other 68 bytes, in order, for U+0100 onwards.
fn byte_of(c: char) -> Option<u8> {
    let printable = |b: u32| {
        (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b)
    };
    let code = c as u32;
    if code < 0x100 {
        return printable(code).then_some(code as u8);
    }
    (0u32..=0xFF)
        .filter(|&b| !printable(b))
        .nth((code - 0x100) as usize)
        .map(|b| b as u8)
}

#[cfg(test)]
mod byte_tests {
    use super::*;

    #[test]
    fn the_byte_alphabet_maps_back_to_every_byte() {
        // Space is U+0120 ('Ġ'), newline U+010A ('Ċ'), as in every GPT-2-style vocabulary.
        assert_eq!(byte_of('Ġ'), Some(b' '));
        assert_eq!(byte_of('Ċ'), Some(b'\n'));
        assert_eq!(byte_of('a'), Some(b'a'));
        assert_eq!(byte_of('\u{80}'), None);
        let all: std::collections::BTreeSet<u8> =
            ('\u{21}'..='\u{143}').filter_map(byte_of).collect();
        assert_eq!(all.len(), 256);
    }

    #[test]
    fn sentencepiece_pieces_give_their_bytes() {
        use tokenizers::models::bpe::BPE;
        let vocab: tokenizers::models::bpe::Vocab =
            [("\u{2581}caf\u{e9}", 0), ("<0x0A>", 1), ("x", 2)]
                .into_iter()
                .map(|(t, id)| (t.to_string(), id))
                .collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, vec![])
            .build()
            .unwrap();
        let tok = tokenizers::Tokenizer::new(bpe);
        assert!(!is_byte_level(&tok));
        assert_eq!(token_bytes(&tok, false, 0), " café".as_bytes());
        assert_eq!(token_bytes(&tok, false, 1), b"\n");
    }
}
