//! The browser playground (`web/`), built into the binary: `GET /` and its two assets. No CDN,
//! works offline. The page talks to the same public API as any client: the Responses
//! WebSocket (SSE fallback) and `GET /v1/stats`.

use actix_web::http::header;
use actix_web::HttpResponse;

const INDEX_HTML: &str = include_str!("../../web/index.html");
const APP_JS: &str = include_str!("../../web/app.js");
const STYLE_CSS: &str = include_str!("../../web/style.css");

/// Only this origin's scripts, styles and connections (the WebSocket included).
const CSP: &str = "default-src 'self'; connect-src 'self' ws: wss:; img-src 'self' data:; \
                   style-src 'self'; script-src 'self'; frame-ancestors 'none'";

fn asset(content_type: &str, body: &'static str) -> HttpResponse {
    HttpResponse::Ok()
        .insert_header((header::CONTENT_TYPE, content_type))
        .insert_header((header::CACHE_CONTROL, "no-cache"))
        .insert_header((header::CONTENT_SECURITY_POLICY, CSP))
        .insert_header((header::X_CONTENT_TYPE_OPTIONS, "nosniff"))
        .body(body)
}

pub async fn index() -> HttpResponse {
    asset("text/html; charset=utf-8", INDEX_HTML)
}

pub async fn app_js() -> HttpResponse {
    asset("text/javascript; charset=utf-8", APP_JS)
}

pub async fn style_css() -> HttpResponse {
    asset("text/css; charset=utf-8", STYLE_CSS)
}
