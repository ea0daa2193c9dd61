//! The project's own tiny test model: a valid qwen3 GGUF with deterministic random weights,
//! MTP blocks in the `nextn` layout, a byte-level BPE tokenizer trained on a small built-in
//! corpus, and a ChatML chat template with tools. It is small enough to run thousands of tokens
//! per second, so tests can drive sessions to 70,000 tokens.

use anyhow::{Context, Result};
use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::path::{Path, PathBuf};
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{
    DecoderWrapper, NormalizerWrapper, PostProcessorWrapper, TokenizerBuilder, TokenizerImpl,
};

const CHAT_TEMPLATE: &str = include_str!("chat_template.jinja");
const CORPUS: &str = include_str!("corpus.txt");

/// Special tokens: `(text, GGUF token type)`; 3 = control, 4 = user-defined (never split, but
/// part of the visible text, like Qwen's tool-call tags).
const SPECIAL_TOKENS: [(&str, i32); 9] = [
    ("<|endoftext|>", 3),
    ("<|im_start|>", 3),
    ("<|im_end|>", 3),
    ("<tool_call>", 4),
    ("</tool_call>", 4),
    ("<tool_response>", 4),
    ("</tool_response>", 4),
    ("<think>", 4),
    ("</think>", 4),
];

#[derive(Debug, Clone, clap::Args)]
pub struct TestModelSpec {
    /// Main transformer blocks.
    #[arg(long, default_value_t = 2)]
    pub layers: usize,
    #[arg(long, default_value_t = 64)]
    pub hidden: usize,
    #[arg(long, default_value_t = 4)]
    pub heads: usize,
    #[arg(long, default_value_t = 2)]
    pub kv_heads: usize,
    #[arg(long, default_value_t = 16)]
    pub head_dim: usize,
    #[arg(long, default_value_t = 128)]
    pub intermediate: usize,
    /// Vocabulary size including byte tokens, merges and special tokens.
    #[arg(long, default_value_t = 512)]
    pub vocab: usize,
    /// MTP (`nextn`) blocks after the main blocks.
    #[arg(long, default_value_t = 1)]
    pub mtp_depth: usize,
    #[arg(long, default_value_t = 131_072)]
    pub context_length: usize,
    /// Store matrices as Q8_0 instead of F32 (dimensions must be multiples of 32).
    #[arg(long)]
    pub q8: bool,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Perturbs every matrix entry by up to this fraction of its range (from a separate random
    /// stream, so the weights are otherwise the unperturbed model's): a model that mostly, not
    /// always, agrees with it — a stand-in for a small draft model in tests.
    #[arg(long, default_value_t = 0.0)]
    pub noise: f32,
    /// MTP modules that mirror the last main block and the output norm and read only the
    /// token (`eh_proj = [I | 0]`): for a one-layer model they predict what the model itself
    /// will (almost always), so speculative tests see MTP drafts accepted.
    #[arg(long)]
    pub mtp_mirror: bool,
}

impl Default for TestModelSpec {
    fn default() -> Self {
        Self {
            layers: 2,
            hidden: 64,
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            intermediate: 128,
            vocab: 512,
            mtp_depth: 1,
            context_length: 131_072,
            q8: false,
            seed: 0,
            noise: 0.0,
            mtp_mirror: false,
        }
    }
}

/// Writes `DIR/test-model.gguf` and returns its path.
pub fn write_test_model(dir: &Path, spec: &TestModelSpec) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let path = dir.join("test-model.gguf");
    let vocab = train_vocab(spec.vocab)?;
    let tensors = random_tensors(spec, vocab.tokens.len())?;
    let metadata = metadata(spec, &vocab);
    let meta_refs: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, t)| (k.as_str(), t)).collect();
    let tmp = path.with_extension("gguf.partial");
    let mut file = std::fs::File::create(&tmp)?;
    gguf_file::write(&mut file, &meta_refs, &tensor_refs)?;
    file.sync_all()?;
    std::fs::rename(&tmp, &path)?;
    Ok(path)
}

struct Vocab {
    tokens: Vec<String>,
    token_types: Vec<i32>,
    merges: Vec<String>,
}

/// Trains a byte-level BPE on the built-in corpus; deterministic for a given size.
fn train_vocab(vocab_size: usize) -> Result<Vocab> {
    let num_merged = vocab_size
        .checked_sub(SPECIAL_TOKENS.len())
        .filter(|n| *n >= 256)
        .context("vocab must hold the 256 byte tokens plus the special tokens")?;
    let mut trainer = BpeTrainerBuilder::new()
        .vocab_size(num_merged)
        .min_frequency(2)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .show_progress(false)
        .build();
    let mut tokenizer: TokenizerImpl<
        BPE,
        NormalizerWrapper,
        ByteLevel,
        PostProcessorWrapper,
        DecoderWrapper,
    > = TokenizerBuilder::new()
        .with_model(BPE::default())
        .with_pre_tokenizer(Some(ByteLevel::new(false, false, true)))
        .build()
        .map_err(anyhow::Error::msg)?;
    tokenizer
        .train(&mut trainer, CORPUS.lines())
        .map_err(anyhow::Error::msg)?;
    let model = tokenizer.get_model();
    let mut tokens: Vec<(String, u32)> = model.get_vocab().into_iter().collect();
    tokens.sort_by_key(|(_, id)| *id);
    let mut tokens: Vec<String> = tokens.into_iter().map(|(t, _)| t).collect();
    let merges = merges_of(model)?;
    // Pad with unreachable filler tokens when the corpus yields fewer merges than asked, so
    // the vocabulary has exactly the requested size.
    let mut filler = 0;
    while tokens.len() < num_merged {
        tokens.push(format!("<|filler_{filler}|>"));
        filler += 1;
    }
    let mut token_types = vec![1; tokens.len()];
    for (text, ty) in SPECIAL_TOKENS {
        tokens.push(text.to_string());
        token_types.push(ty);
    }
    Ok(Vocab {
        tokens,
        token_types,
        merges,
    })
}

/// The merges of a trained model in GGUF's `"left right"` form, in rank order. The model keeps
/// them private; its serialised form lists them in order.
fn merges_of(model: &BPE) -> Result<Vec<String>> {
    let json = serde_json::to_value(model)?;
    let merges = json["merges"]
        .as_array()
        .context("BPE model has no merges")?;
    merges
        .iter()
        .map(|m| match m {
            serde_json::Value::String(s) => Ok(s.clone()),
            serde_json::Value::Array(pair) => Ok(format!(
                "{} {}",
                pair[0].as_str().unwrap_or_default(),
                pair[1].as_str().unwrap_or_default()
            )),
            other => anyhow::bail!("unexpected merge entry {other}"),
        })
        .collect()
}

fn special_id(vocab: &Vocab, text: &str) -> u32 {
    vocab.tokens.iter().position(|t| t == text).unwrap() as u32
}

fn metadata(spec: &TestModelSpec, vocab: &Vocab) -> Vec<(String, Value)> {
    let u32v = |v: usize| Value::U32(v as u32);
    let strings = |v: &[String]| Value::Array(v.iter().map(|s| Value::String(s.clone())).collect());
    let a = |k: &str| format!("qwen3.{k}");
    vec![
        ("general.architecture".into(), Value::String("qwen3".into())),
        (
            "general.name".into(),
            Value::String("mtpx-test-model".into()),
        ),
        (a("block_count"), u32v(spec.layers + spec.mtp_depth)),
        (a("nextn_predict_layers"), u32v(spec.mtp_depth)),
        (a("context_length"), u32v(spec.context_length)),
        (a("embedding_length"), u32v(spec.hidden)),
        (a("feed_forward_length"), u32v(spec.intermediate)),
        (a("attention.head_count"), u32v(spec.heads)),
        (a("attention.head_count_kv"), u32v(spec.kv_heads)),
        (a("attention.key_length"), u32v(spec.head_dim)),
        (a("attention.value_length"), u32v(spec.head_dim)),
        (a("attention.layer_norm_rms_epsilon"), Value::F32(1e-6)),
        (a("rope.freq_base"), Value::F32(1_000_000.0)),
        (a("vocab_size"), u32v(vocab.tokens.len())),
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::String("qwen2".into())),
        ("tokenizer.ggml.tokens".into(), strings(&vocab.tokens)),
        (
            "tokenizer.ggml.token_type".into(),
            Value::Array(vocab.token_types.iter().map(|t| Value::I32(*t)).collect()),
        ),
        ("tokenizer.ggml.merges".into(), strings(&vocab.merges)),
        (
            "tokenizer.ggml.eos_token_id".into(),
            Value::U32(special_id(vocab, "<|im_end|>")),
        ),
        (
            "tokenizer.ggml.bos_token_id".into(),
            Value::U32(special_id(vocab, "<|endoftext|>")),
        ),
        (
            "tokenizer.ggml.padding_token_id".into(),
            Value::U32(special_id(vocab, "<|endoftext|>")),
        ),
        ("tokenizer.ggml.add_bos_token".into(), Value::Bool(false)),
        (
            "tokenizer.chat_template".into(),
            Value::String(CHAT_TEMPLATE.into()),
        ),
    ]
}

struct Init {
    rng: ChaCha8Rng,
    q8: bool,
    noise: f32,
    noise_rng: ChaCha8Rng,
}

impl Init {
    /// A `[rows, cols]` matrix with variance `gain² / cols`.
    fn matrix(&mut self, rows: usize, cols: usize, gain: f32) -> Result<QTensor> {
        let bound = gain * (3.0 / cols as f32).sqrt();
        let mut data: Vec<f32> = (0..rows * cols)
            .map(|_| self.rng.random_range(-bound..bound))
            .collect();
        if self.noise > 0.0 {
            let amplitude = self.noise * bound;
            for v in &mut data {
                *v += self.noise_rng.random_range(-amplitude..amplitude);
            }
        }
        let t = Tensor::from_vec(data, (rows, cols), &Device::Cpu)?;
        let dtype = if self.q8 && cols.is_multiple_of(32) {
            GgmlDType::Q8_0
        } else {
            GgmlDType::F32
        };
        Ok(QTensor::quantize(&t, dtype)?)
    }

    /// A norm weight near 1.
    fn norm(&mut self, n: usize) -> Result<QTensor> {
        let data: Vec<f32> = (0..n)
            .map(|_| 1.0 + self.rng.random_range(-0.1..0.1))
            .collect();
        Ok(QTensor::quantize(
            &Tensor::from_vec(data, n, &Device::Cpu)?,
            GgmlDType::F32,
        )?)
    }
}

fn block_tensors(
    init: &mut Init,
    spec: &TestModelSpec,
    i: usize,
    out: &mut Vec<(String, QTensor)>,
) -> Result<()> {
    let (h, hd) = (spec.hidden, spec.head_dim);
    let n = |s: &str| format!("blk.{i}.{s}");
    out.push((n("attn_norm.weight"), init.norm(h)?));
    out.push((n("attn_q.weight"), init.matrix(spec.heads * hd, h, 1.0)?));
    out.push((n("attn_k.weight"), init.matrix(spec.kv_heads * hd, h, 1.0)?));
    out.push((n("attn_v.weight"), init.matrix(spec.kv_heads * hd, h, 1.0)?));
    out.push((
        n("attn_output.weight"),
        init.matrix(h, spec.heads * hd, 0.5)?,
    ));
    out.push((n("attn_q_norm.weight"), init.norm(hd)?));
    out.push((n("attn_k_norm.weight"), init.norm(hd)?));
    out.push((n("ffn_norm.weight"), init.norm(h)?));
    out.push((
        n("ffn_gate.weight"),
        init.matrix(spec.intermediate, h, 1.0)?,
    ));
    out.push((n("ffn_up.weight"), init.matrix(spec.intermediate, h, 1.0)?));
    out.push((
        n("ffn_down.weight"),
        init.matrix(h, spec.intermediate, 0.5)?,
    ));
    Ok(())
}

/// MTP module `i` as a copy of the last main block reading only the token: `eh_proj = [I | 0]`,
/// `enorm` rescaling the normalised embedding to the embeddings' own scale (rms 1/√3), and the
/// output norm as its head norm.
fn mirror_block(spec: &TestModelSpec, i: usize, out: &mut Vec<(String, QTensor)>) -> Result<()> {
    let h = spec.hidden;
    let last = format!("blk.{}.", spec.layers - 1);
    let copy = |name: &str, out: &[(String, QTensor)]| -> Result<QTensor> {
        let t = &out
            .iter()
            .find(|(n, _)| n == name)
            .context("no such tensor")?
            .1;
        Ok(QTensor::quantize(&t.dequantize(&Device::Cpu)?, t.dtype())?)
    };
    let copies: Vec<(String, QTensor)> = out
        .iter()
        .filter(|(n, _)| n.starts_with(&last))
        .map(|(n, _)| Ok((format!("blk.{i}.{}", &n[last.len()..]), copy(n, out)?)))
        .collect::<Result<_>>()?;
    out.extend(copies);
    let mut eh = vec![0f32; h * 2 * h];
    for r in 0..h {
        eh[r * 2 * h + r] = 1.0;
    }
    let vector = |v: Vec<f32>| -> Result<QTensor> {
        let n = v.len();
        Ok(QTensor::quantize(
            &Tensor::from_vec(v, n, &Device::Cpu)?,
            GgmlDType::F32,
        )?)
    };
    let eh = Tensor::from_vec(eh, (h, 2 * h), &Device::Cpu)?;
    out.push((
        format!("blk.{i}.nextn.eh_proj.weight"),
        QTensor::quantize(&eh, GgmlDType::F32)?,
    ));
    let scale = 1.0 / 3f32.sqrt();
    out.push((
        format!("blk.{i}.nextn.enorm.weight"),
        vector(vec![scale; h])?,
    ));
    out.push((format!("blk.{i}.nextn.hnorm.weight"), vector(vec![1.0; h])?));
    let head_norm = copy("output_norm.weight", out)?;
    out.push((format!("blk.{i}.nextn.shared_head_norm.weight"), head_norm));
    Ok(())
}

fn random_tensors(spec: &TestModelSpec, vocab: usize) -> Result<Vec<(String, QTensor)>> {
    let mut init = Init {
        rng: ChaCha8Rng::seed_from_u64(spec.seed),
        q8: spec.q8,
        noise: spec.noise,
        noise_rng: ChaCha8Rng::seed_from_u64(spec.seed ^ 0x006e_6f69_7365),
    };
    let h = spec.hidden;
    let mut out = Vec::new();
    // Embeddings of unit scale; a sharp output layer so greedy decoding is not degenerate.
    out.push((
        "token_embd.weight".into(),
        init.matrix(vocab, h, (h as f32 / 3.0).sqrt())?,
    ));
    for i in 0..spec.layers {
        block_tensors(&mut init, spec, i, &mut out)?;
    }
    out.push(("output_norm.weight".into(), init.norm(h)?));
    out.push(("output.weight".into(), init.matrix(vocab, h, 4.0)?));
    for d in 0..spec.mtp_depth {
        let i = spec.layers + d;
        if spec.mtp_mirror {
            mirror_block(spec, i, &mut out)?;
            continue;
        }
        block_tensors(&mut init, spec, i, &mut out)?;
        out.push((
            format!("blk.{i}.nextn.eh_proj.weight"),
            init.matrix(h, 2 * h, 1.0)?,
        ));
        out.push((format!("blk.{i}.nextn.enorm.weight"), init.norm(h)?));
        out.push((format!("blk.{i}.nextn.hnorm.weight"), init.norm(h)?));
        out.push((
            format!("blk.{i}.nextn.shared_head_norm.weight"),
            init.norm(h)?,
        ));
    }
    Ok(out)
}
