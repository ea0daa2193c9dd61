//! The decoder-only transformer shared by llama, qwen2 and qwen3, read top-down: blocks, then
//! the model. It is stateless: K/V live in pages passed in by the caller, and the caller says
//! which rows need logits.

use super::config::{Arch, ModelConfig};
use super::layers::{
    add_in_place, rms_norm, rms_norm_in_place, silu_mul_in_place, Linear, RopeTable,
};
use super::weights::{linear_from_qtensor, GgufWeights, WeightFormat};
use crate::error::KvError;
use crate::kv::{paged_attention, AttentionRow, AttentionShape, KvShape, KvStorage};
use crate::runner::batch::{ForwardOutput, OutputRow, OutputRows, SeqStep};
use anyhow::{bail, Context, Result};
use candle_core::quantized::gguf_file::Content;
use candle_core::quantized::QTensor;
use candle_core::{Device, Tensor};
use std::path::Path;
use std::sync::Arc;

struct Block {
    attn_norm: Vec<f32>,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    /// Qwen3's per-head RMSNorm weights (`[head_dim]`).
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    ffn_norm: Vec<f32>,
    gate: Linear,
    up: Linear,
    down: Linear,
}

impl Block {
    fn load(w: &mut GgufWeights, cfg: &ModelConfig, i: usize) -> Result<Self> {
        let n = |s: &str| format!("blk.{i}.{s}");
        let bias = |s: &str| (cfg.arch == Arch::Qwen2).then(|| format!("blk.{i}.{s}"));
        let (q_norm, k_norm) = if cfg.arch == Arch::Qwen3 {
            (
                Some(w.vector(&n("attn_q_norm.weight"))?),
                Some(w.vector(&n("attn_k_norm.weight"))?),
            )
        } else {
            (None, None)
        };
        Ok(Self {
            attn_norm: w.vector(&n("attn_norm.weight"))?,
            q: w.linear(&n("attn_q.weight"), bias("attn_q.bias").as_deref())?,
            k: w.linear(&n("attn_k.weight"), bias("attn_k.bias").as_deref())?,
            v: w.linear(&n("attn_v.weight"), bias("attn_v.bias").as_deref())?,
            o: w.linear(&n("attn_output.weight"), None)?,
            q_norm,
            k_norm,
            ffn_norm: w.vector(&n("ffn_norm.weight"))?,
            gate: w.linear(&n("ffn_gate.weight"), None)?,
            up: w.linear(&n("ffn_up.weight"), None)?,
            down: w.linear(&n("ffn_down.weight"), None)?,
        })
    }
}

/// Per-step facts about the batch rows, shared by all layers.
struct RowLayout<'a> {
    batch: &'a [SeqStep<'a>],
    attention_rows: Vec<AttentionRow>,
    rope: RopeTable,
}

pub struct Transformer {
    pub config: ModelConfig,
    embedding: Arc<QTensor>,
    blocks: Vec<Block>,
    final_norm: Vec<f32>,
    lm_head: Linear,
}

impl Transformer {
    /// Loads the weights and returns the GGUF metadata too (the tokenizer and chat template
    /// live there).
    pub fn load(path: &Path) -> Result<(Self, Content)> {
        Self::load_as(path, WeightFormat::Quantized)
    }

    pub fn load_as(path: &Path, format: WeightFormat) -> Result<(Self, Content)> {
        let mut file = std::fs::File::open(path)
            .with_context(|| format!("opening model file {}", path.display()))?;
        let content = Content::read(&mut file)
            .with_context(|| format!("{} is not a readable GGUF file", path.display()))?;
        let model = Self::from_gguf(&content, file, &path.display().to_string(), format)?;
        Ok((model, content))
    }

    pub fn from_gguf(
        content: &Content,
        file: std::fs::File,
        path: &str,
        format: WeightFormat,
    ) -> Result<Self> {
        let config = ModelConfig::from_gguf(content)?;
        let mut w = GgufWeights::new(content, file, path, format);
        let embedding = Arc::new(w.qtensor("token_embd.weight")?);
        let blocks = (0..config.num_layers)
            .map(|i| Block::load(&mut w, &config, i))
            .collect::<Result<Vec<_>>>()?;
        let final_norm = w.vector("output_norm.weight")?;
        let lm_head = if w.has("output.weight") {
            w.linear("output.weight", None)?
        } else {
            // Tied embeddings: the output projection is the embedding table.
            linear_from_qtensor(w.qtensor("token_embd.weight")?, None, format)?
        };
        let (rows, width) = embedding.shape().dims2()?;
        if width != config.hidden_size || lm_head.out_dim < config.vocab_size {
            bail!(
                "token_embd is [{rows}, {width}] and the output projection has {} rows, \
                 but the metadata says hidden {} and vocab {}",
                lm_head.out_dim,
                config.hidden_size,
                config.vocab_size
            );
        }
        Ok(Self {
            config,
            embedding,
            blocks,
            final_norm,
            lm_head,
        })
    }

    /// The shape a KV storage for this model must have.
    pub fn kv_shape(&self, page_size: usize) -> KvShape {
        KvShape {
            num_layers: self.config.num_layers,
            num_kv_heads: self.config.num_kv_heads,
            head_dim: self.config.head_dim,
            page_size,
        }
    }

    /// Runs one step over a ragged batch: writes every row's K/V into its pages and returns
    /// logits (and optionally final hidden states) for the rows each sequence asked for.
    pub fn forward(
        &self,
        batch: &[SeqStep],
        kv: &mut KvStorage,
        want_hidden: bool,
    ) -> Result<ForwardOutput> {
        let layout = self.layout(batch, kv.shape().page_size)?;
        let tokens: Vec<u32> = batch
            .iter()
            .flat_map(|s| s.tokens.iter().copied())
            .collect();
        let mut x = self.embed(&tokens)?;
        for (layer, block) in self.blocks.iter().enumerate() {
            self.block_forward(block, layer, &mut x, &layout, kv)?;
        }
        self.outputs(&x, batch, want_hidden)
    }

    fn layout<'a>(&self, batch: &'a [SeqStep<'a>], page_size: usize) -> Result<RowLayout<'a>> {
        let mut attention_rows = Vec::new();
        let mut positions = Vec::new();
        for (seq, step) in batch.iter().enumerate() {
            let end = step.start_position + step.tokens.len();
            let capacity = step.page_ids.len() * page_size;
            if end > capacity {
                return Err(KvError::PastCapacity {
                    position: end - 1,
                    capacity,
                }
                .into());
            }
            for (i, &t) in step.tokens.iter().enumerate() {
                if t as usize >= self.config.vocab_size {
                    bail!(
                        "token id {t} is outside the vocabulary of {}",
                        self.config.vocab_size
                    );
                }
                let position = step.start_position + i;
                attention_rows.push(AttentionRow { seq, position });
                positions.push(position);
            }
        }
        let rope = RopeTable::new(&positions, self.config.head_dim, self.config.rope_theta);
        Ok(RowLayout {
            batch,
            attention_rows,
            rope,
        })
    }

    /// `[num_tokens, hidden]` embeddings.
    fn embed(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        let ids = Tensor::from_slice(tokens, tokens.len(), &Device::Cpu)?;
        Ok(self.embedding.embedding(&ids)?.flatten_all()?.to_vec1()?)
    }

    fn block_forward(
        &self,
        block: &Block,
        layer: usize,
        x: &mut [f32],
        layout: &RowLayout,
        kv: &mut KvStorage,
    ) -> Result<()> {
        let cfg = &self.config;
        let mut h = Vec::new();
        rms_norm(x, &block.attn_norm, cfg.rms_eps, &mut h);
        let mut q = block.q.forward(&h)?;
        let mut k = block.k.forward(&h)?;
        let v = block.v.forward(&h)?;
        if let (Some(qn), Some(kn)) = (&block.q_norm, &block.k_norm) {
            rms_norm_in_place(&mut q, qn, cfg.rms_eps);
            rms_norm_in_place(&mut k, kn, cfg.rms_eps);
        }
        layout.rope.apply(&mut q, cfg.num_heads, cfg.rope_style);
        layout.rope.apply(&mut k, cfg.num_kv_heads, cfg.rope_style);

        let kv_width = cfg.num_kv_heads * cfg.head_dim;
        let page_size = kv.shape().page_size;
        for (r, row) in layout.attention_rows.iter().enumerate() {
            let page_id = layout.batch[row.seq].page_ids[row.position / page_size];
            kv.write_token(
                page_id,
                row.position % page_size,
                layer,
                &k[r * kv_width..(r + 1) * kv_width],
                &v[r * kv_width..(r + 1) * kv_width],
            );
        }
        let tables: Vec<&[u32]> = layout.batch.iter().map(|s| s.page_ids).collect();
        let mut attn = vec![0f32; q.len()];
        let shape = AttentionShape {
            num_heads: cfg.num_heads,
            num_kv_heads: cfg.num_kv_heads,
            head_dim: cfg.head_dim,
        };
        paged_attention(
            &q,
            &layout.attention_rows,
            &tables,
            kv,
            layer,
            shape,
            &mut attn,
        );
        add_in_place(x, &block.o.forward(&attn)?);

        rms_norm(x, &block.ffn_norm, cfg.rms_eps, &mut h);
        let mut gate = block.gate.forward(&h)?;
        let up = block.up.forward(&h)?;
        silu_mul_in_place(&mut gate, &up);
        add_in_place(x, &block.down.forward(&gate)?);
        Ok(())
    }

    fn outputs(&self, x: &[f32], batch: &[SeqStep], want_hidden: bool) -> Result<ForwardOutput> {
        let hs = self.config.hidden_size;
        let mut rows = Vec::new();
        let mut hidden = Vec::new();
        let mut offset = 0;
        for (seq, step) in batch.iter().enumerate() {
            let n = step.tokens.len();
            let wanted = match step.outputs {
                OutputRows::None => 0..0,
                OutputRows::Last => n.saturating_sub(1)..n,
                OutputRows::All => 0..n,
            };
            for i in wanted {
                rows.push(OutputRow {
                    seq,
                    position: step.start_position + i,
                });
                hidden.extend_from_slice(&x[(offset + i) * hs..(offset + i + 1) * hs]);
            }
            offset += n;
        }
        rms_norm_in_place(&mut hidden, &self.final_norm, self.config.rms_eps);
        let mut logits = if rows.is_empty() {
            Vec::new()
        } else {
            self.lm_head.forward(&hidden)?
        };
        let vocab = self.config.vocab_size;
        if self.lm_head.out_dim != vocab {
            // Some files pad the output projection; keep only real tokens.
            logits = logits
                .chunks_exact(self.lm_head.out_dim)
                .flat_map(|r| r[..vocab].iter().copied())
                .collect();
        }
        Ok(ForwardOutput {
            logits,
            hidden: if want_hidden { hidden } else { Vec::new() },
            rows,
            vocab_size: vocab,
            hidden_size: hs,
        })
    }
}
