//! A small typed client of the Responses WebSocket mode (tokio-tungstenite): connect, send
//! `response.create` / `response.cancel`, receive typed [`ResponseEvent`]s (with their `tag`),
//! or run one turn to its terminal event with its timings.

use crate::api::responses::types::{ResponseEvent, ResponseObject};
use anyhow::{anyhow, bail, Context, Result};
use futures::{SinkExt, StreamExt};
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

/// One received event: typed, with the tag it carried and the raw JSON.
#[derive(Debug, Clone)]
pub struct Received {
    pub event: ResponseEvent,
    pub tag: Option<String>,
    pub raw: Value,
}

#[derive(Debug, Clone)]
pub enum Incoming {
    Event(Box<Received>),
    /// The server closed the connection (`code`: the close frame's code, if any).
    Closed {
        code: Option<u16>,
        reason: String,
    },
}

/// One response run to its end.
#[derive(Debug, Clone)]
pub struct Turn {
    pub response: ResponseObject,
    pub events: Vec<ResponseEvent>,
    /// From sending `response.create` to the first text or arguments delta.
    pub ttft: Option<Duration>,
    pub elapsed: Duration,
}

pub struct ResponsesSocket {
    ws: WebSocketStream<MaybeTlsStream<TcpStream>>,
}

/// `http://host:port` (or `ws://…`) → `ws://host:port/v1/responses`.
pub fn socket_url(base: &str) -> String {
    let base = base.trim_end_matches('/');
    let base = base
        .strip_prefix("http://")
        .map(|r| format!("ws://{r}"))
        .or_else(|| base.strip_prefix("https://").map(|r| format!("wss://{r}")))
        .unwrap_or_else(|| base.to_string());
    let base = base
        .trim_end_matches("/v1/responses")
        .trim_end_matches("/v1");
    format!("{base}/v1/responses")
}

impl ResponsesSocket {
    /// Connects to the server at `base_url` (`http://127.0.0.1:8080`).
    pub async fn connect(base_url: &str, api_key: Option<&str>) -> Result<Self> {
        let url = socket_url(base_url);
        let mut request = url.as_str().into_client_request()?;
        if let Some(key) = api_key {
            request
                .headers_mut()
                .insert("authorization", format!("Bearer {key}").parse()?);
        }
        let (ws, _) = tokio_tungstenite::connect_async(request)
            .await
            .with_context(|| format!("connecting to {url}"))?;
        Ok(Self { ws })
    }

    /// Sends a text frame as is (tests send malformed ones).
    pub async fn send_raw(&mut self, text: impl Into<String>) -> Result<()> {
        self.ws.send(Message::text(text.into())).await?;
        Ok(())
    }

    /// Sends `response.create` with `body` (the body of `POST /v1/responses`) and `tag`.
    pub async fn create(&mut self, body: &Value, tag: Option<&str>) -> Result<()> {
        let mut event = body.clone();
        let obj = event
            .as_object_mut()
            .ok_or_else(|| anyhow!("the body must be a JSON object"))?;
        obj.insert("type".into(), json!("response.create"));
        if let Some(t) = tag {
            obj.insert("tag".into(), json!(t));
        }
        self.send_raw(event.to_string()).await
    }

    /// Sends `response.cancel` for a response id and/or a tag (neither: all in flight).
    pub async fn cancel(&mut self, response_id: Option<&str>, tag: Option<&str>) -> Result<()> {
        let mut event = json!({"type": "response.cancel"});
        if let Some(id) = response_id {
            event["response_id"] = json!(id);
        }
        if let Some(t) = tag {
            event["tag"] = json!(t);
        }
        self.send_raw(event.to_string()).await
    }

    /// The next event (pings are answered and skipped) or the close.
    pub async fn recv(&mut self) -> Result<Incoming> {
        loop {
            let Some(msg) = self.ws.next().await else {
                return Ok(Incoming::Closed {
                    code: None,
                    reason: String::new(),
                });
            };
            let text = match msg {
                Ok(Message::Text(t)) => t.to_string(),
                Ok(Message::Binary(b)) => String::from_utf8(b.to_vec())?,
                Ok(Message::Close(frame)) => {
                    return Ok(Incoming::Closed {
                        code: frame.as_ref().map(|f| u16::from(f.code)),
                        reason: frame.map(|f| f.reason.to_string()).unwrap_or_default(),
                    })
                }
                Ok(_) => continue,
                Err(tokio_tungstenite::tungstenite::Error::ConnectionClosed) => {
                    return Ok(Incoming::Closed {
                        code: None,
                        reason: String::new(),
                    })
                }
                Err(e) => return Err(e.into()),
            };
            let raw: Value = serde_json::from_str(&text).context("a non-JSON frame")?;
            let tag = raw.get("tag").and_then(Value::as_str).map(str::to_string);
            let event: ResponseEvent = serde_json::from_value(raw.clone())
                .with_context(|| format!("an unexpected event: {text}"))?;
            return Ok(Incoming::Event(Box::new(Received { event, tag, raw })));
        }
    }

    /// The next event; a close is an error.
    pub async fn next_event(&mut self) -> Result<Received> {
        match self.recv().await? {
            Incoming::Event(e) => Ok(*e),
            Incoming::Closed { code, reason } => {
                bail!("the server closed the connection ({code:?}: {reason})")
            }
        }
    }

    /// Runs one untagged response to its terminal event; an `error` event is an error.
    pub async fn turn(&mut self, body: &Value) -> Result<Turn> {
        let start = Instant::now();
        self.create(body, None).await?;
        let mut events = Vec::new();
        let mut ttft = None;
        loop {
            let received = self.next_event().await?;
            if let ResponseEvent::Error { error } = &received.event {
                bail!("error event: {error}");
            }
            if matches!(
                received.event,
                ResponseEvent::OutputTextDelta { .. }
                    | ResponseEvent::FunctionCallArgumentsDelta { .. }
                    | ResponseEvent::ReasoningTextDelta { .. }
            ) {
                ttft.get_or_insert_with(|| start.elapsed());
            }
            let terminal = received.event.terminal_response().cloned();
            events.push(received.event);
            if let Some(response) = terminal {
                return Ok(Turn {
                    response,
                    events,
                    ttft,
                    elapsed: start.elapsed(),
                });
            }
        }
    }

    /// Closes the connection politely.
    pub async fn close(mut self) -> Result<()> {
        self.ws.close(None).await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::socket_url;

    #[test]
    fn socket_urls_are_derived_from_base_urls() {
        assert_eq!(
            socket_url("http://127.0.0.1:8080"),
            "ws://127.0.0.1:8080/v1/responses"
        );
        assert_eq!(socket_url("http://h:1/v1/"), "ws://h:1/v1/responses");
        assert_eq!(socket_url("ws://h:1/v1/responses"), "ws://h:1/v1/responses");
    }
}
