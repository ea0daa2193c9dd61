//! Model hyper-parameters, read from GGUF metadata. Nothing here is guessed from tensor shapes
//! except where the format leaves it implicit (tied output, vocabulary size).

use anyhow::{bail, Context, Result};
use candle_core::quantized::gguf_file::{Content, Value};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// SmolLM2 and friends: no biases, rotary on interleaved pairs (llama.cpp's "normal" mode,
    /// because the GGUF converter permutes Q/K rows for it).
    Llama,
    /// Qwen2 / Qwen2.5: biases on Q, K and V; NeoX rotary (pairs `i`, `i + d/2`).
    Qwen2,
    /// Qwen3: per-head RMSNorm on Q and K before rotary; NeoX rotary; no biases.
    Qwen3,
}

impl Arch {
    fn from_name(name: &str) -> Result<Self> {
        Ok(match name {
            "llama" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            "qwen3" => Arch::Qwen3,
            other => {
                bail!("unsupported model architecture `{other}` (supported: llama, qwen2, qwen3)")
            }
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// Rotate pairs `(2i, 2i+1)`.
    Interleaved,
    /// Rotate pairs `(i, i + head_dim/2)`.
    Neox,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    /// Main transformer blocks (MTP blocks, if any, follow them in the file).
    pub num_layers: usize,
    /// MTP (`nextn`) blocks stored after the main blocks.
    pub num_mtp_layers: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rope_theta: f32,
    pub rope_style: RopeStyle,
    pub rms_eps: f32,
    /// The context length the model was trained for.
    pub context_length: usize,
    pub vocab_size: usize,
}

fn get<'a>(content: &'a Content, key: &str) -> Option<&'a Value> {
    content.metadata.get(key)
}

fn get_usize(content: &Content, key: &str) -> Result<usize> {
    let value = get(content, key).with_context(|| format!("GGUF metadata lacks `{key}`"))?;
    as_usize(value).with_context(|| format!("GGUF metadata `{key}` is not an integer"))
}

fn as_usize(value: &Value) -> Option<usize> {
    Some(match value {
        Value::U8(v) => *v as usize,
        Value::I8(v) => *v as usize,
        Value::U16(v) => *v as usize,
        Value::I16(v) => *v as usize,
        Value::U32(v) => *v as usize,
        Value::I32(v) => *v as usize,
        Value::U64(v) => *v as usize,
        Value::I64(v) => *v as usize,
        _ => return None,
    })
}

fn get_f32(content: &Content, key: &str) -> Option<f32> {
    match get(content, key)? {
        Value::F32(v) => Some(*v),
        Value::F64(v) => Some(*v as f32),
        other => as_usize(other).map(|v| v as f32),
    }
}

impl ModelConfig {
    pub fn from_gguf(content: &Content) -> Result<Self> {
        let arch_name = get(content, "general.architecture")
            .context("GGUF metadata lacks `general.architecture`")?
            .to_string()
            .context("`general.architecture` is not a string")?
            .clone();
        let arch = Arch::from_name(&arch_name)?;
        let key = |k: &str| format!("{arch_name}.{k}");
        let block_count = get_usize(content, &key("block_count"))?;
        let num_mtp_layers = get(content, &key("nextn_predict_layers"))
            .and_then(as_usize)
            .unwrap_or(0);
        if num_mtp_layers >= block_count {
            bail!("`{arch_name}.nextn_predict_layers` ({num_mtp_layers}) must be below block_count ({block_count})");
        }
        let hidden_size = get_usize(content, &key("embedding_length"))?;
        let num_heads = get_usize(content, &key("attention.head_count"))?;
        let num_kv_heads = get(content, &key("attention.head_count_kv"))
            .and_then(as_usize)
            .unwrap_or(num_heads);
        let head_dim = get(content, &key("attention.key_length"))
            .and_then(as_usize)
            .unwrap_or(hidden_size / num_heads);
        if num_heads % num_kv_heads != 0 {
            bail!("head_count {num_heads} is not a multiple of head_count_kv {num_kv_heads}");
        }
        if let Some(kind) = get(content, &key("rope.scaling.type")).and_then(|v| v.to_string().ok())
        {
            if kind != "none" {
                bail!("rope scaling `{kind}` is not supported");
            }
        }
        let vocab_size = match get(content, &key("vocab_size")).and_then(as_usize) {
            Some(v) => v,
            None => get(content, "tokenizer.ggml.tokens")
                .and_then(|v| v.to_vec().ok())
                .map(|v| v.len())
                .context("cannot tell the vocabulary size")?,
        };
        Ok(Self {
            arch,
            num_layers: block_count - num_mtp_layers,
            num_mtp_layers,
            hidden_size,
            intermediate_size: get_usize(content, &key("feed_forward_length"))?,
            num_heads,
            num_kv_heads,
            head_dim,
            rope_theta: get_f32(content, &key("rope.freq_base")).unwrap_or(10_000.0),
            rope_style: match arch {
                Arch::Llama => RopeStyle::Interleaved,
                Arch::Qwen2 | Arch::Qwen3 => RopeStyle::Neox,
            },
            rms_eps: get_f32(content, &key("attention.layer_norm_rms_epsilon")).unwrap_or(1e-6),
            context_length: get_usize(content, &key("context_length"))?,
            vocab_size,
        })
    }
}
