//! `GET /metrics`: Prometheus text format. The HTTP layer counts what it sees (responses by
//! status, tokens in and out, time to first token, inter-token latency); the engine's gauges
//! (running/waiting sequences, KV pages, sessions, prefix-cache hits) are read at scrape time.
//! A small hand-rolled writer: counters and histograms are atomics, nothing is locked across
//! an `.await`.

use super::AppState;
use actix_web::{web, HttpResponse};
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Seconds; shared by both latency histograms.
const LATENCY_BUCKETS: [f64; 14] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

#[derive(Debug)]
pub struct Histogram {
    counts: [AtomicU64; LATENCY_BUCKETS.len()],
    count: AtomicU64,
    sum_micros: AtomicU64,
}

impl Default for Histogram {
    fn default() -> Self {
        Self {
            counts: std::array::from_fn(|_| AtomicU64::new(0)),
            count: AtomicU64::new(0),
            sum_micros: AtomicU64::new(0),
        }
    }
}

impl Histogram {
    pub fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        for (bound, count) in LATENCY_BUCKETS.iter().zip(&self.counts) {
            if secs <= *bound {
                count.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_micros
            .fetch_add(d.as_micros() as u64, Ordering::Relaxed);
    }

    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    fn write(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (bound, count) in LATENCY_BUCKETS.iter().zip(&self.counts) {
            let _ = writeln!(
                out,
                "{name}_bucket{{le=\"{bound}\"}} {}",
                count.load(Ordering::Relaxed)
            );
        }
        let n = self.count();
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {n}");
        let sum = self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6;
        let _ = writeln!(out, "{name}_sum {sum}\n{name}_count {n}");
    }
}

/// What the HTTP layer counts.
#[derive(Debug, Default)]
pub struct Metrics {
    responses: Mutex<BTreeMap<u16, u64>>,
    pub prompt_tokens: AtomicU64,
    pub cached_tokens: AtomicU64,
    pub completion_tokens: AtomicU64,
    pub time_to_first_token: Histogram,
    pub inter_token: Histogram,
}

impl Metrics {
    pub fn count_response(&self, status: u16) {
        if let Ok(mut map) = self.responses.lock() {
            *map.entry(status).or_default() += 1;
        }
    }

    pub fn count_usage(&self, prompt: usize, cached: usize, completion: usize) {
        self.prompt_tokens
            .fetch_add(prompt as u64, Ordering::Relaxed);
        self.cached_tokens
            .fetch_add(cached as u64, Ordering::Relaxed);
        self.completion_tokens
            .fetch_add(completion as u64, Ordering::Relaxed);
    }

    fn responses(&self) -> BTreeMap<u16, u64> {
        self.responses.lock().map(|m| m.clone()).unwrap_or_default()
    }
}

/// Times one request's tokens: the first against the request's start, the rest against the
/// previous one.
#[derive(Debug)]
pub struct TokenClock {
    started: Instant,
    last: Option<Instant>,
}

impl TokenClock {
    pub fn start() -> Self {
        Self {
            started: Instant::now(),
            last: None,
        }
    }

    /// Records `num_tokens` newly generated tokens.
    pub fn tokens(&mut self, metrics: &Metrics, num_tokens: usize) {
        if num_tokens == 0 {
            return;
        }
        let now = Instant::now();
        match self.last {
            None => metrics.time_to_first_token.observe(now - self.started),
            Some(last) => metrics.inter_token.observe(now - last),
        }
        self.last = Some(now);
    }
}

fn gauge(out: &mut String, name: &str, help: &str, kind: &str, value: impl std::fmt::Display) {
    let _ = writeln!(
        out,
        "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}"
    );
}

/// The whole exposition text.
/// `mtpx_simd_info{cpu=…,kernel=…,attention_f16=…,…} 1`: which code paths this process takes
/// on this CPU (as `mtpx --version` prints them), for a scrape or a bug report.
fn write_simd_info(out: &mut String) {
    let report = crate::kv::SimdReport::current();
    let escape = |s: &str| s.replace('\\', "\\\\").replace('"', "\\\"");
    let mut labels = format!(
        "cpu=\"{}\",features=\"{}\",built_for=\"{}\",kernel=\"{}\"",
        escape(&report.cpu),
        report.detected.join(" "),
        report.built_for.join(" "),
        report.kernel_name(),
    );
    for (dtype, path) in &report.attention {
        let dtype = format!("{dtype:?}").to_lowercase();
        let _ = write!(labels, ",attention_{dtype}=\"{}\"", path.name());
    }
    let _ = writeln!(
        out,
        "# HELP mtpx_simd_info The CPU and the instruction-set paths this process runs on it.\n\
         # TYPE mtpx_simd_info gauge\nmtpx_simd_info{{{labels}}} 1"
    );
}

/// The session store's gauges and counters (`--session-dir`).
fn write_store(out: &mut String, m: &crate::session::store::StoreMetrics) {
    let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let rows: [(&str, &str, &str, u64); 12] = [
        (
            "mtpx_session_store_bytes",
            "Bytes of session and response files on disk.",
            "gauge",
            load(&m.bytes_on_disk),
        ),
        (
            "mtpx_session_store_sessions",
            "Session files on disk.",
            "gauge",
            load(&m.files_on_disk),
        ),
        (
            "mtpx_session_store_writes_total",
            "Files written or appended to.",
            "counter",
            load(&m.writes),
        ),
        (
            "mtpx_session_store_written_bytes_total",
            "Bytes written.",
            "counter",
            load(&m.bytes_written),
        ),
        (
            "mtpx_session_store_write_errors_total",
            "Writes that failed (serving went on).",
            "counter",
            load(&m.write_errors),
        ),
        (
            "mtpx_session_store_restores_total",
            "Sessions read back from disk.",
            "counter",
            load(&m.restores),
        ),
        (
            "mtpx_session_store_restored_bytes_total",
            "Page bytes read back.",
            "counter",
            load(&m.restored_bytes),
        ),
        (
            "mtpx_session_store_restored_tokens_total",
            "Positions read back (before matching the prompt).",
            "counter",
            load(&m.restored_tokens),
        ),
        (
            "mtpx_session_store_torn_files_total",
            "Files or tails skipped as torn or corrupt.",
            "counter",
            load(&m.torn_files),
        ),
        (
            "mtpx_session_store_foreign_files_total",
            "Files skipped as written for another model, K/V layout or session.",
            "counter",
            load(&m.foreign_files),
        ),
        (
            "mtpx_session_store_evicted_files_total",
            "Files removed for the disk budget or a full disk.",
            "counter",
            load(&m.evicted_files),
        ),
        (
            "mtpx_session_store_dropped_writes_total",
            "Finished turns not written because the writer was too far behind.",
            "counter",
            load(&m.dropped_writes),
        ),
    ];
    for (name, help, kind, value) in rows {
        gauge(out, name, help, kind, value);
    }
    gauge(
        out,
        "mtpx_session_store_restore_seconds_total",
        "Time spent reading sessions back (restored bytes over it: the read rate).",
        "counter",
        load(&m.restore_micros) as f64 / 1e6,
    );
}

pub async fn render(state: &AppState) -> String {
    let m = &state.metrics;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# HELP mtpx_http_responses_total HTTP responses by status code.\n# TYPE mtpx_http_responses_total counter"
    );
    for (status, n) in m.responses() {
        let _ = writeln!(out, "mtpx_http_responses_total{{status=\"{status}\"}} {n}");
    }
    let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
    gauge(
        &mut out,
        "mtpx_prompt_tokens_total",
        "Prompt tokens of completed requests.",
        "counter",
        load(&m.prompt_tokens),
    );
    gauge(
        &mut out,
        "mtpx_cached_prompt_tokens_total",
        "Prompt tokens reused from KV instead of prefilled.",
        "counter",
        load(&m.cached_tokens),
    );
    gauge(
        &mut out,
        "mtpx_completion_tokens_total",
        "Generated tokens.",
        "counter",
        load(&m.completion_tokens),
    );
    m.time_to_first_token.write(
        &mut out,
        "mtpx_time_to_first_token_seconds",
        "From request to first generated token.",
    );
    m.inter_token.write(
        &mut out,
        "mtpx_inter_token_seconds",
        "Between consecutive generated tokens of a request.",
    );
    write_simd_info(&mut out);
    gauge(
        &mut out,
        "mtpx_ready",
        "1 when the model is loaded and the engine serves.",
        "gauge",
        u8::from(state.is_ready()),
    );
    gauge(
        &mut out,
        "mtpx_stored_responses",
        "Responses stored for previous_response_id and GET /v1/responses/{id}.",
        "gauge",
        state.responses.len(),
    );
    gauge(
        &mut out,
        "mtpx_background_responses_running",
        "Background responses whose run goes on.",
        "gauge",
        state.background.len(),
    );
    gauge(
        &mut out,
        "mtpx_response_event_log_bytes",
        "Bytes of background streams' events kept for streaming again.",
        "gauge",
        state.responses.event_log_bytes(),
    );
    let Ok(engine) = state.engine() else {
        return out;
    };
    if let Some(store) = engine.session_store() {
        write_store(&mut out, &store.metrics);
    }
    let s = engine.scheduler_stats().await;
    gauge(
        &mut out,
        "mtpx_sequences_running",
        "Sequences being scheduled.",
        "gauge",
        s.num_running,
    );
    gauge(
        &mut out,
        "mtpx_sequences_waiting",
        "Sequences waiting for their first step.",
        "gauge",
        s.num_waiting,
    );
    gauge(
        &mut out,
        "mtpx_scheduler_steps_total",
        "Batched forward steps.",
        "counter",
        s.num_steps,
    );
    gauge(
        &mut out,
        "mtpx_preemptions_total",
        "Sequences preempted under KV pressure.",
        "counter",
        s.num_preemptions,
    );
    gauge(
        &mut out,
        "mtpx_prefill_tokens_total",
        "Prompt tokens computed (prefilled).",
        "counter",
        s.prompt_tokens_computed,
    );
    gauge(
        &mut out,
        "mtpx_generated_tokens_total",
        "Tokens generated by the scheduler.",
        "counter",
        s.tokens_generated,
    );
    spec_counters(&mut out, &s.spec);
    let p = engine.pool_stats().await;
    gauge(
        &mut out,
        "mtpx_kv_pages_total",
        "KV pages in the pool.",
        "gauge",
        p.num_pages,
    );
    gauge(
        &mut out,
        "mtpx_kv_pages_used",
        "KV pages allocated (by sequences, sessions or the prefix cache).",
        "gauge",
        p.num_used,
    );
    gauge(
        &mut out,
        "mtpx_kv_pages_free",
        "KV pages free.",
        "gauge",
        p.num_free,
    );
    gauge(
        &mut out,
        "mtpx_kv_pages_cached",
        "KV pages indexed by the prefix cache.",
        "gauge",
        p.num_cached,
    );
    gauge(
        &mut out,
        "mtpx_kv_pages_evictable",
        "Cached KV pages held only by the cache.",
        "gauge",
        p.num_evictable,
    );
    gauge(
        &mut out,
        "mtpx_kv_pages_held",
        "KV pages held by sequences or sessions (used minus evictable).",
        "gauge",
        p.num_used.saturating_sub(p.num_evictable),
    );
    gauge(
        &mut out,
        "mtpx_prefix_cache_hits_total",
        "Prefix-cache lookups that found pages.",
        "counter",
        p.prefix_hits,
    );
    gauge(
        &mut out,
        "mtpx_prefix_cache_lookups_total",
        "Prefix-cache lookups.",
        "counter",
        p.prefix_lookups,
    );
    let ratio = if p.prefix_lookups == 0 {
        0.0
    } else {
        p.prefix_hits as f64 / p.prefix_lookups as f64
    };
    gauge(
        &mut out,
        "mtpx_prefix_cache_hit_ratio",
        "Hits over lookups.",
        "gauge",
        ratio,
    );
    let sessions = engine.sessions().await.len();
    gauge(
        &mut out,
        "mtpx_sessions",
        "Named sessions alive.",
        "gauge",
        sessions,
    );
    gauge(
        &mut out,
        "mtpx_context_window_tokens",
        "The enforced context window.",
        "gauge",
        engine.info().context_window,
    );
    out
}

/// `GET /metrics`.
#[utoipa::path(get, path = "/metrics", responses((status = 200, description = "Prometheus text format", content_type = "text/plain")))]
pub async fn metrics(state: web::Data<AppState>) -> HttpResponse {
    HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4; charset=utf-8")
        .body(render(&state).await)
}

/// The value of an unlabelled sample in exposition text (tests and tools).
pub fn sample(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// Speculative-decoding counters by drafter and depth position (1-based).
fn spec_counters(out: &mut String, c: &crate::spec::SpecCounters) {
    use crate::spec::DraftSource;
    let families = [
        (
            "mtpx_spec_drafted_tokens_total",
            "Draft tokens verified.",
            &c.drafted,
        ),
        (
            "mtpx_spec_accepted_tokens_total",
            "Draft tokens accepted.",
            &c.accepted,
        ),
    ];
    for (name, help, counts) in families {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
        for source in DraftSource::ALL {
            for (d, n) in counts[source as usize].iter().enumerate() {
                if *n > 0 {
                    let _ = writeln!(
                        out,
                        "{name}{{drafter=\"{}\",depth=\"{}\"}} {n}",
                        source.name(),
                        d + 1
                    );
                }
            }
        }
    }
    let name = "mtpx_spec_rejected_tokens_total";
    let _ = writeln!(
        out,
        "# HELP {name} Draft tokens rejected.\n# TYPE {name} counter"
    );
    for source in DraftSource::ALL {
        let rejected = c.num_drafted(source) - c.num_accepted(source);
        let _ = writeln!(out, "{name}{{drafter=\"{}\"}} {rejected}", source.name());
    }
    let name = "mtpx_spec_rounds_total";
    let _ = writeln!(
        out,
        "# HELP {name} Verification rounds (steps with drafts).\n# TYPE {name} counter"
    );
    for source in DraftSource::ALL {
        let _ = writeln!(
            out,
            "{name}{{drafter=\"{}\"}} {}",
            source.name(),
            c.rounds[source as usize]
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_are_cumulative() {
        let h = Histogram::default();
        h.observe(Duration::from_millis(3));
        h.observe(Duration::from_millis(300));
        let mut out = String::new();
        h.write(&mut out, "x", "help");
        assert!(out.contains("x_bucket{le=\"0.005\"} 1"));
        assert!(out.contains("x_bucket{le=\"0.5\"} 2"));
        assert!(out.contains("x_bucket{le=\"+Inf\"} 2"));
        assert_eq!(sample(&out, "x_count"), Some(2.0));
    }
}
