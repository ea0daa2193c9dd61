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
    /// Repository-level context (Qwen2.5-Coder `<|file_sep|>`, StarCoder2 `<file_sep>`): other
    /// files put before the one being completed, each after this marker and its path.
    pub file_sep: Option<String>,
    /// Names the repository before those files (`<|repo_name|>`, `<reponame>`).
    pub repo_name: Option<String>,
}

impl FimTokens {
    /// The prompt text (its special-token text is encoded as the special tokens).
    pub fn prompt(&self, before: &str, after: &str) -> String {
        format!(
            "{}{before}{}{after}{}",
            self.prefix, self.suffix, self.middle
        )
    }

    /// [`FimTokens::prompt`] after other files of the repository, in the layout the model was
    /// trained on: `{repo_name}{repo}\n{file_sep}{path}\n{text}…{file_sep}{current}\n` and
    /// then the fill-in-the-middle prompt. `None` when the model has no file separator.
    pub fn repository_prompt(
        &self,
        repo: &str,
        files: &[(String, String)],
        current: &str,
        before: &str,
        after: &str,
    ) -> Option<String> {
        let sep = self.file_sep.as_ref()?;
        let mut out = String::new();
        if let Some(name) = &self.repo_name {
            out.push_str(&format!("{name}{repo}\n"));
        }
        for (path, text) in files {
            out.push_str(&format!("{sep}{path}\n{text}"));
            if !text.ends_with('\n') {
                out.push('\n');
            }
        }
        out.push_str(&format!("{sep}{current}\n"));
        out.push_str(&self.prompt(before, after));
        Some(out)
    }
}

pub struct ModelBundle {
    pub path: PathBuf,
    pub transformer: Transformer,
    pub tokenizer: Tokenizer,
    pub template: Option<ChatTemplate>,
    /// Tokens that end a reply: the file's eos plus the chat end-of-turn markers it has.
    pub stop_token_ids: Vec<u32>,
    pub facts: ModelFacts,
}

/// What the GGUF file says about the model, for clients that ask (`/api/show`, `/api/tags`).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct ModelFacts {
    /// `general.architecture` (`qwen2`, `llama`, ...).
    pub architecture: String,
    /// Elements of every tensor in the file (MTP heads included).
    pub parameter_count: u64,
    /// llama.cpp's name for `general.file_type` (`Q4_K_M`, ...), when the file gives one.
    pub quantization: Option<String>,
    /// The Jinja chat template, when the file has one.
    pub chat_template: Option<String>,
    /// Bytes of the file.
    pub file_bytes: u64,
}

impl ModelFacts {
    fn of(path: &Path, content: &Content) -> Self {
        let string = |key: &str| match content.metadata.get(key) {
            Some(Value::String(s)) => Some(s.clone()),
            _ => None,
        };
        let file_type = match content.metadata.get("general.file_type") {
            Some(Value::U32(t)) => Some(*t),
            Some(Value::I32(t)) => u32::try_from(*t).ok(),
            _ => None,
        };
        Self {
            architecture: string("general.architecture").unwrap_or_default(),
            parameter_count: content
                .tensor_infos
                .values()
                .map(|t| t.shape.elem_count() as u64)
                .sum(),
            quantization: file_type.and_then(file_type_name).map(str::to_string),
            chat_template: string("tokenizer.chat_template"),
            file_bytes: std::fs::metadata(path).map_or(0, |m| m.len()),
        }
    }
}

/// llama.cpp's `LLAMA_FTYPE_MOSTLY_*` names for `general.file_type`.
fn file_type_name(file_type: u32) -> Option<&'static str> {
    Some(match file_type {
        0 => "F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        7 => "Q8_0",
        8 => "Q5_0",
        9 => "Q5_1",
        10 => "Q2_K",
        11 => "Q3_K_S",
        12 => "Q3_K_M",
        13 => "Q3_K_L",
        14 => "Q4_K_S",
        15 => "Q4_K_M",
        16 => "Q5_K_S",
        17 => "Q5_K_M",
        18 => "Q6_K",
        32 => "BF16",
        _ => return None,
    })
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
            facts: ModelFacts::of(path, &content),
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
        let known = |names: [&str; 2]| {
            names
                .into_iter()
                .find(|t| self.tokenizer.token_to_id(t).is_some())
                .map(str::to_string)
        };
        Some(FimTokens {
            prefix: prefix.into(),
            suffix: suffix.into(),
            middle: middle.into(),
            file_sep: known(["<|file_sep|>", "<file_sep>"]),
            repo_name: known(["<|repo_name|>", "<reponame>"]),
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
    // Chat end-of-turn markers, and (as llama.cpp counts them) the fill-in-the-middle markers
    // a code model writes when the middle is done and it would go on to another file.
    const MARKERS: [&str; 10] = [
        "<|im_end|>",
        "<|endoftext|>",
        "<|eot_id|>",
        "<end_of_turn>",
        "<|fim_pad|>",
        "<|file_sep|>",
        "<|repo_name|>",
        "<fim_pad>",
        "<file_sep>",
        "<reponame>",
    ];
    for marker in MARKERS {
        if let Some(id) = tokenizer.token_to_id(marker) {
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
    }
    ids
}
