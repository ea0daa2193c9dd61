//! llama.cpp server's native routes: `POST /completion` (also `/completions`), `POST /infill`
//! and `GET /props`, for the editor plugins and scripts written against llama.cpp
//! (llama.vscode and llama.vim complete code through `/infill`; Continue's llama.cpp provider
//! uses `/completion`).
//!
//! The request's llama.cpp fields become the OpenAI fields the rest of the API layer plans
//! with, so admission, sampling and structured outputs are the same as on `/v1/completions`.
//! The reply is llama.cpp's: `content`, `stop`, `tokens_predicted`, `tokens_evaluated`,
//! `tokens_cached`, `stop_type`, `timings`, and `completion_probabilities` with `n_probs`;
//! streamed as SSE `data:` objects without a closing `[DONE]`, as llama.cpp sends them.
//! `grammar` (GBNF, see `sampling::gbnf`) and `json_schema` constrain the output as in
//! llama.cpp; `ignore_eos` bans the end tokens. Differences, on purpose: a prompt over the
//! window is refused (400) instead of truncated.

use super::auth::Authorized;
use super::disconnect::Peer;
use super::errors::{from_value, optional_string, read_json_object, ApiError};
use super::generate::{self, collect_all, submit_all, Collected};
use super::sse;
use super::types::GenerationParams;
use super::AppState;
use crate::engine::{EngineEvent, EventStream, Prompt};
use crate::scheduler::{FinishReason, Usage as EngineUsage};
use actix_web::web::Bytes;
use actix_web::{web, HttpRequest, HttpResponse};
use serde_json::{json, Map, Value};
use std::collections::VecDeque;

/// llama.cpp server's defaults where a request leaves a sampling field out.
fn defaults() -> [(&'static str, Value); 4] {
    [
        ("temperature", json!(0.8)),
        ("top_k", json!(40)),
        ("top_p", json!(0.95)),
        ("min_p", json!(0.05)),
    ]
}

/// Numeric llama.cpp fields and the OpenAI fields they become.
const NUMERIC: [(&str, &str); 7] = [
    ("temperature", "temperature"),
    ("top_k", "top_k"),
    ("top_p", "top_p"),
    ("min_p", "min_p"),
    ("repeat_penalty", "repetition_penalty"),
    ("presence_penalty", "presence_penalty"),
    ("frequency_penalty", "frequency_penalty"),
];

/// The fields every route shares, as a `/v1/completions` body (without the prompt).
fn openai_fields(body: &Value) -> Result<Map<String, Value>, ApiError> {
    let mut out = Map::new();
    for (field, openai) in NUMERIC {
        if let Some(v) = body.get(field).filter(|v| !v.is_null()) {
            if !v.is_number() {
                return Err(ApiError::invalid(
                    Some(field),
                    format!("`{field}` must be a number, got `{v}`"),
                ));
            }
            out.insert(openai.into(), v.clone());
        }
    }
    for (field, value) in defaults() {
        out.entry(field).or_insert(value);
    }
    match body.get("seed") {
        // -1: a random seed.
        Some(v) if v.as_i64().is_some_and(|s| s >= 0) => {
            out.insert("seed".into(), v.clone());
        }
        Some(v) if v.is_null() || v.as_i64().is_some() => {}
        Some(v) => {
            return Err(ApiError::invalid(
                Some("seed"),
                format!("`seed` must be an integer, got `{v}`"),
            ))
        }
        None => {}
    }
    match body.get("n_predict") {
        None | Some(Value::Null) => {}
        Some(v) if v.as_i64() == Some(-1) => {}
        Some(v) if v.as_u64().is_some_and(|n| n > 0) => {
            out.insert("max_tokens".into(), v.clone());
        }
        Some(v) => {
            return Err(ApiError::invalid(
                Some("n_predict"),
                format!("`n_predict` must be -1 (until the model stops) or at least 1, got `{v}`"),
            ))
        }
    }
    if let Some(stop) = body.get("stop").filter(|s| !s.is_null()) {
        out.insert("stop".into(), stop.clone());
    }
    if let Some(bias) = logit_bias(body.get("logit_bias"))? {
        out.insert("logit_bias".into(), bias);
    }
    if let Some(schema) = body.get("json_schema").filter(|s| !s.is_null()) {
        out.insert("guided_json".into(), schema.clone());
    }
    // Type-checked when the body is read as OpenAI fields.
    for field in ["grammar", "ignore_eos"] {
        if let Some(v) = body.get(field).filter(|v| !v.is_null()) {
            out.insert(field.into(), v.clone());
        }
    }
    Ok(out)
}

/// `logit_bias` as llama.cpp takes it — `[[id, bias], ...]` (bias `false` bans the token) or
/// `{"id": bias}` — in OpenAI's shape.
fn logit_bias(bias: Option<&Value>) -> Result<Option<Value>, ApiError> {
    let invalid = || {
        ApiError::invalid(
            Some("logit_bias"),
            "`logit_bias` must be [[token id, bias or false], ...] or {\"token id\": bias}",
        )
    };
    match bias {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Object(map)) => Ok(Some(Value::Object(map.clone()))),
        Some(Value::Array(pairs)) => {
            let mut out = Map::new();
            for pair in pairs {
                let (Some(id), Some(bias)) = (
                    pair.get(0).and_then(Value::as_u64),
                    pair.get(1)
                        .filter(|_| pair.as_array().is_some_and(|p| p.len() == 2)),
                ) else {
                    return Err(invalid());
                };
                let bias = match bias {
                    Value::Bool(false) => json!(-100),
                    b if b.is_number() => b.clone(),
                    _ => return Err(invalid()),
                };
                out.insert(id.to_string(), bias);
            }
            Ok(Some(Value::Object(out)))
        }
        Some(_) => Err(invalid()),
    }
}

/// OpenAI field names in refusals → the llama.cpp fields they came from.
fn llama_param(mut e: ApiError) -> ApiError {
    let renamed = match e.param.as_deref() {
        Some("max_tokens") => "n_predict",
        Some("repetition_penalty") => "repeat_penalty",
        Some("guided_json") => "json_schema",
        Some("top_logprobs") => "n_probs",
        Some("messages") => "prompt",
        _ => return e,
    };
    e.param = Some(renamed.into());
    e
}

/// `prompt`: a string, token ids, or both mixed (`[12, " text", 34]`).
async fn prompt_of(state: &AppState, prompt: Option<&Value>) -> Result<Prompt, ApiError> {
    let invalid = |m: &str| ApiError::invalid(Some("prompt"), m.to_string());
    match prompt {
        Some(Value::String(s)) => Ok(Prompt::Text(s.clone())),
        Some(Value::Array(parts)) if parts.iter().all(|p| p.is_u64()) => Ok(Prompt::Tokens(
            parts
                .iter()
                .filter_map(|p| p.as_u64())
                .map(|t| t as u32)
                .collect(),
        )),
        Some(Value::Array(parts)) if parts.iter().all(|p| p.is_u64() || p.is_string()) => {
            let engine = state.engine()?;
            let mut ids = Vec::new();
            for part in parts {
                match part {
                    Value::String(s) => ids.extend(
                        engine
                            .tokenize(&Prompt::Text(s.clone()))
                            .await
                            .map_err(ApiError::from)?,
                    ),
                    id => ids.push(id.as_u64().unwrap_or_default() as u32),
                }
            }
            Ok(Prompt::Tokens(ids))
        }
        Some(Value::Array(_)) => Err(invalid(
            "send one prompt per request: a string, token ids, or strings and token ids mixed",
        )),
        None | Some(Value::Null) => Err(invalid("`prompt` is required")),
        Some(_) => Err(invalid(
            "`prompt` must be a string or an array of token ids",
        )),
    }
}

/// `POST /completion`.
#[utoipa::path(post, path = "/completion", request_body(content = Object, description = "llama.cpp's completion request: `prompt`, `n_predict`, `temperature`, `top_k`, `top_p`, `min_p`, `seed`, `stop`, `n_probs`, `logit_bias`, `json_schema`, `stream`"),
    responses(
        (status = 200, description = "llama.cpp's completion object, or SSE `data:` objects when `stream` is true", body = Object),
        (status = 400, description = "Invalid request or `context_length_exceeded`", body = super::types::ErrorResponse),
    ))]
pub async fn completion(
    auth: Authorized,
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    let body = read_json_object(&req, payload, state.config.max_body).await?;
    let prompt = prompt_of(&state, body.get("prompt")).await?;
    run(auth, req, body, state, prompt).await
}

/// `POST /infill`: code completion between `input_prefix` and `input_suffix`, after the files
/// of `input_extra` (`[{"filename", "text"}]`) when the model knows repository context; the
/// `prompt` text, if any, starts the middle.
#[utoipa::path(post, path = "/infill", request_body(content = Object, description = "llama.cpp's infill request: `input_prefix`, `input_suffix`, `input_extra`, `prompt`, and the `/completion` fields"),
    responses(
        (status = 200, description = "llama.cpp's completion object, or SSE `data:` objects", body = Object),
        (status = 400, description = "Invalid request, or a model without fill-in-the-middle tokens", body = super::types::ErrorResponse),
    ))]
pub async fn infill(
    auth: Authorized,
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    let body = read_json_object(&req, payload, state.config.max_body).await?;
    let text = |field: &str| optional_string(&body, field);
    let (before, after, started) = (
        text("input_prefix")?,
        text("input_suffix")?,
        text("prompt")?,
    );
    let files = extra_files(body.get("input_extra"))?;
    let engine = state.engine()?;
    let Some(fim) = engine.info().fim.as_ref() else {
        return Err(ApiError::invalid(
            Some("input_suffix"),
            "this model has no fill-in-the-middle tokens, so /infill cannot be used",
        ));
    };
    let mut prompt = if files.is_empty() {
        fim.prompt(&before, &after)
    } else {
        fim.repository_prompt("myproject", &files, "filename", &before, &after)
            .ok_or_else(|| {
                ApiError::invalid(
                    Some("input_extra"),
                    "this model has no repository-context tokens (a file separator), so `input_extra` cannot be used",
                )
            })?
    };
    prompt.push_str(&started);
    run(auth, req, body, state, Prompt::Text(prompt)).await
}

/// `input_extra`: `[{"filename": …, "text": …}]`.
fn extra_files(extra: Option<&Value>) -> Result<Vec<(String, String)>, ApiError> {
    let Some(list) = extra.filter(|e| !e.is_null()) else {
        return Ok(Vec::new());
    };
    let invalid = || {
        ApiError::invalid(
            Some("input_extra"),
            "`input_extra` must be an array of {\"filename\": string, \"text\": string}",
        )
    };
    list.as_array()
        .ok_or_else(invalid)?
        .iter()
        .map(|chunk| {
            let field = |k: &str| chunk.get(k).and_then(Value::as_str).map(str::to_string);
            Ok((
                field("filename").unwrap_or_default(),
                field("text").ok_or_else(invalid)?,
            ))
        })
        .collect()
}

/// Plans, submits and answers one completion in llama.cpp's shape.
async fn run(
    auth: Authorized,
    req: HttpRequest,
    body: Value,
    state: web::Data<AppState>,
    prompt: Prompt,
) -> Result<HttpResponse, ApiError> {
    let engine = state.engine()?;
    super::completions::check_token_ids(&prompt, engine.info().vocab_size)?;
    let fields = Value::Object(openai_fields(&body)?);
    let params: GenerationParams = from_value(&fields).map_err(llama_param)?;
    let n_probs = match body.get("n_probs") {
        None | Some(Value::Null) => 0,
        Some(v) => v.as_u64().filter(|&n| n <= 20).ok_or_else(|| {
            ApiError::invalid(
                Some("n_probs"),
                format!("`n_probs` must be in 0..=20, got `{v}`"),
            )
        })? as u32,
    };
    let session = generate::session_key(&req, &auth.scope)?;
    let plan =
        generate::plan(&params, prompt, n_probs > 0, n_probs, session).map_err(llama_param)?;
    let mut streams = submit_all(engine, &plan).await.map_err(llama_param)?;
    let events = streams.remove(0);
    let model = state.config.model_id.clone();
    let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
    if stream {
        let frames = frames(state.clone(), model, events, n_probs > 0);
        return Ok(sse::response(
            frames,
            state.config.keep_alive,
            Peer::of(&req),
        ));
    }
    let mut collected = collect_all(vec![events], &state.metrics, Peer::of(&req)).await?;
    let c = collected.remove(0);
    generate::count_usage(&state.metrics, &c.usage);
    let mut reply = final_object(
        &model,
        &c.text,
        c.finish,
        c.stop_string.as_deref(),
        &c.usage,
    );
    if n_probs > 0 {
        reply["completion_probabilities"] = probabilities(&state, &c);
    }
    Ok(HttpResponse::Ok().json(reply))
}

/// The last object of a reply: the counts, why it stopped, and the timings.
fn final_object(
    model: &str,
    content: &str,
    finish: Option<FinishReason>,
    stop_string: Option<&str>,
    u: &EngineUsage,
) -> Value {
    let stop_type = match (finish, stop_string) {
        (Some(FinishReason::Length), _) => "limit",
        (Some(FinishReason::Stop), Some(_)) => "word",
        (Some(FinishReason::Stop), None) => "eos",
        _ => "none",
    };
    json!({
        "index": 0,
        "content": content,
        "tokens": [],
        "id_slot": 0,
        "stop": true,
        "model": model,
        "tokens_predicted": u.completion_tokens,
        "tokens_evaluated": u.prompt_tokens,
        "tokens_cached": u.cached_tokens,
        "truncated": false,
        "has_new_line": content.contains('\n'),
        "stop_type": stop_type,
        "stopping_word": stop_string.unwrap_or(""),
        "timings": generate::timings(u),
    })
}

/// `completion_probabilities`: per generated token, its id, text, logprob and the most likely
/// alternatives.
fn probabilities(state: &AppState, c: &Collected) -> Value {
    token_probabilities(state, &c.token_ids, &c.logprobs, &c.top_logprobs)
}

fn token_probabilities(
    state: &AppState,
    ids: &[u32],
    logprobs: &[Option<f32>],
    top: &[Vec<(u32, f32)>],
) -> Value {
    let entry = |id: u32, logprob: f32| {
        let token = state.token_text(id);
        json!({"id": id, "token": token, "bytes": token.as_bytes(), "logprob": logprob})
    };
    ids.iter()
        .enumerate()
        .map(|(i, &id)| {
            let mut e = entry(
                id,
                logprobs
                    .get(i)
                    .copied()
                    .flatten()
                    .unwrap_or(f32::NEG_INFINITY),
            );
            e["top_logprobs"] = top
                .get(i)
                .into_iter()
                .flatten()
                .map(|&(alt, lp)| entry(alt, lp))
                .collect();
            e
        })
        .collect()
}

/// SSE frames: one `{"content", "stop": false}` object per piece of text, then the final object
/// (no `[DONE]`: llama.cpp's native stream has none).
fn frames(
    state: web::Data<AppState>,
    model: String,
    events: EventStream,
    with_probs: bool,
) -> futures::stream::LocalBoxStream<'static, Bytes> {
    let reply = Streaming {
        state: state.clone(),
        model,
        with_probs,
        predicted: 0,
    };
    generate::event_frames(reply, events, VecDeque::new(), state)
}

struct Streaming {
    state: web::Data<AppState>,
    model: String,
    with_probs: bool,
    /// Tokens generated so far.
    predicted: usize,
}

impl generate::EventFrames for Streaming {
    fn on_event(&mut self, event: EngineEvent, queue: &mut VecDeque<Bytes>) -> bool {
        match event {
            EngineEvent::Started { .. } | EngineEvent::PromptLogprobs { .. } => false,
            EngineEvent::Delta {
                text,
                token_ids,
                logprobs,
                top_logprobs,
                ..
            } => {
                self.predicted += token_ids.len();
                // Held text (a stop string may be starting) waits, unless its tokens'
                // probabilities are asked for.
                let scored = self.with_probs && !token_ids.is_empty();
                if text.is_empty() && !scored {
                    return false;
                }
                let mut chunk = json!({"index": 0, "content": text, "tokens": [],
                    "stop": false, "id_slot": 0, "tokens_predicted": self.predicted});
                if self.with_probs {
                    chunk["completion_probabilities"] =
                        token_probabilities(&self.state, &token_ids, &logprobs, &top_logprobs);
                }
                queue.push_back(sse::data(&chunk));
                false
            }
            EngineEvent::Finished {
                reason,
                usage,
                stop_string,
            } => {
                let stop = stop_string.as_deref();
                let last = final_object(&self.model, "", Some(reason), stop, &usage);
                queue.push_back(sse::data(&last));
                true
            }
            EngineEvent::Error(e) => {
                queue.push_back(sse::data(&ApiError::from(e).body()));
                true
            }
        }
    }
}

/// `GET /props`: what llama.cpp clients read before completing (the context size above all).
#[utoipa::path(get, path = "/props", responses((status = 200, description = "`default_generation_settings.n_ctx` (the enforced window), `total_slots`, `model_path`, `chat_template`", body = Object)))]
pub async fn props(
    _auth: Authorized,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    let info = state.engine()?.info();
    Ok(HttpResponse::Ok().json(json!({
        "default_generation_settings": {
            "n_ctx": info.context_window,
            "params": Value::Object(defaults().into_iter().map(|(k, v)| (k.to_string(), v)).chain([("n_predict".to_string(), json!(-1))]).collect()),
        },
        "total_slots": 1,
        "model_alias": state.config.model_id,
        "model_path": info.model_path,
        "chat_template": info.facts.chat_template.clone().unwrap_or_default(),
        "build_info": format!("mtpx {}", env!("CARGO_PKG_VERSION")),
    })))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama_fields_become_openai_fields() {
        let body = json!({"n_predict": 16, "repeat_penalty": 1.1, "seed": -1, "stop": ["\n"],
                          "logit_bias": [[15, false], [16, 2.5]], "json_schema": {"type": "object"}});
        let out = openai_fields(&body).unwrap();
        assert_eq!(out["max_tokens"], json!(16));
        assert_eq!(out["repetition_penalty"], json!(1.1));
        assert!(out.get("seed").is_none(), "-1 is a random seed");
        assert_eq!(out["logit_bias"], json!({"15": -100, "16": 2.5}));
        assert_eq!(out["guided_json"], json!({"type": "object"}));
        assert_eq!(out["temperature"], json!(0.8));
        let g = openai_fields(&json!({"grammar": "root ::= \"a\"", "ignore_eos": true})).unwrap();
        assert_eq!(g["grammar"], json!("root ::= \"a\""));
        assert_eq!(g["ignore_eos"], json!(true));
        let unlimited = openai_fields(&json!({"n_predict": -1})).unwrap();
        assert!(unlimited.get("max_tokens").is_none());
    }

    #[test]
    fn refusals_name_llama_fields() {
        let param = |body: Value| openai_fields(&body).unwrap_err().param.clone().unwrap();
        assert_eq!(param(json!({"n_predict": 0})), "n_predict");
        assert_eq!(param(json!({"logit_bias": [[1]]})), "logit_bias");
        assert_eq!(param(json!({"top_k": "many"})), "top_k");
        let renamed = llama_param(ApiError::invalid(Some("max_tokens"), "x"));
        assert_eq!(renamed.param.as_deref(), Some("n_predict"));
    }
}
