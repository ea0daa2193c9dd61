//! Responses WebSocket mode: `GET /v1/responses` with an upgrade.
//!
//! The client sends `{"type": "response.create", …the body of POST /v1/responses…}` and gets
//! the same events as the SSE stream, one JSON text frame each. A continuation sends only the
//! new items and `previous_response_id`; the conversation's engine session still holds its KV
//! (it outlives the connection, until its TTL), so only those items are prefilled.
//!
//! - Several responses may be in flight when the client tags them (`"tag": "…"`, echoed on
//!   every event of that response); one untagged response at a time.
//! - `{"type": "response.cancel", "response_id"?, "tag"?}` stops one (or, naming neither,
//!   every in-flight response): dropping its engine stream cancels the request and frees its
//!   pages; it ends with `response.cancelled`.
//! - Errors are `{"type": "error", "error": {OpenAI shape}}` events (with the `tag`); a
//!   malformed frame does not close the connection. A frame over `--max-ws-frame` closes it
//!   with 1009.
//! - The server pings every `ws_ping`; a peer silent for two intervals is dropped. Closing the
//!   connection cancels its in-flight responses (not its sessions).
//! - A browser `Origin` must be this server's own or one CORS allows (this machine's pages,
//!   `--cors-origin`).

use super::auth::Authorized;
use super::cors::AllowedOrigins;
use super::errors::{parse_object, ApiError};
use super::responses::builder::new_item_id;
use super::responses::types::ResponseEvent;
use super::responses::{self};
use super::types::ErrorResponse;
use super::AppState;
use actix_web::http::StatusCode;
use actix_web::{web, HttpRequest, HttpResponse};
use actix_ws::{AggregatedMessage, AggregatedMessageStream, CloseCode, CloseReason, ProtocolError};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::time::Instant;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use tokio::sync::oneshot;

/// Upgrade to a Responses WebSocket session. The client sends `response.create` events (the
/// `POST /v1/responses` body with `"type": "response.create"`, optionally a `tag`) and
/// `response.cancel` events; the server answers with `ResponseEvent` JSON text frames.
#[utoipa::path(get, path = "/v1/responses", responses(
    (status = 101, description = "Switching to the WebSocket protocol; frames are `ResponseEvent`s", body = ResponseEvent),
    (status = 400, description = "Not a WebSocket upgrade", body = ErrorResponse),
    (status = 401, body = ErrorResponse),
    (status = 403, description = "Origin not allowed", body = ErrorResponse),
))]
pub async fn responses_socket(
    auth: Authorized,
    req: HttpRequest,
    body: web::Payload,
    state: web::Data<AppState>,
) -> Result<HttpResponse, actix_web::Error> {
    check_origin(&req, &state.config.cors_origins)?;
    let upgrade = req
        .headers()
        .get(actix_web::http::header::UPGRADE)
        .and_then(|v| v.to_str().ok());
    if !upgrade.is_some_and(|u| u.eq_ignore_ascii_case("websocket")) {
        // actix-ws would answer with a bare-text 400.
        return Err(ApiError::invalid(
            None,
            "GET /v1/responses is the Responses API's WebSocket mode: connect with a WebSocket \
             (Upgrade: websocket), or POST to /v1/responses",
        )
        .into());
    }
    let (response, session, messages) = actix_ws::handle(&req, body)?;
    let max = state.config.max_ws_frame;
    let messages = messages
        .max_frame_size(max)
        .aggregate_continuations()
        .max_continuation_size(max);
    let (out_tx, out_rx) = unbounded_channel();
    let connection = Connection {
        state: state.clone(),
        scope: auth.scope,
        session_header: responses::session_header(&req).map(str::to_string),
        in_flight: HashMap::new(),
        out_tx,
    };
    actix_rt::spawn(connection.run(session, messages, out_rx));
    Ok(response)
}

/// Browsers send `Origin` on WebSocket upgrades (CORS does not apply to them): allow the
/// server's own origin and the configured CORS origins. Non-browser clients send none.
fn check_origin(req: &HttpRequest, allowed: &AllowedOrigins) -> Result<(), ApiError> {
    let Some(origin) = req
        .headers()
        .get(actix_web::http::header::ORIGIN)
        .and_then(|v| v.to_str().ok())
    else {
        return Ok(());
    };
    let info = req.connection_info();
    let same_host = origin.split_once("://").map(|(_, h)| h) == Some(info.host());
    if same_host || allowed.allows(origin) {
        return Ok(());
    }
    Err(ApiError::new(
        StatusCode::FORBIDDEN,
        "invalid_request_error",
        format!("WebSocket connections from origin `{origin}` are not allowed (--cors-origin)."),
    )
    .with_code("origin_not_allowed"))
}

/// What the response tasks send the connection.
enum Out {
    Frame(String),
    /// The response `response_id` under `key` (its tag, or "") ended.
    Done {
        key: String,
        response_id: String,
    },
}

struct InFlight {
    response_id: String,
    /// Taken when cancelled; dropping it (the connection ends) cancels too.
    cancel: Option<oneshot::Sender<()>>,
}

struct Connection {
    state: web::Data<AppState>,
    scope: String,
    /// The conversation key the upgrade request's headers gave (`X-Session-Id`, `session-id`).
    session_header: Option<String>,
    /// By tag ("" for the untagged one).
    in_flight: HashMap<String, InFlight>,
    out_tx: UnboundedSender<Out>,
}

impl Connection {
    async fn run(
        mut self,
        mut session: actix_ws::Session,
        mut messages: AggregatedMessageStream,
        mut out_rx: UnboundedReceiver<Out>,
    ) {
        let every = self.state.config.ws_ping;
        let mut ping = actix_rt::time::interval_at(actix_rt::time::Instant::now() + every, every);
        let mut last_seen = Instant::now();
        let close = loop {
            tokio::select! {
                msg = messages.recv() => {
                    let Some(msg) = msg else { break None };
                    last_seen = Instant::now();
                    match msg {
                        Ok(AggregatedMessage::Text(text)) => self.on_text(&text),
                        Ok(AggregatedMessage::Binary(bytes)) => match std::str::from_utf8(&bytes) {
                            Ok(text) => self.on_text(text),
                            Err(_) => self.send_error(None, ApiError::invalid(None,
                                "binary frames must hold UTF-8 JSON events")),
                        },
                        Ok(AggregatedMessage::Ping(p)) => {
                            if session.pong(&p).await.is_err() {
                                break None;
                            }
                        }
                        Ok(AggregatedMessage::Pong(_)) => {}
                        Ok(AggregatedMessage::Close(reason)) => break reason,
                        Err(e) => break Some(close_reason_of(&e, self.state.config.max_ws_frame)),
                    }
                }
                out = out_rx.recv() => match out {
                    Some(Out::Frame(text)) => {
                        if session.text(text).await.is_err() {
                            break None;
                        }
                    }
                    Some(Out::Done { key, response_id }) => {
                        if self.in_flight.get(&key).is_some_and(|f| f.response_id == response_id) {
                            self.in_flight.remove(&key);
                        }
                    }
                    None => break None,
                },
                _ = ping.tick() => {
                    if last_seen.elapsed() > every * 2 {
                        break Some(CloseReason {
                            code: CloseCode::Away,
                            description: Some("no answer to pings".into()),
                        });
                    }
                    if session.ping(b"mtpx").await.is_err() {
                        break None;
                    }
                }
            }
        };
        // Dropping the cancel senders stops every in-flight response.
        self.in_flight.clear();
        let _ = session.close(close).await;
    }

    fn on_text(&mut self, text: &str) {
        let value = match parse_object(text.as_bytes()) {
            Ok(v) => v,
            Err(e) => return self.send_error(None, e),
        };
        let tag = match value.get("tag") {
            None | Some(Value::Null) => None,
            Some(Value::String(t)) => Some(t.clone()),
            Some(_) => {
                return self.send_error(
                    None,
                    ApiError::invalid(Some("tag"), "`tag` must be a string"),
                )
            }
        };
        match value.get("type").and_then(Value::as_str) {
            Some("response.create") => self.create(value, tag),
            Some("response.cancel") => self.cancel(&value, tag),
            other => self.send_error(
                tag,
                ApiError::invalid(
                    Some("type"),
                    format!(
                        "unknown event type {}; send `response.create` or `response.cancel`",
                        other.map_or("(none)".into(), |t| format!("`{t}`"))
                    ),
                )
                .with_code("unknown_event"),
            ),
        }
    }

    fn create(&mut self, value: Value, tag: Option<String>) {
        let key = tag.clone().unwrap_or_default();
        if self.in_flight.contains_key(&key) {
            let what = tag.as_ref().map_or("An untagged response".into(), |t| {
                format!("A response tagged `{t}`")
            });
            let e = ApiError::invalid(
                Some("tag"),
                format!("{what} is already in flight on this connection; tag concurrent responses with distinct `tag`s"),
            )
            .with_code("response_in_flight");
            return self.send_error(tag, e);
        }
        let id = new_item_id("resp");
        let header = self.session_header.as_deref();
        let mut job = match responses::prepare(&self.state, &self.scope, &value, id.clone(), header)
        {
            Ok(job) if job.template.background => {
                let e = ApiError::invalid(
                    Some("background"),
                    "`background: true` is not served over the WebSocket: a response runs while \
                     its connection is open; create background responses with `POST /v1/responses`",
                );
                return self.send_error(tag, e);
            }
            Ok(job) => job,
            Err(e) => return self.send_error(tag, e),
        };
        let (cancel_tx, cancel_rx) = oneshot::channel::<()>();
        self.in_flight.insert(
            key.clone(),
            InFlight {
                response_id: id.clone(),
                cancel: Some(cancel_tx),
            },
        );
        let (state, out) = (self.state.clone(), self.out_tx.clone());
        actix_rt::spawn(async move {
            let frame = |event: Value| -> String {
                let mut event = event;
                if let (Some(t), Some(obj)) = (&tag, event.as_object_mut()) {
                    obj.insert("tag".into(), json!(t));
                }
                event.to_string()
            };
            let submitted = match state.engine() {
                Ok(engine) => responses::submit(engine, &mut job).await,
                Err(e) => Err(e),
            };
            match submitted {
                Err(e) => {
                    let _ = out.send(Out::Frame(frame(error_event(&e))));
                }
                Ok(stream) => {
                    let cancel = async move {
                        let _ = cancel_rx.await;
                    };
                    responses::run(job, stream, state.clone(), cancel, |event| {
                        let value = serde_json::to_value(&event).unwrap_or(Value::Null);
                        out.send(Out::Frame(frame(value))).is_ok()
                    })
                    .await;
                }
            }
            let _ = out.send(Out::Done {
                key,
                response_id: id,
            });
        });
    }

    fn cancel(&mut self, value: &Value, tag: Option<String>) {
        let response_id = value.get("response_id").and_then(Value::as_str);
        let mut found = false;
        for (key, f) in self.in_flight.iter_mut() {
            let matches = match (response_id, &tag) {
                (Some(id), _) => f.response_id == id,
                (None, Some(t)) => key == t,
                (None, None) => true,
            };
            if matches {
                found = true;
                if let Some(tx) = f.cancel.take() {
                    let _ = tx.send(());
                }
            }
        }
        if !found {
            let e = ApiError::invalid(
                Some("response_id"),
                "no response in flight on this connection matches the cancel",
            )
            .with_code("response_not_found");
            self.send_error(tag, e);
        }
    }

    fn send_error(&self, tag: Option<String>, e: ApiError) {
        let mut event = error_event(&e);
        if let Some(t) = tag {
            event["tag"] = json!(t);
        }
        let _ = self.out_tx.send(Out::Frame(event.to_string()));
    }
}

/// `{"type": "error", "status": 400, "error": {...}}`.
fn error_event(e: &ApiError) -> Value {
    let event = ResponseEvent::Error {
        error: e.body()["error"].clone(),
    };
    let mut v = serde_json::to_value(event).unwrap_or_else(|_| json!({"type": "error"}));
    v["status"] = json!(e.status.as_u16());
    v
}

/// 1009 for a frame or message over the limit, 1002 for other protocol errors.
fn close_reason_of(e: &ProtocolError, max: usize) -> CloseReason {
    let too_big = matches!(e, ProtocolError::Overflow)
        || matches!(e, ProtocolError::Io(io) if io.to_string().contains("maximum continuation size"));
    if too_big {
        return CloseReason {
            code: CloseCode::Size,
            description: Some(format!("frame larger than --max-ws-frame ({max} bytes)")),
        };
    }
    CloseReason {
        code: CloseCode::Protocol,
        description: Some(e.to_string()),
    }
}
