//! `mtpx chat`: a terminal chat with a running `mtpx serve`, over one Responses WebSocket
//! session held across turns. Each turn continues the previous response, so the server
//! prefills only the new message; after each reply it prints the timings and cached tokens.
//! `/reset` starts a new conversation, `/quit` (or end of input) leaves.

use crate::api::responses::types::{OutputItem, ResponseEvent};
use crate::client::ws::{Incoming, ResponsesSocket};
use anyhow::{bail, Result};
use clap::Args;
use serde_json::json;
use std::io::Write;
use std::time::Instant;

#[derive(Debug, Clone, Args)]
pub struct ChatArgs {
    /// The server's base URL.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    pub url: String,
    #[arg(long, env = "MTPX_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Instructions (a system message) sent with every turn.
    #[arg(long)]
    pub system: Option<String>,
    #[arg(long, default_value_t = 512)]
    pub max_tokens: u32,
    #[arg(long, default_value_t = 0.7)]
    pub temperature: f32,
    #[arg(long, default_value_t = 0.9)]
    pub top_p: f32,
}

pub fn chat(args: ChatArgs) -> Result<()> {
    actix_rt::System::new().block_on(run(args))
}

/// Lines of stdin, read on their own thread so the socket keeps answering pings meanwhile.
fn stdin_lines() -> tokio::sync::mpsc::UnboundedReceiver<String> {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    std::thread::spawn(move || {
        let stdin = std::io::stdin();
        let mut line = String::new();
        while stdin.read_line(&mut line).map(|n| n > 0).unwrap_or(false) {
            if tx.send(std::mem::take(&mut line)).is_err() {
                break;
            }
        }
    });
    rx
}

async fn run(args: ChatArgs) -> Result<()> {
    let mut ws = ResponsesSocket::connect(&args.url, args.api_key.as_deref()).await?;
    eprintln!("connected to {} (/reset, /quit)", args.url);
    let mut lines = stdin_lines();
    let mut previous: Option<String> = None;
    loop {
        eprint!("> ");
        let _ = std::io::stderr().flush();
        let line = tokio::select! {
            line = lines.recv() => line,
            incoming = ws.recv() => match incoming? {
                Incoming::Closed { code, reason } => bail!("the server closed the connection ({code:?}: {reason})"),
                Incoming::Event(_) => continue,
            },
        };
        let Some(line) = line else { break };
        let line = line.trim();
        match line {
            "" => continue,
            "/quit" | "/exit" => break,
            "/reset" => {
                previous = None;
                eprintln!("(new conversation)");
                continue;
            }
            _ => {}
        }
        let mut body = json!({
            "input": line,
            "max_output_tokens": args.max_tokens,
            "temperature": args.temperature,
            "top_p": args.top_p,
        });
        if let Some(s) = &args.system {
            body["instructions"] = json!(s);
        }
        if let Some(p) = &previous {
            body["previous_response_id"] = json!(p);
        }
        previous = turn(&mut ws, &body).await?.or(previous);
    }
    ws.close().await
}

/// Streams one reply; returns its id (to continue from), or `None` after an error event.
async fn turn(ws: &mut ResponsesSocket, body: &serde_json::Value) -> Result<Option<String>> {
    let start = Instant::now();
    ws.create(body, None).await?;
    let mut ttft = None;
    let mut out = std::io::stdout();
    loop {
        let event = ws.next_event().await?.event;
        match &event {
            ResponseEvent::OutputTextDelta { delta, .. }
            | ResponseEvent::ReasoningTextDelta { delta, .. } => {
                ttft.get_or_insert_with(|| start.elapsed());
                write!(out, "{delta}")?;
                out.flush()?;
            }
            ResponseEvent::OutputItemDone {
                item:
                    OutputItem::FunctionCall {
                        name, arguments, ..
                    },
                ..
            } => writeln!(out, "\n[tool call] {name}({arguments})")?,
            ResponseEvent::Error { error } => {
                eprintln!("\nerror: {}", error["message"].as_str().unwrap_or("?"));
                return Ok(None);
            }
            _ => {}
        }
        if let Some(r) = event.terminal_response() {
            let elapsed = start.elapsed();
            let u = r.usage.unwrap_or_default();
            let decode_s = (elapsed - ttft.unwrap_or_default()).as_secs_f64();
            let tps = if decode_s > 0.0 {
                u.output_tokens.saturating_sub(1) as f64 / decode_s
            } else {
                0.0
            };
            eprintln!(
                "\n[{}: ttft {:.0} ms, {} tokens in {:.2} s ({tps:.1} tok/s), input {} tokens, {} cached]",
                r.status,
                ttft.unwrap_or_default().as_secs_f64() * 1e3,
                u.output_tokens,
                elapsed.as_secs_f64(),
                u.input_tokens,
                u.input_tokens_details.cached_tokens,
            );
            return Ok(Some(r.id.clone()));
        }
    }
}
