//! The OpenAI-compatible HTTP edge: wire types, handlers, SSE framing, auth, metrics and the
//! `serve` command.
//!
//! This layer owns everything a client sees (JSON shapes, status codes, SSE, tool-call parsing
//! of the model's text) and nothing the engine owns: it never touches pages, sessions or the
//! scheduler directly. It turns a request into an [`crate::engine::GenerateRequest`], submits it
//! (admission happens there, before inference), and turns the engine's events into OpenAI
//! responses or `chat.completion.chunk`s.
//!
//! Routes (see [`app_routes`]):
//!
//! | route | handler |
//! | --- | --- |
//! | `POST /v1/chat/completions` | [`chat`] (stream and not) |
//! | `POST /v1/chat/completions/count` | [`tokens`]: count a chat's prompt tokens |
//! | `POST /v1/completions` | [`completions`] |
//! | `POST /v1/embeddings` | [`embeddings`]: pooled hidden states |
//! | `POST /v1/responses`, `GET`/`DELETE /v1/responses/{id}`, `POST /v1/responses/{id}/cancel`, `GET /v1/responses/{id}/input_items` | [`responses`] |
//! | `GET /v1/responses` (WebSocket upgrade) | [`ws`]: Responses WebSocket mode |
//! | `GET /v1/stats` | [`stats`]: engine state as JSON (pool, scheduler, sessions) |
//! | `GET /v1/models`, `GET /v1/models/{id}` | [`models`] |
//! | `POST /tokenize`, `POST /detokenize` | [`tokens`] |
//! | `GET /health`, `GET /get_load`, `GET /metrics` | [`health`], [`metrics`] |
//! | `POST /api/chat`, `/api/generate`, `/api/embed`, `/api/embeddings`, `/api/show`; `GET /api/tags`, `/api/ps`, `/api/version` | [`ollama`]: Ollama's API |
//! | `POST /completion` (and `/completions`), `/infill`; `GET /props` | [`llamacpp`]: llama.cpp's native routes |
//! | `POST /embedding` (and `/embeddings`) | [`embeddings`]: llama.cpp's native embeddings |
//! | `POST /v1/messages`, `/v1/messages/count_tokens` | [`anthropic`]: Anthropic's Messages API |
//! | `GET /`, `/app.js`, `/style.css` | [`playground`]: the browser playground |
//! | `GET /openapi.json` | [`openapi`] |
//!
//! With an API key configured, every route except `/health`, `/metrics`, `/openapi.json` and
//! the playground's static files
//! needs it ([`auth`]), and session ids (`X-Session-Id`) are scoped to that key.

pub mod anthropic;
pub mod auth;
mod bare_tool_calls;
pub mod chat;
pub mod chat_prompt;
pub mod completions;
pub mod cors;
pub mod disconnect;
pub mod embeddings;
pub mod errors;
pub mod generate;
pub mod health;
pub mod llamacpp;
pub mod metrics;
pub mod models;
pub mod ollama;
pub mod openapi;
pub mod playground;
pub mod responses;
pub mod serve;
pub mod sse;
pub mod stats;
pub mod testing;
pub mod tokens;
pub mod tool_calls;
mod tool_grammar;
pub mod types;
pub mod ws;

use crate::engine::Engine;
use actix_web::{web, HttpResponse};
use errors::ApiError;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Token ids to text, for `/detokenize` and logprob token strings. The engine has no public
/// detokenize call for arbitrary ids yet, so `serve` builds one from the model's tokenizer.
#[derive(Clone)]
pub struct Detokenizer {
    tokenizer: Arc<tokenizers::Tokenizer>,
    byte_level: bool,
}

impl Detokenizer {
    /// The text of `ids` (special tokens included).
    pub fn decode(&self, ids: &[u32]) -> Result<String, String> {
        self.tokenizer.decode(ids, false).map_err(|e| e.to_string())
    }

    /// One token's raw bytes (see [`crate::tokenizer::token_bytes`]).
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        crate::tokenizer::token_bytes(&self.tokenizer, self.byte_level, id)
    }

    /// A special (control) token: an end-of-turn marker, never text of the reply.
    pub fn is_special(&self, id: u32) -> bool {
        let added = self.tokenizer.get_added_vocabulary();
        self.tokenizer
            .id_to_token(id)
            .is_some_and(|t| added.is_special_token(&t))
    }
}

/// Builds a [`Detokenizer`] from a loaded model (before the bundle is given to the engine).
pub fn detokenizer_of(bundle: &crate::model::ModelBundle) -> Detokenizer {
    Detokenizer {
        byte_level: crate::tokenizer::is_byte_level(&bundle.tokenizer),
        tokenizer: Arc::new(bundle.tokenizer.clone()),
    }
}

/// Settings of the HTTP layer (not of the engine).
#[derive(Debug, Clone)]
pub struct ApiConfig {
    /// The id clients name the model by (`/v1/models`); also accepted: `aliases`.
    pub model_id: String,
    pub aliases: Vec<String>,
    /// When not empty, one of them is required on every route but `/health`, `/metrics`,
    /// `/openapi.json`. Each key is its own scope: sessions and stored responses created with
    /// one key are invisible to the others.
    pub api_keys: Vec<String>,
    /// Largest request body in bytes (413 beyond).
    pub max_body: usize,
    /// SSE keep-alive comment interval while no token arrives.
    pub keep_alive: Duration,
    /// Origins allowed by CORS (and to open the WebSocket): this machine's by default.
    pub cors_origins: cors::AllowedOrigins,
    /// Largest WebSocket frame (or reassembled message) in bytes; beyond it the socket is
    /// closed with 1009.
    pub max_ws_frame: usize,
    /// WebSocket ping interval; a peer silent for two intervals is dropped.
    pub ws_ping: Duration,
    /// How long stored responses stay continuable (`previous_response_id`).
    pub response_ttl: Duration,
    /// Most stored responses kept (the oldest go first).
    pub max_stored_responses: usize,
}

impl ApiConfig {
    pub fn new(model_id: impl Into<String>) -> Self {
        Self {
            model_id: model_id.into(),
            aliases: Vec::new(),
            api_keys: Vec::new(),
            max_body: 16 << 20,
            keep_alive: Duration::from_secs(5),
            cors_origins: cors::AllowedOrigins::default(),
            max_ws_frame: 16 << 20,
            ws_ping: Duration::from_secs(15),
            response_ttl: Duration::from_secs(3600),
            max_stored_responses: 100_000,
        }
    }
}

/// What every handler shares: the engine (once loaded), the config and the metrics.
pub struct AppState {
    pub config: ApiConfig,
    pub metrics: metrics::Metrics,
    /// Stored responses (`previous_response_id`), scoped by API key.
    pub responses: responses::store::ResponseStore,
    /// Background responses still running.
    pub background: responses::background::BackgroundRuns,
    engine: OnceLock<Engine>,
    detokenizer: OnceLock<Detokenizer>,
    /// Unix seconds at start (the model's `created`).
    pub created: u64,
    /// Set on SIGTERM/SIGINT: `/health` answers 503 so routers stop sending new work while
    /// running turns finish and sessions are written to disk.
    pub draining: std::sync::atomic::AtomicBool,
}

impl AppState {
    /// A state that answers 503 until [`AppState::set_ready`].
    pub fn new(config: ApiConfig) -> Self {
        Self {
            responses: responses::store::ResponseStore::new(
                config.response_ttl,
                config.max_stored_responses,
            ),
            background: Default::default(),
            config,
            metrics: metrics::Metrics::default(),
            engine: OnceLock::new(),
            detokenizer: OnceLock::new(),
            created: unix_now(),
            draining: Default::default(),
        }
    }

    /// Makes the server ready. Called once, when the model is loaded and the engine started.
    pub fn set_ready(&self, engine: Engine, detokenizer: Detokenizer) {
        let _ = self.detokenizer.set(detokenizer);
        if let Some(store) = engine.session_store() {
            self.responses.keep_on_disk(store.clone());
        }
        if self.engine.set(engine).is_err() {
            tracing::warn!("the engine was already set; ignoring the second one");
        }
    }

    pub fn is_ready(&self) -> bool {
        self.engine.get().is_some()
    }

    /// The engine, or 503 while the model is loading.
    pub fn engine(&self) -> Result<&Engine, ApiError> {
        self.engine.get().ok_or_else(ApiError::loading)
    }

    pub fn detokenizer(&self) -> Result<&Detokenizer, ApiError> {
        self.detokenizer.get().ok_or_else(ApiError::loading)
    }

    /// One token's text, as logprobs list it (empty while loading or for an unknown id).
    pub fn token_text(&self, id: u32) -> String {
        self.detokenizer()
            .ok()
            .and_then(|d| d.decode(&[id]).ok())
            .unwrap_or_default()
    }

    /// A special (control) token, e.g. the end-of-turn token that ends a reply.
    pub fn is_special_token(&self, id: u32) -> bool {
        self.detokenizer().is_ok_and(|d| d.is_special(id))
    }

    /// One token's raw bytes, as logprobs' `bytes` give them (empty while loading).
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        self.detokenizer()
            .map(|d| d.token_bytes(id))
            .unwrap_or_default()
    }

    /// `None` when `name` is absent (accepted); an error when it names another model.
    pub fn check_model(&self, name: Option<&str>) -> Result<(), ApiError> {
        match name {
            None | Some("") => Ok(()),
            Some(n) if n == self.config.model_id || self.config.aliases.iter().any(|a| a == n) => {
                Ok(())
            }
            Some(n) => Err(ApiError::model_not_found(n)),
        }
    }
}

pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Registers every route on an actix-web `App` (see the module docs for the table), behind a
/// middleware that counts responses by status and adds CORS headers when configured.
pub fn app_routes(state: web::Data<AppState>) -> impl FnOnce(&mut web::ServiceConfig) {
    move |cfg| {
        cfg.app_data(state)
            .app_data(errors::json_config())
            .app_data(errors::path_config())
            .app_data(errors::query_config())
            .service(
                web::scope("")
                    .wrap_fn(|mut req, srv| {
                        use actix_web::dev::Service;
                        // HEAD is answered wherever GET is (RFC 9110), as clients probe with it:
                        // Ollama's CLI and Go client send `HEAD /` as their heartbeat. Routed as
                        // a GET; the HTTP codec, which saw the HEAD, sends no body.
                        // (Not a WebSocket handshake: its reply has no body to drop.)
                        if req.method() == actix_web::http::Method::HEAD
                            && !req.headers().contains_key(actix_web::http::header::UPGRADE)
                        {
                            req.head_mut().method = actix_web::http::Method::GET;
                        }
                        let state = req.app_data::<web::Data<AppState>>().cloned();
                        let origin = req
                            .headers()
                            .get(actix_web::http::header::ORIGIN)
                            .and_then(|v| v.to_str().ok())
                            .map(str::to_string);
                        let method = req.method().clone();
                        let response = srv.call(req);
                        async move {
                            let mut res = response.await?;
                            if let Some(state) = state {
                                state.metrics.count_response(res.status().as_u16());
                                let origins = &state.config.cors_origins;
                                for (k, v) in cors::headers_for(origins, origin.as_deref(), &method)
                                {
                                    res.headers_mut().insert(k, v);
                                }
                            }
                            Ok(res)
                        }
                    })
                    .service(endpoint("/", "GET", [web::get().to(playground::index)]))
                    .service(endpoint(
                        "/app.js",
                        "GET",
                        [web::get().to(playground::app_js)],
                    ))
                    .service(endpoint(
                        "/style.css",
                        "GET",
                        [web::get().to(playground::style_css)],
                    ))
                    .service(endpoint("/health", "GET", [web::get().to(health::health)]))
                    .service(endpoint(
                        "/get_load",
                        "GET",
                        [web::get().to(health::get_load)],
                    ))
                    // llama.cpp's server also answers these without (or with) the `/v1`.
                    .service(endpoint(
                        "/v1/health",
                        "GET",
                        [web::get().to(health::health)],
                    ))
                    .service(endpoint(
                        "/models",
                        "GET",
                        [web::get().to(models::list_models)],
                    ))
                    .service(endpoint(
                        "/chat/completions",
                        "POST",
                        [web::post().to(chat::chat_completions)],
                    ))
                    .service(endpoint(
                        "/metrics",
                        "GET",
                        [web::get().to(metrics::metrics)],
                    ))
                    .service(endpoint(
                        "/openapi.json",
                        "GET",
                        [web::get().to(openapi::openapi_json)],
                    ))
                    .service(endpoint(
                        "/v1/models",
                        "GET",
                        [web::get().to(models::list_models)],
                    ))
                    .service(endpoint(
                        "/v1/models/{id:.*}",
                        "GET",
                        [web::get().to(models::get_model)],
                    ))
                    .service(endpoint(
                        "/v1/chat/completions",
                        "POST",
                        [web::post().to(chat::chat_completions)],
                    ))
                    .service(endpoint(
                        "/v1/chat/completions/count",
                        "POST",
                        [web::post().to(tokens::count_chat)],
                    ))
                    .service(endpoint(
                        "/v1/completions",
                        "POST",
                        [web::post().to(completions::completions)],
                    ))
                    .service(endpoint(
                        "/v1/responses",
                        "GET, POST",
                        [
                            web::post().to(responses::create_response),
                            web::get().to(ws::responses_socket),
                        ],
                    ))
                    .service(endpoint(
                        "/v1/responses/{id}",
                        "GET, DELETE",
                        [
                            web::get().to(responses::get_response),
                            web::delete().to(responses::delete_response),
                        ],
                    ))
                    .service(endpoint(
                        "/v1/responses/{id}/cancel",
                        "POST",
                        [web::post().to(responses::cancel_response)],
                    ))
                    .service(endpoint(
                        "/v1/responses/{id}/input_items",
                        "GET",
                        [web::get().to(responses::input_items::list_input_items)],
                    ))
                    .service(endpoint("/v1/stats", "GET", [web::get().to(stats::stats)]))
                    .service(endpoint(
                        "/v1/embeddings",
                        "POST",
                        [web::post().to(embeddings::embeddings)],
                    ))
                    .service(endpoint(
                        "/tokenize",
                        "POST",
                        [web::post().to(tokens::tokenize)],
                    ))
                    .service(endpoint(
                        "/detokenize",
                        "POST",
                        [web::post().to(tokens::detokenize)],
                    ))
                    .service(endpoint(
                        "/completion",
                        "POST",
                        [web::post().to(llamacpp::completion)],
                    ))
                    .service(endpoint(
                        "/completions",
                        "POST",
                        [web::post().to(llamacpp::completion)],
                    ))
                    .service(endpoint(
                        "/infill",
                        "POST",
                        [web::post().to(llamacpp::infill)],
                    ))
                    .service(endpoint("/props", "GET", [web::get().to(llamacpp::props)]))
                    .service(endpoint(
                        "/embedding",
                        "POST",
                        [web::post().to(embeddings::llamacpp_embedding)],
                    ))
                    .service(endpoint(
                        "/embeddings",
                        "POST",
                        [web::post().to(embeddings::llamacpp_embedding)],
                    ))
                    .service(endpoint(
                        "/v1/messages",
                        "POST",
                        [web::post().to(anthropic::messages)],
                    ))
                    .service(endpoint(
                        "/v1/messages/count_tokens",
                        "POST",
                        [web::post().to(anthropic::count_tokens)],
                    ))
                    .service(endpoint(
                        "/api/chat",
                        "POST",
                        [web::post().to(ollama::chat)],
                    ))
                    .service(endpoint(
                        "/api/generate",
                        "POST",
                        [web::post().to(ollama::generate)],
                    ))
                    .service(endpoint(
                        "/api/embed",
                        "POST",
                        [web::post().to(ollama::embed::embed)],
                    ))
                    .service(endpoint(
                        "/api/embeddings",
                        "POST",
                        [web::post().to(ollama::embed::embeddings)],
                    ))
                    .service(endpoint(
                        "/api/show",
                        "POST",
                        [web::post().to(ollama::show)],
                    ))
                    .service(endpoint("/api/tags", "GET", [web::get().to(ollama::tags)]))
                    .service(endpoint("/api/ps", "GET", [web::get().to(ollama::ps)]))
                    .service(endpoint(
                        "/api/version",
                        "GET",
                        [web::get().to(ollama::version)],
                    ))
                    .service(web::resource("/api/{rest:.*}").to(ollama::unsupported))
                    .default_service(web::to(not_found)),
            );
    }
}

/// Builds the HTTP server (not yet running) bound to `addr`; `signals`: stop gracefully on
/// SIGINT/SIGTERM (off in tests).
pub fn http_server(
    state: web::Data<AppState>,
    addr: (&str, u16),
    workers: usize,
    signals: bool,
) -> std::io::Result<(actix_web::dev::Server, std::net::SocketAddr)> {
    let mut server = actix_web::HttpServer::new(move || {
        actix_web::App::new().configure(app_routes(state.clone()))
    })
    .on_connect(disconnect::on_connect)
    .workers(workers.max(1))
    .shutdown_timeout(10)
    .bind(addr)?;
    if !signals {
        server = server.disable_signals();
    }
    let bound = server
        .addrs()
        .first()
        .copied()
        .ok_or_else(|| std::io::Error::other("the server bound no address"))?;
    Ok((server.run(), bound))
}

/// A path and the routes (methods) it answers; another method gets a 405 naming them in
/// `Allow` (left to itself actix-web would pass it to the scope's 404), and `OPTIONS` (a CORS
/// preflight, answered by the CORS headers) a 204. A path that answers GET answers HEAD too
/// (see `app_routes`), and `Allow` says so.
fn endpoint<const N: usize>(
    path: &str,
    allow: &'static str,
    routes: [actix_web::Route; N],
) -> actix_web::Resource {
    let allow = if allow.split(", ").any(|m| m == "GET") {
        format!("{allow}, HEAD")
    } else {
        allow.to_string()
    };
    let mut resource = web::resource(path).app_data(Allow(allow));
    for route in routes {
        resource = resource.route(route);
    }
    resource.default_service(web::to(method_not_allowed))
}

/// The methods an [`endpoint`] answers, as its `Allow` header lists them.
#[derive(Clone)]
struct Allow(String);

async fn method_not_allowed(req: actix_web::HttpRequest) -> HttpResponse {
    if req.method() == actix_web::http::Method::OPTIONS {
        return HttpResponse::NoContent().finish();
    }
    let allow = req
        .app_data::<Allow>()
        .map_or("GET, HEAD", |a| a.0.as_str());
    let error = ApiError::new(
        actix_web::http::StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        format!(
            "{} is not allowed on {}; use {allow}",
            req.method(),
            req.path()
        ),
    )
    .with_code("method_not_allowed");
    let mut res = route_error(&req, error);
    if let Ok(value) = actix_web::http::header::HeaderValue::from_str(allow) {
        res.headers_mut()
            .insert(actix_web::http::header::ALLOW, value);
    }
    res
}

async fn not_found(req: actix_web::HttpRequest) -> HttpResponse {
    if req.method() == actix_web::http::Method::OPTIONS {
        return HttpResponse::NoContent().finish();
    }
    let error = ApiError::not_found(&format!("{} {}", req.method(), req.path()));
    route_error(&req, error)
}

/// A routing error in the shape of the API the path belongs to: Anthropic's SDKs read
/// `{"type": "error", ...}` under `/v1/messages`, Ollama's clients `{"error": "..."}` under
/// `/api/`; everywhere else OpenAI's shape.
fn route_error(req: &actix_web::HttpRequest, error: ApiError) -> HttpResponse {
    use actix_web::ResponseError;
    if req.path().starts_with("/v1/messages") {
        anthropic::AnthropicError::from(error).error_response()
    } else if req.path().starts_with("/api/") {
        ollama::OllamaError::from(error).error_response()
    } else {
        error.error_response()
    }
}
