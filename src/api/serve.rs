//! `mtpx serve`: the HTTP server over the engine.
//!
//! Order of start-up: check the security policy, bind and start answering (`/health` is 503
//! while loading), resolve/pull and load the model on a background thread, start the engine on
//! the actix system, then `/health` turns 200. SIGINT and SIGTERM both stop the server
//! gracefully (no new connections; in-flight requests get up to 10 s, streams still open then
//! are dropped, which cancels them and frees their pages) and the process exits 0.

use super::{detokenizer_of, http_server, ApiConfig, AppState};
use crate::cli::ModelArgs;
use crate::engine::{Engine, EngineConfig};
use crate::model::ModelBundle;
use crate::session::store::StoreConfig;
use anyhow::{bail, Context, Result};
use clap::Args;
use std::net::IpAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Address to bind. Binding beyond loopback needs --api-key (or --insecure-no-auth).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Cap on the context window (prompt + max_tokens); default: the model's, within the KV budget.
    #[arg(long)]
    pub context_window: Option<usize>,
    /// Refuse a request whose `prompt + max_tokens` exceeds the window (400
    /// `context_length_exceeded`, OpenAI's rule). By default `max_tokens` is a ceiling: such a
    /// request is served up to the window and ends with `finish_reason: "length"` there, as
    /// llama.cpp's server and Ollama serve it (agents send large defaults, e.g. 32000).
    #[arg(long)]
    pub strict_max_tokens: bool,
    /// Do not hold tool calls to the tools' grammar under `tool_choice: "auto"` (by default,
    /// once the model opens a call it must name a declared tool and give it valid arguments).
    #[arg(long)]
    pub no_tool_grammar: bool,
    /// The seed of every request that gives none, so that sampled replies (an agent's, say)
    /// are the same from run to run. By default such requests are seeded at random.
    #[arg(long)]
    pub seed: Option<u64>,
    /// The temperature of every request that gives none (llama.cpp's `--temp`; 0 is greedy).
    /// By default such requests sample at OpenAI's 1.0.
    #[arg(long)]
    pub temperature: Option<f32>,
    /// Require this key on every /v1 route (`Authorization: Bearer KEY` or `X-API-Key: KEY`).
    /// Several keys, comma-separated, serve several clients; each key sees only its own
    /// sessions and stored responses.
    #[arg(long, env = "MTPX_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Allow binding a non-loopback address without an API key.
    #[arg(long)]
    pub insecure_no_auth: bool,
    /// Another name requests may give for the served model (repeat for several): the names
    /// an existing client asks for, e.g. Claude Code's `claude-sonnet-4-5` and haiku models.
    #[arg(long = "alias", value_name = "NAME")]
    pub aliases: Vec<String>,
    /// Most tokens computed per engine step.
    #[arg(long, default_value_t = 2048)]
    pub max_batch_tokens: usize,
    /// Most sequences per engine step.
    #[arg(long, default_value_t = 64)]
    pub max_seqs: usize,
    /// Longest prefill chunk per sequence per step.
    #[arg(long, default_value_t = 512)]
    pub prefill_chunk: usize,
    /// Requests waiting beyond this are refused with 503 overloaded.
    #[arg(long, default_value_t = 256)]
    pub max_queue: usize,
    /// Seconds an idle session keeps its KV.
    #[arg(long, default_value_t = 3600)]
    pub session_ttl: u64,
    /// Where sessions (their K/V pages and token histories) and stored responses are written
    /// after each turn, so that a session evicted from memory or lost in a restart resumes
    /// from disk instead of a cold prefill. Replicas serving the same model may share it.
    /// Default: `$MTPX_HOME/sessions`.
    #[arg(long, value_name = "DIR")]
    pub session_dir: Option<std::path::PathBuf>,
    /// Most bytes the session store keeps on disk; past it the oldest files are evicted.
    #[arg(long, default_value = "20GiB", value_parser = parse_size)]
    pub session_disk: usize,
    /// Keep sessions in memory only (no session store; wins over --session-dir).
    #[arg(long)]
    pub no_session_store: bool,
    /// Largest request body (e.g. 16MiB, 1MB, 65536).
    #[arg(long, default_value = "16MiB", value_parser = parse_size)]
    pub max_body: usize,
    /// Also allow browser requests from this origin (repeatable; `*` for any; `none` for no
    /// origin at all). Pages served from this machine (localhost, 127.0.0.1, [::1]) are allowed
    /// without it.
    #[arg(long)]
    pub cors_origin: Vec<String>,
    /// HTTP worker threads.
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    /// Seconds between SSE keep-alive comments while a stream waits.
    #[arg(long, default_value_t = 5)]
    pub sse_keep_alive: u64,
    /// Largest WebSocket frame (or reassembled message); a bigger one closes the socket (1009).
    #[arg(long, default_value = "16MiB", value_parser = parse_size)]
    pub max_ws_frame: usize,
    /// Seconds between WebSocket pings; a peer silent for two intervals is dropped.
    #[arg(long, default_value_t = 15)]
    pub ws_ping: u64,
    /// How `/v1/embeddings` (and Ollama's `/api/embed`) pool a text's hidden states: `mean` over
    /// its tokens, or the `last` token's (for decoder models trained for embeddings).
    #[arg(long, default_value = "mean")]
    pub pooling: crate::runner::embed::Pooling,
    #[command(flatten)]
    pub spec: crate::spec::SpecArgs,
}

/// `16MiB`, `1MB`, `64KiB`, `65536`.
pub fn parse_size(s: &str) -> Result<usize, String> {
    let lower = s.trim().to_ascii_lowercase();
    let units: [(&str, usize); 7] = [
        ("gib", 1 << 30),
        ("mib", 1 << 20),
        ("kib", 1 << 10),
        ("gb", 1_000_000_000),
        ("mb", 1_000_000),
        ("kb", 1_000),
        ("b", 1),
    ];
    let (num, scale) = units
        .iter()
        .find_map(|(u, scale)| lower.strip_suffix(u).map(|n| (n.trim(), *scale)))
        .unwrap_or((lower.as_str(), 1));
    num.parse::<f64>()
        .ok()
        .filter(|v| *v > 0.0)
        .map(|v| (v * scale as f64) as usize)
        .ok_or_else(|| format!("bad size `{s}` (try 16MiB, 1MB, 65536)"))
}

impl ServeArgs {
    pub fn engine_config(&self) -> EngineConfig {
        EngineConfig {
            page_size: self.model.page_size,
            kv_memory: self.model.kv_memory,
            kv_dtype: self.model.kv_dtype,
            context_window: self.context_window,
            max_batch_tokens: self.max_batch_tokens,
            max_seqs: self.max_seqs,
            prefill_chunk: self.prefill_chunk,
            max_queue: self.max_queue,
            session_ttl: Duration::from_secs(self.session_ttl),
            speculative: self.spec.config(),
            // Resolved (and pulled if need be) by the loader thread.
            draft_model: None,
            pooling: self.pooling,
            strict_max_tokens: self.strict_max_tokens,
            lazy_tool_grammar: !self.no_tool_grammar,
            default_seed: self.seed,
            session_store: (!self.no_session_store).then(|| StoreConfig {
                dir: self
                    .session_dir
                    .clone()
                    .unwrap_or_else(|| crate::pull::mtpx_home().join("sessions")),
                budget_bytes: self.session_disk as u64,
                response_ttl: Duration::from_secs(self.session_ttl),
            }),
        }
    }

    /// The id clients use: the registry name, or the file stem of a path.
    pub fn model_id(&self) -> String {
        let name = self.model.model.trim();
        if crate::pull::find_model(name).is_some() {
            return name.to_string();
        }
        Path::new(name)
            .file_stem()
            .map_or_else(|| name.to_string(), |s| s.to_string_lossy().into_owned())
    }

    /// `--api-key` split at commas, blanks dropped.
    pub fn api_keys(&self) -> Vec<String> {
        self.api_key
            .iter()
            .flat_map(|k| k.split(','))
            .map(str::trim)
            .filter(|k| !k.is_empty())
            .map(str::to_string)
            .collect()
    }

    /// Refuses to expose an unauthenticated server beyond loopback.
    pub fn check_security(&self) -> Result<()> {
        let loopback = self.host == "localhost"
            || self.host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback());
        if !loopback && self.api_keys().is_empty() && !self.insecure_no_auth {
            bail!(
                "refusing to bind {} without an API key: pass --api-key KEY (or MTPX_API_KEY), \
                 or --insecure-no-auth to serve it open",
                self.host
            );
        }
        Ok(())
    }
}

/// Runs the server until SIGINT/SIGTERM.
pub fn serve(args: ServeArgs) -> Result<()> {
    args.check_security()?;
    if let Some(t) = args.temperature {
        anyhow::ensure!(
            t.is_finite() && (0.0..=2.0).contains(&t),
            "--temperature must be in 0..=2, got {t}"
        );
        super::generate::set_default_temperature(t);
    }
    actix_rt::System::new().block_on(run(args))
}

async fn run(args: ServeArgs) -> Result<()> {
    let model_id = args.model_id();
    let mut config = ApiConfig::new(model_id.clone());
    config.aliases = vec![args.model.model.clone()];
    config.aliases.extend(args.aliases.iter().cloned());
    config.api_keys = args.api_keys();
    config.max_body = args.max_body;
    config.keep_alive = Duration::from_secs(args.sse_keep_alive.max(1));
    config.cors_origins = crate::api::cors::AllowedOrigins::from_flags(&args.cors_origin);
    config.max_ws_frame = args.max_ws_frame;
    config.ws_ping = Duration::from_secs(args.ws_ping.max(1));
    config.response_ttl = Duration::from_secs(args.session_ttl);
    let state = actix_web::web::Data::new(AppState::new(config));
    let (server, addr) = http_server(state.clone(), (&args.host, args.port), args.workers, false)
        .with_context(|| format!("binding {}:{}", args.host, args.port))?;
    tracing::info!(
        "listening on http://{addr} (auth: {}, CORS: {}, max body {} bytes); loading {}",
        match state.config.api_keys.len() {
            0 => "none".to_string(),
            1 => "API key".to_string(),
            n => format!("{n} API keys"),
        },
        state.config.cors_origins,
        state.config.max_body,
        args.model.model
    );
    let stopper = server.handle();
    let draining = state.clone();
    actix_rt::spawn(async move {
        shutdown_signal().await;
        draining
            .draining
            .store(true, std::sync::atomic::Ordering::Relaxed);
        tracing::info!("shutting down: in-flight requests get up to 10 s");
        stopper.stop(true).await;
    });
    let failure: Arc<Mutex<Option<anyhow::Error>>> = Arc::default();
    let handle = server.handle();
    let (tx, rx) = tokio::sync::oneshot::channel();
    let name = args.model.model.clone();
    let spec_args = args.spec.clone();
    std::thread::spawn(move || {
        let loaded = crate::pull::resolve_model(&name, true).and_then(|path| {
            let bundle =
                ModelBundle::load(&path).with_context(|| format!("loading {}", path.display()))?;
            let draft = spec_args
                .draft_model_path()
                .context("resolving --draft-model")?;
            Ok((bundle, draft))
        });
        let _ = tx.send(loaded);
    });
    let mut engine_cfg = args.engine_config();
    let fail = failure.clone();
    let stopped_state = state.clone();
    actix_rt::spawn(async move {
        let started = match rx.await {
            Ok(Ok((bundle, draft))) => {
                engine_cfg.draft_model = draft;
                let detokenizer = detokenizer_of(&bundle);
                Engine::start(bundle, engine_cfg.clone()).map(|engine| (engine, detokenizer))
            }
            Ok(Err(e)) => Err(e),
            Err(_) => Err(anyhow::anyhow!("the model loader thread died")),
        };
        match started {
            Ok((engine, detokenizer)) => {
                log_config(&model_id, &engine, &engine_cfg);
                state.set_ready(engine, detokenizer);
            }
            Err(e) => {
                tracing::error!("cannot serve: {e:#}");
                *fail.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                handle.stop(false).await;
            }
        }
    });
    server.await.context("running the HTTP server")?;
    if let Ok(engine) = stopped_state.engine() {
        engine.persist_sessions().await;
    }
    if let Some(e) = failure.lock().unwrap_or_else(|p| p.into_inner()).take() {
        return Err(e);
    }
    tracing::info!("stopped");
    Ok(())
}

/// SIGINT or SIGTERM, whichever comes first (both mean a graceful stop).
async fn shutdown_signal() {
    let interrupt = async {
        let _ = actix_rt::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        use actix_rt::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        _ = interrupt => {}
        _ = terminate => {}
    }
}

fn log_config(model_id: &str, engine: &Engine, cfg: &EngineConfig) {
    let info = engine.info();
    tracing::info!(
        "ready: model {model_id} ({}), context window {} tokens (model {}), KV {:.1} MiB = {} pages × {} tokens ({:?}), \
         max batch tokens {}, max seqs {}, prefill chunk {}, max queue {}, session TTL {} s; \
         drafters {:?} (draft model {:?})",
        info.model_path,
        info.context_window,
        info.model_context_length,
        info.kv_budget_bytes as f64 / 1048576.0,
        info.num_pages,
        info.page_size,
        info.kv_dtype,
        cfg.max_batch_tokens,
        cfg.max_seqs,
        cfg.prefill_chunk,
        cfg.max_queue,
        cfg.session_ttl.as_secs(),
        info.drafters,
        info.draft_model_path
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }

    fn parse(args: &[&str]) -> ServeArgs {
        Cli::parse_from(std::iter::once("serve").chain(args.iter().copied())).serve
    }

    #[test]
    fn defaults_are_safe() {
        let a = parse(&[]);
        assert_eq!(a.host, "127.0.0.1");
        assert_eq!(a.port, 8080);
        assert_eq!(a.max_body, 16 << 20);
        assert_eq!(a.model_id(), "qwen2.5-coder-0.5b");
        assert!(a.check_security().is_ok());
    }

    #[test]
    fn an_open_non_loopback_bind_is_refused() {
        assert!(parse(&["--host", "0.0.0.0"]).check_security().is_err());
        assert!(parse(&["--host", "0.0.0.0", "--api-key", "k"])
            .check_security()
            .is_ok());
        assert!(parse(&["--host", "0.0.0.0", "--insecure-no-auth"])
            .check_security()
            .is_ok());
        assert!(parse(&["--host", "::1"]).check_security().is_ok());
    }

    #[test]
    fn sizes_and_model_ids_parse() {
        assert_eq!(parse_size("1MB"), Ok(1_000_000));
        assert_eq!(parse_size("64KiB"), Ok(65536));
        assert_eq!(parse_size("100"), Ok(100));
        assert!(parse_size("lots").is_err());
        assert_eq!(
            parse(&["--model", "/tmp/x/test-model.gguf"]).model_id(),
            "test-model"
        );
    }
}
