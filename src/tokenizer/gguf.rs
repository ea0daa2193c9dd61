//! Builds a byte-level BPE [`Tokenizer`] from the `tokenizer.ggml.*` metadata of a GGUF file.
//!
//! The pipeline for each `tokenizer.ggml.pre` value mirrors the model's Hugging Face
//! `tokenizer.json`, so that token ids are identical to the reference tokenizer:
//!
//! | pre | normalizer | pre-tokenizer |
//! | --- | --- | --- |
//! | `qwen2` | NFC | Split(Qwen2 regex, Isolated) + ByteLevel(no prefix space, no regex) |
//! | `smollm` | none | Digits(individual) + ByteLevel(GPT-2 regex) |
//! | `llama3`, `smaug-bpe` | none | Split(Llama 3 regex, Isolated) + ByteLevel(no regex) |
//! | `gpt2` (or absent) | none | ByteLevel(GPT-2 regex) |
//!
//! GGUF token types decide how the vocabulary's extra entries behave: control tokens (type 3)
//! become special added tokens (never split, skipped by `decode(.., true)`), user-defined tokens
//! (type 4, e.g. Qwen's `<tool_call>`) become non-special added tokens (never split, always
//! decoded), exactly as `special: false` entries of a `tokenizer.json`.

use anyhow::{anyhow, bail, Context, Result};
use candle_core::quantized::gguf_file::{Content, Value};
use std::path::Path;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::unicode::NFC;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::sequence::Sequence as PostSequence;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{
    AddedToken, NormalizerWrapper, PostProcessorWrapper, PreTokenizerWrapper,
    SplitDelimiterBehavior, Tokenizer,
};

/// Qwen2 `tokenizer.json` split regex (single digits).
const REGEX_QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Llama 3 `tokenizer.json` split regex (digits in groups of up to three).
const REGEX_LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// GGUF `tokenizer.ggml.token_type` values (llama.cpp `llama_token_type`).
const TOKEN_TYPE_UNKNOWN: u32 = 2;
const TOKEN_TYPE_CONTROL: u32 = 3;
const TOKEN_TYPE_USER_DEFINED: u32 = 4;

/// Loads the tokenizer for a model file: a `tokenizer.json` in the same folder as
/// `model_path` wins over the tokenizer described by the GGUF metadata.
pub fn load_tokenizer(model_path: &Path, content: &Content) -> Result<Tokenizer> {
    let beside = model_path.with_file_name("tokenizer.json");
    if beside.is_file() {
        return Tokenizer::from_file(&beside)
            .map_err(|e| anyhow!("{e}"))
            .with_context(|| format!("loading {}", beside.display()));
    }
    tokenizer_from_gguf(content)
        .with_context(|| format!("building the tokenizer of {}", model_path.display()))
}

/// Builds the tokenizer described by the `tokenizer.ggml.*` metadata of a GGUF file.
pub fn tokenizer_from_gguf(content: &Content) -> Result<Tokenizer> {
    let mut vocab = GgufVocab::read(content)?;
    let pre = PreTokenizerKind::from_name(&vocab.pre)?;
    let pipeline = Pipeline::for_kind(pre)?;

    let bpe_vocab: Vocab = vocab
        .tokens
        .iter()
        .enumerate()
        .map(|(id, token)| (token.clone(), id as u32))
        .collect();
    let bpe = BPE::builder()
        .vocab_and_merges(bpe_vocab, std::mem::take(&mut vocab.merges))
        .ignore_merges(pipeline.ignore_merges)
        .build()
        .map_err(|e| anyhow!("building the BPE model: {e}"))?;

    let mut tokenizer = Tokenizer::new(bpe);
    if let Some(normalizer) = pipeline.normalizer {
        tokenizer
            .with_normalizer(Some(normalizer))
            .map_err(|e| anyhow!("{e}"))?;
    }
    tokenizer.with_pre_tokenizer(Some(pipeline.pre_tokenizer));
    tokenizer.with_decoder(Some(ByteLevelDecoder::new(false, false, false)));
    tokenizer.with_post_processor(Some(post_processor(&vocab, pipeline.post_processor)?));
    add_vocab_tokens(&mut tokenizer, &vocab)?;
    Ok(tokenizer)
}

/// The `tokenizer.ggml.*` metadata we use, read and validated once.
struct GgufVocab {
    tokens: Vec<String>,
    /// One entry per token; normal (1) when the file has no `token_type` array.
    token_types: Vec<u32>,
    merges: Vec<(String, String)>,
    bos_id: Option<u32>,
    eos_id: Option<u32>,
    pad_id: Option<u32>,
    unk_id: Option<u32>,
    add_bos: bool,
    add_eos: bool,
    pre: String,
}

impl GgufVocab {
    fn read(content: &Content) -> Result<Self> {
        let model = string_value(content, "tokenizer.ggml.model")?;
        if model != "gpt2" {
            bail!(
                "unsupported GGUF tokenizer model `{model}` (tokenizer.ggml.model); only byte-level \
                 BPE (`gpt2`) is supported — put a tokenizer.json beside the model file instead"
            );
        }
        let tokens = string_array(content, "tokenizer.ggml.tokens")?;
        let token_types = match content.metadata.get("tokenizer.ggml.token_type") {
            Some(v) => integer_array(v, "tokenizer.ggml.token_type")?,
            None => vec![1; tokens.len()],
        };
        if token_types.len() != tokens.len() {
            bail!(
                "tokenizer.ggml.token_type has {} entries but tokenizer.ggml.tokens has {}",
                token_types.len(),
                tokens.len()
            );
        }
        let merges = string_array(content, "tokenizer.ggml.merges")?
            .into_iter()
            .map(|m| match m.split_once(' ') {
                Some((a, b)) => Ok((a.to_string(), b.to_string())),
                None => Err(anyhow!("invalid entry `{m}` in tokenizer.ggml.merges")),
            })
            .collect::<Result<Vec<_>>>()?;
        let id = |key: &str| optional_id(content, key, tokens.len());
        Ok(Self {
            bos_id: id("tokenizer.ggml.bos_token_id")?,
            eos_id: id("tokenizer.ggml.eos_token_id")?,
            pad_id: id("tokenizer.ggml.padding_token_id")?,
            unk_id: id("tokenizer.ggml.unknown_token_id")?,
            add_bos: optional_bool(content, "tokenizer.ggml.add_bos_token")?.unwrap_or(false),
            add_eos: optional_bool(content, "tokenizer.ggml.add_eos_token")?.unwrap_or(false),
            pre: match content.metadata.get("tokenizer.ggml.pre") {
                Some(v) => v
                    .to_string()
                    .map_err(|e| anyhow!("tokenizer.ggml.pre: {e}"))?
                    .clone(),
                None => "gpt2".to_string(),
            },
            tokens,
            token_types,
            merges,
        })
    }

    fn token(&self, id: Option<u32>) -> Option<&str> {
        id.and_then(|id| self.tokens.get(id as usize))
            .map(String::as_str)
    }
}

/// The pre-tokenizer families we know how to reproduce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PreTokenizerKind {
    Gpt2,
    Qwen2,
    Llama3,
    SmaugBpe,
    SmolLm,
}

impl PreTokenizerKind {
    fn from_name(name: &str) -> Result<Self> {
        Ok(match name {
            "gpt2" | "default" | "" => Self::Gpt2,
            "qwen2" | "deepseek-r1-qwen" => Self::Qwen2,
            "llama3" | "llama-bpe" => Self::Llama3,
            "smaug-bpe" => Self::SmaugBpe,
            "smollm" => Self::SmolLm,
            other => bail!(
                "unsupported GGUF pre-tokenizer `{other}` (tokenizer.ggml.pre); supported: qwen2, \
                 smollm, llama3, smaug-bpe, gpt2 — put a tokenizer.json beside the model file instead"
            ),
        })
    }
}

/// Normalizer, pre-tokenizer and post-processor of one `tokenizer.json` family.
struct Pipeline {
    normalizer: Option<NormalizerWrapper>,
    pre_tokenizer: PreTokenizerWrapper,
    post_processor: PostProcessorWrapper,
    ignore_merges: bool,
}

impl Pipeline {
    fn for_kind(kind: PreTokenizerKind) -> Result<Self> {
        let gpt2_byte_level = ByteLevel::new(false, true, true);
        Ok(match kind {
            PreTokenizerKind::Qwen2 => Self {
                normalizer: Some(NFC.into()),
                pre_tokenizer: split_then_byte_level(
                    REGEX_QWEN2,
                    ByteLevel::new(false, false, false),
                )?,
                post_processor: ByteLevel::new(false, false, false).into(),
                ignore_merges: false,
            },
            PreTokenizerKind::Llama3 | PreTokenizerKind::SmaugBpe => Self {
                normalizer: None,
                pre_tokenizer: split_then_byte_level(
                    REGEX_LLAMA3,
                    ByteLevel::new(false, true, false),
                )?,
                post_processor: ByteLevel::new(true, false, true).into(),
                // llama.cpp sets ignore_merges for llama3 only, as its tokenizer.json does.
                ignore_merges: kind == PreTokenizerKind::Llama3,
            },
            PreTokenizerKind::SmolLm => Self {
                normalizer: None,
                pre_tokenizer: Sequence::new(vec![
                    Digits::new(true).into(),
                    gpt2_byte_level.into(),
                ])
                .into(),
                post_processor: ByteLevel::new(true, false, true).into(),
                ignore_merges: false,
            },
            PreTokenizerKind::Gpt2 => Self {
                normalizer: None,
                pre_tokenizer: gpt2_byte_level.into(),
                post_processor: ByteLevel::new(false, true, true).into(),
                ignore_merges: false,
            },
        })
    }
}

fn split_then_byte_level(regex: &str, byte_level: ByteLevel) -> Result<PreTokenizerWrapper> {
    let split = Split::new(
        SplitPattern::Regex(regex.to_string()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .map_err(|e| anyhow!("compiling the pre-tokenizer regex: {e}"))?;
    Ok(Sequence::new(vec![split.into(), byte_level.into()]).into())
}

/// The ByteLevel post-processor, followed by a BOS/EOS template when the GGUF asks for one.
fn post_processor(
    vocab: &GgufVocab,
    byte_level: PostProcessorWrapper,
) -> Result<PostProcessorWrapper> {
    let bos = vocab.token(vocab.bos_id).filter(|_| vocab.add_bos);
    let eos = vocab.token(vocab.eos_id).filter(|_| vocab.add_eos);
    if bos.is_none() && eos.is_none() {
        return Ok(byte_level);
    }
    let mut specials = Vec::new();
    let (mut single, mut pair) = (Vec::new(), Vec::new());
    if let (Some(bos), Some(id)) = (bos, vocab.bos_id) {
        specials.push((bos.to_string(), id));
    }
    if let (Some(eos), Some(id)) = (eos, vocab.eos_id) {
        specials.push((eos.to_string(), id));
    }
    for (sequence, type_id) in [("$A", 0), ("$B", 1)] {
        let part: Vec<String> = bos
            .into_iter()
            .map(|t| format!("{t}:{type_id}"))
            .chain(std::iter::once(format!("{sequence}:{type_id}")))
            .chain(eos.into_iter().map(|t| format!("{t}:{type_id}")))
            .collect();
        if type_id == 0 {
            single.clone_from(&part);
        }
        pair.extend(part);
    }
    let template = TemplateProcessing::builder()
        .try_single(single)
        .map_err(|e| anyhow!("bos/eos template: {e}"))?
        .try_pair(pair)
        .map_err(|e| anyhow!("bos/eos template: {e}"))?
        .special_tokens(specials)
        .build()
        .map_err(|e| anyhow!("bos/eos template: {e}"))?;
    Ok(PostSequence::new(vec![byte_level, template.into()]).into())
}

/// Registers control tokens as special added tokens and user-defined tokens as non-special
/// added tokens; both are matched whole in the input and never split by BPE.
fn add_vocab_tokens(tokenizer: &mut Tokenizer, vocab: &GgufVocab) -> Result<()> {
    let explicit = [vocab.bos_id, vocab.eos_id, vocab.pad_id, vocab.unk_id];
    let mut specials = Vec::new();
    let mut user_defined = Vec::new();
    for (id, (token, &kind)) in vocab.tokens.iter().zip(&vocab.token_types).enumerate() {
        let id = Some(id as u32);
        match kind {
            TOKEN_TYPE_USER_DEFINED => {
                user_defined.push(AddedToken::from(token.clone(), false).normalized(false))
            }
            TOKEN_TYPE_CONTROL | TOKEN_TYPE_UNKNOWN => {
                specials.push(AddedToken::from(token.clone(), true))
            }
            _ if explicit.contains(&id) => specials.push(AddedToken::from(token.clone(), true)),
            _ => {}
        }
    }
    tokenizer
        .add_special_tokens(specials)
        .map_err(|e| anyhow!("adding control tokens: {e}"))?;
    tokenizer
        .add_tokens(user_defined)
        .map_err(|e| anyhow!("adding user-defined tokens: {e}"))?;
    Ok(())
}

fn string_value(content: &Content, key: &str) -> Result<String> {
    let value = required(content, key)?;
    Ok(value
        .to_string()
        .map_err(|e| anyhow!("{key}: {e}"))?
        .clone())
}

fn string_array(content: &Content, key: &str) -> Result<Vec<String>> {
    let values = required(content, key)?
        .to_vec()
        .map_err(|e| anyhow!("{key}: {e}"))?;
    values
        .iter()
        .map(|v| match v {
            Value::String(s) => Ok(s.clone()),
            other => bail!("{key}: expected strings, found {other:?}"),
        })
        .collect()
}

fn integer_array(value: &Value, key: &str) -> Result<Vec<u32>> {
    let values = value.to_vec().map_err(|e| anyhow!("{key}: {e}"))?;
    values.iter().map(|v| to_u32(v, key)).collect()
}

/// The text of the token that a `tokenizer.ggml.*_token_id` key names; `None` when the key is
/// absent or the file has no vocabulary.
pub(crate) fn token_text(content: &Content, key: &str) -> Result<Option<String>> {
    let Some(tokens) = content.metadata.get("tokenizer.ggml.tokens") else {
        return Ok(None);
    };
    let tokens = tokens
        .to_vec()
        .map_err(|e| anyhow!("tokenizer.ggml.tokens: {e}"))?;
    let Some(id) = optional_id(content, key, tokens.len())? else {
        return Ok(None);
    };
    match &tokens[id as usize] {
        Value::String(s) => Ok(Some(s.clone())),
        other => bail!("tokenizer.ggml.tokens: expected strings, found {other:?}"),
    }
}

fn optional_id(content: &Content, key: &str, num_tokens: usize) -> Result<Option<u32>> {
    let Some(value) = content.metadata.get(key) else {
        return Ok(None);
    };
    let id = to_u32(value, key)?;
    if id as usize >= num_tokens {
        bail!("{key} = {id} is outside the vocabulary of {num_tokens} tokens");
    }
    Ok(Some(id))
}

fn optional_bool(content: &Content, key: &str) -> Result<Option<bool>> {
    content
        .metadata
        .get(key)
        .map(|v| v.to_bool().map_err(|e| anyhow!("{key}: {e}")))
        .transpose()
}

fn to_u32(value: &Value, key: &str) -> Result<u32> {
    let wide: i128 = match *value {
        Value::U8(v) => v.into(),
        Value::I8(v) => v.into(),
        Value::U16(v) => v.into(),
        Value::I16(v) => v.into(),
        Value::U32(v) => v.into(),
        Value::I32(v) => v.into(),
        Value::U64(v) => v.into(),
        Value::I64(v) => v.into(),
        ref other => bail!("{key}: expected an integer, found {other:?}"),
    };
    u32::try_from(wide).map_err(|_| anyhow!("{key}: {wide} does not fit a token id"))
}

fn required<'a>(content: &'a Content, key: &str) -> Result<&'a Value> {
    content
        .metadata
        .get(key)
        .ok_or_else(|| anyhow!("GGUF metadata has no `{key}`: the file carries no tokenizer"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};

    fn splits(kind: PreTokenizerKind, input: &str) -> Vec<String> {
        let pipeline = Pipeline::for_kind(kind).unwrap();
        let mut pre_tokenized = PreTokenizedString::from(input);
        pipeline
            .pre_tokenizer
            .pre_tokenize(&mut pre_tokenized)
            .unwrap();
        pre_tokenized
            .get_splits(OffsetReferential::Original, OffsetType::Byte)
            .into_iter()
            .map(|(s, _, _)| s.replace('\u{120}', " ").replace('\u{10a}', "\n"))
            .collect()
    }

    #[test]
    fn qwen2_splits_single_digits_and_keeps_contractions() {
        let got = splits(PreTokenizerKind::Qwen2, "I'LL pay 123\n\n  x");
        assert_eq!(
            got,
            ["I", "'LL", " pay", " ", "1", "2", "3", "\n\n", " ", " x"]
        );
    }

    #[test]
    fn llama3_groups_digits_by_three() {
        let got = splits(PreTokenizerKind::Llama3, "x 12345");
        assert_eq!(got, ["x", " ", "123", "45"]);
    }

    #[test]
    fn smollm_isolates_every_digit_before_gpt2_regex() {
        let got = splits(PreTokenizerKind::SmolLm, "ab 12 don't");
        assert_eq!(got, ["ab", " ", "1", "2", " don", "'t"]);
    }

    #[test]
    fn unknown_pre_tokenizer_is_refused_by_name() {
        let err = PreTokenizerKind::from_name("falcon")
            .unwrap_err()
            .to_string();
        assert!(err.contains("`falcon`"), "{err}");
    }
}
