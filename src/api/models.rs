//! `GET /v1/models` and `GET /v1/models/{id}`: the served model, with the context window the
//! engine enforces (`context_window`, also as vLLM's `max_model_len`).

use super::auth::Authorized;
use super::errors::ApiError;
use super::types::{ErrorResponse, ModelList, ModelObject};
use super::AppState;
use actix_web::{web, HttpResponse};

fn model_object(state: &AppState) -> Result<ModelObject, ApiError> {
    let window = state.engine()?.info().context_window;
    Ok(ModelObject {
        id: state.config.model_id.clone(),
        object: "model".into(),
        created: state.created,
        owned_by: "mtpx".into(),
        context_window: window,
        max_model_len: window,
    })
}

/// List the served model.
#[utoipa::path(get, path = "/v1/models", responses(
    (status = 200, body = ModelList),
    (status = 401, body = ErrorResponse),
    (status = 503, description = "Loading", body = ErrorResponse),
))]
pub async fn list_models(
    _auth: Authorized,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    Ok(HttpResponse::Ok().json(ModelList {
        object: "list".into(),
        data: vec![model_object(&state)?],
    }))
}

/// Describe one model (404 `model_not_found` unless it is the served one).
#[utoipa::path(get, path = "/v1/models/{id}", params(("id" = String, Path)), responses(
    (status = 200, body = ModelObject),
    (status = 401, body = ErrorResponse),
    (status = 404, body = ErrorResponse),
))]
pub async fn get_model(
    _auth: Authorized,
    id: web::Path<String>,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    state.check_model(Some(id.as_str()))?;
    Ok(HttpResponse::Ok().json(model_object(&state)?))
}
