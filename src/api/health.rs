//! `GET /health`: 200 `{"status": "ok"}` when the engine serves, 503 `{"status": "loading"}`
//! (with `Retry-After`) while the model loads. Never needs a key.

use super::types::HealthResponse;
use super::AppState;
use actix_web::{web, HttpResponse};

/// Readiness.
#[utoipa::path(get, path = "/health", responses(
    (status = 200, description = "Ready", body = HealthResponse),
    (status = 503, description = "Loading", body = HealthResponse),
))]
pub async fn health(state: web::Data<AppState>) -> HttpResponse {
    if state.is_ready() {
        HttpResponse::Ok().json(HealthResponse {
            status: "ok".into(),
        })
    } else {
        HttpResponse::ServiceUnavailable()
            .insert_header(("Retry-After", "1"))
            .json(HealthResponse {
                status: "loading".into(),
            })
    }
}
