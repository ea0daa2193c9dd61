//! A model as the rest of mtpx uses it: weights plus the tokenizer, chat template and stop
//! tokens that come from the same GGUF file.

use super::weights::WeightFormat;
use super::Transformer;
use crate::tokenizer::{load_tokenizer, ChatTemplate};
use anyhow::{Context, Result};
use candle_core::quantized::gguf_file::{Content, Value};
use std::path::{Path, PathBuf};
use tokenizers::Tokenizer;

/// The special tokens of a fill-in-the-middle prompt: `{prefix}code before{suffix}code
/// after{middle}`, after which the model writes what goes between.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct FimTokens {
    pub prefix: String,
    pub suffix: String,
    pub middle: String,
}

impl FimTokens {
    /// The prompt text (its special-token text is encoded as the special tokens).
    pub fn prompt(&self, before: &str, after: &str) -> String {
        format!(
            "{}{before}{}{after}{}",
            self.prefix, self.suffix, self.middle
        )
    }
}

pub struct ModelBundle {
    pub path: PathBuf,
    pub transformer: Transformer,
    pub tokenizer: Tokenizer,
    pub template: Option<ChatTemplate>,
    /// Tokens that end a reply: the file's eos plus the chat end-of-turn markers it has.
    pub stop_token_ids: Vec<u32>,
}

impl ModelBundle {
    pub fn load(path: &Path) -> Result<Self> {
        Self::load_as(path, WeightFormat::Quantized)
    }

    pub fn load_as(path: &Path, format: WeightFormat) -> Result<Self> {
        let (mut transformer, content) = Transformer::load_as(path, format)?;
        let tokenizer = load_tokenizer(path, &content)
            .with_context(|| format!("building the tokenizer of {}", path.display()))?;
        let calibration = tokenizer
            .encode(crate::runner::calibrate::CALIBRATION_TEXT, false)
            .map_err(anyhow::Error::msg)?;
        transformer.set_calibration_tokens(calibration.get_ids().to_vec());
        let template = ChatTemplate::from_gguf(&content)?;
        let stop_token_ids = stop_token_ids(&content, &tokenizer);
        Ok(Self {
            path: path.to_path_buf(),
            transformer,
            tokenizer,
            template,
            stop_token_ids,
        })
    }

    /// The model's fill-in-the-middle tokens, when its vocabulary has a known set.
    pub fn fim_tokens(&self) -> Option<FimTokens> {
        const KNOWN: [[&str; 3]; 2] = [
            // Qwen2.5-Coder
            ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"],
            // StarCoder and its descendants
            ["<fim_prefix>", "<fim_suffix>", "<fim_middle>"],
        ];
        let [prefix, suffix, middle] = KNOWN
            .into_iter()
            .find(|set| set.iter().all(|t| self.tokenizer.token_to_id(t).is_some()))?;
        Some(FimTokens {
            prefix: prefix.into(),
            suffix: suffix.into(),
            middle: middle.into(),
        })
    }

    /// Renders a single-turn chat (optional system prompt) into prompt token ids.
    pub fn encode_chat(&self, system: Option<&str>, user: &str) -> Result<Vec<u32>> {
        let mut messages = Vec::new();
        if let Some(system) = system {
            messages.push(serde_json::json!({"role": "system", "content": system}));
        }
        messages.push(serde_json::json!({"role": "user", "content": user}));
        let text = match &self.template {
            Some(t) => t.render(
                &serde_json::Value::Array(messages),
                None,
                true,
                &serde_json::json!({}),
            )?,
            None => user.to_string(),
        };
        self.encode(&text)
    }

    /// Tokenizes text as-is (special-token text becomes special tokens; nothing is added).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self
            .tokenizer
            .encode(text, false)
            .map_err(anyhow::Error::msg)?
            .get_ids()
            .to_vec())
    }
}

fn stop_token_ids(content: &Content, tokenizer: &Tokenizer) -> Vec<u32> {
    let mut ids = Vec::new();
    if let Some(Value::U32(eos)) = content.metadata.get("tokenizer.ggml.eos_token_id") {
        ids.push(*eos);
    }
    for marker in ["<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<end_of_turn>"] {
        if let Some(id) = tokenizer.token_to_id(marker) {
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
    }
    ids
}
