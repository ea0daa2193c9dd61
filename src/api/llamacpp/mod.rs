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
//! llama.cpp; `ignore_eos` bans the end tokens. Also as llama.cpp: `max_tokens` for
//! `n_predict`; `n_predict: 0` (the plugins' cache warming) computes the prompt and answers no
//! text; an array of prompts answers an array; `samplers` turns off the samplers it leaves
//! out (their order is mtpx's own); `logit_bias` keys may be text; `return_tokens`;
//! `response_fields`; `t_max_predict_ms` and `n_indent` (see `editor_stops`). Differences, on
//! purpose: a prompt over the window is refused (400) instead of truncated; penalties count
//! the generated tokens only (OpenAI's rule), not the prompt's last `repeat_last_n`.

use super::auth::Authorized;
use super::disconnect::Peer;
use super::errors::{from_value, optional_string, read_json_object, ApiError};
use super::generate::{self, collect_all, submit_all, Collected};
use super::sse;
use super::types::GenerationParams;
use super::AppState;
use crate::engine::{Engine, EngineEvent, EventStream, Prompt};
use crate::scheduler::{FinishReason, Usage as EngineUsage};
use actix_web::web::Bytes;
use actix_web::{web, HttpRequest, HttpResponse};
use serde_json::{json, Map, Value};
use std::collections::VecDeque;

mod editor_stops;
mod infill;

use editor_stops::EditorStops;
use infill::{infill_tokens, InfillInput};

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
    if let Some(n) = n_predict(body)?.filter(|&n| n >= 0) {
        // 0 computes the prompt alone: one token is generated and left out of the reply.
        out.insert("max_tokens".into(), json!(n.max(1)));
    }
    samplers(body, &mut out)?;
    if let Some(stop) = body.get("stop").filter(|s| !s.is_null()) {
        out.insert("stop".into(), stop.clone());
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

/// `n_predict`, or `max_tokens` when it is absent (llama.cpp reads both); `None`: absent,
/// negative: until the model stops.
fn n_predict(body: &Value) -> Result<Option<i64>, ApiError> {
    let field = ["n_predict", "max_tokens"]
        .into_iter()
        .find(|f| body.get(*f).is_some_and(|v| !v.is_null()));
    let Some(field) = field else { return Ok(None) };
    let v = &body[field];
    v.as_i64().map(Some).ok_or_else(|| {
        ApiError::invalid(
            Some(field),
            format!("`{field}` must be an integer (-1: until the model stops), got `{v}`"),
        )
    })
}

/// llama.cpp's sampler names and the fields whose samplers they are.
const SAMPLERS: [(&str, &[&str]); 5] = [
    ("temperature", &["temperature", "temp"]),
    ("top_k", &["top_k"]),
    ("top_p", &["top_p"]),
    ("min_p", &["min_p"]),
    ("repetition_penalty", &["penalties"]),
];

/// `samplers` (llama.cpp's chain, e.g. the editor plugins' `["top_k", "top_p", "infill"]`):
/// a sampler left out is off, so its field gets the neutral value (temperature 1). Names mtpx
/// does not run (`infill`, `dry`, `xtc`, `typ_p`) are accepted and skipped.
fn samplers(body: &Value, out: &mut Map<String, Value>) -> Result<(), ApiError> {
    let names = match body.get("samplers") {
        None | Some(Value::Null) => return Ok(()),
        Some(Value::Array(names)) if names.iter().all(Value::is_string) => names,
        Some(v) => {
            return Err(ApiError::invalid(
                Some("samplers"),
                format!("`samplers` must be an array of sampler names, got `{v}`"),
            ))
        }
    };
    let listed = |aliases: &[&str]| {
        names
            .iter()
            .any(|n| aliases.contains(&n.as_str().unwrap_or_default()))
    };
    for (field, aliases) in SAMPLERS {
        if !listed(aliases) {
            let neutral = match field {
                "temperature" | "top_p" | "repetition_penalty" => json!(1.0),
                _ => json!(0),
            };
            out.insert(field.into(), neutral);
            if field == "repetition_penalty" {
                out.remove("presence_penalty");
                out.remove("frequency_penalty");
            }
        }
    }
    Ok(())
}

/// `logit_bias` as llama.cpp takes it, in OpenAI's shape: `[[token, bias], ...]` or
/// `{"token": bias}`, a token given by id or as text (each of the text's tokens gets the
/// bias); `false` bans it. A token named twice (by id and inside a text) gets the sum, as
/// llama.cpp adds them; a ban stays a ban. Sums beyond OpenAI's ±100 are clamped: ±100
/// already decides.
async fn logit_bias(engine: &Engine, bias: Option<&Value>) -> Result<Option<Value>, ApiError> {
    let invalid = || {
        ApiError::invalid(
            Some("logit_bias"),
            "`logit_bias` must be [[token id or text, bias or false], ...] or {\"token id or text\": bias}",
        )
    };
    let pairs: Vec<(Value, Value)> = match bias {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(map)) => map
            .iter()
            .map(|(k, v)| {
                let key = k.parse::<u64>().map_or_else(|_| json!(k), |id| json!(id));
                (key, v.clone())
            })
            .collect(),
        Some(Value::Array(pairs)) => pairs
            .iter()
            .map(|pair| match pair.as_array().map(Vec::as_slice) {
                Some([token, bias]) => Ok((token.clone(), bias.clone())),
                _ => Err(invalid()),
            })
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(invalid()),
    };
    let mut sums: std::collections::BTreeMap<u32, f64> = std::collections::BTreeMap::new();
    let mut banned = std::collections::BTreeSet::new();
    for (token, bias) in pairs {
        let bias = match bias {
            Value::Bool(false) => None,
            b => Some(b.as_f64().ok_or_else(invalid)?),
        };
        let ids = match token {
            Value::String(text) => engine.tokenize_literal(&text).await?,
            id => vec![id
                .as_u64()
                .and_then(|id| u32::try_from(id).ok())
                .ok_or_else(invalid)?],
        };
        for id in ids {
            match bias {
                Some(b) => *sums.entry(id).or_default() += b,
                None => {
                    banned.insert(id);
                }
            }
        }
    }
    let mut out = Map::new();
    for (id, sum) in sums {
        out.insert(id.to_string(), json!(sum.clamp(-100.0, 100.0)));
    }
    for id in banned {
        out.insert(id.to_string(), json!(-100.0));
    }
    Ok(Some(Value::Object(out)))
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

/// `prompt` as llama.cpp reads it: a string, token ids, or strings and ids mixed
/// (`[12, " text", 34]`) are one prompt; an array of those (`["a", "b"]`, `[[1, 2], "c"]`) is
/// one prompt each.
async fn prompts_of(state: &AppState, prompt: Option<&Value>) -> Result<Vec<Prompt>, ApiError> {
    let invalid = |m: &str| ApiError::invalid(Some("prompt"), m.to_string());
    let one = |v: &Value| {
        let parts = v.as_array()?;
        let mixed = parts.iter().any(Value::is_u64) && parts.iter().any(Value::is_string);
        (mixed || parts.iter().all(Value::is_u64))
            .then(|| parts.iter().all(|p| p.is_u64() || p.is_string()))
            .filter(|&ok| ok)
    };
    let prompts: Vec<&Value> =
        match prompt {
            Some(Value::String(_)) => vec![prompt.unwrap_or(&Value::Null)],
            Some(v @ Value::Array(parts)) if !parts.is_empty() && one(v).is_some() => vec![v],
            Some(Value::Array(list)) if !list.is_empty() => list.iter().collect(),
            None | Some(Value::Null) => return Err(invalid("`prompt` is required")),
            Some(_) => return Err(invalid(
                "`prompt` must be a string, token ids, strings and ids mixed, or an array of those",
            )),
        };
    let engine = state.engine()?;
    let mut out = Vec::with_capacity(prompts.len());
    for (i, p) in prompts.into_iter().enumerate() {
        let prompt = match p {
            Value::String(s) => Prompt::Text(s.clone()),
            v if one(v).is_some() => {
                let mut ids = Vec::new();
                for part in v.as_array().into_iter().flatten() {
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
                Prompt::Tokens(ids)
            }
            _ => {
                return Err(ApiError::invalid(
                    Some(&format!("prompt[{i}]")),
                    "each prompt must be a string, token ids, or strings and ids mixed",
                ))
            }
        };
        out.push(prompt);
    }
    Ok(out)
}

/// `POST /completion`.
#[utoipa::path(post, path = "/completion", request_body(content = Object, description = "llama.cpp's completion request: `prompt` (or an array of prompts), `n_predict` (or `max_tokens`), `temperature`, `top_k`, `top_p`, `min_p`, `seed`, `stop`, `samplers`, `n_probs`, `logit_bias`, `return_tokens`, `response_fields`, `t_max_predict_ms`, `n_indent`, `json_schema`, `grammar`, `stream`"),
    responses(
        (status = 200, description = "llama.cpp's completion object (an array of them for an array of prompts), or SSE `data:` objects when `stream` is true", body = Object),
        (status = 400, description = "Invalid request or `context_length_exceeded`", body = super::types::ErrorResponse),
    ))]
pub async fn completion(
    auth: Authorized,
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    let body = read_json_object(&req, payload, state.config.max_body).await?;
    let prompts = prompts_of(&state, body.get("prompt")).await?;
    run(auth, req, body, state, prompts).await
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
    let input = InfillInput {
        prefix: text("input_prefix")?,
        suffix: text("input_suffix")?,
        started: text("prompt")?,
        files: extra_files(body.get("input_extra"))?,
        n_predict: n_predict(&body)?.unwrap_or(-1),
    };
    let engine = state.engine()?;
    let Some(fim) = engine.info().fim.as_ref() else {
        return Err(ApiError::invalid(
            Some("input_suffix"),
            "this model has no fill-in-the-middle tokens, so /infill cannot be used",
        ));
    };
    let prompt = Prompt::Tokens(infill_tokens(engine, fim, &input).await?);
    run(auth, req, body, state, vec![prompt]).await
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
                field("filename").unwrap_or_else(|| "tmp".into()),
                field("text").ok_or_else(invalid)?,
            ))
        })
        .collect()
}

/// What a reply shows besides the text (the request's options).
#[derive(Clone, Copy)]
struct Shown {
    /// `n_probs`: the most likely tokens at each step.
    n_probs: u32,
    /// `return_tokens`: the generated token ids.
    tokens: bool,
    /// `n_predict: 0`: the prompt was computed for the cache; the token generated is not shown.
    prompt_only: bool,
}

/// Plans, submits and answers completions of `prompts` in llama.cpp's shape.
async fn run(
    auth: Authorized,
    req: HttpRequest,
    body: Value,
    state: web::Data<AppState>,
    prompts: Vec<Prompt>,
) -> Result<HttpResponse, ApiError> {
    let engine = state.engine()?;
    for prompt in &prompts {
        super::completions::check_token_ids(prompt, engine.info().vocab_size)?;
    }
    let mut fields = openai_fields(&body)?;
    if let Some(bias) = logit_bias(engine, body.get("logit_bias")).await? {
        fields.insert("logit_bias".into(), bias);
    }
    let params: GenerationParams = from_value(&Value::Object(fields)).map_err(llama_param)?;
    let shown = Shown {
        n_probs: match body.get("n_probs") {
            None | Some(Value::Null) => 0,
            Some(v) => v.as_u64().filter(|&n| n <= 20).ok_or_else(|| {
                ApiError::invalid(
                    Some("n_probs"),
                    format!("`n_probs` must be in 0..=20, got `{v}`"),
                )
            })? as u32,
        },
        tokens: body.get("return_tokens").and_then(Value::as_bool) == Some(true),
        prompt_only: n_predict(&body)? == Some(0),
    };
    let stops = EditorStops::from_body(&body)?;
    let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
    if stream && prompts.len() > 1 {
        return Err(ApiError::invalid(
            Some("prompt"),
            "stream one prompt per request (several prompts are answered without `stream`)",
        ));
    }
    // A session continues with one prompt only: several would each overwrite it.
    let session = match prompts.len() {
        1 => generate::session_key(&req, &auth.scope)?,
        _ => None,
    };
    let mut streams = Vec::with_capacity(prompts.len());
    for prompt in prompts {
        let with_probs = shown.n_probs > 0;
        let plan = generate::plan(&params, prompt, with_probs, shown.n_probs, session.clone())
            .map_err(llama_param)?;
        let events = submit_all(engine, &plan)
            .await
            .map_err(llama_param)?
            .remove(0);
        streams.push(match stops {
            Some(stops) => stops.watch(events),
            None => events,
        });
    }
    let model = state.config.model_id.clone();
    if stream && !shown.prompt_only {
        let events = streams.remove(0);
        let frames = frames(state.clone(), model, events, shown);
        return Ok(sse::response(
            frames,
            state.config.keep_alive,
            Peer::of(&req),
        ));
    }
    let collected = collect_all(streams, &state.metrics, Peer::of(&req)).await?;
    let mut replies = Vec::with_capacity(collected.len());
    for (index, c) in collected.into_iter().enumerate() {
        generate::count_usage(&state.metrics, &c.usage);
        let mut reply = if shown.prompt_only {
            let usage = EngineUsage {
                completion_tokens: 0,
                ..c.usage
            };
            final_object(
                &model,
                index,
                "",
                &[],
                Some(FinishReason::Length),
                None,
                &usage,
            )
        } else {
            let ids = if shown.tokens { &c.token_ids[..] } else { &[] };
            let stop = c.stop_string.as_deref();
            final_object(&model, index, &c.text, ids, c.finish, stop, &c.usage)
        };
        if shown.n_probs > 0 && !shown.prompt_only {
            reply["completion_probabilities"] = probabilities(&state, &c);
        }
        replies.push(select_fields(reply, body.get("response_fields"))?);
    }
    if stream {
        // `n_predict: 0` streamed: the final object alone.
        let last = sse::data(&replies.remove(0));
        let frames = futures::stream::once(async move { last });
        return Ok(sse::response(
            Box::pin(frames),
            state.config.keep_alive,
            Peer::of(&req),
        ));
    }
    Ok(match replies.len() {
        1 => HttpResponse::Ok().json(replies.remove(0)),
        _ => HttpResponse::Ok().json(replies),
    })
}

/// `response_fields`: only the fields named, a nested one by its path (`"timings/prompt_n"`),
/// each under its path as the key, as llama.cpp answers them.
fn select_fields(reply: Value, fields: Option<&Value>) -> Result<Value, ApiError> {
    let paths = match fields {
        None | Some(Value::Null) => return Ok(reply),
        Some(Value::Array(paths)) if !paths.is_empty() => paths,
        Some(Value::Array(_)) => return Ok(reply),
        Some(v) => {
            return Err(ApiError::invalid(
                Some("response_fields"),
                format!("`response_fields` must be an array of field paths, got `{v}`"),
            ))
        }
    };
    let mut out = Map::new();
    for path in paths {
        let Some(path) = path.as_str() else {
            return Err(ApiError::invalid(
                Some("response_fields"),
                format!("`response_fields` must hold strings, got `{path}`"),
            ));
        };
        let found = path
            .split('/')
            .try_fold(&reply, |v, key| v.as_object()?.get(key));
        if let Some(v) = found {
            out.insert(path.to_string(), v.clone());
        }
    }
    Ok(Value::Object(out))
}

/// The last object of a reply: the counts, why it stopped, and the timings.
fn final_object(
    model: &str,
    index: usize,
    content: &str,
    tokens: &[u32],
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
        "index": index,
        "content": content,
        "tokens": tokens,
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
        json!({"id": id, "token": token, "bytes": state.token_bytes(id), "logprob": logprob})
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
    shown: Shown,
) -> futures::stream::LocalBoxStream<'static, Bytes> {
    let reply = Streaming {
        state: state.clone(),
        model,
        shown,
        predicted: 0,
        has_new_line: false,
    };
    generate::event_frames(reply, events, VecDeque::new(), state)
}

struct Streaming {
    state: web::Data<AppState>,
    model: String,
    shown: Shown,
    /// Tokens generated so far.
    predicted: usize,
    /// A newline has been sent.
    has_new_line: bool,
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
                self.has_new_line |= text.contains('\n');
                // Held text (a stop string may be starting) waits, unless its tokens'
                // probabilities or ids are asked for.
                let shown_ids =
                    (self.shown.n_probs > 0 || self.shown.tokens) && !token_ids.is_empty();
                if text.is_empty() && !shown_ids {
                    return false;
                }
                let ids: &[u32] = if self.shown.tokens { &token_ids } else { &[] };
                let mut chunk = json!({"index": 0, "content": text, "tokens": ids,
                    "stop": false, "id_slot": 0, "tokens_predicted": self.predicted});
                if self.shown.n_probs > 0 {
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
                let mut last = final_object(&self.model, 0, "", &[], Some(reason), stop, &usage);
                last["has_new_line"] = json!(self.has_new_line);
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
                          "json_schema": {"type": "object"}});
        let out = openai_fields(&body).unwrap();
        assert_eq!(out["max_tokens"], json!(16));
        assert_eq!(out["repetition_penalty"], json!(1.1));
        assert!(out.get("seed").is_none(), "-1 is a random seed");
        assert_eq!(out["guided_json"], json!({"type": "object"}));
        assert_eq!(out["temperature"], json!(0.8));
        let g = openai_fields(&json!({"grammar": "root ::= \"a\"", "ignore_eos": true})).unwrap();
        assert_eq!(g["grammar"], json!("root ::= \"a\""));
        assert_eq!(g["ignore_eos"], json!(true));
        let unlimited = openai_fields(&json!({"n_predict": -1})).unwrap();
        assert!(unlimited.get("max_tokens").is_none());
        // `max_tokens` stands for `n_predict` when that is absent; 0 computes one token.
        let aliased = openai_fields(&json!({"max_tokens": 3})).unwrap();
        assert_eq!(aliased["max_tokens"], json!(3));
        let both = openai_fields(&json!({"n_predict": 5, "max_tokens": 3})).unwrap();
        assert_eq!(both["max_tokens"], json!(5));
        let warm = openai_fields(&json!({"n_predict": 0})).unwrap();
        assert_eq!(warm["max_tokens"], json!(1));
    }

    #[test]
    fn samplers_left_out_of_the_chain_are_off() {
        let body = json!({"samplers": ["top_k", "top_p", "infill"], "top_k": 40, "top_p": 0.9,
                          "temperature": 0.2, "min_p": 0.1, "presence_penalty": 0.5});
        let out = openai_fields(&body).unwrap();
        assert_eq!(out["top_k"], json!(40));
        assert_eq!(out["top_p"], json!(0.9));
        assert_eq!(out["temperature"], json!(1.0));
        assert_eq!(out["min_p"], json!(0));
        assert!(out.get("presence_penalty").is_none());
        let all = openai_fields(&json!({"samplers": ["temperature", "min_p"]})).unwrap();
        assert_eq!(all["temperature"], json!(0.8));
        assert_eq!(all["min_p"], json!(0.05));
        assert_eq!(all["top_k"], json!(0));
    }

    #[test]
    fn response_fields_pick_nested_values_by_path() {
        let reply = json!({"content": "x", "timings": {"prompt_n": 3}, "stop": true});
        let fields = json!(["content", "timings/prompt_n", "missing/x"]);
        let picked = select_fields(reply.clone(), Some(&fields)).unwrap();
        assert_eq!(picked, json!({"content": "x", "timings/prompt_n": 3}));
        assert_eq!(
            select_fields(reply.clone(), Some(&json!([""]))).unwrap(),
            json!({})
        );
        assert_eq!(select_fields(reply.clone(), None).unwrap(), reply);
    }

    #[test]
    fn refusals_name_llama_fields() {
        let param = |body: Value| openai_fields(&body).unwrap_err().param.clone().unwrap();
        assert_eq!(param(json!({"n_predict": "lots"})), "n_predict");
        assert_eq!(param(json!({"max_tokens": 1.5})), "max_tokens");
        assert_eq!(param(json!({"samplers": "top_k"})), "samplers");
        assert_eq!(param(json!({"top_k": "many"})), "top_k");
        let renamed = llama_param(ApiError::invalid(Some("max_tokens"), "x"));
        assert_eq!(renamed.param.as_deref(), Some("n_predict"));
    }
}
