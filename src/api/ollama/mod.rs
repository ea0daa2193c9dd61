//! Ollama's API (`/api/chat`, `/api/generate`, `/api/embed`, `/api/tags`, `/api/show`, `/api/ps`,
//! `/api/version`), so that editors and tools written for Ollama (Continue, Open WebUI, the
//! `ollama` Python and JS packages, ...) work against mtpx unchanged.
//!
//! Requests are translated into the OpenAI request objects ([`request`]) and go through the
//! same prompt building, validation, admission and engine as `/v1/chat/completions`;
//! [`reply`] turns the engine's events into Ollama's NDJSON lines. Differences from Ollama,
//! on purpose:
//! - one model is served; its name is accepted with or without a `:tag`, and the management
//!   endpoints (`/api/pull`, `/api/create`, `/api/delete`, ...) answer 501;
//! - a prompt that does not fit the window is refused (400, before inference) instead of being
//!   truncated from the front, which silently drops the system prompt;
//! - `options.num_ctx` cannot raise the window the server enforces (`/api/show` reports it);
//! - errors are Ollama's `{"error": "message"}` with the right status (an error after a
//!   streamed reply began is its last line).

pub mod embed;
mod reply;
pub mod request;

use super::auth::Authorized;
use super::chat_prompt;
use super::disconnect::Peer;
use super::errors::{
    from_value, optional_bool, optional_string, read_json_object, ApiError, ErrorShape, ShapedError,
};
use super::generate::{self, collect_all, submit_all};
use super::tool_calls::ToolCallParser;
use super::types::{ChatCompletionRequest, GenerationParams};
use super::AppState;
use crate::engine::{Engine, EventStream, Prompt};
use crate::tokenizer::template::civil_from_days;
use actix_web::http::{header, StatusCode};
use actix_web::{web, HttpRequest, HttpResponse, ResponseError};
use futures::StreamExt;
use reply::{Endpoint, ReplyContext};
use serde_json::{json, Map, Value};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// The Ollama release whose API this module follows (clients check `/api/version` before
/// using tools, structured outputs and thinking, all present by this release).
pub const OLLAMA_API_VERSION: &str = "0.12.6";

/// Ollama's error shape: `{"error": "message"}`.
#[derive(Debug)]
pub struct OllamaShape;

impl ErrorShape for OllamaShape {
    fn body(e: &ApiError) -> Value {
        json!(OllamaErrorBody {
            error: e.message.clone(),
        })
    }
}

pub type OllamaError = ShapedError<OllamaShape>;

type Reply = Result<HttpResponse, OllamaError>;

/// Ollama's error body.
#[derive(serde::Serialize, utoipa::ToSchema)]
pub struct OllamaErrorBody {
    pub error: String,
}

/// OpenAI field names in refusals → the Ollama fields they came from.
fn ollama_param(mut e: ApiError) -> ApiError {
    let renamed = match e.param.as_deref() {
        Some("max_tokens") => "options.num_predict".to_string(),
        Some("repetition_penalty") => "options.repeat_penalty".to_string(),
        Some("response_format") => "format".to_string(),
        Some(
            p @ ("temperature" | "top_p" | "top_k" | "min_p" | "seed" | "presence_penalty"
            | "frequency_penalty" | "stop"),
        ) => format!("options.{p}"),
        _ => return e,
    };
    e.param = Some(renamed);
    e
}

/// The `model` a request names, checked against the served one (`name` or `name:tag`); the
/// reply echoes it as given. Ollama requires it; mtpx serves one model, so it may be omitted.
fn requested_model(state: &AppState, body: &Value) -> Result<String, ApiError> {
    let name = match body.get("model").or_else(|| body.get("name")) {
        None | Some(Value::Null) => return Ok(listed_name(state)),
        Some(Value::String(s)) => s.clone(),
        Some(other) => {
            return Err(ApiError::invalid(
                Some("model"),
                format!("`model` must be a string, got `{other}`"),
            ))
        }
    };
    let untagged = name.split_once(':').map_or(name.as_str(), |(base, _)| base);
    state
        .check_model(Some(untagged))
        .or_else(|_| state.check_model(Some(&name)))?;
    Ok(name)
}

/// The served model's name as `/api/tags` lists it.
fn listed_name(state: &AppState) -> String {
    format!("{}:latest", state.config.model_id)
}

/// A model thinks when its chat template writes `<think>` (what `/api/show` reports as the
/// `thinking` capability).
fn thinks(state: &AppState) -> Result<bool, ApiError> {
    let template = state.engine()?.info().facts.chat_template.as_deref();
    Ok(template.is_some_and(|t| t.contains("<think>")))
}

/// `think: true` for a model that does not think is refused, as Ollama refuses it.
fn check_think(state: &AppState, body: &Value, model: &str) -> Result<(), ApiError> {
    if body.get("think") == Some(&Value::Bool(true)) && !thinks(state)? {
        return Err(ApiError::invalid(
            Some("think"),
            format!("\"{model}\" does not support thinking"),
        ));
    }
    Ok(())
}

/// `stream` (Ollama's default: true).
fn wants_stream(body: &Value) -> Result<bool, ApiError> {
    optional_bool(body, "stream", true)
}

/// A request with nothing to generate loads (or, with `keep_alive: 0`, unloads) the model in
/// Ollama; here the model is always loaded, so it is answered at once.
fn load_reply(body: &Value, model: String, endpoint: Endpoint) -> HttpResponse {
    let unload = body.get("keep_alive").is_some_and(|k| k == 0 || k == "0");
    let mut line = Map::new();
    line.insert("model".into(), json!(model));
    line.insert("created_at".into(), json!(rfc3339_now()));
    match endpoint {
        Endpoint::Chat => line.insert(
            "message".into(),
            json!({"role": "assistant", "content": ""}),
        ),
        Endpoint::Generate => line.insert("response".into(), json!("")),
    };
    line.insert("done".into(), json!(true));
    line.insert(
        "done_reason".into(),
        json!(if unload { "unload" } else { "load" }),
    );
    HttpResponse::Ok().json(line)
}

/// A final assistant message with text (and no tool calls), taken out of the messages: the
/// reply continues it, as Ollama's templates leave the last assistant message open.
fn take_prefill(value: &mut Value) -> Option<String> {
    let messages = value.get_mut("messages")?.as_array_mut()?;
    let last = messages.last()?;
    let text = last["content"].as_str().filter(|t| !t.is_empty())?;
    let calls = last.get("tool_calls").and_then(Value::as_array);
    if last["role"] != "assistant" || calls.is_some_and(|c| !c.is_empty()) || messages.len() < 2 {
        return None;
    }
    let text = text.to_string();
    messages.pop();
    Some(text)
}

/// Ollama's chat: NDJSON lines (`stream`, default true) or one object.
#[utoipa::path(post, path = "/api/chat", request_body(content = Object, description = "Ollama's chat request: `model`, `messages`, `tools`, `format`, `options`, `stream`"),
    params(("X-Session-Id" = Option<String>, Header, description = "Continue a persistent session (its KV is reused)")),
    responses(
        (status = 200, description = "`application/x-ndjson` lines, the last with `\"done\": true`; or one object with `stream: false`", body = Object),
        (status = 400, description = "Invalid request, or a prompt over the window", body = OllamaErrorBody),
        (status = 404, description = "Unknown model", body = OllamaErrorBody),
        (status = 503, description = "Overloaded or loading", body = OllamaErrorBody),
    ))]
pub async fn chat(
    auth: Result<Authorized, ApiError>,
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<AppState>,
) -> Reply {
    let received = Instant::now();
    let auth = auth?;
    let body = read_json_object(&req, payload, state.config.max_body).await?;
    let model = requested_model(&state, &body)?;
    let stream = wants_stream(&body)?;
    check_think(&state, &body, &model)?;
    let value = request::chat(&body)?;
    let engine = state.engine()?;
    if value["messages"].as_array().is_some_and(Vec::is_empty) {
        return Ok(load_reply(&body, model, Endpoint::Chat));
    }
    let mut value = value;
    let prefill = take_prefill(&mut value);
    let params: GenerationParams = from_value(&value).map_err(ollama_param)?;
    let chat_request: ChatCompletionRequest = from_value(&value)?;
    let mut prompt = chat_prompt::build(&value, &chat_request)?;
    if let Some(prefill) = prefill {
        let format = value.get("response_format").is_some();
        prompt.continue_prefill(prefill, format.then_some("format"))?;
    }
    let ctx = ReplyContext {
        endpoint: Endpoint::Chat,
        model,
        received,
        parser: ToolCallParser::new(prompt.parse_tools, prompt.single_call)
            .with_tool_names(prompt.tool_names.clone()),
        forced_prefix: prompt.forced_prefix.clone(),
    };
    let events = submit(engine, &req, &auth, &params, prompt.prompt).await?;
    Ok(respond(&req, state, ctx, events, stream).await?)
}

#[utoipa::path(post, path = "/api/generate", request_body(content = Object, description = "Ollama's generate request: `prompt`, `suffix`, `system`, `raw`, `format`, `options`, `stream`"),
    responses(
        (status = 200, description = "`application/x-ndjson` lines with `response` text, or one object", body = Object),
        (status = 400, description = "Invalid request, or a prompt over the window", body = OllamaErrorBody),
        (status = 404, description = "Unknown model", body = OllamaErrorBody),
    ))]
/// `POST /api/generate`: a prompt rendered through the chat template with an optional
/// `system`, or sent as is (`raw`), or with `suffix` as fill-in-the-middle.
pub async fn generate(
    auth: Result<Authorized, ApiError>,
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<AppState>,
) -> Reply {
    let received = Instant::now();
    let auth = auth?;
    let body = read_json_object(&req, payload, state.config.max_body).await?;
    let model = requested_model(&state, &body)?;
    let stream = wants_stream(&body)?;
    check_think(&state, &body, &model)?;
    let text = |field: &str| optional_string(&body, field);
    let (prompt_text, suffix, system) = (text("prompt")?, text("suffix")?, text("system")?);
    let raw = body.get("raw").and_then(Value::as_bool).unwrap_or(false);
    refuse_unsupported_generate_fields(&body, &text("template")?)?;
    let mut value = request::common(&body)?;
    let engine = state.engine()?;
    if prompt_text.is_empty() && suffix.is_empty() {
        return Ok(load_reply(&body, model, Endpoint::Generate));
    }
    let prompt = if !suffix.is_empty() {
        if raw {
            return Err(ApiError::invalid(
                Some("suffix"),
                "`suffix` cannot be used with `raw`: the fill-in-the-middle prompt is built from `prompt` and `suffix`",
            )
            .into());
        }
        let fim = engine.info().fim.as_ref();
        super::completions::fill_in_the_middle(Prompt::Text(prompt_text), &suffix, fim)?
    } else if raw {
        Prompt::Text(prompt_text)
    } else {
        let mut messages = Vec::new();
        if !system.is_empty() {
            messages.push(json!({"role": "system", "content": system}));
        }
        messages.push(json!({"role": "user", "content": prompt_text}));
        value.insert("messages".into(), Value::Array(messages));
        let value = Value::Object(value.clone());
        let chat_request: ChatCompletionRequest = from_value(&value)?;
        chat_prompt::build(&value, &chat_request)?.prompt
    };
    let params: GenerationParams = from_value(&Value::Object(value)).map_err(ollama_param)?;
    let ctx = ReplyContext {
        endpoint: Endpoint::Generate,
        model,
        received,
        parser: ToolCallParser::new(false, false),
        forced_prefix: String::new(),
    };
    let events = submit(engine, &req, &auth, &params, prompt)
        .await
        .map_err(|e| e.with_param_renamed("messages", "prompt"))?;
    Ok(respond(&req, state, ctx, events, stream).await?)
}

/// Fields of `/api/generate` that mtpx does not implement, refused rather than ignored: each
/// would change what the model is asked.
fn refuse_unsupported_generate_fields(body: &Value, template: &str) -> Result<(), ApiError> {
    let non_empty = |field: &str| {
        body.get(field)
            .and_then(Value::as_array)
            .is_some_and(|a| !a.is_empty())
    };
    if non_empty("images") {
        return Err(ApiError::invalid(
            Some("images"),
            "the served model reads text only: `images` cannot be used",
        ));
    }
    if non_empty("context") {
        return Err(ApiError::invalid(
            Some("context"),
            "`context` (token ids of an earlier reply) is not supported; send the conversation \
             to /api/chat instead (its shared prefix is reused from the cache)",
        ));
    }
    if !template.is_empty() {
        return Err(ApiError::invalid(
            Some("template"),
            "`template` is not supported: prompts are rendered with the model's own chat \
             template (or sent as is with `raw: true`)",
        ));
    }
    Ok(())
}

/// Plans and submits one choice (Ollama has no `n`).
async fn submit(
    engine: &Engine,
    req: &HttpRequest,
    auth: &Authorized,
    params: &GenerationParams,
    prompt: Prompt,
) -> Result<EventStream, ApiError> {
    let session = generate::session_key(req, &auth.scope)?;
    let mut plan = generate::plan(params, prompt, false, 0, session).map_err(ollama_param)?;
    // `num_predict` is a ceiling in Ollama: generation also ends when the window is full.
    plan.max_tokens_ceiling = true;
    let mut streams = submit_all(engine, &plan).await.map_err(ollama_param)?;
    Ok(streams.remove(0))
}

/// NDJSON lines while streaming (ended early when the client hangs up), else one object.
async fn respond(
    req: &HttpRequest,
    state: web::Data<AppState>,
    ctx: ReplyContext,
    events: EventStream,
    stream: bool,
) -> Result<HttpResponse, ApiError> {
    let peer = Peer::of(req);
    if stream {
        let lines = ctx
            .lines(state, events)
            .take_until(Box::pin(peer.hung_up()))
            .map(Ok::<_, std::convert::Infallible>);
        return Ok(HttpResponse::Ok()
            .insert_header((header::CONTENT_TYPE, "application/x-ndjson"))
            .insert_header(("X-Accel-Buffering", "no"))
            .streaming(lines));
    }
    let mut collected = collect_all(vec![events], &state.metrics, peer).await?;
    Ok(HttpResponse::Ok().json(ctx.complete(&state, collected.remove(0))))
}

/// `GET /api/tags`: the served model.
#[utoipa::path(get, path = "/api/tags", responses((status = 200, description = "`{\"models\": [...]}`", body = Object)))]
pub async fn tags(auth: Result<Authorized, ApiError>, state: web::Data<AppState>) -> Reply {
    auth?;
    Ok(HttpResponse::Ok().json(json!({"models": [model_entry(&state)?]})))
}

/// `GET /api/ps`: the served model, loaded until the server stops.
#[utoipa::path(get, path = "/api/ps", responses((status = 200, description = "`{\"models\": [...]}` with `context_length`", body = Object)))]
pub async fn ps(auth: Result<Authorized, ApiError>, state: web::Data<AppState>) -> Reply {
    auth?;
    let mut entry = model_entry(&state)?;
    let window = state.engine()?.info().context_window;
    entry["expires_at"] = json!("2999-12-31T00:00:00Z");
    entry["size_vram"] = json!(0);
    entry["context_length"] = json!(window);
    Ok(HttpResponse::Ok().json(json!({"models": [entry]})))
}

/// `GET /api/version`: the Ollama API release followed.
#[utoipa::path(get, path = "/api/version", responses((status = 200, description = "`{\"version\": \"0.12.6\"}`", body = Object)))]
pub async fn version() -> HttpResponse {
    HttpResponse::Ok().json(json!({"version": OLLAMA_API_VERSION}))
}

/// `POST /api/show`: details, the chat template, and under `model_info` the context length
/// clients size their prompts by (the window the server enforces).
#[utoipa::path(post, path = "/api/show", request_body(content = Object, description = "`{\"model\": name}`"),
    responses(
        (status = 200, description = "details, template, `model_info`, `capabilities`", body = Object),
        (status = 404, description = "Unknown model", body = OllamaErrorBody),
    ))]
pub async fn show(
    auth: Result<Authorized, ApiError>,
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<AppState>,
) -> Reply {
    auth?;
    let body = read_json_object(&req, payload, state.config.max_body).await?;
    requested_model(&state, &body)?;
    let info = state.engine()?.info();
    let facts = &info.facts;
    let template = facts.chat_template.clone().unwrap_or_default();
    let mut capabilities = vec!["completion"];
    if template.contains("tools") {
        capabilities.push("tools");
    }
    if thinks(&state)? {
        capabilities.push("thinking");
    }
    if info.fim.is_some() {
        capabilities.push("insert");
    }
    let arch = &facts.architecture;
    Ok(HttpResponse::Ok().json(json!({
        "license": "",
        "modelfile": format!("# Served by mtpx\nFROM {}\n", info.model_path),
        "parameters": "",
        "template": template,
        "details": details(&state)?,
        "model_info": {
            "general.architecture": arch,
            "general.parameter_count": facts.parameter_count,
            format!("{arch}.context_length"): info.context_window,
        },
        "capabilities": capabilities,
        "modified_at": modified_at(&info.model_path),
    })))
}

/// Other `/api/*` paths: Ollama's model management has no meaning for a server of one file.
pub async fn unsupported(req: HttpRequest) -> HttpResponse {
    OllamaError::from(
        ApiError::new(
            StatusCode::NOT_IMPLEMENTED,
            "invalid_request_error",
            format!(
                "{} {} is not implemented: mtpx serves the one model it was started with \
                 (fetch models with `mtpx pull NAME`)",
                req.method(),
                req.path()
            ),
        )
        .with_code("not_implemented"),
    )
    .error_response()
}

fn model_entry(state: &AppState) -> Result<Value, ApiError> {
    let info = state.engine()?.info();
    let name = listed_name(state);
    Ok(json!({
        "name": name,
        "model": name,
        "modified_at": modified_at(&info.model_path),
        "size": info.facts.file_bytes,
        "digest": digest(&info.model_path, info.facts.file_bytes),
        "details": details(state)?,
    }))
}

fn details(state: &AppState) -> Result<Value, ApiError> {
    let facts = &state.engine()?.info().facts;
    Ok(json!({
        "parent_model": "",
        "format": "gguf",
        "family": facts.architecture,
        "families": [facts.architecture],
        "parameter_size": parameter_size(facts.parameter_count),
        "quantization_level": facts.quantization.clone().unwrap_or_default(),
    }))
}

/// `494.03M`, `1.54B`: how Ollama writes parameter counts.
fn parameter_size(count: u64) -> String {
    let n = count as f64;
    if n >= 1e9 {
        format!("{:.2}B", n / 1e9)
    } else {
        format!("{:.2}M", n / 1e6)
    }
}

/// An identifier of the served file (its path, size and modification time), in Ollama's
/// `sha256:…` digest form. It names the file; it is not a hash of its contents.
fn digest(path: &str, bytes: u64) -> String {
    use sha2::{Digest, Sha256};
    let stamp = format!("{path}\n{bytes}\n{}", modified_at(path));
    hex::encode(Sha256::digest(stamp.as_bytes()))
}

fn modified_at(path: &str) -> String {
    let time = std::fs::metadata(path)
        .and_then(|m| m.modified())
        .unwrap_or(UNIX_EPOCH);
    rfc3339(time)
}

pub fn rfc3339_now() -> String {
    rfc3339(SystemTime::now())
}

/// `2026-12-03T08:15:02.123456789Z`: UTC, nanoseconds, as Ollama's `created_at`.
pub fn rfc3339(time: SystemTime) -> String {
    let since = time.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = since.as_secs();
    let (year, month, day) = civil_from_days((secs / 86_400) as i64);
    let in_day = secs % 86_400;
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:09}Z",
        in_day / 3600,
        in_day % 3600 / 60,
        in_day % 60,
        since.subsec_nanos()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn dates_are_rfc3339_utc() {
        let at = |secs: u64, nanos: u32| rfc3339(UNIX_EPOCH + Duration::new(secs, nanos));
        assert_eq!(at(0, 0), "1970-01-01T00:00:00.000000000Z");
        assert_eq!(at(951_782_400, 5), "2000-02-29T00:00:00.000000005Z");
        assert_eq!(at(1_798_761_599, 0), "2026-12-31T23:59:59.000000000Z");
        assert_eq!(at(4_107_542_400, 0), "2100-03-01T00:00:00.000000000Z");
    }

    #[test]
    fn refusals_name_ollama_fields() {
        let renamed = |p: &str| {
            ollama_param(ApiError::invalid(Some(p), "x"))
                .param
                .clone()
                .unwrap()
        };
        assert_eq!(renamed("max_tokens"), "options.num_predict");
        assert_eq!(renamed("temperature"), "options.temperature");
        assert_eq!(renamed("repetition_penalty"), "options.repeat_penalty");
        assert_eq!(renamed("response_format"), "format");
        assert_eq!(renamed("messages"), "messages");
    }

    #[test]
    fn parameter_sizes_read_like_ollamas() {
        assert_eq!(parameter_size(494_032_768), "494.03M");
        assert_eq!(parameter_size(1_543_714_304), "1.54B");
    }
}
