//! API-key authentication. With a key configured (`--api-key` / `MTPX_API_KEY`), a request
//! must carry `Authorization: Bearer KEY` or `X-API-Key: KEY`; keys are compared in constant
//! time. The key also scopes session ids: the same `X-Session-Id` under two keys names two
//! sessions.

use super::errors::ApiError;
use super::AppState;
use actix_web::dev::Payload;
use actix_web::http::header::{HeaderMap, AUTHORIZATION};
use actix_web::{web, FromRequest, HttpRequest};
use std::future::{ready, Ready};
use subtle::ConstantTimeEq;

/// An authorised caller; holds the session scope (the key, or "" without auth).
#[derive(Debug, Clone)]
pub struct Authorized {
    pub scope: String,
}

impl FromRequest for Authorized {
    type Error = ApiError;
    type Future = Ready<Result<Self, ApiError>>;

    fn from_request(req: &HttpRequest, _: &mut Payload) -> Self::Future {
        let Some(state) = req.app_data::<web::Data<AppState>>() else {
            return ready(Err(ApiError::internal("the app state is missing")));
        };
        ready(authorize(&state.config.api_keys, req.headers()))
    }
}

/// Checks `headers` against `expected` (no key configured: everyone is authorised).
/// `keys` empty: open. Otherwise the request must carry one of them; it becomes the scope.
pub fn authorize(keys: &[String], headers: &HeaderMap) -> Result<Authorized, ApiError> {
    if keys.is_empty() {
        return Ok(Authorized {
            scope: String::new(),
        });
    }
    let bearer = headers
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            v.strip_prefix("Bearer ")
                .or_else(|| v.strip_prefix("bearer "))
        })
        .map(str::trim);
    let x_api_key = headers
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .map(str::trim);
    // Every key is compared (no early exit), so timing does not tell which one nearly matched.
    let mut matched = None;
    for given in [bearer, x_api_key].into_iter().flatten() {
        for key in keys {
            if keys_equal(given, key) {
                matched = Some(key);
            }
        }
    }
    match matched {
        Some(key) => Ok(Authorized { scope: key.clone() }),
        None => Err(ApiError::unauthorized()),
    }
}

/// Constant-time in the key's content (the length is not secret).
fn keys_equal(given: &str, expected: &str) -> bool {
    given.len() == expected.len() && bool::from(given.as_bytes().ct_eq(expected.as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use actix_web::http::header::{HeaderName, HeaderValue};

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        h
    }

    #[test]
    fn bearer_or_x_api_key_is_accepted_and_scopes_sessions() {
        let keys = ["k1".to_string(), "k2".to_string()];
        let ok = authorize(&keys, &headers(&[("authorization", "Bearer k1")])).unwrap();
        assert_eq!(ok.scope, "k1");
        assert!(authorize(&keys[..1], &headers(&[("x-api-key", "k1")])).is_ok());
        let second = authorize(&keys, &headers(&[("x-api-key", "k2")])).unwrap();
        assert_eq!(second.scope, "k2", "each key is its own scope");
        assert!(authorize(&[], &headers(&[])).unwrap().scope.is_empty());
    }

    #[test]
    fn wrong_or_missing_keys_are_refused() {
        for h in [
            headers(&[]),
            headers(&[("authorization", "Bearer k2")]),
            headers(&[("authorization", "k1")]),
            headers(&[("x-api-key", "k")]),
        ] {
            let err = authorize(&["k1".to_string()], &h).unwrap_err();
            assert_eq!(err.status.as_u16(), 401);
            assert_eq!(err.code, Some("invalid_api_key"));
        }
    }
}
