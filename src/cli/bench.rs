//! `mtpx bench`: the figures BENCHMARKS.md records for one model, measured in one process so
//! their ratios hold even on a noisy machine.
//!
//! - prefill tok/s for a 512-token prompt;
//! - decode tok/s over 256 tokens (greedy) after that prompt;
//! - decode tok/s at 16K context (the context is filled with synthetic K/V, not prefilled);
//! - continuation prefill: `--continuation-tokens` new tokens appended after that long context,
//!   against the same tokens prefilled fresh (the single-sequence form of a continuation's TTFT);
//! - the time of a 9-row verify step relative to a 1-row decode step;
//! - peak RSS.

use super::ModelArgs;
use crate::config::peak_rss_bytes;
use crate::model::ModelBundle;
use crate::pull::resolve_model;
use crate::runner::{argmax, SingleSequence};
use anyhow::Result;
use clap::Args;
use std::time::{Duration, Instant};

#[derive(Debug, Args)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[arg(long, default_value_t = 512)]
    pub prompt_tokens: usize,
    #[arg(long, default_value_t = 256)]
    pub decode_tokens: usize,
    /// Context for the long-context decode figure (0 skips it).
    #[arg(long, default_value_t = 16_384)]
    pub long_context: usize,
    /// New tokens prefilled after the long context, timed against the same tokens prefilled
    /// fresh (0 skips it).
    #[arg(long, default_value_t = 50)]
    pub continuation_tokens: usize,
    /// Only the long-context figures (decode and continuation at `--long-context`, against a
    /// decode step and a fresh prefill at short context): skips the 512-token prefill, the
    /// timed decode run and the verify step.
    #[arg(long)]
    pub long_only: bool,
    /// Rows of the verify step compared with a 1-row decode step.
    #[arg(long, default_value_t = 9)]
    pub verify_rows: usize,
    /// Repetitions of the short steps (verify and decode) whose median is reported.
    #[arg(long, default_value_t = 16)]
    pub repeats: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Instead of the model figures: an agent session over a Responses WebSocket at URL (or,
    /// with no URL, against `--model` served in-process), each turn against a cold peer.
    #[arg(long, value_name = "URL", num_args = 0..=1, default_missing_value = "")]
    pub ws: Option<String>,
    /// `--ws`: continuation turns (each a tool call and its output).
    #[arg(long, default_value_t = 8)]
    pub ws_turns: usize,
    /// `--ws`: tokens of tool output per turn (about).
    #[arg(long, default_value_t = 400)]
    pub ws_tool_tokens: usize,
    /// `--ws`: tokens generated per turn.
    #[arg(long, default_value_t = 8)]
    pub ws_max_output_tokens: usize,
    /// `--ws`: the server's API key.
    #[arg(long, env = "MTPX_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
}

const BENCH_TEXT: &str = include_str!("../model/test_model/corpus.txt");

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Median time of `step` over `repeats` runs on `seq`, restoring its length after each.
fn time_steps(
    seq: &mut SingleSequence,
    tokens: &[u32],
    all_logits: bool,
    repeats: usize,
) -> Result<Duration> {
    let base = seq.len();
    let mut times = Vec::with_capacity(repeats);
    for _ in 0..repeats {
        let t = Instant::now();
        seq.step(tokens, all_logits)?;
        times.push(t.elapsed());
        seq.truncate(base)?;
    }
    Ok(median(times))
}

pub fn bench(args: BenchArgs) -> Result<()> {
    if let Some(url) = &args.ws {
        let opts = super::bench_ws::WsBench {
            turns: args.ws_turns,
            tool_tokens: args.ws_tool_tokens,
            max_output_tokens: args.ws_max_output_tokens.max(1),
            api_key: args.api_key.clone(),
        };
        return super::bench_ws::bench_ws(url, &args.model, &opts, args.json);
    }
    let path = resolve_model(&args.model.model, true)?;
    let bundle = ModelBundle::load(&path)?;
    let model = &bundle.transformer;
    let mut prompt = Vec::new();
    while prompt.len() < args.prompt_tokens.max(args.continuation_tokens) {
        prompt.extend(bundle.encode(BENCH_TEXT)?);
    }
    let (page, dtype) = (args.model.page_size, args.model.kv_dtype);
    let mut report = serde_json::json!({
        "model": path.display().to_string(),
        "threads": rayon::current_num_threads(),
        "kv_dtype": format!("{dtype:?}").to_lowercase(),
        "kernels": format!("{:?}", crate::kernels::Dispatch::active()).to_lowercase(),
        "attention": crate::kv::AttentionPath::for_kv(dtype).name(),
        "one_row_prefetch": prefetch_report(crate::kernels::choose_one_row_prefetch()),
    });

    let mut next;
    if args.long_only {
        next = prompt[0];
    } else {
        let prompt = &prompt[..args.prompt_tokens];
        let capacity = args.prompt_tokens + args.decode_tokens + args.verify_rows + 1;
        let mut seq = SingleSequence::new(model, capacity, page, dtype);
        let t = Instant::now();
        next = argmax(&seq.append(prompt, 512, false)?);
        let prefill = t.elapsed();

        let t = Instant::now();
        for _ in 0..args.decode_tokens {
            next = argmax(seq.step(&[next], false)?);
        }
        let decode = t.elapsed();

        let verify_tokens = vec![next; args.verify_rows];
        // Alternately, so that load on a shared machine hits both alike.
        let (mut one_row, mut verify) = (Vec::new(), Vec::new());
        for _ in 0..args.repeats {
            one_row.push(time_steps(&mut seq, &[next], false, 1)?);
            verify.push(time_steps(&mut seq, &verify_tokens, true, 1)?);
        }
        let (one_row, verify) = (median(one_row), median(verify));
        let short_decode_tps = args.decode_tokens as f64 / decode.as_secs_f64();
        let extra = serde_json::json!({
            "prefill_tokens": args.prompt_tokens,
            "prefill_tok_s": args.prompt_tokens as f64 / prefill.as_secs_f64(),
            "decode_tokens": args.decode_tokens,
            "decode_tok_s": short_decode_tps,
            "decode_step_ms": one_row.as_secs_f64() * 1e3,
            "verify_rows": args.verify_rows,
            "verify_step_ms": verify.as_secs_f64() * 1e3,
            "verify_over_decode": verify.as_secs_f64() / one_row.as_secs_f64(),
        });
        for (k, v) in extra.as_object().unwrap() {
            report[k] = v.clone();
        }
    }

    if args.long_context > 0 {
        let new = args.continuation_tokens;
        let mut long_seq = SingleSequence::new(model, args.long_context + new + 2, page, dtype);
        long_seq.fill_synthetic(args.long_context, next)?;
        // The yardstick: a decode step at `--prompt-tokens` context, timed alternately with the
        // long one so that load on a shared machine hits both alike.
        let mut short_seq = SingleSequence::new(model, args.prompt_tokens + 2, page, dtype);
        short_seq.fill_synthetic(args.prompt_tokens, next)?;
        let (mut short, mut long) = (Vec::new(), Vec::new());
        for _ in 0..args.repeats {
            short.push(time_steps(&mut short_seq, &[next], false, 1)?);
            long.push(time_steps(&mut long_seq, &[next], false, 1)?);
        }
        let (short, long) = (median(short), median(long));
        report["short_context"] = args.prompt_tokens.into();
        report["short_context_step_ms"] = (short.as_secs_f64() * 1e3).into();
        report["long_context"] = args.long_context.into();
        report["long_context_decode_tok_s"] = (1.0 / long.as_secs_f64()).into();
        report["long_over_short_decode"] = (short.as_secs_f64() / long.as_secs_f64()).into();
        if new > 0 {
            let tokens = &prompt[..new];
            let repeats = args.repeats.div_ceil(3).max(3);
            let mut fresh_seq = SingleSequence::new(model, new + 1, page, dtype);
            // Alternate the two so that load on a shared machine hits both alike.
            let (mut cont, mut fresh) = (Vec::new(), Vec::new());
            for _ in 0..repeats {
                cont.push(time_steps(&mut long_seq, tokens, false, 1)?);
                fresh.push(time_steps(&mut fresh_seq, tokens, false, 1)?);
            }
            let (cont, fresh) = (median(cont), median(fresh));
            report["continuation_tokens"] = new.into();
            report["continuation_ms"] = (cont.as_secs_f64() * 1e3).into();
            report["fresh_prefill_ms"] = (fresh.as_secs_f64() * 1e3).into();
            report["continuation_over_fresh"] = (cont.as_secs_f64() / fresh.as_secs_f64()).into();
            // As llama-bench's `pp N @ dD` reports it.
            report["continuation_tok_s"] = (new as f64 / cont.as_secs_f64()).into();
        }
    }
    report["peak_rss_mib"] = peak_rss_bytes().map(|b| b as f64 / 1048576.0).into();
    if args.json {
        println!("{report}");
    } else {
        print_table(&report);
    }
    Ok(())
}

fn print_table(r: &serde_json::Value) {
    let f = |k: &str| r[k].as_f64().map_or("-".to_string(), |v| format!("{v:.2}"));
    let has = |k: &str| !r[k].is_null();
    println!(
        "model                      {}",
        r["model"].as_str().unwrap_or("?")
    );
    println!("threads                    {}", r["threads"]);
    println!(
        "kernels, attention         {}, {} ({} K/V)",
        r["kernels"].as_str().unwrap_or("?"),
        r["attention"].as_str().unwrap_or("?"),
        r["kv_dtype"].as_str().unwrap_or("?")
    );
    println!(
        "one-row weight prefetch    {}",
        r["one_row_prefetch"].as_str().unwrap_or("?")
    );
    if has("prefill_tokens") {
        println!(
            "prefill ({} tok)          {} tok/s",
            r["prefill_tokens"],
            f("prefill_tok_s")
        );
        println!(
            "decode ({} tok)           {} tok/s",
            r["decode_tokens"],
            f("decode_tok_s")
        );
    }
    if has("short_context") {
        println!(
            "decode step at {} ctx     {} ms",
            r["short_context"],
            f("short_context_step_ms")
        );
    }
    if has("long_context") {
        println!(
            "decode at {} ctx        {} tok/s ({}x of short)",
            r["long_context"],
            f("long_context_decode_tok_s"),
            f("long_over_short_decode")
        );
    }
    if has("continuation_tokens") {
        println!(
            "{} tok after {} ctx      {} ms ({} tok/s) vs fresh {} ms: {}x",
            r["continuation_tokens"],
            r["long_context"],
            f("continuation_ms"),
            f("continuation_tok_s"),
            f("fresh_prefill_ms"),
            f("continuation_over_fresh")
        );
    }
    if has("verify_rows") {
        println!(
            "verify step ({} rows)       {} ms vs decode step {} ms: {}x",
            r["verify_rows"],
            f("verify_step_ms"),
            f("decode_step_ms"),
            f("verify_over_decode")
        );
    }
    println!("peak RSS                   {} MiB", f("peak_rss_mib"));
}

/// How `mtpx bench` reports the one-row prefetch decision.
fn prefetch_report(choice: crate::kernels::PrefetchChoice) -> String {
    let state = if choice.one_row { "on" } else { "off" };
    if choice.with_hints.is_zero() {
        return format!("{state} (MTPX_PREFETCH)");
    }
    let over = if choice.model_weights {
        "the model's"
    } else {
        "a synthetic"
    };
    format!(
        "{state} (one-row sweep over {over} {} MB: {} µs with, {} µs without)",
        choice.swept_bytes >> 20,
        choice.with_hints.as_micros(),
        choice.without_hints.as_micros()
    )
}
