//! `mtpx bench-spec`: speculative decoding against plain decoding on the same engine, in one
//! run: an edit task (a 60-line Python file returned with a function renamed: long spans repeat
//! the prompt) and a free-form task. Greedy; reports decode tok/s, speed-up, mean committed
//! tokens per verify round and acceptance by depth position. With `--draft-model`, each task
//! also runs with the draft model alone (when the server mode runs more than it). With `--peer`,
//! the same requests also go to other OpenAI-compatible servers (llama.cpp's `llama-server`),
//! after mtpx's rows of each task (see `bench_peer`).

use super::bench_peer::{self, Peer};
use super::ModelArgs;
use crate::engine::{Engine, EngineConfig, EngineEvent, GenerateRequest, Prompt};
use crate::model::ModelBundle;
use crate::pull::resolve_model;
use crate::sampling::SamplingParams;
use crate::scheduler::Usage;
use crate::spec::{DraftSource, SpecArgs, SpecChoice, SpecCounters, MAX_DEPTH, NUM_SOURCES};
use anyhow::{anyhow, Result};
use clap::Args;
use serde_json::json;
use std::time::Instant;

#[derive(Debug, Args)]
pub struct BenchSpecArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub spec: SpecArgs,
    /// Most tokens generated per request.
    #[arg(long, default_value_t = 700)]
    pub tokens: usize,
    /// Also ask with the file as an OpenAI Predicted Output on the edit task.
    #[arg(long)]
    pub with_prediction: bool,
    /// Also send each task's request (greedy, non-streaming, same messages and max_tokens) to
    /// the OpenAI-compatible server at URL (`POST URL/v1/chat/completions`), e.g. llama.cpp's
    /// llama-server; repeatable, optionally named (`--peer llama-draft=http://127.0.0.1:8082`).
    /// Its rows give decode tok/s from the reply's llama.cpp `timings` (else the wall clock),
    /// the speed-up over mtpx's plain row and over the first peer's row, drafted/accepted
    /// tokens, and whether its text equals mtpx's plain output. A peer that fails is reported
    /// and skipped; the command then exits non-zero after printing every row. Peers that learn
    /// across requests (llama-server's `--spec-type ngram-mod` pool) need a restart per run.
    #[arg(long, value_name = "[NAME=]URL")]
    pub peer: Vec<Peer>,
    #[arg(long)]
    pub json: bool,
}

/// The 60-line file of the edit task.
pub fn edit_task_file() -> String {
    let mut lines = vec![
        "import re".to_string(),
        "from datetime import datetime, timezone, timedelta".to_string(),
        String::new(),
        "ISO_RE = re.compile(r\"(\\d{4})-(\\d{2})-(\\d{2})(?:T(\\d{2}):(\\d{2}):(\\d{2}))?\")"
            .into(),
        String::new(),
        String::new(),
        "def parse(text):".into(),
        "    \"\"\"Parse an ISO-8601 date or date-time string.\"\"\"".into(),
        "    m = ISO_RE.match(text.strip())".into(),
        "    if not m:".into(),
        "        raise ValueError(f\"not an ISO date: {text!r}\")".into(),
        "    year, month, day = int(m.group(1)), int(m.group(2)), int(m.group(3))".into(),
        "    if m.group(4) is None:".into(),
        "        return datetime(year, month, day, tzinfo=timezone.utc)".into(),
        "    hour, minute, second = int(m.group(4)), int(m.group(5)), int(m.group(6))".into(),
        "    return datetime(year, month, day, hour, minute, second, tzinfo=timezone.utc)".into(),
        String::new(),
        String::new(),
    ];
    let helpers = [
        (
            "days_between",
            "a, b",
            "return abs((parse(b) - parse(a)).days)",
        ),
        ("is_weekend", "text", "return parse(text).weekday() >= 5"),
        (
            "add_days",
            "text, n",
            "return (parse(text) + timedelta(days=n)).isoformat()",
        ),
        (
            "same_month",
            "a, b",
            "return parse(a).month == parse(b).month",
        ),
        (
            "to_timestamp",
            "text",
            "return int(parse(text).timestamp())",
        ),
        ("year_of", "text", "return parse(text).year"),
        (
            "quarter_of",
            "text",
            "return (parse(text).month - 1) // 3 + 1",
        ),
        (
            "is_leap",
            "text",
            "y = parse(text).year\n    return y % 4 == 0 and (y % 100 != 0 or y % 400 == 0)",
        ),
        ("sort_dates", "items", "return sorted(items, key=parse)"),
    ];
    for (name, params, body) in helpers {
        lines.push(format!("def {name}({params}):"));
        lines.push(format!("    \"\"\"{}.\"\"\"", name.replace('_', " ")));
        lines.extend(body.lines().map(|l| format!("    {}", l.trim_start())));
        lines.push(String::new());
        lines.push(String::new());
    }
    lines.truncate(60);
    lines.join("\n") + "\n"
}

struct Task {
    name: &'static str,
    messages: serde_json::Value,
    prediction: Option<String>,
}

fn tasks(with_prediction: bool) -> Vec<Task> {
    let file = edit_task_file();
    let edit = format!(
        "Return this Python file with the function `parse` renamed to `parse_iso` (update every \
         call). Reply with the whole file in one ```python block and nothing else.\n\n```python\n{file}```"
    );
    let mut out = vec![
        Task {
            name: "edit",
            messages: json!([{"role": "user", "content": edit}]),
            prediction: None,
        },
        Task {
            name: "free-form",
            messages: json!([{"role": "user", "content": "Write a Python function that parses ISO-8601 dates."}]),
            prediction: None,
        },
    ];
    if with_prediction {
        out.push(Task {
            name: "edit+prediction",
            messages: out[0].messages.clone(),
            prediction: Some(format!(
                "```python\n{}```",
                file.replace("parse(", "parse_iso(")
            )),
        });
    }
    out
}

/// Runs a request to its end; returns (usage, token ids, text, wall seconds).
async fn run(engine: &Engine, req: GenerateRequest) -> Result<(Usage, Vec<u32>, String, f64)> {
    let start = Instant::now();
    let mut stream = engine.submit(req).await?;
    let mut ids = Vec::new();
    let mut text = String::new();
    while let Some(event) = stream.recv().await {
        match event {
            EngineEvent::Delta {
                token_ids,
                text: delta,
                ..
            } => {
                ids.extend(token_ids);
                text.push_str(&delta);
            }
            EngineEvent::Finished { usage, .. } => {
                return Ok((usage, ids, text, start.elapsed().as_secs_f64()))
            }
            EngineEvent::Error(e) => return Err(anyhow!("{e}")),
            _ => {}
        }
    }
    Err(anyhow!("the request ended without finishing"))
}

fn diff(after: &SpecCounters, before: &SpecCounters) -> serde_json::Value {
    let mut rounds = 0u64;
    let mut accepted = 0u64;
    let mut per_depth = Vec::new();
    let mut by_source = serde_json::Map::new();
    for s in DraftSource::ALL {
        let i = s as usize;
        let r = after.rounds[i] - before.rounds[i];
        let a = after.num_accepted(s) - before.num_accepted(s);
        let d = after.num_drafted(s) - before.num_drafted(s);
        rounds += r;
        accepted += a;
        if r > 0 {
            by_source.insert(
                s.name().into(),
                json!({"rounds": r, "drafted": d, "accepted": a}),
            );
        }
    }
    for d in 0..MAX_DEPTH {
        let drafted: u64 = (0..NUM_SOURCES)
            .map(|i| after.drafted[i][d] - before.drafted[i][d])
            .sum();
        let acc: u64 = (0..NUM_SOURCES)
            .map(|i| after.accepted[i][d] - before.accepted[i][d])
            .sum();
        if drafted > 0 {
            per_depth.push(json!({"depth": d + 1, "drafted": drafted, "accepted": acc,
                "rate": acc as f64 / drafted as f64}));
        }
    }
    json!({
        "rounds": rounds,
        "mean_committed_per_round": if rounds > 0 { (accepted + rounds) as f64 / rounds as f64 } else { 0.0 },
        "per_depth": per_depth,
        "by_drafter": by_source,
    })
}

pub fn bench_spec(args: BenchSpecArgs) -> Result<()> {
    let path = resolve_model(&args.model.model, true)?;
    let bundle = ModelBundle::load(&path)?;
    let cfg = EngineConfig {
        kv_memory: args.model.kv_memory,
        kv_dtype: args.model.kv_dtype,
        page_size: args.model.page_size,
        speculative: args.spec.config(),
        draft_model: args.spec.draft_model_path()?,
        ..EngineConfig::default()
    };
    let system = actix_rt::System::new();
    let report = system.block_on(async move {
        let engine = Engine::start(bundle, cfg)?;
        let drafters = engine.info().drafters.clone();
        let mut choices = vec![SpecChoice::Off, SpecChoice::On];
        if drafters.contains(&"draft") && drafters.len() > 1 {
            choices.push(SpecChoice::Only(DraftSource::DraftModel));
        }
        let mut rows = Vec::new();
        let client = bench_peer::client();
        let mut peer_failures = 0;
        for task in tasks(args.with_prediction) {
            let mut plain_tps = None;
            let mut plain_text = None;
            for &choice in &choices {
                let speculative = choice != SpecChoice::Off;
                if task.prediction.is_some() && choice != SpecChoice::On {
                    continue;
                }
                let mut req = GenerateRequest::new(Prompt::Chat {
                    messages: task.messages.clone(),
                    tools: None,
                });
                req.max_tokens = Some(args.tokens);
                req.sampling = SamplingParams::greedy();
                req.speculative = Some(choice);
                if let Some(p) = &task.prediction {
                    req.prediction = Some(engine.tokenize(&Prompt::Text(p.clone())).await?);
                }
                // Every run is a cold turn: an earlier run's draft K/V (which a later request
                // with the same prompt takes over) would spare this one its draft catch-up.
                engine.clear_caches().await;
                let before = engine.scheduler_stats().await;
                let (usage, ids, text, wall) = run(&engine, req).await?;
                if choice == SpecChoice::Off {
                    plain_text = Some(text);
                }
                let after = engine.scheduler_stats().await;
                let tps = usage.completion_tokens.saturating_sub(1) as f64 * 1e3 / usage.decode_ms.max(1e-9);
                let base = *plain_tps.get_or_insert(tps);
                let row = json!({
                    "task": task.name,
                    "draft_catch_up_rows": after.draft_catch_up_rows - before.draft_catch_up_rows,
                    "speculative": speculative,
                    "drafters": match choice {
                        SpecChoice::Off => Vec::new(),
                        SpecChoice::On => drafters.clone(),
                        SpecChoice::Only(s) => vec![s.name()],
                    },
                    "completion_tokens": usage.completion_tokens,
                    "prompt_tokens": usage.prompt_tokens,
                    "decode_tok_s": tps,
                    "speedup": tps / base,
                    "wall_s": wall,
                    "drafted": usage.draft_tokens,
                    "accepted": usage.accepted_draft_tokens,
                    "spec": diff(&after.spec, &before.spec),
                    "draft_model_pauses": after.draft_model_pauses,
                    "output_hash": format!("{:x}", ids.iter().fold(0xcbf29ce484222325u64, |h, &t| (h ^ t as u64).wrapping_mul(0x100000001b3))),
                });
                if !args.json {
                    println!("{row}");
                }
                rows.push(row);
            }
            // Predicted Outputs are an OpenAI extension llama-server does not take.
            if task.prediction.is_some() {
                continue;
            }
            let mut first_peer_tps = None;
            for (i, peer) in args.peer.iter().enumerate() {
                let row = match bench_peer::ask(&client, peer, &task.messages, args.tokens).await {
                    Ok(reply) => {
                        if i == 0 {
                            first_peer_tps = Some(reply.decode_tok_s);
                        }
                        let mtpx_plain = plain_tps.zip(plain_text.as_deref());
                        bench_peer::row(task.name, peer, &reply, mtpx_plain, first_peer_tps)
                    }
                    Err(e) => {
                        eprintln!("peer {} ({}) on task {}: {e:#}", peer.name, peer.url, task.name);
                        peer_failures += 1;
                        bench_peer::error_row(task.name, peer, &e)
                    }
                };
                if !args.json {
                    println!("{row}");
                }
                rows.push(row);
            }
        }
        anyhow::Ok((peer_failures, json!({
            "model": path.display().to_string(),
            "row_cost": engine.info().spec_row_cost,
            "draft_model": engine.info().draft_model_path,
            "draft_cost": engine.info().draft_cost,
            "runs": rows,
        })))
    })?;
    let (peer_failures, report) = report;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!(
            "row_cost {:?}, draft_cost {:?}",
            report["row_cost"], report["draft_cost"]
        );
    }
    if peer_failures > 0 {
        return Err(anyhow!(
            "{peer_failures} peer request(s) failed (see the rows with \"error\")"
        ));
    }
    Ok(())
}
