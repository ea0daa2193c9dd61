//! OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right status,
//! plus extra fields where they help a client act (`prompt_tokens`, `max_tokens`,
//! `context_window` on `context_length_exceeded`). Every refusal of the engine maps to one of
//! these; a client error is never a 500.
//!
//! Request bodies are parsed here from bytes (never with actix-web's `Json` extractor), so that
//! malformed JSON reports its line and column and a wrongly typed field is named by its path
//! (`messages[1].role`).

use crate::error::EngineError;
use crate::sampling::SamplingParamsError;
use actix_web::http::{header, StatusCode};
use actix_web::{error::JsonPayloadError, web, HttpRequest, HttpResponse, ResponseError};
use futures::StreamExt;
use serde::de::DeserializeOwned;
use serde_json::{json, Map, Value};
use std::fmt;

/// An OpenAI-shaped error response (boxed: it travels in every handler's `Result`).
#[derive(Debug, Clone)]
pub struct ApiError(Box<ErrorDetail>);

/// The fields of an [`ApiError`] (reached through `Deref`).
#[derive(Debug, Clone)]
pub struct ErrorDetail {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type`: `invalid_request_error`, `authentication_error`, `server_error`, ….
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Extra fields beside `message`/`type`/`param`/`code`.
    pub extra: Map<String, Value>,
    pub retry_after_s: Option<u64>,
}

impl std::ops::Deref for ApiError {
    type Target = ErrorDetail;
    fn deref(&self) -> &ErrorDetail {
        &self.0
    }
}

impl std::ops::DerefMut for ApiError {
    fn deref_mut(&mut self) -> &mut ErrorDetail {
        &mut self.0
    }
}

impl ApiError {
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self(Box::new(ErrorDetail {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            extra: Map::new(),
            retry_after_s: None,
        }))
    }

    /// 400 `invalid_request_error` naming `param`.
    pub fn invalid(param: Option<&str>, message: impl Into<String>) -> Self {
        let mut e = Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message);
        e.param = param.map(str::to_string);
        e
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    pub fn unauthorized() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            "Incorrect or missing API key: send `Authorization: Bearer KEY` or `X-API-Key: KEY`.",
        )
        .with_code("invalid_api_key")
    }

    pub fn model_not_found(name: &str) -> Self {
        let mut e = Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("The model `{name}` does not exist; see GET /v1/models for the served model."),
        )
        .with_code("model_not_found");
        e.param = Some("model".into());
        e
    }

    pub fn not_found(what: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("Unknown route: {what}"),
        )
        .with_code("not_found")
    }

    pub fn too_large(limit: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!(
                "The request body is larger than the server's limit of {limit} bytes (--max-body)."
            ),
        )
        .with_code("request_too_large")
    }

    pub fn loading() -> Self {
        let mut e = Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "The model is still loading; retry shortly.",
        )
        .with_code("model_loading");
        e.retry_after_s = Some(1);
        e
    }

    /// The client closed the connection before the answer was ready (nginx's 499); nobody reads
    /// it, but the request ends as every other does, through an error.
    pub fn client_closed() -> Self {
        let status = StatusCode::from_u16(499).expect("499 is a valid status code");
        Self::new(
            status,
            "client_closed_request",
            "The client closed the connection before the response was ready.",
        )
    }

    /// The error with `param` renamed from `from` to `to`: the engine's refusals name the chat
    /// field (`messages`), which is `prompt` or `input` on other endpoints.
    pub fn with_param_renamed(mut self, from: &str, to: &str) -> Self {
        if self.param.as_deref() == Some(from) {
            self.param = Some(to.to_string());
        }
        self
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
            .with_code("internal_error")
    }

    /// The error object alone (also used inside an SSE stream).
    pub fn body(&self) -> Value {
        let mut inner = Map::new();
        inner.insert("message".into(), json!(self.message));
        inner.insert("type".into(), json!(self.kind));
        inner.insert("param".into(), json!(self.param));
        inner.insert("code".into(), json!(self.code));
        for (k, v) in &self.extra {
            inner.insert(k.clone(), v.clone());
        }
        json!({ "error": inner })
    }
}

impl fmt::Display for ApiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.status.as_u16(), self.message)
    }
}

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        self.status
    }

    fn error_response(&self) -> HttpResponse {
        let mut res = HttpResponse::build(self.status);
        if let Some(s) = self.retry_after_s {
            res.insert_header((header::RETRY_AFTER, s.to_string()));
        }
        if self.status == StatusCode::UNAUTHORIZED {
            res.insert_header((header::WWW_AUTHENTICATE, "Bearer"));
        }
        res.json(self.body())
    }
}

/// How another API (Ollama's, Anthropic's) writes an error body.
pub trait ErrorShape: fmt::Debug + 'static {
    fn body(e: &ApiError) -> Value;
}

/// An [`ApiError`] answered in the shape `S`: same status and `Retry-After`, `S`'s body.
#[derive(Debug)]
pub struct ShapedError<S>(pub ApiError, std::marker::PhantomData<S>);

impl<S> From<ApiError> for ShapedError<S> {
    fn from(e: ApiError) -> Self {
        Self(e, std::marker::PhantomData)
    }
}

impl<S> fmt::Display for ShapedError<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl<S: ErrorShape> ResponseError for ShapedError<S> {
    fn status_code(&self) -> StatusCode {
        self.0.status
    }

    fn error_response(&self) -> HttpResponse {
        let mut res = HttpResponse::build(self.0.status);
        if let Some(seconds) = self.0.retry_after_s {
            res.insert_header((header::RETRY_AFTER, seconds.to_string()));
        }
        res.json(S::body(&self.0))
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        let message = e.to_string();
        match e {
            EngineError::ContextLengthExceeded {
                prompt_tokens,
                max_tokens,
                context_window,
            } => {
                let mut err = ApiError::invalid(Some("messages"), message)
                    .with_code("context_length_exceeded");
                err.extra
                    .insert("prompt_tokens".into(), json!(prompt_tokens));
                err.extra.insert("max_tokens".into(), json!(max_tokens));
                err.extra
                    .insert("context_window".into(), json!(context_window));
                err
            }
            EngineError::InsufficientKvMemory {
                needed_tokens,
                budget_tokens,
            } => {
                let mut err = ApiError::invalid(Some("max_tokens"), message)
                    .with_code("insufficient_kv_memory");
                err.extra
                    .insert("needed_tokens".into(), json!(needed_tokens));
                err.extra
                    .insert("budget_tokens".into(), json!(budget_tokens));
                err
            }
            EngineError::Overloaded { retry_after_s } => {
                let mut err =
                    ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message)
                        .with_code("overloaded");
                err.retry_after_s = Some(retry_after_s.max(1));
                err
            }
            EngineError::SessionBusy { .. } => {
                let mut err = ApiError::new(StatusCode::CONFLICT, "invalid_request_error", message)
                    .with_code("session_busy");
                err.param = Some("X-Session-Id".into());
                err
            }
            // The message alone: the type already says it is an invalid request.
            EngineError::InvalidRequest(m) => ApiError::invalid(None, m),
            EngineError::InvalidParam { param, message } => ApiError::invalid(Some(param), message),
            EngineError::Kv(_) => {
                let mut err =
                    ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message)
                        .with_code("overloaded");
                err.retry_after_s = Some(1);
                err
            }
            EngineError::Internal(_) => ApiError::internal(message),
        }
    }
}

impl From<SamplingParamsError> for ApiError {
    fn from(e: SamplingParamsError) -> Self {
        ApiError::invalid(Some(e.field()), e.to_string())
    }
}

/// Reads the whole body, refusing more than `limit` bytes with a 413 (checked against
/// `Content-Length` first, then while reading).
pub async fn read_body(
    req: &HttpRequest,
    mut payload: web::Payload,
    limit: usize,
) -> Result<web::Bytes, ApiError> {
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if declared.is_some_and(|n| n > limit) {
        return Err(ApiError::too_large(limit));
    }
    let mut body = web::BytesMut::new();
    while let Some(chunk) = payload.next().await {
        let chunk = chunk.map_err(|e| ApiError::invalid(None, format!("reading the body: {e}")))?;
        if body.len() + chunk.len() > limit {
            return Err(ApiError::too_large(limit));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body.freeze())
}

/// The request body as a JSON object: [`read_body`] then [`parse_object`], as every POST
/// handler starts.
pub async fn read_json_object(
    req: &HttpRequest,
    payload: web::Payload,
    limit: usize,
) -> Result<Value, ApiError> {
    parse_object(&read_body(req, payload, limit).await?)
}

/// Parses a JSON object from bytes; syntax errors name their line and column.
pub fn parse_object(body: &[u8]) -> Result<Value, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::invalid(
            None,
            "The request body is empty; expected a JSON object.",
        ));
    }
    let value: Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::invalid(
            None,
            format!(
                "Malformed JSON in the request body at line {} column {}: {e}",
                e.line(),
                e.column()
            ),
        )
        .with_code("invalid_json")
    })?;
    if !value.is_object() {
        return Err(ApiError::invalid(
            None,
            "The request body must be a JSON object.",
        ));
    }
    Ok(value)
}

/// A string field of a request object that may be absent or null (then empty); another type
/// is a 400 naming it.
pub fn optional_string(body: &Value, field: &str) -> Result<String, ApiError> {
    match body.get(field) {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(other) => Err(ApiError::invalid(
            Some(field),
            format!("`{field}` must be a string, got `{other}`"),
        )),
    }
}

/// A boolean field of a request body, `default` when absent or null.
pub fn optional_bool(body: &Value, field: &str, default: bool) -> Result<bool, ApiError> {
    match body.get(field) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(other) => Err(ApiError::invalid(
            Some(field),
            format!("`{field}` must be a boolean, got `{other}`"),
        )),
    }
}

/// Deserializes a typed request from an already parsed object; a wrong type or a missing
/// field is a 400 whose `param` is the field's path.
pub fn from_value<T: DeserializeOwned>(value: &Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner().to_string();
        let param = match inner.strip_prefix("missing field `") {
            Some(rest) => {
                let field = rest.split('`').next().unwrap_or_default();
                if path == "." {
                    field.to_string()
                } else {
                    format!("{path}.{field}")
                }
            }
            None => path,
        };
        ApiError::invalid(Some(&param), format!("Invalid `{param}`: {inner}"))
    })
}

/// actix-web's `Json` extractor errors in the OpenAI shape (handlers parse bodies themselves;
/// this covers any extractor added later).
pub fn json_config() -> web::JsonConfig {
    web::JsonConfig::default().error_handler(|err, _req| {
        let api = match &err {
            JsonPayloadError::OverflowKnownLength { limit, .. }
            | JsonPayloadError::Overflow { limit } => ApiError::too_large(*limit),
            JsonPayloadError::Deserialize(e) => ApiError::invalid(
                None,
                format!(
                    "Malformed JSON at line {} column {}: {e}",
                    e.line(),
                    e.column()
                ),
            ),
            other => ApiError::invalid(None, other.to_string()),
        };
        actix_web::error::InternalError::from_response(err, api.error_response()).into()
    })
}

pub fn path_config() -> web::PathConfig {
    web::PathConfig::default().error_handler(|err, _req| {
        let api = ApiError::invalid(None, err.to_string());
        actix_web::error::InternalError::from_response(err, api.error_response()).into()
    })
}

pub fn query_config() -> web::QueryConfig {
    web::QueryConfig::default().error_handler(|err, _req| {
        let api = ApiError::invalid(None, err.to_string());
        actix_web::error::InternalError::from_response(err, api.error_response()).into()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    #[allow(dead_code)]
    struct Req {
        messages: Vec<Msg>,
        temperature: Option<f32>,
    }

    #[derive(Debug, serde::Deserialize)]
    #[allow(dead_code)]
    struct Msg {
        role: String,
    }

    #[test]
    fn malformed_json_names_line_and_column() {
        let err = parse_object(b"{\n  \"messages\": [,]\n}").unwrap_err();
        assert_eq!(err.status, StatusCode::BAD_REQUEST);
        assert!(err.message.contains("line 2 column"), "{}", err.message);
    }

    #[test]
    fn a_wrong_type_names_the_field_path() {
        let v = json!({"messages": [{"role": "user"}], "temperature": "hot"});
        let err = from_value::<Req>(&v).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("temperature"));
        let v = json!({"messages": [{"role": 3}]});
        let err = from_value::<Req>(&v).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("messages[0].role"));
    }

    #[test]
    fn a_missing_field_is_named() {
        let err = from_value::<Req>(&json!({})).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("messages"));
        let err = from_value::<Req>(&json!({"messages": [{}]})).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("messages[0].role"));
    }

    #[test]
    fn context_errors_carry_their_counts_as_fields() {
        let err: ApiError = EngineError::ContextLengthExceeded {
            prompt_tokens: 10,
            max_tokens: 5,
            context_window: 12,
        }
        .into();
        let body = err.body();
        assert_eq!(body["error"]["code"], "context_length_exceeded");
        assert_eq!(body["error"]["prompt_tokens"], 10);
        assert_eq!(body["error"]["context_window"], 12);
        assert!(err.message.contains("12"));
    }
}
