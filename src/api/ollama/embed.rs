//! Ollama's embeddings: `POST /api/embed` (`input`: a string or strings; unit-length vectors;
//! `truncate`, default true, keeps the first context-window tokens of a longer input) and the
//! older `POST /api/embeddings` (`prompt`: one string; the vector as pooled, not normalised,
//! as Ollama sends it). Both run through [`embed_inputs`], as `/v1/embeddings` does.

use super::{requested_model, Reply};
use crate::api::auth::Authorized;
use crate::api::disconnect::Peer;
use crate::api::embeddings::{check_dimensions, embed_inputs, MAX_INPUTS};
use crate::api::errors::{optional_bool, optional_string, read_json_object, ApiError};
use crate::api::AppState;
use crate::engine::Prompt;
use crate::runner::embed::normalized;
use actix_web::{web, HttpRequest, HttpResponse};
use serde_json::{json, Value};
use std::time::Instant;

/// `input` as Ollama takes it: absent or empty means "load the model" (answered with no
/// embeddings); otherwise one string or a list of non-empty strings.
fn inputs(body: &Value) -> Result<Vec<String>, ApiError> {
    let bad = |what: &str| {
        ApiError::invalid(
            Some("input"),
            format!("`input` must be a string or a list of strings, got {what}"),
        )
    };
    let texts = match body.get("input") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) if s.is_empty() => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| {
                v.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| bad(&v.to_string()))
            })
            .collect::<Result<_, _>>()?,
        Some(other) => return Err(bad(&other.to_string())),
    };
    if let Some(i) = texts.iter().position(String::is_empty) {
        return Err(ApiError::invalid(
            Some("input"),
            format!("`input[{i}]` is empty: every input needs at least one token"),
        ));
    }
    if texts.len() > MAX_INPUTS {
        return Err(ApiError::invalid(
            Some("input"),
            format!(
                "`input` holds {} texts; at most {MAX_INPUTS} per request",
                texts.len()
            ),
        ));
    }
    Ok(texts)
}

/// `dimensions`, a whole number when given (checked by [`check_dimensions`]).
fn dimensions(body: &Value) -> Result<Option<usize>, ApiError> {
    match body.get("dimensions") {
        None | Some(Value::Null) => Ok(None),
        Some(d) => d.as_u64().map(|d| Some(d as usize)).ok_or_else(|| {
            ApiError::invalid(
                Some("dimensions"),
                format!("`dimensions` must be a whole number, got `{d}`"),
            )
        }),
    }
}

#[utoipa::path(post, path = "/api/embed", operation_id = "ollama_embed", request_body(content = Object, description = "Ollama's embed request: `model`, `input` (a string or strings), `truncate`, `dimensions`"),
    responses(
        (status = 200, description = "`embeddings` (unit length, one per input), `prompt_eval_count`, durations", body = Object),
        (status = 400, description = "Invalid request, or an input over the window with `truncate: false`", body = super::OllamaErrorBody),
        (status = 404, description = "Unknown model", body = super::OllamaErrorBody),
    ))]
pub async fn embed(
    auth: Result<Authorized, ApiError>,
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<AppState>,
) -> Reply {
    let received = Instant::now();
    auth?;
    let body = read_json_object(&req, payload, state.config.max_body).await?;
    let model = requested_model(&state, &body)?;
    let truncate = optional_bool(&body, "truncate", true)?;
    let texts = inputs(&body)?;
    if texts.is_empty() {
        // Ollama's way to load a model: nothing to embed.
        return Ok(HttpResponse::Ok().json(json!({ "model": model, "embeddings": [] })));
    }
    let engine = state.engine()?;
    check_dimensions(dimensions(&body)?, engine.info().embedding_size)?;
    let prompts = texts.into_iter().map(Prompt::Text).collect();
    let embedded = embed_inputs(engine, prompts, truncate, Peer::of(&req)).await?;
    let prompt_tokens: usize = embedded.iter().map(|e| e.prompt_tokens).sum();
    state.metrics.count_usage(prompt_tokens, 0, 0);
    let vectors: Vec<Vec<f32>> = embedded.iter().map(|e| normalized(&e.vector)).collect();
    Ok(HttpResponse::Ok().json(json!({
        "model": model,
        "embeddings": vectors,
        "total_duration": received.elapsed().as_nanos() as u64,
        "load_duration": 0,
        "prompt_eval_count": prompt_tokens,
    })))
}

#[utoipa::path(post, path = "/api/embeddings", operation_id = "ollama_embeddings", request_body(content = Object, description = "Ollama's older embeddings request: `model`, `prompt`"),
    responses(
        (status = 200, description = "`embedding`: the pooled vector, not normalised", body = Object),
        (status = 400, description = "Invalid request, or a prompt over the window", body = super::OllamaErrorBody),
        (status = 404, description = "Unknown model", body = super::OllamaErrorBody),
    ))]
pub async fn embeddings(
    auth: Result<Authorized, ApiError>,
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<AppState>,
) -> Reply {
    auth?;
    let body = read_json_object(&req, payload, state.config.max_body).await?;
    requested_model(&state, &body)?;
    let prompt = optional_string(&body, "prompt")?;
    let engine = state.engine()?;
    if prompt.is_empty() {
        // Ollama answers an empty prompt (a model load) with an empty embedding.
        return Ok(HttpResponse::Ok().json(json!({ "embedding": [] })));
    }
    let mut embedded = embed_inputs(engine, vec![Prompt::Text(prompt)], false, Peer::of(&req))
        .await
        .map_err(|e| e.with_param_renamed("input", "prompt"))?;
    let e = embedded.remove(0);
    state.metrics.count_usage(e.prompt_tokens, 0, 0);
    Ok(HttpResponse::Ok().json(json!({ "embedding": e.vector })))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn input_shapes() {
        assert!(inputs(&json!({})).unwrap().is_empty());
        assert!(inputs(&json!({"input": ""})).unwrap().is_empty());
        assert!(inputs(&json!({"input": []})).unwrap().is_empty());
        assert_eq!(inputs(&json!({"input": "a"})).unwrap(), vec!["a"]);
        assert_eq!(
            inputs(&json!({"input": ["a", "b"]})).unwrap(),
            vec!["a", "b"]
        );
        let refusal = |v| inputs(&v).unwrap_err().message.clone();
        assert!(refusal(json!({"input": ["a", ""]})).contains("`input[1]` is empty"));
        assert!(refusal(json!({"input": [1]})).contains("got 1"));
        assert!(refusal(json!({"input": {"a": 1}})).contains("a string or a list"));
    }

    #[test]
    fn dimensions_must_be_the_models_own() {
        let check = |body| check_dimensions(dimensions(&body)?, 896);
        assert!(check(json!({})).is_ok());
        assert!(check(json!({"dimensions": 896})).is_ok());
        let e = check(json!({"dimensions": 256})).unwrap_err();
        assert!(e.message.contains("896 dimensions"));
        assert!(check(json!({"dimensions": "x"})).is_err());
    }
}
