//! The decoder-only transformer shared by llama, qwen2 and qwen3, read top-down: blocks, then
//! the model, then its MTP heads. It is stateless: K/V live in pages passed in by the caller,
//! and the caller says which rows need logits.

use super::config::{Arch, ModelConfig};
use super::layers::{
    add_in_place, rms_norm, rms_norm_in_place, silu_mul_in_place, Linear, RopeTable,
};
use super::weights::{linear_from_qtensor, GgufWeights, WeightFormat};
use crate::error::KvError;
use crate::kernels::QuantMatrix;
use crate::kv::{paged_attention, AttentionRow, AttentionShape, KvShape, KvStorage};
use crate::runner::batch::{ForwardOutput, OutputRow, OutputRows, SeqStep};
use anyhow::{bail, Context, Result};
use candle_core::quantized::gguf_file::Content;
use candle_core::quantized::QTensor;
use candle_core::{Device, Tensor};
use std::path::Path;
use std::sync::{Arc, OnceLock};

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

/// A multi-token-prediction module (DeepSeek-V3, GGUF `nextn` layout): from the hidden state
/// at position `p` (before the final norm) and the embedding of token `p + 1`, one transformer
/// block predicts token `p + 2` through the model's own lm_head:
/// `h' = block(eh_proj · [enorm(emb(t_{p+1})); hnorm(h_p)])`, logits `= lm_head(shared_head_norm(h'))`.
struct MtpModule {
    eh_proj: Linear,
    enorm: Vec<f32>,
    hnorm: Vec<f32>,
    shared_head_norm: Vec<f32>,
    block: Block,
}

impl MtpModule {
    fn load(w: &mut GgufWeights, cfg: &ModelConfig, i: usize) -> Result<Self> {
        let n = |s: &str| format!("blk.{i}.nextn.{s}");
        Ok(Self {
            eh_proj: w.linear(&n("eh_proj.weight"), None)?,
            enorm: w.vector(&n("enorm.weight"))?,
            hnorm: w.vector(&n("hnorm.weight"))?,
            shared_head_norm: w.vector(&n("shared_head_norm.weight"))?,
            block: Block::load(w, cfg, i)?,
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
    mtp: Vec<MtpModule>,
    /// Tokens a q8 K/V cache's key channel scales are measured on (`runner::calibrate`): text
    /// from the file's own tokenizer, set by `ModelBundle::load`.
    calibration_tokens: Vec<u32>,
    /// Those scales, measured the first time a q8 cache is made for this model.
    key_channels: OnceLock<Arc<[f32]>>,
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
        let mtp = (config.num_layers..config.num_layers + config.num_mtp_layers)
            .map(|i| MtpModule::load(&mut w, &config, i))
            .collect::<Result<Vec<_>>>()?;
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
        let model = Self {
            config,
            embedding,
            blocks,
            final_norm,
            lm_head,
            mtp,
            calibration_tokens: Vec::new(),
            key_channels: OnceLock::new(),
        };
        crate::kernels::choose_one_row_prefetch_for(&model.decode_matrices());
        Ok(model)
    }

    /// The weight matrices a decode step reads, in the order it reads them (the MTP modules'
    /// aside).
    fn decode_matrices(&self) -> Vec<&QuantMatrix> {
        let mut matrices: Vec<&QuantMatrix> = self
            .blocks
            .iter()
            .flat_map(|b| [&b.q, &b.k, &b.v, &b.o, &b.gate, &b.up, &b.down])
            .map(Linear::matrix)
            .collect();
        matrices.push(self.lm_head.matrix());
        matrices
    }

    /// Sets the tokens the key channel scales of a q8 cache are measured on.
    pub fn set_calibration_tokens(&mut self, tokens: Vec<u32>) {
        self.calibration_tokens = tokens;
    }

    pub fn calibration_tokens(&self) -> &[u32] {
        &self.calibration_tokens
    }

    /// Where `runner::calibrate` keeps the model's key channel scales once measured.
    pub fn key_channels_cell(&self) -> &OnceLock<Arc<[f32]>> {
        &self.key_channels
    }

    /// MTP modules loaded with the model.
    pub fn num_mtp_modules(&self) -> usize {
        self.mtp.len()
    }

    /// One MTP module's forward relative to a one-row decode step of the model, estimated from
    /// the weights each reads (decode is memory-bound): a block, `eh_proj` and the lm_head,
    /// against every block and the lm_head.
    pub fn mtp_relative_cost(&self) -> f64 {
        let c = &self.config;
        let (h, q, kv) = (
            c.hidden_size,
            c.num_heads * c.head_dim,
            c.num_kv_heads * c.head_dim,
        );
        let block = (h * (q + 2 * kv) + q * h + 3 * h * c.intermediate_size) as f64;
        let head = (c.vocab_size * h) as f64;
        (block + 2.0 * (h * h) as f64 + head) / (c.num_layers as f64 * block + head)
    }

    /// The shape of a KV storage for the MTP modules: one layer per module.
    pub fn mtp_kv_shape(&self, page_size: usize) -> KvShape {
        KvShape {
            num_layers: self.mtp.len(),
            ..self.kv_shape(page_size)
        }
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
    /// logits for the rows each sequence asked for (and, with `want_hidden`, every row's
    /// hidden state before the final norm).
    pub fn forward(
        &self,
        batch: &[SeqStep],
        kv: &mut KvStorage,
        want_hidden: bool,
    ) -> Result<ForwardOutput> {
        self.forward_into(batch, kv, want_hidden, Vec::new())
    }

    /// [`Transformer::forward`], writing the logits into `logits` (a buffer from an earlier
    /// step, reused: a batch of 64 decode rows has 39 MB of logits, and allocating and freeing
    /// that every step costs more than sampling it).
    pub fn forward_into(
        &self,
        batch: &[SeqStep],
        kv: &mut KvStorage,
        want_hidden: bool,
        logits: Vec<f32>,
    ) -> Result<ForwardOutput> {
        on_pool(|| {
            let layout = self.layout(batch, kv.shape().page_size)?;
            let mut x = self.embed(&batch_tokens(batch))?;
            for (layer, block) in self.blocks.iter().enumerate() {
                self.block_forward(block, layer, &mut x, &layout, kv)?;
            }
            let mut out = self.outputs(&x, batch, &self.final_norm, logits)?;
            if want_hidden {
                out.hidden = x;
            }
            Ok(out)
        })
    }

    /// `out = final_norm(hidden)` for rows of hidden states taken before it (as
    /// [`ForwardOutput::hidden`] holds them): what the output projection reads, and what an
    /// embedding pools.
    pub fn final_norm(&self, hidden: &[f32], out: &mut Vec<f32>) {
        rms_norm(hidden, &self.final_norm, self.config.rms_eps, out);
    }

    /// Runs MTP module `module` over a ragged batch: each row takes a hidden state
    /// (`hidden: [num rows, hidden_size]`, the target's or a module's output, before any final
    /// norm) and the batch's token for that row (the token after the hidden state's position).
    /// K/V go to layer `module` of `kv` (shaped by [`Transformer::mtp_kv_shape`]). Returns
    /// logits for the rows asked for and every row's output hidden state.
    pub fn mtp_forward(
        &self,
        module: usize,
        batch: &[SeqStep],
        hidden: &[f32],
        kv: &mut KvStorage,
    ) -> Result<ForwardOutput> {
        on_pool(|| {
            let m = &self.mtp[module];
            let layout = self.layout(batch, kv.shape().page_size)?;
            let tokens = batch_tokens(batch);
            let hs = self.config.hidden_size;
            assert_eq!(hidden.len(), tokens.len() * hs, "one hidden state per row");
            let mut e = self.embed(&tokens)?;
            rms_norm_in_place(&mut e, &m.enorm, self.config.rms_eps);
            let mut h = Vec::new();
            rms_norm(hidden, &m.hnorm, self.config.rms_eps, &mut h);
            // [enorm(emb) ‖ hnorm(h)] per row: [num rows, 2 · hidden].
            let joined: Vec<f32> = e
                .chunks_exact(hs)
                .zip(h.chunks_exact(hs))
                .flat_map(|(e, h)| e.iter().chain(h).copied())
                .collect();
            let mut x = m.eh_proj.forward(&joined)?;
            self.block_forward(&m.block, module, &mut x, &layout, kv)?;
            let mut out = self.outputs(&x, batch, &m.shared_head_norm, Vec::new())?;
            out.hidden = x;
            Ok(out)
        })
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

        // The MLP a block of rows at a time (rows are independent there): a 2,048-row step's
        // `[rows, intermediate]` activations (40 MB each on the 0.5B) fall out of cache between
        // the products and the SwiGLU, which made such steps ~25% slower a token than 512-row
        // ones. Blocks are balanced, so none is small enough to take the few-row kernels.
        let hs = cfg.hidden_size;
        let rows = x.len() / hs;
        let per_block = rows.div_ceil(rows.div_ceil(MLP_ROW_BLOCK).max(1)).max(1);
        for rows in x.chunks_mut(per_block * hs) {
            rms_norm(rows, &block.ffn_norm, cfg.rms_eps, &mut h);
            let mut gate = block.gate.forward(&h)?;
            let up = block.up.forward(&h)?;
            silu_mul_in_place(&mut gate, &up);
            add_in_place(rows, &block.down.forward(&gate)?);
        }
        Ok(())
    }

    /// Logits (through `norm` and the lm_head) for the rows each sequence asked for.
    fn outputs(
        &self,
        x: &[f32],
        batch: &[SeqStep],
        norm: &[f32],
        mut logits: Vec<f32>,
    ) -> Result<ForwardOutput> {
        let hs = self.config.hidden_size;
        let mut rows = Vec::new();
        let mut hidden = Vec::new();
        let mut row_starts = Vec::with_capacity(batch.len() + 1);
        let mut offset = 0;
        for (seq, step) in batch.iter().enumerate() {
            row_starts.push(offset);
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
        row_starts.push(offset);
        rms_norm_in_place(&mut hidden, norm, self.config.rms_eps);
        // A reused buffer is not cleared first: the matmul writes every logit, and clearing
        // made `forward_into` zero them all again each step (5.5 MB for a 9-row verify step).
        if rows.is_empty() {
            logits.clear();
        } else {
            self.lm_head.forward_into(&hidden, &mut logits)?;
        }
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
            hidden: Vec::new(),
            row_starts,
            rows,
            vocab_size: vocab,
            hidden_size: hs,
            ..ForwardOutput::default()
        })
    }
}

/// Most rows the MLP takes at once (see `block_forward`): the prefill chunk's size.
const MLP_ROW_BLOCK: usize = 512;

/// The batch's tokens, sequence after sequence: its rows in order.
fn batch_tokens(batch: &[SeqStep]) -> Vec<u32> {
    batch
        .iter()
        .flat_map(|s| s.tokens.iter().copied())
        .collect()
}

/// Runs `f` on a thread of rayon's pool (at once when already on one). A forward makes ~200
/// parallel calls per token (matmuls, attention); from outside the pool each call wakes a pool
/// thread and puts the caller to sleep until it is done, which cost about a quarter of a 1.5B
/// decode step. On a pool thread the calls run partly inline while the other threads steal.
fn on_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    if rayon::current_thread_index().is_some() {
        f()
    } else {
        rayon::scope(|_| f())
    }
}
