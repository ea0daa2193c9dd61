//! `GET /v1/stats`: the engine's state as JSON for dashboards and the playground's live panel:
//! the page pool (used / cached / free), the scheduler (running / waiting, totals), the
//! sessions in aggregate, and with `?session=conv_…` the pages held by that conversation's
//! session (conversation ids are unguessable; other sessions are only counted).

use super::auth::Authorized;
use super::errors::ApiError;
use super::types::ErrorResponse;
use super::AppState;
use actix_web::{web, HttpResponse};
use serde::Deserialize;
use serde_json::json;

#[derive(Debug, Deserialize)]
pub struct StatsQuery {
    /// A conversation id (`conv_…`, from a stored response's session).
    pub session: Option<String>,
}

#[utoipa::path(get, path = "/v1/stats", params(
    ("session" = Option<String>, Query, description = "A conversation id (`conv_…`): adds the pages its session holds"),
), responses(
    (status = 200, description = "`{object: \"engine.stats\", model, context_window, pool, scheduler, sessions, session, stored_responses, speculation}`", body = Object),
    (status = 401, body = ErrorResponse),
    (status = 503, body = ErrorResponse),
))]
pub async fn stats(
    _auth: Authorized,
    query: web::Query<StatsQuery>,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    let engine = state.engine()?;
    let pool = engine.pool_stats().await;
    let scheduler = engine.scheduler_stats().await;
    let sessions = engine.sessions().await;
    let session = query.session.as_ref().and_then(|conv| {
        let name = format!("responses/{conv}");
        sessions.iter().find(|s| s.session_id == name).cloned()
    });
    let info = engine.info();
    Ok(HttpResponse::Ok().json(json!({
        "object": "engine.stats",
        "model": state.config.model_id,
        "context_window": info.context_window,
        "pool": pool,
        "scheduler": scheduler,
        "sessions": {
            "count": sessions.len(),
            "num_pages": sessions.iter().map(|s| s.num_pages).sum::<usize>(),
            "num_tokens": sessions.iter().map(|s| s.num_tokens).sum::<usize>(),
        },
        "session": session,
        "stored_responses": state.responses.len(),
        "background_responses_running": state.background.len(),
        "response_event_log_bytes": state.responses.event_log_bytes(),
        // The drafters this server runs (a request may turn speculation off or pick one).
        "speculation": {
            "enabled": !info.drafters.is_empty(),
            "drafters": info.drafters,
            "draft_model": info.draft_model_path,
        },
    })))
}
