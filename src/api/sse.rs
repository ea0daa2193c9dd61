//! Server-sent events: `data: {json}` frames, the closing `data: [DONE]`, and a keep-alive
//! comment whenever nothing was sent for a while (a long prefill must not look like a dead
//! connection to clients and proxies).

use super::disconnect::Peer;
use actix_web::http::header;
use actix_web::web::Bytes;
use actix_web::HttpResponse;
use futures::{Stream, StreamExt};
use serde::Serialize;
use std::convert::Infallible;
use std::time::Duration;

/// The comment sent while waiting.
pub const KEEP_ALIVE: &str = ": keep-alive\n\n";

/// One `data:` frame.
pub fn data(value: &impl Serialize) -> Bytes {
    let json = serde_json::to_string(value).unwrap_or_else(|e| {
        format!(
            "{{\"error\":{{\"message\":\"serializing a chunk: {e}\",\"type\":\"server_error\"}}}}"
        )
    });
    Bytes::from(format!("data: {json}\n\n"))
}

/// One named event (`event: name` then its `data:`), as Anthropic's streams send them.
pub fn event(name: &str, value: &impl Serialize) -> Bytes {
    let data = data(value);
    let mut frame = format!("event: {name}\n").into_bytes();
    frame.extend_from_slice(&data);
    Bytes::from(frame)
}

/// The last frame of every stream.
pub fn done() -> Bytes {
    Bytes::from_static(b"data: [DONE]\n\n")
}

/// Interleaves `KEEP_ALIVE` comments into `frames` whenever `every` passes without a frame.
pub fn with_keep_alive<S>(
    frames: S,
    every: Duration,
) -> impl Stream<Item = Result<Bytes, Infallible>>
where
    S: Stream<Item = Bytes> + Unpin + 'static,
{
    futures::stream::unfold(frames, move |mut frames| async move {
        match tokio::time::timeout(every, frames.next()).await {
            Ok(Some(frame)) => Some((Ok(frame), frames)),
            Ok(None) => None,
            Err(_) => Some((Ok(Bytes::from_static(KEEP_ALIVE.as_bytes())), frames)),
        }
    })
}

/// A `text/event-stream` response over `frames`, which ends (dropping `frames`, and with them the
/// engine streams they read) as soon as the client hangs up, even with no frame on its way.
pub fn response<S>(frames: S, keep_alive: Duration, peer: Peer) -> HttpResponse
where
    S: Stream<Item = Bytes> + Unpin + 'static,
{
    let frames = frames.take_until(Box::pin(peer.hung_up()));
    HttpResponse::Ok()
        .insert_header((header::CONTENT_TYPE, "text/event-stream; charset=utf-8"))
        .insert_header((header::CACHE_CONTROL, "no-cache"))
        .insert_header(("X-Accel-Buffering", "no"))
        .streaming(with_keep_alive(frames, keep_alive))
}

/// Splits an SSE body into its `data:` payloads (for tests and clients of this crate).
pub fn parse_data_lines(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter_map(|event| {
            let data: Vec<&str> = event
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .map(|l| l.strip_prefix(' ').unwrap_or(l))
                .collect();
            (!data.is_empty()).then(|| data.join("\n"))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[actix_rt::test]
    async fn keep_alive_comments_fill_silences() {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<Bytes>();
        let frames = Box::pin(futures::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|b| (b, rx))
        }));
        let mut out = Box::pin(with_keep_alive(frames, Duration::from_millis(20)));
        actix_rt::spawn(async move {
            actix_rt::time::sleep(Duration::from_millis(70)).await;
            let _ = tx.send(data(&serde_json::json!({"a": 1})));
        });
        let mut got = Vec::new();
        while let Some(Ok(b)) = out.next().await {
            got.push(String::from_utf8(b.to_vec()).unwrap());
        }
        let n_keep_alive = got.iter().filter(|s| s.as_str() == KEEP_ALIVE).count();
        assert!(n_keep_alive >= 2, "{got:?}");
        assert_eq!(got.last().unwrap(), "data: {\"a\":1}\n\n");
        assert_eq!(
            parse_data_lines(&got.concat()),
            vec!["{\"a\":1}".to_string()]
        );
    }
}
