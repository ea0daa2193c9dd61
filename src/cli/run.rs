//! `mtpx run`: one chat turn against a model, streamed to the terminal, then timings.

use super::{ModelArgs, SamplingArgs};
use crate::config::peak_rss_bytes;
use crate::model::ModelBundle;
use crate::pull::resolve_model;
use crate::runner::SingleSequence;
use crate::sampling::{Sampler, TokenHistory};
use crate::tokenizer::IncrementalDecoder;
use anyhow::{bail, Result};
use clap::Args;
use std::io::Write;
use std::time::Instant;

#[derive(Debug, Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 512)]
    pub max_tokens: usize,
    /// System prompt.
    #[arg(long)]
    pub system: Option<String>,
    /// Send the prompt as-is, without the chat template.
    #[arg(long)]
    pub raw: bool,
    /// Prefill chunk size.
    #[arg(long, default_value_t = 512)]
    pub prefill_chunk: usize,
    pub prompt: String,
}

pub fn run(args: RunArgs) -> Result<()> {
    let path = resolve_model(&args.model.model, true)?;
    let bundle = ModelBundle::load(&path)?;
    let prompt = if args.raw {
        bundle.encode(&args.prompt)?
    } else {
        bundle.encode_chat(args.system.as_deref(), &args.prompt)?
    };
    let context_window = bundle.transformer.config.context_length;
    let needed = prompt.len() + args.max_tokens;
    if needed > context_window {
        bail!(
            "the prompt ({} tokens) plus --max-tokens {} exceeds the model's context window of {context_window} tokens",
            prompt.len(),
            args.max_tokens
        );
    }
    let kv_shape = bundle.transformer.kv_shape(args.model.page_size);
    let budget_tokens =
        (args.model.kv_memory.bytes() as f64 / kv_shape.token_bytes(args.model.kv_dtype)) as usize;
    if needed > budget_tokens {
        bail!(
            "{needed} tokens need more KV memory than --kv-memory allows ({budget_tokens} tokens)"
        );
    }
    let mut sampler = Sampler::new(args.sampling.params())?;
    let mut seq = SingleSequence::new(
        &bundle.transformer,
        needed,
        args.model.page_size,
        args.model.kv_dtype,
    );

    let started = Instant::now();
    let mut logits = seq.append(&prompt, args.prefill_chunk, false)?;
    let prefill_time = started.elapsed();

    let mut generated = Vec::new();
    let mut decoder = IncrementalDecoder::new(true).with_context(&prompt);
    let mut stdout = std::io::stdout().lock();
    let decode_started = Instant::now();
    while generated.len() < args.max_tokens {
        let token = sampler
            .sample(&logits, &TokenHistory::new(&prompt, &generated))?
            .token;
        generated.push(token);
        if bundle.stop_token_ids.contains(&token) {
            break;
        }
        if let Some(text) = decoder.push(&bundle.tokenizer, token) {
            write!(stdout, "{text}")?;
            stdout.flush()?;
        }
        if generated.len() == args.max_tokens {
            break;
        }
        logits = seq.append(&[token], 1, false)?;
    }
    if let Some(text) = decoder.finish(&bundle.tokenizer) {
        write!(stdout, "{text}")?;
    }
    writeln!(stdout)?;
    let decode_time = decode_started.elapsed();

    let secs = |d: std::time::Duration| d.as_secs_f64().max(1e-9);
    eprintln!(
        "\nprompt {} tokens, prefill {:.1} tok/s | generated {} tokens, decode {:.1} tok/s | peak RSS {}",
        prompt.len(),
        prompt.len() as f64 / secs(prefill_time),
        generated.len(),
        generated.len().saturating_sub(1) as f64 / secs(decode_time),
        peak_rss_bytes().map_or("?".into(), |b| format!("{:.0} MiB", b as f64 / 1048576.0)),
    );
    Ok(())
}
