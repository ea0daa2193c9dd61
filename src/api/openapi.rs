//! `GET /openapi.json`: an OpenAPI 3 description of every route, generated from the wire types
//! and the handlers' `#[utoipa::path]` annotations (fuzzers and SDK generators read it).

use super::anthropic;
use super::embeddings::{
    self, EmbeddingInput, EmbeddingObject, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage,
};
use super::ollama::{self, OllamaErrorBody};
use super::responses::{self, types::*};
use super::{chat, completions, health, llamacpp, metrics, models, stats, tokens, types::*, ws};
use actix_web::HttpResponse;
use utoipa::openapi::security::{ApiKey, ApiKeyValue, HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

#[derive(OpenApi)]
#[openapi(
    info(
        title = "mtpx",
        description = "OpenAI-compatible inference server for coding agents and chat (Ollama's /api routes, llama.cpp's and Anthropic's Messages API too). With an API key configured, every route but /health, /metrics and /openapi.json needs `Authorization: Bearer KEY` or `X-API-Key: KEY`."
    ),
    paths(
        chat::chat_completions,
        completions::completions,
        embeddings::embeddings,
        embeddings::llamacpp_embedding,
        models::list_models,
        models::get_model,
        tokens::tokenize,
        tokens::detokenize,
        tokens::count_chat,
        responses::create_response,
        responses::get_response,
        responses::delete_response,
        responses::cancel_response,
        responses::input_items::list_input_items,
        ws::responses_socket,
        stats::stats,
        health::health,
        health::get_load,
        metrics::metrics,
        ollama::chat,
        ollama::generate,
        ollama::embed::embed,
        ollama::embed::embeddings,
        ollama::show,
        ollama::tags,
        ollama::ps,
        ollama::version,
        llamacpp::completion,
        llamacpp::infill,
        llamacpp::props,
        anthropic::messages,
        anthropic::count_tokens,
    ),
    components(schemas(
        ChatCompletionRequest, ChatMessage, Role, MessageContent, ContentPart, Tool, FunctionDef,
        ToolChoice, NamedToolChoice, FunctionName, ToolCall, FunctionCall, GenerationParams,
        StopSpec, Speculative, StreamOptions, CompletionRequest, PromptInput, ChatCompletionResponse,
        ChatChoice, AssistantMessage, ChatLogprobs, TokenLogprob, TopLogprob, ChatCompletionChunk,
        ChunkChoice, ChunkDelta, ToolCallDelta, FunctionCallDelta, CompletionResponse,
        CompletionChoice, CompletionLogprobs, Usage, PromptTokensDetails, Timings, ModelObject,
        ModelList, TokenizeRequest, TokenizeResponse, DetokenizeRequest, DetokenizeResponse,
        CountResponse, ErrorResponse, ErrorBody, HealthResponse, DepthAcceptance,
        ResponsesRequest, Input, ResponseObject, IncompleteDetails, ResponseUsage,
        InputTokensDetails, OutputTokensDetails, OutputItem, OutputContent, ResponseEvent,
        OllamaErrorBody, EmbeddingRequest, EmbeddingInput, EmbeddingResponse, EmbeddingObject,
        EmbeddingUsage,
    )),
    modifiers(&Security),
    security(("bearer" = []), ("api_key" = []))
)]
pub struct ApiDoc;

struct Security;

impl Modify for Security {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
        components.add_security_scheme(
            "api_key",
            SecurityScheme::ApiKey(ApiKey::Header(ApiKeyValue::new("X-API-Key"))),
        );
    }
}

/// The document as JSON.
pub fn document() -> serde_json::Value {
    serde_json::to_value(ApiDoc::openapi()).unwrap_or_default()
}

pub async fn openapi_json() -> HttpResponse {
    HttpResponse::Ok().json(document())
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_route_is_described() {
        let doc = super::document();
        assert!(doc["openapi"].as_str().unwrap().starts_with("3."));
        for (method, path) in [
            ("post", "/v1/chat/completions"),
            ("post", "/v1/chat/completions/count"),
            ("post", "/v1/completions"),
            ("get", "/v1/models"),
            ("get", "/v1/models/{id}"),
            ("post", "/v1/responses"),
            ("get", "/v1/responses"),
            ("get", "/v1/responses/{id}"),
            ("delete", "/v1/responses/{id}"),
            ("get", "/v1/stats"),
            ("post", "/tokenize"),
            ("post", "/detokenize"),
            ("get", "/health"),
            ("get", "/metrics"),
            ("post", "/api/chat"),
            ("post", "/api/generate"),
            ("post", "/api/show"),
            ("get", "/api/tags"),
            ("get", "/api/ps"),
            ("get", "/api/version"),
            ("post", "/completion"),
            ("post", "/infill"),
            ("get", "/props"),
        ] {
            assert!(
                doc["paths"][path][method].is_object(),
                "{method} {path} is missing"
            );
        }
        for schema in [
            "ResponsesRequest",
            "ResponseObject",
            "ResponseEvent",
            "OutputItem",
        ] {
            assert!(doc["components"]["schemas"][schema].is_object(), "{schema}");
        }
        assert!(doc["components"]["schemas"]["ChatCompletionRequest"].is_object());
    }
}
