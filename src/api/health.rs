//! `GET /health`: 200 `{"status": "ok"}` when the engine serves, 503 `{"status": "loading"}`
//! (with `Retry-After`) while the model loads and `{"status": "draining"}` once a graceful stop
//! began. `GET /get_load`: `{"load": N}`, the requests running and waiting (what vllm-router's
//! `power_of_two` policy polls). Neither needs a key.

use super::types::HealthResponse;
use super::AppState;
use actix_web::{web, HttpResponse};

/// Readiness.
#[utoipa::path(get, path = "/health", responses(
    (status = 200, description = "Ready", body = HealthResponse),
    (status = 503, description = "Loading", body = HealthResponse),
))]
pub async fn health(state: web::Data<AppState>) -> HttpResponse {
    if state.draining.load(std::sync::atomic::Ordering::Relaxed) {
        return HttpResponse::ServiceUnavailable().json(HealthResponse {
            status: "draining".into(),
        });
    }
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

/// Load, for routers that balance on it: requests running and waiting in the scheduler.
#[utoipa::path(get, path = "/get_load", responses(
    (status = 200, description = "`{\"load\": N}`: requests running and waiting", body = serde_json::Value),
    (status = 503, description = "Loading", body = serde_json::Value),
))]
pub async fn get_load(state: web::Data<AppState>) -> HttpResponse {
    match state.engine() {
        Ok(engine) => {
            let s = engine.scheduler_stats().await;
            HttpResponse::Ok().json(serde_json::json!({ "load": s.num_running + s.num_waiting }))
        }
        Err(_) => HttpResponse::ServiceUnavailable()
            .insert_header(("Retry-After", "1"))
            .json(serde_json::json!({ "load": 0, "status": "loading" })),
    }
}
