//! CORS, off unless origins are configured (`--cors-origin`, repeatable; `*` allows any).
//! Preflight `OPTIONS` requests are answered without authentication.

use actix_web::http::header::{self, HeaderValue};
use actix_web::http::Method;

/// The CORS headers for a response to a request from `origin`, if that origin is allowed.
pub fn headers_for(
    allowed: &[String],
    origin: Option<&str>,
    method: &Method,
) -> Vec<(header::HeaderName, HeaderValue)> {
    let Some(origin) = origin else {
        return Vec::new();
    };
    let any = allowed.iter().any(|a| a == "*");
    if !any && !allowed.iter().any(|a| a == origin) {
        return Vec::new();
    }
    let value = if any { "*" } else { origin };
    let Ok(value) = HeaderValue::from_str(value) else {
        return Vec::new();
    };
    let mut out = vec![
        (header::ACCESS_CONTROL_ALLOW_ORIGIN, value),
        (header::VARY, HeaderValue::from_static("Origin")),
        (
            header::ACCESS_CONTROL_EXPOSE_HEADERS,
            HeaderValue::from_static("Retry-After"),
        ),
    ];
    if method == Method::OPTIONS {
        out.push((
            header::ACCESS_CONTROL_ALLOW_METHODS,
            HeaderValue::from_static("GET, POST, OPTIONS"),
        ));
        out.push((
            header::ACCESS_CONTROL_ALLOW_HEADERS,
            HeaderValue::from_static("Authorization, Content-Type, X-API-Key, X-Session-Id"),
        ));
        out.push((
            header::ACCESS_CONTROL_MAX_AGE,
            HeaderValue::from_static("600"),
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_configured_origins_get_headers() {
        let allowed = vec!["http://a.test".to_string()];
        assert!(headers_for(&[], Some("http://a.test"), &Method::GET).is_empty());
        assert!(headers_for(&allowed, Some("http://b.test"), &Method::GET).is_empty());
        let h = headers_for(&allowed, Some("http://a.test"), &Method::OPTIONS);
        assert_eq!(h[0].1, "http://a.test");
        assert!(h
            .iter()
            .any(|(k, _)| k == header::ACCESS_CONTROL_ALLOW_HEADERS));
        let any = headers_for(&["*".into()], Some("http://x"), &Method::GET);
        assert_eq!(any[0].1, "*");
    }
}
