//! `mtpx bench-engine`: the serving engine under concurrent load, measured in one process.
//!
//! - aggregate decode throughput at each concurrency (greedy, `--tokens` each);
//! - continuation time-to-first-token: a session holding `--history` tokens gets 50 new ones,
//!   against a fresh 50-token prompt;
//! - scheduler overhead per step (everything but the forward pass and the worker's sampling),
//!   and the worker's sampling time per step (parallel over the step's decode rows).

use super::ModelArgs;
use crate::engine::{Engine, EngineConfig, EngineEvent, GenerateRequest, Prompt};
use crate::model::ModelBundle;
use crate::pull::resolve_model;
use crate::sampling::OutputFormat;
use crate::sampling::SamplingParams;
use crate::session::SessionKey;
use anyhow::{anyhow, Result};
use clap::Args;
use std::time::{Duration, Instant};

#[derive(Debug, Args)]
pub struct BenchEngineArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Concurrency levels, comma-separated.
    #[arg(long, default_value = "1,4,16", value_delimiter = ',')]
    pub concurrency: Vec<usize>,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 128)]
    pub tokens: usize,
    /// Session history before the continuation (0 skips the TTFT figure).
    #[arg(long, default_value_t = 8000)]
    pub history: usize,
    #[arg(long)]
    pub json: bool,
    /// Constrain every throughput request's output to `{"text": "<a string>"}` (a JSON Schema
    /// `response_format`), to measure what the grammar costs per token.
    #[arg(long)]
    pub structured: bool,
    #[command(flatten)]
    pub spec: crate::spec::SpecArgs,
}

/// The `--structured` format: a string too long to close, so requests still run to `--tokens`.
fn structured_format() -> OutputFormat {
    OutputFormat::JsonSchema(serde_json::json!({
        "type": "object",
        "properties": {"text": {"type": "string", "minLength": 100000}},
        "required": ["text"],
        "additionalProperties": false
    }))
}

fn greedy(tokens: Vec<u32>, max_tokens: usize, session: Option<&str>) -> GenerateRequest {
    let mut req = GenerateRequest::new(Prompt::Tokens(tokens));
    req.max_tokens = Some(max_tokens);
    req.sampling = SamplingParams::greedy();
    req.session = session.map(|id| SessionKey {
        scope: String::new(),
        session_id: id.into(),
    });
    req
}

/// Runs a request to its end; returns (time to first token, tokens generated).
async fn run(engine: &Engine, req: GenerateRequest) -> Result<(Duration, usize)> {
    let start = Instant::now();
    let mut stream = engine.submit(req).await?;
    let mut first = None;
    let mut n = 0;
    while let Some(event) = stream.recv().await {
        match event {
            EngineEvent::Delta { token_ids, .. } if !token_ids.is_empty() => {
                first.get_or_insert_with(|| start.elapsed());
                n += token_ids.len();
            }
            EngineEvent::Error(e) => return Err(anyhow!("{e}")),
            _ => {}
        }
    }
    Ok((first.unwrap_or_default(), n))
}

/// Continuation and fresh-prompt TTFT measurements; the medians are reported.
const TTFT_TRIALS: usize = 5;

/// Distinct ordinary-text prompts of about `n` tokens.
fn prompt(bundle_tokens: &[u32], i: usize, n: usize) -> Vec<u32> {
    let start = (i * 37) % bundle_tokens.len().saturating_sub(n).max(1);
    bundle_tokens
        .iter()
        .cycle()
        .skip(start)
        .take(n)
        .copied()
        .collect()
}

pub fn bench_engine(args: BenchEngineArgs) -> Result<()> {
    let path = resolve_model(&args.model.model, true)?;
    let bundle = ModelBundle::load(&path)?;
    let text_tokens = {
        let mut t = Vec::new();
        while t.len() < args.history + 4096 {
            t.extend(bundle.encode(include_str!("../model/test_model/corpus.txt"))?);
        }
        t
    };
    let cfg = EngineConfig {
        kv_memory: args.model.kv_memory,
        kv_dtype: args.model.kv_dtype,
        page_size: args.model.page_size,
        max_seqs: args.concurrency.iter().copied().max().unwrap_or(1).max(64),
        speculative: args.spec.config(),
        draft_model: args.spec.draft_model_path()?,
        ..EngineConfig::default()
    };
    let system = actix_rt::System::new();
    let report = system.block_on(async move {
        let engine = Engine::start(bundle, cfg)?;
        let mut levels = Vec::new();
        let mut single = None;
        for &c in &args.concurrency {
            let before = engine.scheduler_stats().await;
            let start = Instant::now();
            let runs = (0..c).map(|i| {
                let mut req = greedy(prompt(&text_tokens, i, 32), args.tokens, None);
                req.format = args.structured.then(structured_format);
                run(&engine, req)
            });
            let results = futures::future::join_all(runs).await;
            let wall = start.elapsed().as_secs_f64();
            let generated: usize = results.into_iter().map(|r| r.map(|(_, n)| n)).sum::<Result<usize>>()?;
            let tps = generated as f64 / wall;
            let single_tps = *single.get_or_insert(tps);
            let after = engine.scheduler_stats().await;
            let steps = (after.forward_steps - before.forward_steps).max(1);
            levels.push(serde_json::json!({
                "concurrency": c,
                "aggregate_tok_s": tps,
                "tokens_generated": generated,
                "vs_single_stream": tps / single_tps,
                "scheduler_overhead_us_mean": (after.overhead_us_total - before.overhead_us_total) as f64 / steps as f64,
                "scheduler_overhead_us_max": after.overhead_us_max,
                "worker_sampling_us_mean": (after.sampling_us_total - before.sampling_us_total) as f64 / steps as f64,
            }));
            engine.clear_caches().await;
        }
        let mut ttft = serde_json::Value::Null;
        if args.history > 0 {
            let history = prompt(&text_tokens, 1, args.history);
            run(&engine, greedy(history.clone(), 1, Some("bench"))).await?;
            // Alternating trials, each a different 50-token message: every continuation goes
            // back to the same history (the session keeps it and re-prefills only the new
            // message), and each fresh prompt shares no prefix with anything cached.
            let (mut continuations, mut fresh) = (Vec::new(), Vec::new());
            for trial in 0..TTFT_TRIALS {
                let mut continued = history.clone();
                continued.extend(prompt(&text_tokens, 99 + trial, 50));
                let (t, _) = run(&engine, greedy(continued, 1, Some("bench"))).await?;
                continuations.push(t.as_secs_f64() * 1e3);
                let fresh_prompt = prompt(&text_tokens, 7 + trial, 50);
                let (t, _) = run(&engine, greedy(fresh_prompt, 1, None)).await?;
                fresh.push(t.as_secs_f64() * 1e3);
            }
            let continuation = super::median_f64(continuations.clone());
            let fresh_median = super::median_f64(fresh.clone());
            ttft = serde_json::json!({
                "history_tokens": args.history,
                "trials": TTFT_TRIALS,
                "continuation_ttft_ms": continuation,
                "fresh_50_token_ttft_ms": fresh_median,
                "ratio": continuation / fresh_median,
                "continuation_ttft_ms_each": continuations,
                "fresh_50_token_ttft_ms_each": fresh,
            });
        }
        anyhow::Ok(serde_json::json!({
            "model": path.display().to_string(),
            "tokens_per_request": args.tokens,
            "structured": args.structured,
            "levels": levels,
            "continuation": ttft,
        }))
    })?;
    if args.json {
        println!("{report}");
    } else {
        println!("{}", serde_json::to_string_pretty(&report)?);
    }
    Ok(())
}
