//! CORS. Pages served from this machine (`http(s)://localhost`, `127.0.0.1`, `[::1]`, any port)
//! may call the API by default, as Ollama allows: a web app in development on
//! `localhost:5173` works against a local server without flags, while a page from anywhere else
//! cannot read the API's answers. `--cors-origin` adds origins (repeatable; `*` allows any);
//! `--cors-origin none` allows none, not even this machine's. Preflight `OPTIONS` requests are
//! answered without authentication.

use actix_web::http::header::{self, HeaderValue};
use actix_web::http::Method;

/// The browser origins allowed to call the API (and to open its WebSocket).
#[derive(Debug, Clone, PartialEq)]
pub struct AllowedOrigins {
    /// Origins allowed by name, or `*` for any.
    pub listed: Vec<String>,
    /// Whether origins on a loopback host are allowed too.
    pub loopback: bool,
}

impl Default for AllowedOrigins {
    fn default() -> Self {
        Self {
            listed: Vec::new(),
            loopback: true,
        }
    }
}

impl AllowedOrigins {
    /// From `--cors-origin` values: `none` alone turns CORS off; anything else adds to the
    /// loopback default.
    pub fn from_flags(values: &[String]) -> Self {
        if values.iter().any(|v| v.trim().eq_ignore_ascii_case("none")) {
            return Self {
                listed: Vec::new(),
                loopback: false,
            };
        }
        Self {
            listed: values.iter().map(|v| v.trim().to_string()).collect(),
            loopback: true,
        }
    }

    /// Whether a page from `origin` may call the API.
    pub fn allows(&self, origin: &str) -> bool {
        self.allows_any()
            || self.listed.iter().any(|a| a == origin)
            || self.loopback && is_loopback(origin)
    }

    fn allows_any(&self) -> bool {
        self.listed.iter().any(|a| a == "*")
    }
}

impl std::fmt::Display for AllowedOrigins {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.loopback, self.listed.as_slice()) {
            (false, []) => write!(f, "off"),
            (true, []) => write!(f, "this machine's origins"),
            (false, listed) => write!(f, "{}", listed.join(", ")),
            (true, listed) => write!(f, "this machine's origins, {}", listed.join(", ")),
        }
    }
}

/// Whether `origin` is an `http` or `https` origin on a loopback host: `localhost` (and its
/// subdomains, RFC 6761), `127.0.0.0/8` or `[::1]`.
fn is_loopback(origin: &str) -> bool {
    let Ok(url) = url::Url::parse(origin) else {
        return false;
    };
    if !matches!(url.scheme(), "http" | "https") {
        return false;
    }
    match url.host() {
        Some(url::Host::Domain(name)) => {
            let name = name.trim_end_matches('.').to_ascii_lowercase();
            name == "localhost" || name.ends_with(".localhost")
        }
        Some(url::Host::Ipv4(ip)) => ip.is_loopback(),
        Some(url::Host::Ipv6(ip)) => ip.is_loopback(),
        None => false,
    }
}

/// The CORS headers for a response to a request from `origin`, if that origin is allowed.
pub fn headers_for(
    allowed: &AllowedOrigins,
    origin: Option<&str>,
    method: &Method,
) -> Vec<(header::HeaderName, HeaderValue)> {
    let Some(origin) = origin else {
        return Vec::new();
    };
    if !allowed.allows(origin) {
        return Vec::new();
    }
    let value = if allowed.allows_any() { "*" } else { origin };
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

    fn listed(origins: &[&str]) -> AllowedOrigins {
        AllowedOrigins::from_flags(&origins.iter().map(|o| o.to_string()).collect::<Vec<_>>())
    }

    #[test]
    fn listed_origins_and_this_machines_get_headers() {
        let allowed = listed(&["http://a.test"]);
        assert!(headers_for(&allowed, Some("http://b.test"), &Method::GET).is_empty());
        assert!(headers_for(&allowed, None, &Method::GET).is_empty());
        let h = headers_for(&allowed, Some("http://a.test"), &Method::OPTIONS);
        assert_eq!(h[0].1, "http://a.test");
        assert!(h
            .iter()
            .any(|(k, _)| k == header::ACCESS_CONTROL_ALLOW_HEADERS));
        let local = headers_for(&allowed, Some("http://localhost:5173"), &Method::GET);
        assert_eq!(local[0].1, "http://localhost:5173");
        let any = headers_for(&listed(&["*"]), Some("http://x"), &Method::GET);
        assert_eq!(any[0].1, "*");
    }

    #[test]
    fn loopback_hosts_are_allowed_by_default_and_nothing_else() {
        let default = AllowedOrigins::default();
        for origin in [
            "http://localhost",
            "http://localhost:3000",
            "https://LOCALHOST:8443",
            "http://app.localhost:8080",
            "http://127.0.0.1:8080",
            "http://127.1.2.3",
            "http://[::1]:5173",
        ] {
            assert!(default.allows(origin), "{origin}");
        }
        for origin in [
            "http://example.com",
            "http://localhost.example.com",
            "http://127.0.0.1.example.com",
            "http://192.168.1.10:8080",
            "http://[::2]",
            "file://",
            "null",
            "chrome-extension://abcdef",
            "ws://localhost:8080",
            "",
        ] {
            assert!(!default.allows(origin), "{origin}");
        }
    }

    #[test]
    fn none_turns_cors_off_and_other_flags_add_to_the_default() {
        let off = listed(&["none"]);
        assert!(off.listed.is_empty() && !off.loopback);
        assert!(!off.allows("http://localhost:3000"));
        assert!(headers_for(&off, Some("http://127.0.0.1"), &Method::OPTIONS).is_empty());
        let added = listed(&["https://app.example"]);
        assert!(added.allows("https://app.example") && added.allows("http://127.0.0.1:1"));
        assert!(!added.allows("https://other.example"));
    }
}
