//! Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`), so that
//! agents and SDKs written for it (Claude Code through `ANTHROPIC_BASE_URL`, the `anthropic`
//! Python and TypeScript packages) run against the served model unchanged.
//!
//! Requests are translated into chat requests ([`request`]) and go through the same prompt
//! building, tool calling, admission and engine as `/v1/chat/completions`; [`reply`] turns the
//! engine's events into Anthropic's `message` or its event stream. `X-Session-Id` continues a
//! persistent session here too; `x-api-key` is the header Anthropic clients send. Differences,
//! on purpose: the model must be the served one or one of its `--alias`es (Claude Code asks
//! for the models set in `ANTHROPIC_MODEL` and `ANTHROPIC_SMALL_FAST_MODEL`); images,
//! documents and Anthropic's server tools are refused; `thinking`, `metadata`, `service_tier`
//! and `cache_control` are accepted and have no effect (the cache is automatic:
//! `usage.cache_read_input_tokens` reports it); `stop_reason` `pause_turn` and `refusal` never
//! occur.

mod reply;
mod request;

use super::auth::Authorized;
use super::chat_prompt;
use super::disconnect::Peer;
use super::errors::{
    from_value, optional_bool, read_json_object, ApiError, ErrorShape, ShapedError,
};
use super::generate::{self, collect_all, submit_all};
use super::sse;
use super::tool_calls::ToolCallParser;
use super::types::{ChatCompletionRequest, GenerationParams};
use super::AppState;
use actix_web::{web, HttpRequest, HttpResponse};
use reply::ReplyContext;
use serde_json::{json, Value};

/// Anthropic's error shape: `{"type": "error", "error": {"type", "message"}}`.
#[derive(Debug)]
pub struct AnthropicShape;

impl ErrorShape for AnthropicShape {
    fn body(e: &ApiError) -> Value {
        error_body(e)
    }
}

pub type AnthropicError = ShapedError<AnthropicShape>;

/// Anthropic's error object for `e` (its `type` follows the status, as Anthropic's do). A
/// request over the window gets Anthropic's wording, which Claude Code reads to lower
/// `max_tokens` and retry (or to compact the conversation).
pub fn error_body(e: &ApiError) -> Value {
    if e.code == Some("context_length_exceeded") {
        let count = |k: &str| e.extra.get(k).and_then(Value::as_u64).unwrap_or(0);
        let (prompt, max, window) = (
            count("prompt_tokens"),
            count("max_tokens"),
            count("context_window"),
        );
        let message = if prompt >= window {
            format!("prompt is too long: {prompt} tokens > {window} maximum")
        } else {
            format!(
                "input length and `max_tokens` exceed context limit: {prompt} + {max} > \
                 {window}, decrease input length or `max_tokens` and try again"
            )
        };
        return json!({"type": "error", "error": {"type": "invalid_request_error", "message": message}});
    }
    let kind = match e.status.as_u16() {
        400 | 405 | 409 | 422 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        _ => "api_error",
    };
    json!({"type": "error", "error": {"type": kind, "message": e.message}})
}

type Reply = Result<HttpResponse, AnthropicError>;

/// The request's `model`, checked against the served one; the reply echoes it.
fn requested_model(state: &AppState, body: &Value) -> Result<String, ApiError> {
    match body.get("model") {
        None | Some(Value::Null) => Ok(state.config.model_id.clone()),
        Some(Value::String(name)) => {
            state.check_model(Some(name))?;
            Ok(name.clone())
        }
        Some(other) => Err(ApiError::invalid(
            Some("model"),
            format!("`model` must be a string, got `{other}`"),
        )),
    }
}

/// A Messages request's prompt (a final assistant message continues the reply) and the chat
/// request it became.
fn prompt_of(body: &Value, count_only: bool) -> Result<(chat_prompt::ChatPrompt, Value), ApiError> {
    let translated = request::chat(body, count_only)?;
    let chat: ChatCompletionRequest = from_value(&translated.chat)?;
    let mut prompt = chat_prompt::build(&translated.chat, &chat)
        .map_err(|e| e.with_param_renamed("tool_choice.function.name", "tool_choice.name"))?;
    if let Some(prefill) = translated.prefill {
        let format = translated.chat.get("response_format").is_some();
        prompt.continue_prefill(prefill, format.then_some("output_config.format"))?;
    }
    Ok((prompt, translated.chat))
}

/// Create a message (Anthropic's Messages API).
#[utoipa::path(post, path = "/v1/messages", request_body(content = Object, description = "Anthropic's Messages request: `model`, `max_tokens`, `messages` (text, `tool_use`, `tool_result` blocks), `system`, `tools`, `tool_choice`, `stop_sequences`, `temperature`, `top_p`, `top_k`, `stream`"),
    params(("X-Session-Id" = Option<String>, Header, description = "Continue a persistent session (its KV is reused)")),
    responses(
        (status = 200, description = "A `message`, or its SSE events with `stream: true`", body = Object),
        (status = 400, description = "`invalid_request_error`, also for a prompt over the window", body = Object),
        (status = 401, description = "`authentication_error`", body = Object),
        (status = 404, description = "`not_found_error`: not the served model", body = Object),
        (status = 503, description = "`overloaded_error` (see Retry-After)", body = Object),
    ))]
pub async fn messages(
    auth: Result<Authorized, ApiError>,
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<AppState>,
) -> Reply {
    let auth = auth?;
    let body = read_json_object(&req, payload, state.config.max_body).await?;
    let model = requested_model(&state, &body)?;
    let stream = optional_bool(&body, "stream", false)?;
    let (prompt, chat) = prompt_of(&body, false)?;
    let params: GenerationParams = from_value(&chat)?;
    let engine = state.engine()?;
    let rename = |e: ApiError| {
        e.with_param_renamed("stop", "stop_sequences")
            .with_param_renamed("response_format", "output_config.format")
            .with_param_renamed("tool_choice.function.name", "tool_choice.name")
    };
    let session = generate::session_key(&req, &auth.scope)?;
    let mut plan =
        generate::plan(&params, prompt.prompt.clone(), false, 0, session).map_err(rename)?;
    if let Some(grammar) = prompt.forced_grammar.clone() {
        plan.force_tool_calls(grammar).map_err(rename)?;
    }
    plan.lazy_tool_calls(prompt.lazy_calls.clone());
    if prompt.ban_tool_calls {
        plan.ban_tool_calls(engine).await?;
    }
    let mut streams = submit_all(engine, &plan).await.map_err(rename)?;
    let ctx = ReplyContext {
        id: generate::new_id("msg").replacen('-', "_", 1),
        model,
        parser: ToolCallParser::new(prompt.parse_tools, prompt.single_call)
            .with_tool_names(prompt.tool_names.clone()),
        forced_prefix: prompt.forced_prefix.clone(),
    };
    if stream {
        let frames = ctx.events(state.clone(), streams.remove(0));
        return Ok(sse::response(
            frames,
            state.config.keep_alive,
            Peer::of(&req),
        ));
    }
    let mut collected = collect_all(streams, &state.metrics, Peer::of(&req)).await?;
    Ok(HttpResponse::Ok().json(ctx.complete(&state, collected.remove(0))))
}

/// Count a Messages request's input tokens without generating.
#[utoipa::path(post, path = "/v1/messages/count_tokens", request_body(content = Object, description = "A Messages request (`max_tokens` not needed)"),
    responses(
        (status = 200, description = "`{\"input_tokens\": N}`: the whole rendered prompt", body = Object),
        (status = 400, description = "`invalid_request_error`", body = Object),
    ))]
pub async fn count_tokens(
    auth: Result<Authorized, ApiError>,
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<AppState>,
) -> Reply {
    auth?;
    let body = read_json_object(&req, payload, state.config.max_body).await?;
    requested_model(&state, &body)?;
    let (prompt, _) = prompt_of(&body, true)?;
    let engine = state.engine()?;
    let tokens = engine
        .tokenize(&prompt.prompt)
        .await
        .map_err(ApiError::from)?;
    Ok(HttpResponse::Ok().json(json!({"input_tokens": tokens.len()})))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_over_the_window_is_refused_in_anthropic_words() {
        let over = |prompt, max| {
            let e = ApiError::from(crate::error::EngineError::ContextLengthExceeded {
                prompt_tokens: prompt,
                max_tokens: max,
                context_window: 32768,
            });
            error_body(&e)["error"]["message"]
                .as_str()
                .unwrap()
                .to_string()
        };
        assert_eq!(
            over(20867, 32000),
            "input length and `max_tokens` exceed context limit: 20867 + 32000 > 32768, \
             decrease input length or `max_tokens` and try again"
        );
        assert_eq!(
            over(40000, 1),
            "prompt is too long: 40000 tokens > 32768 maximum"
        );
    }

    #[test]
    fn a_busy_session_is_an_invalid_request_not_a_server_error() {
        let e = ApiError::from(crate::error::EngineError::SessionBusy {
            session_id: "s".into(),
        });
        assert_eq!(e.status.as_u16(), 409);
        assert_eq!(error_body(&e)["error"]["type"], "invalid_request_error");
    }
}
