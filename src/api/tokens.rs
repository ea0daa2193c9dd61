//! Token counting without generating: `POST /tokenize` (text or a chat), `POST /detokenize`,
//! and `POST /v1/chat/completions/count` (a chat request's prompt tokens, rendered exactly as
//! a completion would render it, and what is left of the window).

use super::auth::Authorized;
use super::chat_prompt;
use super::errors::{from_value, read_json_object, ApiError};
use super::types::*;
use super::AppState;
use crate::engine::Prompt;
use actix_web::{web, HttpRequest, HttpResponse};

/// Tokenize text (`prompt` or `content`) or a chat (`messages`, optional `tools`).
#[utoipa::path(post, path = "/tokenize", request_body = TokenizeRequest, responses(
    (status = 200, body = TokenizeResponse), (status = 400, body = ErrorResponse),
    (status = 401, body = ErrorResponse),
))]
pub async fn tokenize(
    _auth: Authorized,
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    let value = read_json_object(&req, payload, state.config.max_body).await?;
    let request: TokenizeRequest = from_value(&value)?;
    state.check_model(request.model.as_deref())?;
    let engine = state.engine()?;
    let prompt = match (request.prompt.or(request.content), request.messages) {
        (Some(text), None) => Prompt::Text(text),
        // Rendered as a completion renders it (tool-call arguments given as JSON text parsed,
        // content parts joined), so the count is the one generation would use.
        (None, Some(_)) => {
            let chat: ChatCompletionRequest = from_value(&value)?;
            chat_prompt::build(&value, &chat)?.prompt
        }
        _ => {
            return Err(ApiError::invalid(
                Some("prompt"),
                "give exactly one of `prompt` (or `content`) and `messages`",
            ))
        }
    };
    let tokens = engine.tokenize(&prompt).await?;
    Ok(HttpResponse::Ok().json(TokenizeResponse {
        count: tokens.len(),
        tokens,
        max_model_len: engine.info().context_window,
    }))
}

/// Token ids back to text.
#[utoipa::path(post, path = "/detokenize", request_body = DetokenizeRequest, responses(
    (status = 200, body = DetokenizeResponse), (status = 400, body = ErrorResponse),
    (status = 401, body = ErrorResponse),
))]
pub async fn detokenize(
    _auth: Authorized,
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    let value = read_json_object(&req, payload, state.config.max_body).await?;
    let request: DetokenizeRequest = from_value(&value)?;
    state.check_model(request.model.as_deref())?;
    let vocab_size = state.engine()?.info().vocab_size;
    if let Some(id) = request.tokens.iter().find(|&&id| id as usize >= vocab_size) {
        return Err(ApiError::invalid(
            Some("tokens"),
            format!("token id {id} is outside the vocabulary of {vocab_size} tokens"),
        ));
    }
    let text = state
        .detokenizer()?
        .decode(&request.tokens)
        .map_err(ApiError::internal)?;
    Ok(HttpResponse::Ok().json(DetokenizeResponse {
        prompt: text.clone(),
        content: text,
    }))
}

/// Count a chat completion request's prompt tokens without generating.
#[utoipa::path(post, path = "/v1/chat/completions/count", request_body = ChatCompletionRequest, responses(
    (status = 200, body = CountResponse), (status = 400, body = ErrorResponse),
    (status = 401, body = ErrorResponse), (status = 404, body = ErrorResponse),
))]
pub async fn count_chat(
    _auth: Authorized,
    req: HttpRequest,
    payload: web::Payload,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    let value = read_json_object(&req, payload, state.config.max_body).await?;
    let request: ChatCompletionRequest = from_value(&value)?;
    state.check_model(request.params.model.as_deref())?;
    let engine = state.engine()?;
    let prompt = chat_prompt::build(&value, &request)?;
    let prompt_tokens = engine.tokenize(&prompt.prompt).await?.len();
    let window = engine.info().context_window;
    Ok(HttpResponse::Ok().json(CountResponse {
        object: "chat.completion.count".into(),
        prompt_tokens,
        context_window: window,
        remaining_tokens: window.saturating_sub(prompt_tokens),
    }))
}
