//! `mtpx bench-spec --peer`: the same chat requests sent to other OpenAI-compatible servers
//! (llama.cpp's `llama-server`, plain or speculative), so that their figures are measured on the
//! same prompts in the same run as mtpx's own.
//!
//! Decode speed comes from the server's llama.cpp-style `timings` object when it sends one
//! (`"timing": "server"`): `(predicted_n - 1) / predicted_ms`, the definition mtpx uses for its
//! own rows (the first token is sampled from the prompt's logits, so `predicted_ms` spans
//! `predicted_n - 1` decode steps; llama-server 0c1e57098's own `predicted_per_second`, kept as
//! `server_tok_s`, divides the same way). A server without `timings` is timed by the wall clock
//! around the whole request, prompt processing included (`"timing": "wall"`): a lower bound.
//! llama-server sends `draft_n` / `draft_n_accepted` only when it drafted.

use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Value};
use std::str::FromStr;
use std::time::{Duration, Instant};

/// How long one peer request may take, reading the reply included (a 1.5B model decoding 700
/// tokens on 2 loaded cores takes about a minute).
const PEER_TIMEOUT: Duration = Duration::from_secs(900);

/// An OpenAI-compatible server to send the benchmark's requests to: `NAME=URL` or `URL`.
#[derive(Debug, Clone, PartialEq)]
pub struct Peer {
    pub name: String,
    /// Without a trailing `/`; requests go to `{url}/v1/chat/completions`.
    pub url: String,
}

impl FromStr for Peer {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (name, url) = match s.split_once('=') {
            Some((name, url)) if !name.contains("://") => (name.trim(), url.trim()),
            _ => (s.trim(), s.trim()),
        };
        if !url.starts_with("http://") {
            return Err(format!(
                "peer URL {url:?}: expected http://HOST:PORT (TLS is not supported)"
            ));
        }
        if name.is_empty() {
            return Err(format!("peer {s:?}: empty name"));
        }
        Ok(Peer {
            name: name.to_string(),
            url: url.trim_end_matches('/').to_string(),
        })
    }
}

/// What a peer answered to one request.
#[derive(Debug, Clone, PartialEq)]
pub struct PeerReply {
    pub text: String,
    pub completion_tokens: u64,
    pub prompt_tokens: Option<u64>,
    /// Decode tokens per second (see the module documentation).
    pub decode_tok_s: f64,
    /// `"server"` (from `timings`) or `"wall"`.
    pub timing: &'static str,
    /// The server's own `predicted_per_second`, when it sends one.
    pub server_tok_s: Option<f64>,
    pub prompt_ms: Option<f64>,
    /// Prompt tokens the server reused from its cache (`timings.cache_n`) and so did not
    /// count in `prompt_ms`.
    pub cached_prompt_tokens: Option<u64>,
    pub drafted: Option<u64>,
    pub accepted: Option<u64>,
    pub wall_s: f64,
}

/// The request body: greedy (`temperature` 0), non-streaming, the server's defaults otherwise.
pub fn request_body(messages: &Value, max_tokens: usize) -> Value {
    json!({
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": false,
    })
}

/// Reads a chat completion (`body`) into a [`PeerReply`]; `wall_s` is the request's wall time.
pub fn parse_reply(body: &Value, wall_s: f64) -> Result<PeerReply> {
    let text = body["choices"][0]["message"]["content"]
        .as_str()
        .ok_or_else(|| anyhow!("no choices[0].message.content in the reply"))?
        .to_string();
    let t = &body["timings"];
    let u64_of = |v: &Value| v.as_u64();
    let completion_tokens = u64_of(&body["usage"]["completion_tokens"])
        .or_else(|| u64_of(&t["predicted_n"]))
        .ok_or_else(|| anyhow!("neither usage.completion_tokens nor timings.predicted_n"))?;
    let prompt_tokens = u64_of(&body["usage"]["prompt_tokens"]);
    let steps = completion_tokens.saturating_sub(1) as f64;
    let (decode_tok_s, timing) = match (u64_of(&t["predicted_n"]), t["predicted_ms"].as_f64()) {
        (Some(n), Some(ms)) if ms > 0.0 => (n.saturating_sub(1) as f64 * 1e3 / ms, "server"),
        _ => (steps / wall_s.max(1e-9), "wall"),
    };
    Ok(PeerReply {
        text,
        completion_tokens,
        prompt_tokens,
        decode_tok_s,
        timing,
        server_tok_s: t["predicted_per_second"].as_f64(),
        prompt_ms: t["prompt_ms"].as_f64(),
        cached_prompt_tokens: u64_of(&t["cache_n"]),
        drafted: u64_of(&t["draft_n"]),
        accepted: u64_of(&t["draft_n_accepted"]),
        wall_s,
    })
}

pub fn client() -> awc::Client {
    awc::Client::builder().timeout(PEER_TIMEOUT).finish()
}

/// Sends one chat request to `peer` and waits for the whole reply.
pub async fn ask(
    client: &awc::Client,
    peer: &Peer,
    messages: &Value,
    max_tokens: usize,
) -> Result<PeerReply> {
    let url = format!("{}/v1/chat/completions", peer.url);
    let start = Instant::now();
    let mut res = client
        .post(&url)
        .send_json(&request_body(messages, max_tokens))
        .await
        .map_err(|e| anyhow!("{e}"))
        .with_context(|| format!("POST {url}"))?;
    let bytes = res
        .body()
        .limit(64 << 20)
        .await
        .map_err(|e| anyhow!("{e}"))
        .with_context(|| format!("reading the reply of {url}"))?;
    let wall_s = start.elapsed().as_secs_f64();
    if !res.status().is_success() {
        bail!(
            "POST {url}: HTTP {}: {}",
            res.status(),
            String::from_utf8_lossy(&bytes[..bytes.len().min(500)])
        );
    }
    let body: Value =
        serde_json::from_slice(&bytes).with_context(|| format!("POST {url}: not JSON"))?;
    parse_reply(&body, wall_s).with_context(|| format!("POST {url}"))
}

/// One report row for a peer's answer to `task`. `mtpx_plain` is mtpx's plain row of the task
/// (tok/s and text), `first_peer_tps` the first peer's tok/s on it.
pub fn row(
    task: &str,
    peer: &Peer,
    reply: &PeerReply,
    mtpx_plain: Option<(f64, &str)>,
    first_peer_tps: Option<f64>,
) -> Value {
    let ratio = |base: Option<f64>| base.filter(|b| *b > 0.0).map(|b| reply.decode_tok_s / b);
    json!({
        "task": task,
        "peer": peer.name,
        "url": peer.url,
        "timing": reply.timing,
        "completion_tokens": reply.completion_tokens,
        "prompt_tokens": reply.prompt_tokens,
        "decode_tok_s": reply.decode_tok_s,
        "server_tok_s": reply.server_tok_s,
        "speedup": ratio(mtpx_plain.map(|(tps, _)| tps)),
        "speedup_vs_first_peer": ratio(first_peer_tps),
        "prompt_ms": reply.prompt_ms,
        "cached_prompt_tokens": reply.cached_prompt_tokens,
        "wall_s": reply.wall_s,
        "drafted": reply.drafted,
        "accepted": reply.accepted,
        "same_text": mtpx_plain.map(|(_, text)| text == reply.text),
    })
}

/// The row of a peer that failed on `task`.
pub fn error_row(task: &str, peer: &Peer, error: &anyhow::Error) -> Value {
    json!({"task": task, "peer": peer.name, "url": peer.url, "error": format!("{error:#}")})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peers_parse_with_and_without_names() {
        let p: Peer = "llama-plain=http://127.0.0.1:8081/".parse().unwrap();
        assert_eq!(p.name, "llama-plain");
        assert_eq!(p.url, "http://127.0.0.1:8081");
        let p: Peer = "http://127.0.0.1:8082".parse().unwrap();
        assert_eq!(
            (p.name.as_str(), p.url.as_str()),
            ("http://127.0.0.1:8082", "http://127.0.0.1:8082")
        );
        // An `=` inside the URL's query is not a name separator.
        let p: Peer = "http://h:1/x?a=b".parse().unwrap();
        assert_eq!(p.name, "http://h:1/x?a=b");
        assert!("x=https://h".parse::<Peer>().is_err());
        assert!("=http://h".parse::<Peer>().is_err());
        assert!("localhost:8080".parse::<Peer>().is_err());
    }

    #[test]
    fn server_timings_are_preferred_to_the_wall_clock() {
        let body = json!({
            "choices": [{"message": {"role": "assistant", "content": "hi"}}],
            "usage": {"completion_tokens": 11, "prompt_tokens": 30},
            "timings": {"predicted_n": 11, "predicted_ms": 500.0, "predicted_per_second": 22.0,
                        "prompt_ms": 80.0, "cache_n": 5, "draft_n": 12, "draft_n_accepted": 9},
        });
        let r = parse_reply(&body, 2.0).unwrap();
        assert_eq!(r.timing, "server");
        assert!((r.decode_tok_s - 20.0).abs() < 1e-9);
        assert_eq!((r.drafted, r.accepted), (Some(12), Some(9)));
        assert_eq!(r.server_tok_s, Some(22.0));
        assert_eq!(r.cached_prompt_tokens, Some(5));

        let body = json!({
            "choices": [{"message": {"content": "hi"}}],
            "usage": {"completion_tokens": 11},
        });
        let r = parse_reply(&body, 2.0).unwrap();
        assert_eq!(r.timing, "wall");
        assert!((r.decode_tok_s - 5.0).abs() < 1e-9);
        assert_eq!(r.drafted, None);
        assert!(parse_reply(&json!({"error": "x"}), 1.0).is_err());
    }

    #[test]
    fn rows_compare_with_mtpx_plain_and_the_first_peer() {
        let peer: Peer = "p=http://h:1".parse().unwrap();
        let body = json!({
            "choices": [{"message": {"content": "same"}}],
            "usage": {"completion_tokens": 3},
            "timings": {"predicted_n": 3, "predicted_ms": 100.0},
        });
        let reply = parse_reply(&body, 1.0).unwrap();
        let r = row("edit", &peer, &reply, Some((10.0, "same")), Some(40.0));
        assert_eq!(r["decode_tok_s"], 20.0);
        assert_eq!(r["speedup"], 2.0);
        assert_eq!(r["speedup_vs_first_peer"], 0.5);
        assert_eq!(r["same_text"], true);
        let r = row("edit", &peer, &reply, Some((10.0, "other")), None);
        assert_eq!(r["same_text"], false);
        assert!(r["speedup_vs_first_peer"].is_null());
    }
}
