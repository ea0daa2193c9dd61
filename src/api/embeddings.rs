//! `POST /v1/embeddings` (OpenAI; llama.cpp and vLLM serve it too): each input's hidden states
//! after the final norm, pooled as `--pooling` says and scaled to unit length. Inputs run as
//! concurrent engine requests, so a batch of texts shares forward passes with whatever else
//! is running. The Ollama routes (`/api/embed`, `/api/embeddings`) share [`embed_inputs`].

use super::auth::Authorized;
use super::disconnect::Peer;
use super::errors::{from_value, read_json_object, ApiError};
use super::AppState;
use crate::engine::{EmbedRequest, Embedding, Engine, Prompt};
use crate::error::EngineError;
use actix_web::{web, HttpRequest, HttpResponse};
use base64::Engine as _;
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// OpenAI's limit on inputs per request.
pub const MAX_INPUTS: usize = 2048;

/// Inputs embedded at once: enough to fill a batch, few enough that a 2,048-input request
/// leaves the queue to others.
const CONCURRENT_INPUTS: usize = 32;

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct EmbeddingRequest {
    pub model: Option<String>,
    pub input: EmbeddingInput,
    /// `float` (the default) or `base64` (little-endian float32 bytes; the `openai` Python
    /// package asks for it).
    pub encoding_format: Option<String>,
    /// Only the model's own size: its embeddings are not trained to be cut shorter.
    pub dimensions: Option<usize>,
    pub user: Option<String>,
}

/// A string, strings, token ids, or lists of token ids.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum EmbeddingInput {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

impl EmbeddingInput {
    /// The prompts, checked as OpenAI checks them: at least one, at most [`MAX_INPUTS`], none
    /// empty, token ids inside the vocabulary.
    pub fn prompts(self, vocab_size: usize) -> Result<Vec<Prompt>, ApiError> {
        let prompts: Vec<Prompt> = match self {
            EmbeddingInput::Text(t) => vec![Prompt::Text(t)],
            EmbeddingInput::Texts(t) => t.into_iter().map(Prompt::Text).collect(),
            EmbeddingInput::Tokens(ids) => vec![Prompt::Tokens(ids)],
            EmbeddingInput::TokenLists(l) => l.into_iter().map(Prompt::Tokens).collect(),
        };
        if prompts.is_empty() {
            return Err(ApiError::invalid(
                Some("input"),
                "`input` holds no text to embed",
            ));
        }
        if prompts.len() > MAX_INPUTS {
            return Err(ApiError::invalid(
                Some("input"),
                format!(
                    "`input` holds {} items; at most {MAX_INPUTS} may be embedded in one request",
                    prompts.len()
                ),
            ));
        }
        for (i, p) in prompts.iter().enumerate() {
            let empty = match p {
                Prompt::Text(t) => t.is_empty(),
                Prompt::Tokens(ids) => ids.is_empty(),
                _ => false,
            };
            if empty {
                return Err(ApiError::invalid(
                    Some("input"),
                    format!("`input[{i}]` is empty: every input needs at least one token"),
                ));
            }
            if let Prompt::Tokens(ids) = p {
                if let Some(id) = ids.iter().find(|&&id| id as usize >= vocab_size) {
                    return Err(ApiError::invalid(
                        Some("input"),
                        format!("`input[{i}]` holds token id {id}, outside the vocabulary of {vocab_size} tokens"),
                    ));
                }
            }
        }
        Ok(prompts)
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct EmbeddingResponse {
    /// `list`.
    pub object: String,
    pub data: Vec<EmbeddingObject>,
    pub model: String,
    pub usage: EmbeddingUsage,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct EmbeddingObject {
    /// `embedding`.
    pub object: String,
    pub index: usize,
    /// Floats, or a base64 string of little-endian float32 bytes.
    #[schema(value_type = Object)]
    pub embedding: serde_json::Value,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct EmbeddingUsage {
    pub prompt_tokens: usize,
    pub total_tokens: usize,
}

/// `dimensions`, when asked for, must be the model's own size: its embeddings are not trained
/// to be cut shorter (vLLM refuses the same for models without Matryoshka training).
pub fn check_dimensions(requested: Option<usize>, size: usize) -> Result<(), ApiError> {
    match requested {
        Some(d) if d != size => Err(ApiError::invalid(
            Some("dimensions"),
            format!(
                "this model's embeddings have {size} dimensions and cannot be shortened to {d} \
                 (it was not trained for shorter ones); drop `dimensions`"
            ),
        )),
        _ => Ok(()),
    }
}

/// Embeds every prompt (in order), a few at a time; the first failure fails them all, and a
/// client that hangs up cancels the rest.
pub async fn embed_inputs(
    engine: &Engine,
    prompts: Vec<Prompt>,
    truncate: bool,
    peer: Peer,
) -> Result<Vec<Embedding>, ApiError> {
    let all = futures::stream::iter(prompts)
        .map(|prompt| {
            engine.embed(EmbedRequest {
                prompt,
                pooling: None,
                truncate,
            })
        })
        .buffered(CONCURRENT_INPUTS)
        .collect::<Vec<_>>();
    let embedded = tokio::select! {
        embedded = all => embedded,
        () = peer.hung_up() => return Err(ApiError::client_closed()),
    };
    embedded
        .into_iter()
        .enumerate()
        .map(|(i, r)| r.map_err(|e| refusal(i, e)))
        .collect()
}

/// The engine's refusal of input `i`, worded for an embedding (nothing is generated, so no
/// `max_tokens` to lower).
fn refusal(i: usize, e: EngineError) -> ApiError {
    let too_long = match &e {
        EngineError::ContextLengthExceeded {
            prompt_tokens,
            context_window,
            ..
        } => Some((*prompt_tokens, *context_window)),
        _ => None,
    };
    let mut err = ApiError::from(e).with_param_renamed("messages", "input");
    if let Some((tokens, window)) = too_long {
        err.message = format!(
            "`input[{i}]` is {tokens} tokens long but the model's maximum context length is \
             {window} tokens: shorten or split it"
        );
    }
    err
}

/// Create embeddings for one or more inputs.
#[utoipa::path(post, path = "/v1/embeddings", request_body = EmbeddingRequest, responses(
    (status = 200, body = EmbeddingResponse), (status = 400, body = super::types::ErrorResponse),
    (status = 401, body = super::types::ErrorResponse), (status = 404, body = super::types::ErrorResponse),
))]
pub async fn embeddings(
    _auth: Authorized,
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    let value = read_json_object(&req, payload, state.config.max_body).await?;
    let request: EmbeddingRequest = from_value(&value)?;
    state.check_model(request.model.as_deref())?;
    let engine = state.engine()?;
    let info = engine.info();
    let base64 = match request.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(ApiError::invalid(
                Some("encoding_format"),
                format!("`encoding_format` must be `float` or `base64`, not `{other}`"),
            ))
        }
    };
    check_dimensions(request.dimensions, info.embedding_size)?;
    let prompts = request.input.prompts(info.vocab_size)?;
    let embedded = embed_inputs(engine, prompts, false, Peer::of(&req)).await?;
    let prompt_tokens = embedded.iter().map(|e| e.prompt_tokens).sum();
    state.metrics.count_usage(prompt_tokens, 0, 0);
    let data = embedded
        .into_iter()
        .enumerate()
        .map(|(index, e)| {
            let unit = crate::runner::embed::normalized(&e.vector);
            EmbeddingObject {
                object: "embedding".into(),
                index,
                embedding: if base64 {
                    serde_json::Value::String(base64_f32(&unit))
                } else {
                    serde_json::json!(unit)
                },
            }
        })
        .collect();
    Ok(HttpResponse::Ok().json(EmbeddingResponse {
        object: "list".into(),
        data,
        model: request
            .model
            .unwrap_or_else(|| state.config.model_id.clone()),
        usage: EmbeddingUsage {
            prompt_tokens,
            total_tokens: prompt_tokens,
        },
    }))
}

/// llama.cpp's native `POST /embedding` (and `/embeddings`): `content` (or `input`) in the
/// same shapes as `/v1/embeddings`, answered as `[{"index", "embedding": [[...]]}]`, one pooled
/// vector per input, scaled as `embd_normalize` says (llama.cpp's values: -1 none, 0 max-abs to
/// the int16 range, 1 taxicab, 2 Euclidean, the default, p > 2 the p-norm).
#[utoipa::path(post, path = "/embedding", operation_id = "llamacpp_embedding", request_body(content = Object, description = "llama.cpp's embedding request: `content` or `input`, `embd_normalize`"), responses(
    (status = 200, description = "`[{\"index\", \"embedding\": [[...]]}]`", body = Object),
    (status = 400, body = super::types::ErrorResponse),
))]
pub async fn llamacpp_embedding(
    _auth: Authorized,
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    let value = read_json_object(&req, payload, state.config.max_body).await?;
    let Some(input) = value.get("content").or_else(|| value.get("input")).cloned() else {
        return Err(ApiError::invalid(
            Some("content"),
            "`content` (or `input`) must be provided",
        ));
    };
    let input: EmbeddingInput = serde_json::from_value(input).map_err(|_| {
        ApiError::invalid(
            Some("content"),
            "`content` must be a string, strings, token ids or lists of token ids",
        )
    })?;
    let norm = match value.get("embd_normalize") {
        None | Some(serde_json::Value::Null) => 2,
        Some(v) => v.as_i64().filter(|n| *n >= -1).ok_or_else(|| {
            ApiError::invalid(
                Some("embd_normalize"),
                format!("`embd_normalize` must be an integer from -1 up, got `{v}`"),
            )
        })?,
    };
    let engine = state.engine()?;
    let prompts = input
        .prompts(engine.info().vocab_size)
        .map_err(|e| e.with_param_renamed("input", "content"))?;
    let embedded = embed_inputs(engine, prompts, false, Peer::of(&req))
        .await
        .map_err(|e| e.with_param_renamed("input", "content"))?;
    state
        .metrics
        .count_usage(embedded.iter().map(|e| e.prompt_tokens).sum(), 0, 0);
    let answer: Vec<serde_json::Value> = embedded
        .iter()
        .enumerate()
        .map(|(index, e)| serde_json::json!({ "index": index, "embedding": [scaled(&e.vector, norm)] }))
        .collect();
    Ok(HttpResponse::Ok().json(answer))
}

/// `v` scaled as llama.cpp's `embd_normalize` says (see [`llamacpp_embedding`]).
fn scaled(v: &[f32], norm: i64) -> Vec<f32> {
    let magnitude: f64 = match norm {
        -1 => 1.0,
        0 => v.iter().fold(0f64, |m, x| m.max(x.abs() as f64)) / 32760.0,
        2 => return crate::runner::embed::normalized(v),
        p => {
            let p = p as f64;
            v.iter()
                .map(|x| (x.abs() as f64).powf(p))
                .sum::<f64>()
                .powf(1.0 / p)
        }
    };
    let factor = if magnitude > 0.0 {
        1.0 / magnitude
    } else {
        0.0
    };
    v.iter().map(|x| (*x as f64 * factor) as f32).collect()
}

/// Little-endian float32 bytes in standard base64, as OpenAI sends `encoding_format: base64`.
fn base64_f32(v: &[f32]) -> String {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input(v: serde_json::Value) -> EmbeddingInput {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn every_input_shape_becomes_prompts() {
        let count = |v| input(v).prompts(100).map(|p| p.len());
        assert_eq!(count(serde_json::json!("a")).unwrap(), 1);
        assert_eq!(count(serde_json::json!(["a", "b"])).unwrap(), 2);
        assert_eq!(count(serde_json::json!([1, 2, 3])).unwrap(), 1);
        assert_eq!(count(serde_json::json!([[1], [2, 3]])).unwrap(), 2);
    }

    #[test]
    fn empty_oversized_and_out_of_vocabulary_inputs_are_refused() {
        let refusal = |v| input(v).prompts(100).unwrap_err().message.clone();
        assert!(refusal(serde_json::json!([])).contains("no text"));
        assert!(refusal(serde_json::json!(["a", ""])).contains("`input[1]` is empty"));
        assert!(refusal(serde_json::json!([[1], []])).contains("`input[1]` is empty"));
        assert!(refusal(serde_json::json!([7, 100])).contains("token id 100"));
        let many = vec!["x"; MAX_INPUTS + 1];
        assert!(refusal(serde_json::json!(many)).contains("at most 2048"));
    }

    #[test]
    fn llamacpp_normalisations() {
        let v = [3.0, -4.0];
        assert_eq!(scaled(&v, -1), vec![3.0, -4.0]);
        assert_eq!(scaled(&v, 0), vec![3.0 * 32760.0 / 4.0, -32760.0]);
        assert_eq!(scaled(&v, 1), vec![3.0 / 7.0, -4.0 / 7.0]);
        assert_eq!(scaled(&v, 2), vec![0.6, -0.8]);
        let cubic = (27.0f64 + 64.0).powf(1.0 / 3.0);
        assert_eq!(
            scaled(&v, 3),
            vec![(3.0 / cubic) as f32, (-4.0 / cubic) as f32]
        );
        assert_eq!(scaled(&[0.0, 0.0], 0), vec![0.0, 0.0]);
    }

    #[test]
    fn base64_is_little_endian_float32() {
        let encoded = base64_f32(&[1.0, -2.5]);
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(encoded)
            .unwrap();
        assert_eq!(
            bytes,
            [1.0f32.to_le_bytes(), (-2.5f32).to_le_bytes()].concat()
        );
    }
}
